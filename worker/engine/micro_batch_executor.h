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
// The prefill lane (numoe-worker --prefill-lane-tokens): one more part, whose numoe-gpu session shares the
// other parts' sequences (RegisterRequest::share_sequences_with), runs steps of prompt chunks on a thread
// of its own (StartLaneStep .. FinishLaneStep) while Step goes on with the decode parts. A sequence lives in
// its part; StartLaneStep hands it to the lane (Executor::Detach / Adopt, the same key: the parts' key ranges
// do not overlap) and FinishLaneStep hands it back, so after its prompt it decodes where it was opened. While
// it is in the lane, Step, Fork and Close refuse it (FAILED_PRECONDITION).
//
// Thread-safety: one thread drives the executor (the engine's); it drives the parts from helper threads
// only inside Step, joined before Step returns. expert_seconds() and prefix_cache() are safe from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "model/backend.h"
#include "worker/engine/executor.h"

namespace numoe::engine {

// One ExpertBackend shared by several callers (the parts' executors), one RunRouted at a time, in the
// order the callers arrive; the time spent inside the backend is counted (busy_seconds).
// The prefill lane's calls go through RunYielding (its Lane() backend): a call of more than `piece_rows`
// rows runs as pieces of at most that many rows (the rows are independent: the same sums), and before each
// piece it lets every RunRouted caller that is waiting go first, so a decode step's experts wait for at most
// one piece of a prompt's, not for all of it. piece_rows 0 (or hidden 0): whole calls, still yielding.
class SerialExperts final : public ExpertBackend {
 public:
  // `inner` not owned; `hidden`: the model's hidden size (the row stride of x and out).
  explicit SerialExperts(ExpertBackend* inner, int64_t hidden = 0, int64_t piece_rows = 0)
      : inner_(inner), hidden_(hidden), piece_rows_(piece_rows), lane_(this) {}
  Status RunRouted(const MoeRequest& request) override;
  Status RunYielding(const MoeRequest& request);
  // The backend the prefill lane computes with (RunYielding).
  ExpertBackend* lane() { return &lane_; }
  int64_t pieces() const { return pieces_.load(std::memory_order_relaxed); }
  const HostExperts* host_experts() const override { return inner_->host_experts(); }
  double busy_seconds() const { return static_cast<double>(busy_ns_.load(std::memory_order_relaxed)) * 1e-9; }
  int64_t calls() const { return calls_.load(std::memory_order_relaxed); }

 private:
  class Lane final : public ExpertBackend {
   public:
    explicit Lane(SerialExperts* s) : s_(s) {}
    Status RunRouted(const MoeRequest& request) override { return s_->RunYielding(request); }
    const HostExperts* host_experts() const override { return s_->host_experts(); }

   private:
    SerialExperts* s_;
  };
  Status RunLocked(const MoeRequest& request);

  ExpertBackend* inner_;
  int64_t hidden_, piece_rows_;
  Lane lane_;
  std::mutex mu_;
  std::condition_variable cv_;  // RunRouted callers leaving: a yielding piece may go
  std::atomic<int64_t> waiting_{0};  // RunRouted callers waiting for mu_
  std::atomic<int64_t> busy_ns_{0};
  std::atomic<int64_t> calls_{0};
  std::atomic<int64_t> pieces_{0};
};

class MicroBatchExecutor final : public Executor {
 public:
  // `parts` (>= 1, not owned) share one vocabulary and limits (their channels were registered alike);
  // `experts` (not owned, may be null) is the SerialExperts they compute with, for expert_seconds() (null:
  // the sum of the parts').
  // `lane` (not owned, may be null): the prefill lane, an executor sharing the parts' sequences.
  MicroBatchExecutor(std::vector<Executor*> parts, const SerialExperts* experts, Executor* lane = nullptr);
  ~MicroBatchExecutor() override;  // waits for a lane step still running

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
  bool has_prefill_lane() const override { return lane_ != nullptr; }
  Status StartLaneStep(std::span<const StepItem> items) override;
  bool LaneStepDone() const override;
  Status FinishLaneStep(StepOutput* out) override;
  // Lane steps run (tests and logs).
  int64_t lane_steps() const { return lane_steps_; }

  size_t parts() const { return parts_.size(); }
  // Open sequences in part `p` (tests).
  int64_t open_in(size_t p) const { return open_[p]; }
  // Steps in which more than one part ran (tests and logs).
  int64_t split_steps() const { return split_steps_; }

 private:
  struct Where {
    size_t part = 0;
    ExecSeq inner = 0;
    bool in_lane = false;
  };
  // The sequence `seq` (a wrapper key) open and not in the lane, else the error naming why.
  StatusOr<Where*> Find(ExecSeq seq);
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
  // The prefill lane: its step's items (inner keys), their wrapper keys, its output and status, its thread.
  Executor* lane_ = nullptr;
  std::vector<StepItem> lane_items_;
  std::vector<ExecSeq> lane_seqs_;
  StepOutput lane_out_;
  Status lane_status_;
  std::thread lane_thread_;
  std::atomic<bool> lane_done_{true};
  int64_t lane_steps_ = 0;
};

}  // namespace numoe::engine
