// A fixed pool of N worker threads for the CPU kernels: optionally pinned one-to-one to a CPU list,
// per-thread state on its own cache lines, and no allocation per call.
//
//   ASSIGN_OR_RETURN(auto pool, ThreadPool::Create({.num_threads = 2, .cpus = {0, 1}}));
//   pool->ParallelFor(n, [&](int64_t begin, int64_t end, int thread) { ... });
//   pool->RunOnAll([&](int thread) { PhaseA(thread); pool->Barrier(thread); PhaseB(thread); });
//
// Threads are dedicated: the caller of RunOnAll/ParallelFor sleeps until all of them finish (it does not
// take part), so a pool pinned to a node's cores never oversubscribes them. Idle workers spin for
// `spin_us` after a job (the next layer's job usually arrives within that time), then block on a futex.
// One job at a time: calls from several threads are serialised; calling from inside a job deadlocks and
// is caught by a check.
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
    // Empty: threads are not pinned. Otherwise thread i runs only on cpus[i % cpus.size()].
    std::vector<int> cpus;
    // How long an idle worker polls for the next job before sleeping, in microseconds.
    int spin_us = 200;
  };

  // Starts the threads. A CPU outside this process's allowed set, or a failed sched_setaffinity, is an
  // error (no pool is returned): a worker that cannot bind should not silently run unbound.
  static StatusOr<std::unique_ptr<ThreadPool>> Create(const Options& options);
  // Unpinned pool; num_threads >= 1.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(threads_.size()); }
  const std::vector<int>& cpus() const { return cpus_; }

  // Runs fn(thread_idx) once on every thread, thread_idx in [0, size()); returns when all have returned.
  void RunOnAll(absl::FunctionRef<void(int thread_idx)> fn);
  // Inside RunOnAll only, called by every thread: returns once all threads have arrived.
  void Barrier(int thread_idx);

  // Splits [0, n) into size() contiguous ranges (thread i gets the i-th); empty ranges are skipped.
  void ParallelFor(int64_t n, absl::FunctionRef<void(int64_t begin, int64_t end, int thread_idx)> fn);
  // Hands out [0, n) in chunks of `grain` to whichever thread is free (for uneven or noisy work).
  void ParallelForDynamic(int64_t n, int64_t grain,
                          absl::FunctionRef<void(int64_t begin, int64_t end, int thread_idx)> fn);

 private:
  struct alignas(kCacheLine) PerThread {
    uint32_t barrier_sense = 0;
  };

  ThreadPool(int num_threads, std::vector<int> cpus, int spin_us);
  void WorkerLoop(int idx);

  std::vector<std::thread> threads_;
  std::unique_ptr<PerThread[]> per_thread_;
  std::vector<int> cpus_;
  int spin_us_ = 200;
  absl::FunctionRef<void(int)>* job_ = nullptr;
  bool stop_ = false;
  std::mutex caller_mu_;  // one job at a time
  alignas(kCacheLine) std::atomic<uint32_t> generation_{0};
  alignas(kCacheLine) std::atomic<int> pending_{0};
  alignas(kCacheLine) std::atomic<uint32_t> finished_{0};
  alignas(kCacheLine) std::atomic<int> barrier_count_{0};
  alignas(kCacheLine) std::atomic<uint32_t> barrier_sense_{0};
};

}  // namespace numoe
