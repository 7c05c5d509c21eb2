#include "model/generation.h"

#include <algorithm>

#include "model/spec_policy.h"
#include "model/step.h"

namespace numoe {

Status ValidateRequest(const GenerateRequest& r, int64_t vocab_size) {
  if (r.prompt.empty()) return absl::InvalidArgumentError("prompt: must contain at least one token");
  for (size_t i = 0; i < r.prompt.size(); ++i) {
    if (r.prompt[i] < 0 || r.prompt[i] >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("prompt[", i, "]: token id ", r.prompt[i],
                                                     " is out of range [0, ", vocab_size, ")"));
    }
  }
  if (!r.sampling.grammar.empty()) {
    return absl::UnimplementedError("sampling.grammar: constrained output is served by numoe serve, not this loop");
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
  int64_t depth = 0;             // drafts per step (adaptive: moves with acceptance)
};

class Loop {
 public:
  Loop(ModelBackend& model, ExpertBackend& experts, const std::vector<GenerateRequest>& requests,
       const TokenCallback& on_token, const SpecConfig& spec)
      : model_(model), experts_(experts), reqs_(requests), on_token_(on_token), spec_(spec),
        V_(model.vocab_size()), results_(requests.size()) {}

  StatusOr<std::vector<GenerateResult>> Run() {
    for (const auto& r : reqs_) RETURN_IF_ERROR(ValidateRequest(r, V_));
    RETURN_IF_ERROR(CheckSpecAgainstModel(spec_, model_.capabilities(), ModelSide::kThisProcess));
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
    if (r.keep_logits && logits != nullptr) res.step_logits.insert(res.step_logits.end(), logits, logits + V_);
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

  // Emits the tokens of one step for `a` (stopping at EOS / max_new_tokens inside an accepted run) and
  // counts its speculative statistics; `logits` holds a row per emitted token (or is null).
  void EmitStep(Active& a, const int32_t* tokens, int32_t count, int32_t drafted, int32_t accepted,
                const float* logits) {
    if (drafted > 0) {
      SpecStats& st = results_[a.index].spec;
      st.steps++;
      st.drafted += drafted;
    }
    int64_t kept = 0;
    for (int32_t i = 0; i < count; ++i) {
      if (i < accepted) ++kept, ++results_[a.index].spec.accepted;
      const float* row = logits != nullptr ? logits + static_cast<int64_t>(i) * V_ : nullptr;
      if (!Emit(a, tokens[i], row)) break;
    }
    if (drafted > 0 && spec_.adaptive && !a.done) {
      if (kept == drafted) a.depth = std::min(a.depth + 1, spec_.depth);
      if (kept == 0) a.depth = std::max<int64_t>(a.depth - 1, 1);
    }
  }

  // The step item of `a`: the next prompt chunk, or a decode token with the drafts of this step.
  StepItem NextItem(Active& a, std::vector<int32_t>* feed) {
    const GenerateRequest& r = reqs_[a.index];
    StepItem item{.seq = a.seq};
    if (a.fed < r.prompt.size()) {
      size_t n = r.prompt.size() - a.fed;
      if (r.prefill_chunk > 0) n = std::min(n, static_cast<size_t>(r.prefill_chunk));
      item.tokens = std::span<const int32_t>(r.prompt.data() + a.fed, n);
      item.all_logits = r.keep_logits;
      a.fed += n;
      item.sample = a.fed == r.prompt.size();
      return item;
    }
    feed->assign(1, a.next);
    item.sample = true;
    // Never draft past what may still be emitted.
    const int64_t left = r.max_new_tokens - static_cast<int64_t>(results_[a.index].tokens.size());
    const int64_t depth = std::min(a.depth, left - 1);
    if (depth > 0 && spec_.method == SpecMethod::kNgram) {
      const std::vector<int32_t> drafts = NgramPropose(a.history, depth, spec_.ngram_max, spec_.ngram_min);
      feed->insert(feed->end(), drafts.begin(), drafts.end());
      item.drafts = static_cast<int32_t>(drafts.size());
    } else if (depth > 0 && (spec_.method == SpecMethod::kDspark || spec_.method == SpecMethod::kMtp)) {
      item.model_drafts = static_cast<int32_t>(depth);
    }
    item.tokens = *feed;
    // The rows that chose the emitted tokens: the last row, or every row of a speculative step.
    item.all_logits = r.keep_logits && item.speculative();
    item.logits = r.keep_logits && !item.speculative();
    return item;
  }

  Status Steps() {
    std::vector<StepItem> items;
    std::vector<Sampler*> samplers;
    std::vector<size_t> owner;
    std::vector<bool> prompt;  // per item: a prompt chunk (its logits rows are prefill logits)
    std::vector<std::vector<int32_t>> feed(act_.size());
    StepScratch scratch;
    StepOutput out;
    for (;;) {
      items.clear();
      samplers.clear();
      owner.clear();
      prompt.clear();
      for (size_t k = 0; k < act_.size(); ++k) {
        Active& a = act_[k];
        if (a.done) continue;
        prompt.push_back(a.fed < reqs_[a.index].prompt.size());
        items.push_back(NextItem(a, &feed[k]));
        samplers.push_back(&a.sampler);
        owner.push_back(k);
      }
      if (items.empty()) return absl::OkStatus();
      RETURN_IF_ERROR(RunModelStep(model_, experts_, items, samplers, &scratch, &out));
      size_t emitted = 0, logits = 0;
      for (size_t i = 0; i < items.size(); ++i) {
        Active& a = act_[owner[i]];
        GenerateResult& res = results_[a.index];
        const std::vector<float>* rows = (items[i].logits || items[i].all_logits) ? &out.logits[logits++] : nullptr;
        const int32_t* tokens = out.emitted.data() + emitted;
        emitted += static_cast<size_t>(out.counts[i]);
        if (!prompt[i]) {
          EmitStep(a, tokens, out.counts[i], out.drafted[i], out.accepted[i], rows != nullptr ? rows->data() : nullptr);
          continue;
        }
        if (rows != nullptr) res.prefill_logits.insert(res.prefill_logits.end(), rows->begin(), rows->end());
        // The last chunk's last row chose the first generated token.
        if (items[i].sample) EmitStep(a, tokens, 1, 0, 0, rows != nullptr ? rows->data() + rows->size() - V_ : nullptr);
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
