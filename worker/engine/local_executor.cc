#include "worker/engine/local_executor.h"

namespace numoe::engine {

LocalExecutor::LocalExecutor(ModelBackend* model, ExpertBackend* experts, int64_t max_step_tokens,
                             int64_t max_seqs)
    : model_(model), experts_(experts), max_step_tokens_(max_step_tokens), max_seqs_(max_seqs) {}

LocalExecutor::~LocalExecutor() {
  for (auto& [id, s] : seqs_) (void)model_->ReleaseSequence(s.model_seq);
}

StatusOr<ExecSeq> LocalExecutor::Open(const SamplingParams& sampling) {
  RETURN_IF_ERROR(ValidateSampling(sampling, model_->vocab_size()));
  ASSIGN_OR_RETURN(Sampler sampler, MakeSampler(sampling, grammars_));
  ASSIGN_OR_RETURN(SequenceId model_seq, model_->CreateSequence());
  const ExecSeq id = next_++;
  seqs_.emplace(id, Seq{model_seq, std::move(sampler)});
  return id;
}

StatusOr<ExecSeq> LocalExecutor::Fork(ExecSeq parent, const SamplingParams& sampling) {
  RETURN_IF_ERROR(ValidateSampling(sampling, model_->vocab_size()));
  auto it = seqs_.find(parent);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("executor: no open sequence ", parent));
  ASSIGN_OR_RETURN(SequenceId model_seq, model_->ForkSequence(it->second.model_seq));
  const ExecSeq id = next_++;
  Seq child{model_seq, Sampler(sampling)};
  child.sampler.CopyHistoryFrom(it->second.sampler);
  seqs_.emplace(id, std::move(child));
  return id;
}

Status LocalExecutor::Close(ExecSeq seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("executor: no open sequence ", seq));
  Status st = model_->ReleaseSequence(it->second.model_seq);
  seqs_.erase(it);
  return st;
}

Status LocalExecutor::Step(std::span<const StepItem> items, StepOutput* out) {
  model_items_.assign(items.begin(), items.end());
  samplers_.resize(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    auto it = seqs_.find(items[i].seq);
    if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("executor: no open sequence ", items[i].seq));
    model_items_[i].seq = it->second.model_seq;
    samplers_[i] = &it->second.sampler;
  }
  return RunModelStep(*model_, *experts_, model_items_, samplers_, &scratch_, out);
}

ExecutorLimits LocalExecutor::limits() const {
  return ExecutorLimits{.vocab_size = model_->vocab_size(),
                        .max_step_tokens = max_step_tokens_,
                        .max_seqs = max_seqs_,
                        .logits = true,
                        .model = model_->capabilities()};
}

}  // namespace numoe::engine
