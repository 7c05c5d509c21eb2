#include "model/generation.h"

#include <algorithm>

namespace numoe {

Status ValidateRequest(const GenerateRequest& r, int64_t vocab_size) {
  if (r.prompt.empty()) return absl::InvalidArgumentError("prompt: must contain at least one token");
  for (size_t i = 0; i < r.prompt.size(); ++i) {
    if (r.prompt[i] < 0 || r.prompt[i] >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("prompt[", i, "]: token id ", r.prompt[i],
                                                     " is out of range [0, ", vocab_size, ")"));
    }
  }
  if (r.max_new_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_new_tokens must be >= 0 (got ", r.max_new_tokens, ")"));
  }
  if (r.prefill_chunk < 0) {
    return absl::InvalidArgumentError(absl::StrCat("prefill_chunk must be >= 0 (got ", r.prefill_chunk, ")"));
  }
  return ValidateSampling(r.sampling);
}

namespace {

struct Active {
  size_t index;
  SequenceId seq;
  Sampler sampler;
  size_t fed = 0;  // prompt tokens fed so far
  bool done = false;
  int32_t next = -1;             // sampled, not yet fed
  std::vector<int32_t> history;  // prompt + generated (n-gram drafter)
  std::vector<int32_t> drafts;   // this step's drafts
  std::vector<float> draft_logits;  // [drafts, vocab] (model drafter) or empty (deterministic drafter)
  int64_t depth = 0;
};

class Loop {
 public:
  Loop(ModelBackend& model, ExpertBackend& experts, const std::vector<GenerateRequest>& requests,
       const TokenCallback& on_token, const SpecConfig& spec)
      : model_(model), experts_(experts), reqs_(requests), on_token_(on_token), spec_(spec),
        V_(model.vocab_size()), results_(requests.size()) {}

  StatusOr<std::vector<GenerateResult>> Run() {
    for (const auto& r : reqs_) RETURN_IF_ERROR(ValidateRequest(r, V_));
    if (spec_.method != SpecMethod::kNone) RETURN_IF_ERROR(ValidateSpec(spec_));
    if ((spec_.method == SpecMethod::kDspark || spec_.method == SpecMethod::kMtp) && model_.drafter() != spec_.method) {
      return absl::FailedPreconditionError(absl::StrCat("--spec ", SpecMethodName(spec_.method), ": the model has no ",
                                                        spec_.method == SpecMethod::kMtp ? "MTP" : "DSpark",
                                                        " drafter loaded (its drafter: ",
                                                        SpecMethodName(model_.drafter()), ")"));
    }
    for (size_t i = 0; i < reqs_.size(); ++i) {
      auto seq = model_.CreateSequence();
      if (!seq.ok()) {
        ReleaseAll();
        return seq.status();
      }
      act_.push_back(Active{i, *seq, Sampler(reqs_[i].sampling)});
      act_.back().history = reqs_[i].prompt;
      act_.back().depth = spec_.depth;
      if (reqs_[i].max_new_tokens == 0) act_.back().done = true;
    }
    Status st = Steps();
    ReleaseAll();
    if (!st.ok()) return st;
    for (auto& r : results_) {
      if (r.finish_reason.empty()) r.finish_reason = "length";
    }
    return std::move(results_);
  }

 private:
  void ReleaseAll() {
    for (auto& a : act_) (void)model_.ReleaseSequence(a.seq);
  }

  // Emits one token for `a`; returns false when the sequence is finished.
  bool Emit(Active& a, int32_t tok, const float* logits) {
    const GenerateRequest& r = reqs_[a.index];
    GenerateResult& res = results_[a.index];
    if (r.keep_logits) res.step_logits.insert(res.step_logits.end(), logits, logits + V_);
    res.tokens.push_back(tok);
    a.history.push_back(tok);
    a.next = tok;
    if (on_token_) on_token_(a.index, tok);
    if (!r.ignore_eos && tok == r.eos_token_id) {
      res.finish_reason = "stop";
      a.done = true;
    } else if (static_cast<int64_t>(res.tokens.size()) >= r.max_new_tokens) {
      res.finish_reason = "length";
      a.done = true;
    }
    return !a.done;
  }

  Status Propose() {
    std::vector<DraftRequest> dreqs;
    std::vector<size_t> owners;
    for (size_t k = 0; k < act_.size(); ++k) {
      Active& a = act_[k];
      a.drafts.clear();
      a.draft_logits.clear();
      if (a.done || a.fed < reqs_[a.index].prompt.size()) continue;
      // Never draft past what may still be emitted.
      const int64_t left = reqs_[a.index].max_new_tokens - static_cast<int64_t>(results_[a.index].tokens.size());
      const int64_t depth = std::min(a.depth, left - 1);
      if (depth <= 0) continue;
      if (spec_.method == SpecMethod::kNgram) {
        a.drafts = NgramPropose(a.history, depth, spec_.ngram_max, spec_.ngram_min);
      } else if (spec_.method == SpecMethod::kDspark || spec_.method == SpecMethod::kMtp) {
        dreqs.push_back(DraftRequest{a.seq, a.next, depth, &a.sampler});
        owners.push_back(k);
      }
    }
    if (dreqs.empty()) return absl::OkStatus();
    std::vector<DraftResult> out;
    RETURN_IF_ERROR(model_.Draft(dreqs, &experts_, &out));
    for (size_t i = 0; i < out.size(); ++i) {
      act_[owners[i]].drafts = std::move(out[i].tokens);
      act_[owners[i]].draft_logits = std::move(out[i].logits);
    }
    return absl::OkStatus();
  }

  // Accepts drafts of `a` against the target logits rows [1 + drafts, V]; returns drafts kept.
  int64_t Verify(Active& a, const float* rows) {
    SpecStats& st = results_[a.index].spec;
    const Verdict v = VerifyDrafts(a.sampler, a.drafts, a.draft_logits, rows, V_);
    st.steps++;
    st.drafted += static_cast<int64_t>(a.drafts.size());
    int64_t kept = 0;
    for (size_t i = 0; i < v.tokens.size(); ++i) {
      if (static_cast<int64_t>(i) < v.accepted) ++kept, ++st.accepted;
      if (!Emit(a, v.tokens[i], rows + i * V_)) break;
    }
    return kept;
  }

  Status Steps() {
    std::vector<SequenceStep> steps;
    std::vector<size_t> owner;
    std::vector<SequenceLogits> out;
    std::vector<std::vector<int32_t>> feed(act_.size());
    for (;;) {
      if (spec_.method != SpecMethod::kNone) RETURN_IF_ERROR(Propose());
      steps.clear();
      owner.clear();
      for (size_t k = 0; k < act_.size(); ++k) {
        Active& a = act_[k];
        if (a.done) continue;
        const GenerateRequest& r = reqs_[a.index];
        SequenceStep s;
        s.seq = a.seq;
        if (a.fed < r.prompt.size()) {
          size_t n = r.prompt.size() - a.fed;
          if (r.prefill_chunk > 0) n = std::min(n, static_cast<size_t>(r.prefill_chunk));
          s.tokens = std::span<const int32_t>(r.prompt.data() + a.fed, n);
          s.all_logits = r.keep_logits;
          a.fed += n;
        } else {
          feed[k].assign(1, a.next);
          feed[k].insert(feed[k].end(), a.drafts.begin(), a.drafts.end());
          s.tokens = feed[k];
          s.all_logits = !a.drafts.empty();
          s.speculative = !a.drafts.empty();
        }
        steps.push_back(s);
        owner.push_back(k);
      }
      if (steps.empty()) return absl::OkStatus();
      RETURN_IF_ERROR(model_.Forward(steps, &experts_, &out));
      for (size_t i = 0; i < steps.size(); ++i) {
        Active& a = act_[owner[i]];
        const GenerateRequest& r = reqs_[a.index];
        GenerateResult& res = results_[a.index];
        const SequenceLogits& lg = out[i];
        if (steps[i].speculative) {
          const int64_t kept = Verify(a, lg.logits.data());
          const int64_t drop = static_cast<int64_t>(a.drafts.size()) - kept;
          if (!a.done) RETURN_IF_ERROR(model_.Rollback(a.seq, drop));
          if (spec_.adaptive && !a.done) {
            if (drop == 0) a.depth = std::min(a.depth + 1, spec_.depth);
            if (kept == 0) a.depth = std::max<int64_t>(a.depth - 1, 1);
          }
          continue;
        }
        const bool prefill = res.tokens.empty() && a.next < 0;
        if (prefill && r.keep_logits) {
          res.prefill_logits.insert(res.prefill_logits.end(), lg.logits.begin(), lg.logits.end());
        }
        if (a.fed < r.prompt.size()) continue;  // more prompt chunks to feed
        const float* last = lg.logits.data() + (lg.rows - 1) * V_;
        Emit(a, a.sampler.Sample(last, V_), last);
      }
    }
  }

  ModelBackend& model_;
  ExpertBackend& experts_;
  const std::vector<GenerateRequest>& reqs_;
  const TokenCallback& on_token_;
  SpecConfig spec_;
  int64_t V_;
  std::vector<GenerateResult> results_;
  std::vector<Active> act_;
};

}  // namespace

StatusOr<std::vector<GenerateResult>> GenerateBatch(ModelBackend& model, ExpertBackend& experts,
                                                    const std::vector<GenerateRequest>& requests,
                                                    const TokenCallback& on_token, const SpecConfig& spec) {
  Loop loop(model, experts, requests, on_token, spec);
  return loop.Run();
}

}  // namespace numoe
