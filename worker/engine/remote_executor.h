// RemoteExecutor: the Executor over numoe-gpu's shared-memory channel (common/shm_channel.h).
//
// Step() publishes one StepRequest (entries with their drafts, tokens, pending releases), then serves the
// gpu's per-layer MoeRequests with this worker's ExpertBackend (the drafter stages' too, as layers
// num_hidden_layers + s, when numoe-gpu drafts), reading x from and writing the expert sum into the
// channel in place, until the StepResult (per entry: emitted tokens, drafts verified and accepted) or an
// Error arrives. limits() reports what numoe-gpu declared in the geometry (ChannelCapabilities).
// Open() only reserves a key: the sequence is created on the gpu by the first step that carries it
// (kEntryOpen + sampling parameters). Fork() is deferred the same way: the fork rides on the next
// StepRequest (or Flush), which numoe-gpu carries out before anything else. Close() is deferred: releases
// ride on the next StepRequest, or go alone on Flush().
//
// A transport failure (numoe-gpu exited or closed the channel, protocol violation) makes the executor
// unhealthy for good: the worker should exit and be restarted, re-registering with a fresh channel.
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <vector>

#include "common/shm_channel.h"
#include "model/backend.h"
#include "worker/engine/executor.h"

namespace numoe::engine {

class RemoteExecutor final : public Executor {
 public:
  // Neither is owned. `channel` must be the worker side (Channel::Attach).
  // `first_key`: the first sequence key it hands out (executors sharing numoe-gpu's sequences must not
  // overlap: each gets a range of its own).
  RemoteExecutor(shm::Channel* channel, ExpertBackend* experts, ExecSeq first_key = 1);

  StatusOr<ExecSeq> Open(const SamplingParams& sampling) override;
  StatusOr<ExecSeq> Fork(ExecSeq parent, const SamplingParams& sampling) override;
  Status Close(ExecSeq seq) override;
  Status Step(std::span<const StepItem> items, StepOutput* out) override;
  Status Flush() override;
  StatusOr<SeqHandoff> Detach(ExecSeq seq) override;
  Status Adopt(const SeqHandoff& handoff) override;
  bool healthy() const override { return broken_.ok(); }
  ExecutorLimits limits() const override;

  // Seconds spent in the expert backend and MoE requests served, since construction (any thread).
  double expert_seconds() const override { return static_cast<double>(expert_ns_.load(std::memory_order_relaxed)) * 1e-9; }
  PrefixCacheFigures prefix_cache() const override;
  int64_t moe_requests() const { return moe_requests_.load(std::memory_order_relaxed); }

 private:
  Status Exchange(std::span<const StepItem> items, StepOutput* out);
  // Reads and checks the StepResult's per-entry arrays into `out` (a gpu answer that does not fit the
  // items breaks the executor: the two sides no longer agree).
  Status ReadResult(std::span<const StepItem> items, int64_t num_emitted, bool logprobs, StepOutput* out);
  Status Broken(const Status& st);

  shm::Channel* ch_;
  ExpertBackend* experts_;
  struct PendingFork {
    ExecSeq seq, parent;
    SamplingParams sampling;
  };
  std::map<ExecSeq, SamplingParams> pending_open_;  // opened here, not yet seen by the gpu
  std::vector<PendingFork> forks_;                  // forked here, not yet seen by the gpu
  std::map<ExecSeq, int32_t> open_;                 // known to the gpu -> its SamplingParams::logprobs
  std::vector<ExecSeq> releases_;                   // closed here, not yet released on the gpu
  ExecSeq next_ = 1;
  Status broken_;
  std::atomic<int64_t> expert_ns_{0};
  std::atomic<int64_t> moe_requests_{0};
  mutable std::mutex prefix_mu_;
  PrefixCacheFigures prefix_cache_;  // from the last StepResult, under prefix_mu_
};

}  // namespace numoe::engine
