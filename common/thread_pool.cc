#include "common/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <algorithm>

#include "common/log.h"

namespace numoe {
namespace {

inline void CpuRelax() { __builtin_ia32_pause(); }

// Polls `word` until it differs from `old` for up to spin_us, then sleeps on it (futex). Every 16 polls it
// offers its CPU (sched_yield, ~1 us when nobody else wants it): a pinned pool fills its CPUs, and a caller
// woken on one of them would otherwise wait until a spinning worker's spin_us ran out before it could even
// see that its job was done (measured with numoe-bench experts, 16 threads on 16 cores: 115 us of each
// ~1 ms MoE step spent that way, 5-12 us with the yield).
void SpinThenWait(const std::atomic<uint32_t>& word, uint32_t old, int spin_us) {
  if (word.load(std::memory_order_acquire) != old) return;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  for (int i = 0;; ++i) {
    if (word.load(std::memory_order_acquire) != old) return;
    CpuRelax();
    if ((i & 15) == 15) sched_yield();
    if ((i & 255) == 255 && std::chrono::steady_clock::now() > deadline) break;
  }
  while (word.load(std::memory_order_acquire) == old) word.wait(old, std::memory_order_acquire);
}

thread_local const ThreadPool* tls_current_pool = nullptr;

// job_word_ layout: generation in bits [2, 32), then "on available" and "open" flags.
constexpr uint32_t kOpen = 1, kOnAvailable = 2, kGenStep = 4;
inline uint32_t Gen(uint32_t word) { return word & ~(kGenStep - 1); }

// Marks the caller's thread as running a job of `pool` (restored on scope exit), so that a nested call
// is caught instead of deadlocking.
class ScopedInJob {
 public:
  explicit ScopedInJob(const ThreadPool* pool) : saved_(tls_current_pool) { tls_current_pool = pool; }
  ~ScopedInJob() { tls_current_pool = saved_; }

 private:
  const ThreadPool* saved_;
};

}  // namespace

StatusOr<std::unique_ptr<ThreadPool>> ThreadPool::Create(const Options& options) {
  if (options.num_threads < 1 || options.num_threads > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("thread pool: num_threads must be in [1, 4096], got ",
                                                   options.num_threads));
  }
  if (!options.cpus.empty()) {
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) {
      return absl::InternalError(absl::StrCat("thread pool: sched_getaffinity: ", std::strerror(errno)));
    }
    for (int cpu : options.cpus) {
      if (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &allowed)) {
        return absl::InvalidArgumentError(
            absl::StrCat("thread pool: CPU ", cpu, " is not in this process's allowed CPU set"));
      }
    }
  }
  std::unique_ptr<ThreadPool> pool(new ThreadPool(options.num_threads, options.cpus, options.spin_us));
  if (!options.cpus.empty()) {
    for (int i = 0; i < pool->workers(); ++i) {  // pinned: worker i is thread i
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(options.cpus[i % options.cpus.size()], &set);
      const int rc = pthread_setaffinity_np(pool->threads_[i].native_handle(), sizeof(set), &set);
      if (rc != 0) {
        return absl::InternalError(absl::StrCat("thread pool: pinning thread ", i, " to CPU ",
                                                options.cpus[i % options.cpus.size()], ": ", std::strerror(rc)));
      }
    }
  }
  return pool;
}

ThreadPool::ThreadPool(int num_threads) : ThreadPool(num_threads, {}, 200) {}

ThreadPool::ThreadPool(int num_threads, std::vector<int> cpus, int spin_us)
    : num_threads_(num_threads), per_thread_(new PerThread[std::max(1, num_threads)]), cpus_(std::move(cpus)),
      spin_us_(spin_us) {
  NCHECK(num_threads >= 1) << "thread pool needs at least one thread";
  barrier_count_.store(num_threads);
  const int workers = num_threads - (caller_participates() ? 1 : 0);
  threads_.reserve(workers);
  for (int w = 0; w < workers; ++w) threads_.emplace_back([this, w] { WorkerLoop(w); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(caller_mu_);
    stop_ = true;
    job_word_.store(Gen(job_word_.load(std::memory_order_relaxed)) + kGenStep, std::memory_order_release);
    job_word_.notify_all();
  }
  for (auto& t : threads_) t.join();
}

uint32_t ThreadPool::Publish(absl::FunctionRef<void(int)>* fn, bool on_available) {
  job_ = fn;
  dispatched_.fetch_add(1, std::memory_order_relaxed);
  const uint32_t gen = Gen(job_word_.load(std::memory_order_relaxed)) + kGenStep;
  if (on_available) {
    // active_ is not reset: a worker still skipping the previous job may be counted in it.
    job_word_.store(gen | kOnAvailable | kOpen, std::memory_order_seq_cst);
  } else {
    pending_.store(workers(), std::memory_order_relaxed);
    job_word_.store(gen, std::memory_order_release);
  }
  job_word_.notify_all();
  return gen;
}

// finished_ only moves forward (generations compared modulo 2^32), so a thread that was descheduled while
// finishing an old job cannot move it back under a caller that waits for a newer one.
void ThreadPool::FinishIfLast(uint32_t gen) {
  uint32_t cur = finished_.load(std::memory_order_relaxed);
  while (static_cast<int32_t>(gen - cur) > 0) {
    if (finished_.compare_exchange_weak(cur, gen, std::memory_order_release, std::memory_order_relaxed)) {
      finished_.notify_all();
      return;
    }
  }
}

void ThreadPool::WaitFinished(uint32_t gen) {
  // The caller has nothing else to do: a short spin keeps short jobs cheap, then it sleeps.
  for (uint32_t seen = finished_.load(std::memory_order_acquire); seen != gen;
       seen = finished_.load(std::memory_order_acquire)) {
    SpinThenWait(finished_, seen, 20);
  }
}

void ThreadPool::WorkerLoop(int w) {
  const int idx = w + first_worker_idx();
  tls_current_pool = this;
  uint32_t seen = 0;
  for (;;) {
    uint32_t word = job_word_.load(std::memory_order_acquire);
    while (Gen(word) == seen) {  // a job closing (same generation) is not a new job
      SpinThenWait(job_word_, word, spin_us_);
      word = job_word_.load(std::memory_order_acquire);
    }
    seen = Gen(word);
    if (stop_) return;
    if ((word & kOnAvailable) == 0) {
      (*job_)(idx);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) FinishIfLast(seen);
      continue;
    }
    // RunOnAvailable: announce, then enter only if the job is still open. The caller (or the last thread
    // out) sees either this thread's announcement or, if it comes later, this thread sees the job closed:
    // seq_cst on both sides, so a thread never starts a job whose caller has already returned.
    // (The word read above may already be closed: a worker that wakes late never enters.)
    active_.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t open_word = word | kOpen;
    if (job_word_.load(std::memory_order_seq_cst) == open_word) {
      (*job_)(idx);
      uint32_t expected = open_word;
      job_word_.compare_exchange_strong(expected, open_word & ~kOpen, std::memory_order_seq_cst);
    }
    if (active_.fetch_sub(1, std::memory_order_seq_cst) == 1) {
      // Last one out: finished when the job is closed and (read after seeing it closed) nobody is inside.
      const uint32_t now = job_word_.load(std::memory_order_seq_cst);
      if ((now & kOnAvailable) != 0 && (now & kOpen) == 0 && active_.load(std::memory_order_seq_cst) == 0) {
        FinishIfLast(Gen(now));
      }
    }
  }
}

void ThreadPool::RunOnAll(absl::FunctionRef<void(int)> fn) {
  NCHECK(tls_current_pool != this) << "ThreadPool::RunOnAll called from inside one of its own jobs";
  std::lock_guard<std::mutex> lock(caller_mu_);
  ScopedInJob in_job(this);
  if (workers() == 0) {
    fn(0);
    return;
  }
  const uint32_t gen = Publish(&fn, /*on_available=*/false);
  if (caller_participates()) fn(0);
  WaitFinished(gen);
  job_ = nullptr;
}

void ThreadPool::RunOnAvailable(absl::FunctionRef<void(int)> fn) {
  NCHECK(tls_current_pool != this) << "ThreadPool::RunOnAvailable called from inside one of its own jobs";
  std::lock_guard<std::mutex> lock(caller_mu_);
  ScopedInJob in_job(this);
  if (workers() == 0) {
    fn(0);
    return;
  }
  const uint32_t gen = Publish(&fn, /*on_available=*/true);
  if (caller_participates()) {
    fn(0);
    uint32_t open = gen | kOnAvailable | kOpen;
    job_word_.compare_exchange_strong(open, gen | kOnAvailable, std::memory_order_seq_cst);
    // Closed (by us or a worker) before this read: a worker not counted here will see it closed.
    if (active_.load(std::memory_order_seq_cst) == 0) {
      job_ = nullptr;
      return;
    }
  }
  WaitFinished(gen);
  job_ = nullptr;
}

void ThreadPool::Barrier(int thread_idx) {
  if (size() == 1) return;
  uint32_t& local = per_thread_[thread_idx].barrier_sense;
  local ^= 1u;
  if (barrier_count_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    barrier_count_.store(size(), std::memory_order_relaxed);
    barrier_sense_.store(local, std::memory_order_release);
    barrier_sense_.notify_all();
  } else {
    SpinThenWait(barrier_sense_, local ^ 1u, spin_us_);
  }
}

void ThreadPool::ParallelFor(int64_t n, absl::FunctionRef<void(int64_t, int64_t, int)> fn) {
  if (n <= 0) return;
  const int64_t t = size();
  RunOnAll([&](int idx) {
    const int64_t begin = n * idx / t, end = n * (idx + 1) / t;
    if (begin < end) fn(begin, end, idx);
  });
}

void ThreadPool::ParallelForDynamic(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t, int)> fn) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  alignas(kCacheLine) std::atomic<int64_t> next{0};
  RunOnAvailable([&](int idx) {
    for (;;) {
      const int64_t begin = next.fetch_add(grain, std::memory_order_relaxed);
      if (begin >= n) return;
      fn(begin, std::min(n, begin + grain), idx);
    }
  });
}

}  // namespace numoe
