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

// Polls `word` until it differs from `old` for up to spin_us, then sleeps on it (futex).
void SpinThenWait(const std::atomic<uint32_t>& word, uint32_t old, int spin_us) {
  if (word.load(std::memory_order_acquire) != old) return;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  for (int i = 0;; ++i) {
    if (word.load(std::memory_order_acquire) != old) return;
    CpuRelax();
    if ((i & 255) == 255 && std::chrono::steady_clock::now() > deadline) break;
  }
  while (word.load(std::memory_order_acquire) == old) word.wait(old, std::memory_order_acquire);
}

thread_local const ThreadPool* tls_current_pool = nullptr;

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
    for (int i = 0; i < pool->size(); ++i) {
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
    : per_thread_(new PerThread[num_threads]), cpus_(std::move(cpus)), spin_us_(spin_us) {
  NCHECK(num_threads >= 1) << "thread pool needs at least one thread";
  barrier_count_.store(num_threads);
  threads_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) threads_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(caller_mu_);
    stop_ = true;
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
  }
  for (auto& t : threads_) t.join();
}

void ThreadPool::WorkerLoop(int idx) {
  tls_current_pool = this;
  uint32_t seen = 0;
  for (;;) {
    SpinThenWait(generation_, seen, spin_us_);
    seen = generation_.load(std::memory_order_acquire);
    if (stop_) return;
    (*job_)(idx);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      finished_.store(seen, std::memory_order_release);
      finished_.notify_all();
    }
  }
}

void ThreadPool::RunOnAll(absl::FunctionRef<void(int)> fn) {
  NCHECK(tls_current_pool != this) << "ThreadPool::RunOnAll called from inside one of its own jobs";
  std::lock_guard<std::mutex> lock(caller_mu_);
  job_ = &fn;
  pending_.store(size(), std::memory_order_relaxed);
  const uint32_t gen = generation_.load(std::memory_order_relaxed) + 1;
  generation_.store(gen, std::memory_order_release);
  generation_.notify_all();
  // The caller has nothing else to do: a short spin keeps short jobs cheap, then it sleeps.
  uint32_t seen = finished_.load(std::memory_order_acquire);
  while (seen != gen) {
    SpinThenWait(finished_, seen, 20);
    seen = finished_.load(std::memory_order_acquire);
  }
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
  RunOnAll([&](int idx) {
    for (;;) {
      const int64_t begin = next.fetch_add(grain, std::memory_order_relaxed);
      if (begin >= n) return;
      fn(begin, std::min(n, begin + grain), idx);
    }
  });
}

}  // namespace numoe
