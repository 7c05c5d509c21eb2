// LocalExecutor: the Executor over a model in this process (ModelBackend + ExpertBackend), sampling
// with one Sampler per sequence exactly as GenerateBatch does, so the engine's tokens equal the
// one-process loop's for the same requests.
//
// A step maps the executor's handles to the model's sequences and samplers and runs RunModelStep
// (model/step.h): draft, forward, verify, rollback and sample are written there once.
#pragma once

#include <map>

#include "model/backend.h"
#include "model/step.h"
#include "worker/engine/executor.h"

namespace numoe::engine {

class LocalExecutor final : public Executor {
 public:
  // Neither is owned; both must outlive the executor. `max_step_tokens` / `max_seqs` (0 = unbounded)
  // are only reported through limits(): the engine keeps within them.
  LocalExecutor(ModelBackend* model, ExpertBackend* experts, int64_t max_step_tokens = 0, int64_t max_seqs = 0);
  ~LocalExecutor() override;

  StatusOr<ExecSeq> Open(const SamplingParams& sampling) override;
  StatusOr<ExecSeq> Fork(ExecSeq parent, const SamplingParams& sampling) override;
  Status Close(ExecSeq seq) override;
  Status Step(std::span<const StepItem> items, StepOutput* out) override;
  ExecutorLimits limits() const override;

  int64_t open_sequences() const { return static_cast<int64_t>(seqs_.size()); }
  // Compiles constrained sequences' grammars (SamplingParams::grammar); without one they are refused. Not
  // owned.
  void set_grammars(tokenizer::GrammarCache* grammars) { grammars_ = grammars; }

 private:
  struct Seq {
    SequenceId model_seq;
    Sampler sampler;
  };

  ModelBackend* model_;
  ExpertBackend* experts_;
  int64_t max_step_tokens_, max_seqs_;
  tokenizer::GrammarCache* grammars_ = nullptr;
  std::map<ExecSeq, Seq> seqs_;
  ExecSeq next_ = 1;
  std::vector<StepItem> model_items_;  // the step's items with the model's SequenceIds
  std::vector<Sampler*> samplers_;
  StepScratch scratch_;
};

}  // namespace numoe::engine
