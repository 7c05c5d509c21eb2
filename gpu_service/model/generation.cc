#include "gpu_service/model/generation.h"

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
  int32_t next = -1;  // sampled, not yet fed
};

}  // namespace

StatusOr<std::vector<GenerateResult>> GenerateBatch(ModelBackend& model, ExpertBackend& experts,
                                                    const std::vector<GenerateRequest>& requests,
                                                    const TokenCallback& on_token) {
  const int64_t V = model.vocab_size();
  for (const auto& r : requests) RETURN_IF_ERROR(ValidateRequest(r, V));
  std::vector<GenerateResult> results(requests.size());
  std::vector<Active> act;
  for (size_t i = 0; i < requests.size(); ++i) {
    auto seq = model.CreateSequence();
    if (!seq.ok()) {
      for (auto& a : act) (void)model.ReleaseSequence(a.seq);
      return seq.status();
    }
    act.push_back(Active{i, *seq, Sampler(requests[i].sampling)});
    if (requests[i].max_new_tokens == 0) act.back().done = true;
  }
  auto release_all = [&] {
    for (auto& a : act) (void)model.ReleaseSequence(a.seq);
  };

  std::vector<SequenceStep> steps;
  std::vector<size_t> owner;
  std::vector<SequenceLogits> out;
  std::vector<int32_t> one(act.size());
  for (;;) {
    steps.clear();
    owner.clear();
    for (size_t k = 0; k < act.size(); ++k) {
      Active& a = act[k];
      if (a.done) continue;
      const GenerateRequest& r = requests[a.index];
      SequenceStep s;
      s.seq = a.seq;
      if (a.fed < r.prompt.size()) {
        size_t n = r.prompt.size() - a.fed;
        if (r.prefill_chunk > 0) n = std::min(n, static_cast<size_t>(r.prefill_chunk));
        s.tokens = std::span<const int32_t>(r.prompt.data() + a.fed, n);
        s.all_logits = r.keep_logits;
        a.fed += n;
      } else {
        one[k] = a.next;
        s.tokens = std::span<const int32_t>(&one[k], 1);
      }
      steps.push_back(s);
      owner.push_back(k);
    }
    if (steps.empty()) break;
    Status st = model.Forward(steps, &experts, &out);
    if (!st.ok()) {
      release_all();
      return st;
    }
    for (size_t i = 0; i < steps.size(); ++i) {
      Active& a = act[owner[i]];
      const GenerateRequest& r = requests[a.index];
      GenerateResult& res = results[a.index];
      const SequenceLogits& lg = out[i];
      const bool prefill = res.tokens.empty() && a.next < 0;
      if (prefill && r.keep_logits) {
        res.prefill_logits.insert(res.prefill_logits.end(), lg.logits.begin(), lg.logits.end());
      }
      if (a.fed < r.prompt.size()) continue;  // more prompt chunks to feed
      const float* last = lg.logits.data() + (lg.rows - 1) * V;
      const int32_t tok = a.sampler.Sample(last, V);
      if (r.keep_logits) res.step_logits.insert(res.step_logits.end(), last, last + V);
      res.tokens.push_back(tok);
      a.next = tok;
      if (on_token) on_token(a.index, tok);
      if (!r.ignore_eos && tok == r.eos_token_id) {
        res.finish_reason = "stop";
        a.done = true;
      } else if (static_cast<int64_t>(res.tokens.size()) >= r.max_new_tokens) {
        res.finish_reason = "length";
        a.done = true;
      }
    }
  }
  for (auto& a : act) {
    if (results[a.index].finish_reason.empty()) results[a.index].finish_reason = "length";
  }
  release_all();
  return results;
}

}  // namespace numoe
