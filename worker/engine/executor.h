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

namespace numoe::engine {

using ExecSeq = int64_t;  // an executor's handle for one sequence

// One sequence's part of a step: its next tokens (prompt chunk, or the last sampled token).
//
// Speculative decoding (model/spec.h has the verification rule). A decode item (sample set,
// the prompt fully consumed) may carry drafts in one of two ways:
//   - `drafts` > 0: the last `drafts` entries of `tokens` are proposals of a drafter that needs no
//     weights (n-gram, run by the worker): tokens = [last sampled token, d_0 .. d_{drafts-1}];
//   - `model_drafts` > 0 (tokens.size() == 1, drafts == 0): the executor's model drafter (DSpark or MTP,
//     ExecutorLimits::drafter) proposes that many tokens after tokens[0].
// The target runs once over [last token, drafts], the drafts are verified, the rejected positions are
// rolled back in every cache, and the item emits 1 + accepted tokens (StepOutput::counts). Either way the
// item occupies 1 + drafts (+ model_drafts) rows of the step's token budget. Speculative items may not
// ask for logits.
struct StepItem {
  ExecSeq seq = 0;
  std::span<const int32_t> tokens;  // >= 1 tokens, each in [0, vocab)
  bool sample = false;              // pick a token from the logits of the last token
  bool logits = false;              // also return those logits (needs ExecutorLimits::logits)
  int32_t drafts = 0;               // trailing draft tokens in `tokens` (needs sample)
  int32_t model_drafts = 0;         // drafts to ask the model drafter for (needs sample, tokens.size() == 1)

  int64_t rows() const { return static_cast<int64_t>(tokens.size()) + model_drafts; }
};

struct StepOutput {
  // Per item: the first emitted token (the sampled id), or -1 where the item did not sample.
  std::vector<int32_t> tokens;
  // Per item: tokens emitted (0 without sample, 1 without drafts, 1 + accepted with drafts).
  std::vector<int32_t> counts;
  // The emitted tokens of every item, item after item (sum of counts entries); tokens[i] is the first
  // of item i's.
  std::vector<int32_t> emitted;
  // Per item: drafts verified (drafts or model_drafts actually proposed; a model drafter may propose
  // fewer) and accepted (counts[i] - 1 for a sampling item).
  std::vector<int32_t> drafted;
  std::vector<int32_t> accepted;
  // One row of `vocab` floats per item that asked for logits, in item order.
  std::vector<std::vector<float>> logits;

  // Sizes the per-item vectors for `n` items with nothing emitted (tokens -1) and clears the rest.
  void Reset(size_t n) {
    tokens.assign(n, -1);
    counts.assign(n, 0);
    drafted.assign(n, 0);
    accepted.assign(n, 0);
    emitted.clear();
    logits.clear();
  }
};

struct ExecutorLimits {
  int64_t vocab_size = 0;
  int64_t max_step_tokens = 0;  // tokens per Step (sum over items); 0 = unbounded
  int64_t max_seqs = 0;         // open sequences at once; 0 = unbounded
  bool logits = false;          // StepItem::logits is supported
  // The model drafter StepItem::model_drafts uses (kNone: model_drafts must be 0) and the most drafts
  // one item may ask for (0 = no limit beyond max_step_tokens).
  SpecMethod drafter = SpecMethod::kNone;
  int64_t max_model_drafts = 0;
};

class Executor {
 public:
  virtual ~Executor() = default;
  // A new sequence at position 0. The sampler (and its seeded RNG) lives with the sequence.
  virtual StatusOr<ExecSeq> Open(const SamplingParams& sampling) = 0;
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
};

}  // namespace numoe::engine
