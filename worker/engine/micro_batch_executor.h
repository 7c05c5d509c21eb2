// MicroBatchExecutor: one Executor over several part executors (numoe-worker --micro-batches N: one
// RemoteExecutor per channel, each a session and lane of its own in numoe-gpu), so that while this worker's
// CPUs compute one micro-batch's experts for layer L, numoe-gpu runs another micro-batch's layers.
//
// Every sequence lives in one part for its whole life (its state is in that part's numoe-gpu session): Open
// puts it in the part with the fewest open sequences (the next one when that part is full), Fork in its
// parent's. Step splits the items by part and runs every part that has items at once, one thread each (the
// caller's thread runs the first), then merges the parts' outputs back into the items' order. Close and
// Flush go to the owning part(s). A step where one part fails fails as a whole (the first error in part
// order); the engine then closes every sequence of the step, as for any failed step.
//
// The parts' routed experts are serialized: they share one SerialExperts, whose one call at a time is the
// worker's one thread pool streaming its one node's DRAM (the simulated experts wait the same way), and
// whose time inside the backend is this executor's expert_seconds (a part waiting for the other's call is
// not expert time).
//
// Thread-safety: one thread drives the executor (the engine's); it drives the parts from helper threads
// only inside Step, joined before Step returns. expert_seconds() and prefix_cache() are safe from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "model/backend.h"
#include "worker/engine/executor.h"

namespace numoe::engine {

// One ExpertBackend shared by several callers (the parts' executors), one RunRouted at a time, in the
// order the callers arrive; the time spent inside the backend is counted (busy_seconds).
class SerialExperts final : public ExpertBackend {
 public:
  explicit SerialExperts(ExpertBackend* inner) : inner_(inner) {}  // not owned
  Status RunRouted(const MoeRequest& request) override;
  const HostExperts* host_experts() const override { return inner_->host_experts(); }
  double busy_seconds() const { return static_cast<double>(busy_ns_.load(std::memory_order_relaxed)) * 1e-9; }
  int64_t calls() const { return calls_.load(std::memory_order_relaxed); }

 private:
  ExpertBackend* inner_;
  std::mutex mu_;
  std::atomic<int64_t> busy_ns_{0};
  std::atomic<int64_t> calls_{0};
};

class MicroBatchExecutor final : public Executor {
 public:
  // `parts` (>= 1, not owned) share one vocabulary and limits (their channels were registered alike);
  // `experts` (not owned, may be null) is the SerialExperts they compute with, for expert_seconds() (null:
  // the sum of the parts').
  MicroBatchExecutor(std::vector<Executor*> parts, const SerialExperts* experts);

  StatusOr<ExecSeq> Open(const SamplingParams& sampling) override;
  StatusOr<ExecSeq> Fork(ExecSeq parent, const SamplingParams& sampling) override;
  Status Close(ExecSeq seq) override;
  Status Step(std::span<const StepItem> items, StepOutput* out) override;
  Status Flush() override;
  bool healthy() const override;
  // The first part's (they are alike).
  ExecutorLimits limits() const override;
  double expert_seconds() const override;
  // The figures of the part that stepped last (numoe-gpu's one prefix cache, as it last reported them).
  PrefixCacheFigures prefix_cache() const override;

  size_t parts() const { return parts_.size(); }
  // Open sequences in part `p` (tests).
  int64_t open_in(size_t p) const { return open_[p]; }
  // Steps in which more than one part ran (tests and logs).
  int64_t split_steps() const { return split_steps_; }

 private:
  struct Where {
    size_t part = 0;
    ExecSeq inner = 0;
  };
  std::vector<Executor*> parts_;
  const SerialExperts* experts_;
  std::map<ExecSeq, Where> seqs_;
  std::vector<int64_t> open_;  // per part
  ExecSeq next_ = 1;
  int64_t split_steps_ = 0;
  std::atomic<size_t> last_part_{0};
  // Step scratch, per part: its items (inner handles), the positions of those items in the step, its output.
  struct Sub {
    std::vector<StepItem> items;
    std::vector<size_t> at;
    StepOutput out;
    Status status;
  };
  std::vector<Sub> subs_;
};

}  // namespace numoe::engine
