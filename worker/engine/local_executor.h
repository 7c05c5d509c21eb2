// LocalExecutor: the Executor over a model in this process (ModelBackend + ExpertBackend), sampling
// with one Sampler per sequence exactly as GenerateBatch does, so the engine's tokens equal the
// one-process loop's for the same requests.
//
// Speculative items (executor.h): model drafts come from ModelBackend::Draft, batched over the step's
// items with each sequence's Sampler; every speculative item runs in the same Forward as the others
// (speculative, all logits), is verified with VerifyDrafts and rolled back by drafted - accepted.
#pragma once

#include <map>

#include "model/backend.h"
#include "worker/engine/executor.h"

namespace numoe::engine {

class LocalExecutor final : public Executor {
 public:
  // Neither is owned; both must outlive the executor. `max_step_tokens` / `max_seqs` (0 = unbounded)
  // are only reported through limits(): the engine keeps within them.
  LocalExecutor(ModelBackend* model, ExpertBackend* experts, int64_t max_step_tokens = 0, int64_t max_seqs = 0);
  ~LocalExecutor() override;

  StatusOr<ExecSeq> Open(const SamplingParams& sampling) override;
  Status Close(ExecSeq seq) override;
  Status Step(std::span<const StepItem> items, StepOutput* out) override;
  ExecutorLimits limits() const override;

  int64_t open_sequences() const { return static_cast<int64_t>(seqs_.size()); }

 private:
  struct Seq {
    SequenceId model_seq;
    Sampler sampler;
  };
  // The most drafts one item may ask the model drafter for (ValidateSpec's depth bound).
  static constexpr int64_t kMaxModelDrafts = 16;
  Status Validate(std::span<const StepItem> items) const;

  ModelBackend* model_;
  ExpertBackend* experts_;
  int64_t max_step_tokens_, max_seqs_;
  std::map<ExecSeq, Seq> seqs_;
  ExecSeq next_ = 1;
  std::vector<SequenceStep> steps_;
  std::vector<SequenceLogits> logits_;
  std::vector<std::vector<int32_t>> feed_;         // per item with model drafts: [tokens[0], drafts...]
  std::vector<std::vector<float>> draft_logits_;   // per item: the model drafts' distributions (empty: n-gram)
  std::vector<DraftRequest> draft_reqs_;
  std::vector<DraftResult> draft_out_;
};

}  // namespace numoe::engine
