#include "worker/engine/local_executor.h"

namespace numoe::engine {

LocalExecutor::LocalExecutor(ModelBackend* model, ExpertBackend* experts, int64_t max_step_tokens,
                             int64_t max_seqs)
    : model_(model), experts_(experts), max_step_tokens_(max_step_tokens), max_seqs_(max_seqs) {}

LocalExecutor::~LocalExecutor() {
  for (auto& [id, s] : seqs_) (void)model_->ReleaseSequence(s.model_seq);
}

StatusOr<ExecSeq> LocalExecutor::Open(const SamplingParams& sampling) {
  RETURN_IF_ERROR(ValidateSampling(sampling));
  ASSIGN_OR_RETURN(SequenceId model_seq, model_->CreateSequence());
  const ExecSeq id = next_++;
  seqs_.emplace(id, Seq{model_seq, Sampler(sampling)});
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
  steps_.clear();
  for (const StepItem& item : items) {
    auto it = seqs_.find(item.seq);
    if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("executor: no open sequence ", item.seq));
    steps_.push_back(SequenceStep{.seq = it->second.model_seq, .tokens = item.tokens});
  }
  RETURN_IF_ERROR(model_->Forward(steps_, experts_, &logits_));
  if (logits_.size() != items.size()) {
    return absl::InternalError(absl::StrCat("executor: model returned ", logits_.size(), " logit sets for ",
                                            items.size(), " sequences"));
  }
  const int64_t V = model_->vocab_size();
  out->tokens.assign(items.size(), -1);
  out->logits.clear();
  for (size_t i = 0; i < items.size(); ++i) {
    const SequenceLogits& lg = logits_[i];
    const float* last = lg.logits.data() + (lg.rows - 1) * V;
    if (items[i].sample) out->tokens[i] = seqs_.at(items[i].seq).sampler.Sample(last, V);
    if (items[i].logits) out->logits.emplace_back(last, last + V);
  }
  return absl::OkStatus();
}

ExecutorLimits LocalExecutor::limits() const {
  return ExecutorLimits{.vocab_size = model_->vocab_size(),
                        .max_step_tokens = max_step_tokens_,
                        .max_seqs = max_seqs_,
                        .logits = true};
}

}  // namespace numoe::engine
