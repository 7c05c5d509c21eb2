#include "worker/engine/local_executor.h"

#include <algorithm>

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

Status LocalExecutor::Validate(std::span<const StepItem> items) const {
  const SpecMethod drafter = model_->drafter();
  for (size_t i = 0; i < items.size(); ++i) {
    const StepItem& item = items[i];
    if (seqs_.count(item.seq) == 0) return absl::NotFoundError(absl::StrCat("executor: no open sequence ", item.seq));
    if (item.tokens.empty()) return absl::InvalidArgumentError(absl::StrCat("step item ", i, ": no tokens"));
    if (item.drafts < 0 || item.model_drafts < 0) {
      return absl::InvalidArgumentError(absl::StrCat("step item ", i, ": drafts (", item.drafts, ") and model_drafts (",
                                                     item.model_drafts, ") must be >= 0"));
    }
    if (item.drafts == 0 && item.model_drafts == 0) continue;
    if (!item.sample) {
      return absl::InvalidArgumentError(absl::StrCat("step item ", i, ": drafts need sample (a decode item)"));
    }
    if (item.logits) {
      return absl::InvalidArgumentError(absl::StrCat("step item ", i, ": a speculative item may not ask for logits"));
    }
    if (item.drafts > 0 && item.model_drafts > 0) {
      return absl::InvalidArgumentError(absl::StrCat("step item ", i, ": drafts and model_drafts are exclusive"));
    }
    if (item.drafts > 0 && static_cast<int64_t>(item.tokens.size()) < int64_t{item.drafts} + 1) {
      return absl::InvalidArgumentError(absl::StrCat("step item ", i, ": drafts = ", item.drafts, " needs at least ",
                                                     int64_t{item.drafts} + 1, " tokens (got ", item.tokens.size(),
                                                     ")"));
    }
    if (item.model_drafts > 0) {
      if (drafter == SpecMethod::kNone) {
        return absl::FailedPreconditionError(
            absl::StrCat("step item ", i, ": model_drafts = ", item.model_drafts, " but the model has no drafter loaded"));
      }
      if (item.tokens.size() != 1) {
        return absl::InvalidArgumentError(absl::StrCat("step item ", i, ": model_drafts needs exactly 1 token (got ",
                                                       item.tokens.size(), ")"));
      }
      if (item.model_drafts > kMaxModelDrafts) {
        return absl::InvalidArgumentError(absl::StrCat("step item ", i, ": model_drafts = ", item.model_drafts,
                                                       " exceeds the limit of ", kMaxModelDrafts));
      }
    }
  }
  return absl::OkStatus();
}

Status LocalExecutor::Step(std::span<const StepItem> items, StepOutput* out) {
  RETURN_IF_ERROR(Validate(items));
  const int64_t V = model_->vocab_size();
  const size_t n = items.size();
  feed_.resize(n);
  draft_logits_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    feed_[i].clear();
    draft_logits_[i].clear();
  }

  // Model drafts, one batched Draft call over the step's items.
  draft_reqs_.clear();
  std::vector<size_t> draft_owner;
  for (size_t i = 0; i < n; ++i) {
    if (items[i].model_drafts == 0) continue;
    Seq& s = seqs_.at(items[i].seq);
    draft_reqs_.push_back(DraftRequest{.seq = s.model_seq,
                                       .next_token = items[i].tokens[0],
                                       .depth = items[i].model_drafts,
                                       .sampler = &s.sampler});
    draft_owner.push_back(i);
  }
  if (!draft_reqs_.empty()) {
    draft_out_.clear();
    RETURN_IF_ERROR(model_->Draft(draft_reqs_, experts_, &draft_out_));
    if (draft_out_.size() != draft_reqs_.size()) {
      return absl::InternalError(absl::StrCat("executor: the drafter returned ", draft_out_.size(), " results for ",
                                              draft_reqs_.size(), " requests"));
    }
    for (size_t j = 0; j < draft_out_.size(); ++j) {
      const size_t i = draft_owner[j];
      DraftResult& d = draft_out_[j];
      // A drafter may propose fewer than asked, never more.
      const size_t k = std::min(d.tokens.size(), static_cast<size_t>(items[i].model_drafts));
      feed_[i].push_back(items[i].tokens[0]);
      feed_[i].insert(feed_[i].end(), d.tokens.begin(), d.tokens.begin() + static_cast<std::ptrdiff_t>(k));
      if (d.logits.size() >= k * static_cast<size_t>(V)) {
        draft_logits_[i].assign(d.logits.begin(), d.logits.begin() + static_cast<std::ptrdiff_t>(k * V));
      } else if (!d.logits.empty()) {
        return absl::InternalError(absl::StrCat("executor: the drafter returned ", d.logits.size(),
                                                " logits for ", k, " drafts"));
      }
    }
  }

  // Drafts verified per item (n-gram drafts from the worker, or what the drafter proposed).
  std::vector<int64_t> drafted(n, 0);
  steps_.clear();
  for (size_t i = 0; i < n; ++i) {
    const StepItem& item = items[i];
    SequenceStep st{.seq = seqs_.at(item.seq).model_seq, .tokens = item.tokens};
    if (item.model_drafts > 0) {
      st.tokens = feed_[i];
      drafted[i] = static_cast<int64_t>(feed_[i].size()) - 1;
    } else {
      drafted[i] = item.drafts;
    }
    st.speculative = st.all_logits = drafted[i] > 0;
    steps_.push_back(st);
  }
  RETURN_IF_ERROR(model_->Forward(steps_, experts_, &logits_));
  if (logits_.size() != n) {
    return absl::InternalError(absl::StrCat("executor: model returned ", logits_.size(), " logit sets for ", n,
                                            " sequences"));
  }
  out->Reset(n);
  for (size_t i = 0; i < n; ++i) {
    const StepItem& item = items[i];
    const SequenceLogits& lg = logits_[i];
    Seq& s = seqs_.at(item.seq);
    if (drafted[i] > 0) {
      const int64_t k = drafted[i];
      if (lg.rows != static_cast<int64_t>(steps_[i].tokens.size()) ||
          lg.logits.size() != static_cast<size_t>(lg.rows * V)) {
        return absl::InternalError(absl::StrCat("executor: model returned ", lg.rows, " logit rows for a speculative step of ",
                                                steps_[i].tokens.size(), " tokens"));
      }
      // Rows [rows - k - 1, rows): after the last non-draft token, then after each draft.
      const float* target = lg.logits.data() + (lg.rows - k - 1) * V;
      const std::span<const int32_t> drafts = steps_[i].tokens.subspan(steps_[i].tokens.size() - static_cast<size_t>(k));
      const Verdict v = VerifyDrafts(s.sampler, drafts, draft_logits_[i], target, V);
      out->tokens[i] = v.tokens.front();
      out->counts[i] = static_cast<int32_t>(v.tokens.size());
      out->drafted[i] = static_cast<int32_t>(k);
      out->accepted[i] = static_cast<int32_t>(v.accepted);
      out->emitted.insert(out->emitted.end(), v.tokens.begin(), v.tokens.end());
      if (k > v.accepted) RETURN_IF_ERROR(model_->Rollback(s.model_seq, k - v.accepted));
      continue;
    }
    const float* last = lg.logits.data() + (lg.rows - 1) * V;
    if (item.sample) {
      out->tokens[i] = s.sampler.Sample(last, V);
      out->counts[i] = 1;
      out->emitted.push_back(out->tokens[i]);
    }
    if (item.logits) out->logits.emplace_back(last, last + V);
  }
  return absl::OkStatus();
}

ExecutorLimits LocalExecutor::limits() const {
  const SpecMethod drafter = model_->drafter();
  return ExecutorLimits{.vocab_size = model_->vocab_size(),
                        .max_step_tokens = max_step_tokens_,
                        .max_seqs = max_seqs_,
                        .logits = true,
                        .drafter = drafter,
                        .max_model_drafts = drafter == SpecMethod::kNone ? 0 : kMaxModelDrafts};
}

}  // namespace numoe::engine
