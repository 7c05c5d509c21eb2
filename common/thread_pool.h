// A fixed pool of N compute threads for the CPU kernels: optionally pinned one-to-one to a CPU list,
// per-thread state on its own cache lines, and no allocation per call.
//
//   ASSIGN_OR_RETURN(auto pool, ThreadPool::Create({.num_threads = 2, .cpus = {0, 1}}));
//   pool->ParallelFor(n, [&](int64_t begin, int64_t end, int thread) { ... });
//   pool->RunOnAll([&](int thread) { PhaseA(thread); pool->Barrier(thread); PhaseB(thread); });
//   pool->RunOnAvailable([&](int thread) { while (claim work from a shared counter) ...; });
//
// Who computes:
//   - Unpinned pools (no `cpus`): the calling thread is thread 0 and size() - 1 workers are started, so a
//     1-thread pool runs everything inline with no hand-off at all. Waking a sleeping worker costs tens
//     to hundreds of microseconds on a busy machine, more than a small decode step's whole expert work.
//   - Pinned pools: size() dedicated workers, pinned; the caller only waits (it is not on the pool's
//     CPUs, so it must not compute), and a pool pinned to a node's cores never oversubscribes them.
// Idle workers spin for `spin_us` after a job (the next layer's job usually arrives within that time),
// then block on a futex. One job at a time: calls from several threads are serialised; calling from inside
// a job is caught by a check.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "common/status.h"

namespace numoe {

inline constexpr size_t kCacheLine = 64;

class ThreadPool {
 public:
  struct Options {
    int num_threads = 1;
    // Empty: threads are not pinned (and the caller is thread 0). Otherwise thread i runs only on
    // cpus[i % cpus.size()].
    std::vector<int> cpus;
    // How long an idle worker polls for the next job before sleeping, in microseconds.
    int spin_us = 200;
  };

  // Starts the threads. A CPU outside this process's allowed set, or a failed sched_setaffinity, is an
  // error (no pool is returned): a worker that cannot bind should not silently run unbound.
  static StatusOr<std::unique_ptr<ThreadPool>> Create(const Options& options);
  // Unpinned pool; num_threads >= 1 (num_threads - 1 workers plus the caller).
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return num_threads_; }
  const std::vector<int>& cpus() const { return cpus_; }
  // True when the calling thread computes as thread 0 (unpinned pools).
  bool caller_participates() const { return cpus_.empty(); }

  // Runs fn(thread_idx) once for every thread_idx in [0, size()); returns when all have returned.
  void RunOnAll(absl::FunctionRef<void(int thread_idx)> fn);
  // Inside RunOnAll only, called by every thread: returns once all threads have arrived.
  void Barrier(int thread_idx);

  // Runs fn(thread_idx) on the caller (when it participates) and on every worker that picks the job up
  // before the first call of fn returns; returns when all calls have returned. For work that threads
  // claim from shared counters: once any thread finds nothing left to claim, a worker still waking up
  // skips the job instead of being waited for. Each thread_idx runs at most once; Barrier is not allowed.
  void RunOnAvailable(absl::FunctionRef<void(int thread_idx)> fn);

  // Splits [0, n) into size() contiguous ranges (thread i gets the i-th); empty ranges are skipped.
  void ParallelFor(int64_t n, absl::FunctionRef<void(int64_t begin, int64_t end, int thread_idx)> fn);
  // Hands out [0, n) in chunks of `grain` to whichever thread is free (for uneven or noisy work).
  void ParallelForDynamic(int64_t n, int64_t grain,
                          absl::FunctionRef<void(int64_t begin, int64_t end, int thread_idx)> fn);

  // Jobs handed to the workers so far (calls that ran entirely on the caller are not counted). For tests
  // and diagnostics.
  uint64_t jobs_dispatched() const { return dispatched_.load(std::memory_order_relaxed); }

 private:
  struct alignas(kCacheLine) PerThread {
    uint32_t barrier_sense = 0;
  };

  ThreadPool(int num_threads, std::vector<int> cpus, int spin_us);
  int workers() const { return static_cast<int>(threads_.size()); }
  int first_worker_idx() const { return caller_participates() ? 1 : 0; }
  // Publishes a job to the workers and returns its generation.
  uint32_t Publish(absl::FunctionRef<void(int)>* fn, bool on_available);
  void WaitFinished(uint32_t gen);
  void FinishIfLast(uint32_t gen);
  void WorkerLoop(int idx);

  int num_threads_ = 1;
  std::vector<std::thread> threads_;  // workers; worker w is thread_idx w + first_worker_idx()
  std::unique_ptr<PerThread[]> per_thread_;
  std::vector<int> cpus_;
  int spin_us_ = 200;
  absl::FunctionRef<void(int)>* job_ = nullptr;
  bool stop_ = false;
  std::mutex caller_mu_;  // one job at a time
  std::atomic<uint64_t> dispatched_{0};
  // The current job: generation << 2 | on_available << 1 | open. Workers wait for the generation to change.
  alignas(kCacheLine) std::atomic<uint32_t> job_word_{0};
  alignas(kCacheLine) std::atomic<int> pending_{0};  // RunOnAll: workers not finished
  alignas(kCacheLine) std::atomic<int> active_{0};   // RunOnAvailable: workers inside (or deciding to enter) fn
  alignas(kCacheLine) std::atomic<uint32_t> finished_{0};  // generation of the last finished job
  alignas(kCacheLine) std::atomic<int> barrier_count_{0};
  alignas(kCacheLine) std::atomic<uint32_t> barrier_sense_{0};
};

}  // namespace numoe
