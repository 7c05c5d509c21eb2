// What the worker's batching engine needs from numoe-gpu: open a sequence with its sampling parameters,
// close it, and run one step over several sequences that yields one sampled token per sequence.
//
// Two implementations, interchangeable behind this interface:
//   LocalExecutor  (local_executor.h)  the model in this process (tests, `numoe generate`-style use):
//                                      ModelBackend + ExpertBackend + one Sampler per sequence, the same
//                                      numerics as GenerateBatch.
//   RemoteExecutor (remote_executor.h) numoe-gpu over the shared-memory channel; while a step runs on
//                                      the gpu, this process serves its per-layer MoE requests with the
//                                      worker's ExpertBackend.
//
// Thread-safety: one thread (the engine's) drives an executor.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/sampling.h"
#include "model/spec.h"
#include "model/step.h"

namespace numoe::engine {

using ExecSeq = int64_t;  // an executor's handle for one sequence

// StepItem and StepOutput (model/step.h) are what a step carries; here StepItem::seq is the executor's
// handle (ExecSeq). Speculative items, the budget they take and the rules they follow are documented there.

// The figures of the prefix cache behind an executor.
struct PrefixCacheFigures {
  int64_t bytes = -1;        // held by the first tier's checkpoints (the backend's memory); -1: no cache
  int64_t host_bytes = -1;   // held by the host tier's (--prefix-cache-host-gb); -1: no host tier
  int64_t evicted = 0;       // checkpoints evicted from the first tier (moved to the host tier or dropped)
  int64_t host_evicted = 0;  // checkpoints dropped from the host tier
};

struct ExecutorLimits {
  int64_t vocab_size = 0;
  int64_t max_step_tokens = 0;  // tokens per Step (sum over items); 0 = unbounded
  int64_t max_seqs = 0;         // open sequences at once; 0 = unbounded
  bool logits = false;          // StepItem::logits is supported
  // What the model behind the executor declares: verification, the model drafter StepItem::model_drafts
  // uses (kNone: model_drafts must be 0), the most tokens of a speculative step. A speculative setting is
  // checked against it (CheckSpecAgainstModel, model/spec_policy.h).
  Capabilities model;

  SpecMethod drafter() const { return model.drafter; }
  // The most drafts one item may ask the model drafter for: 0 without one, else MaxDraftsPerItem(model).
  int64_t max_model_drafts() const { return drafter() == SpecMethod::kNone ? 0 : MaxDraftsPerItem(model); }
};

// A sequence handed from one executor to another that shares its sequences in numoe-gpu (the lanes of one
// worker, RegisterRequest::share_sequences_with): what the receiving side must know of it.
struct SeqHandoff {
  ExecSeq seq = 0;
  bool opened = false;      // numoe-gpu has it (else the next step that carries it opens it with `sampling`)
  SamplingParams sampling;  // while not opened
  int32_t logprobs = -1;    // SamplingParams::logprobs (what the step results carry for it)
};

class Executor {
 public:
  virtual ~Executor() = default;
  // A new sequence at position 0. The sampler (and its seeded RNG) lives with the sequence.
  virtual StatusOr<ExecSeq> Open(const SamplingParams& sampling) = 0;
  // A new sequence that starts as a copy of `parent`'s state (ModelBackend::ForkSequence) with its own
  // sampler (`sampling`; the parent's penalty history). Call it between steps, after a step in which the
  // parent ran (not speculatively); the copy may be deferred to the next Step (RemoteExecutor), where it
  // happens before that step runs. Only with limits().model.fork.
  virtual StatusOr<ExecSeq> Fork(ExecSeq parent, const SamplingParams& sampling) {
    (void)parent;
    (void)sampling;
    return absl::UnimplementedError("this executor cannot fork sequences");
  }
  // Frees the sequence. May be deferred until the next Step or Flush (RemoteExecutor batches them).
  virtual Status Close(ExecSeq seq) = 0;
  // Runs the items as one step (each sequence at most once). On error, the sequences of this step are in
  // an undefined state and must be closed; a broken transport makes healthy() false.
  virtual Status Step(std::span<const StepItem> items, StepOutput* out) = 0;
  // Carries out deferred work (closes) now; the engine calls it when it goes idle.
  virtual Status Flush() { return absl::OkStatus(); }
  // False once the executor can no longer run steps (e.g. numoe-gpu went away).
  virtual bool healthy() const { return true; }
  virtual ExecutorLimits limits() const = 0;
  // Seconds this process has spent inside its ExpertBackend (the routed experts, computed or simulated)
  // since construction; 0 where the executor does not measure it. Safe to call from any thread.
  virtual double expert_seconds() const { return 0; }
  // The prefix cache behind this executor (numoe-gpu's, as its last step reported; bytes -1 when there is
  // none). Safe to call from any thread.
  virtual PrefixCacheFigures prefix_cache() const { return {}; }

  // Hand-over between executors whose sequences numoe-gpu shares (RemoteExecutor): Detach forgets `seq`
  // here without freeing it (FAILED_PRECONDITION while a fork of it is still to be sent), Adopt takes it
  // under the same key. Between steps only.
  virtual StatusOr<SeqHandoff> Detach(ExecSeq seq) {
    (void)seq;
    return absl::UnimplementedError("this executor cannot hand sequences over");
  }
  virtual Status Adopt(const SeqHandoff& handoff) {
    (void)handoff;
    return absl::UnimplementedError("this executor cannot take sequences over");
  }

  // The prefill lane (MicroBatchExecutor over a worker's decode lanes and one prefill lane): a step of prompt
  // chunks that runs on a thread of its own beside the Step calls, so decode steps go on while a long prompt
  // prefills. StartLaneStep moves the items' sequences into the lane and starts it (one at a time; its
  // sequences may not be in a Step, Fork or Close until FinishLaneStep), LaneStepDone says whether it ended
  // (FinishLaneStep will not wait), FinishLaneStep waits for it, moves the sequences back and gives its
  // output (as Step does; on error the sequences must be closed).
  virtual bool has_prefill_lane() const { return false; }
  virtual Status StartLaneStep(std::span<const StepItem> items) {
    (void)items;
    return absl::UnimplementedError("this executor has no prefill lane");
  }
  virtual bool LaneStepDone() const { return true; }
  virtual Status FinishLaneStep(StepOutput* out) {
    (void)out;
    return absl::UnimplementedError("this executor has no prefill lane");
  }
};

}  // namespace numoe::engine
