#include "model/spec.h"

#include <algorithm>

namespace numoe {

Status ValidateSpec(const SpecConfig& c) {
  if (c.depth < 1 || c.depth > 16) {
    return absl::InvalidArgumentError(absl::StrCat("spec depth must be in [1, 16] (got ", c.depth, ")"));
  }
  if (c.ngram_min < 1 || c.ngram_max < c.ngram_min) {
    return absl::InvalidArgumentError("n-gram drafter: need 1 <= ngram_min <= ngram_max");
  }
  return absl::OkStatus();
}

std::vector<int32_t> NgramPropose(std::span<const int32_t> history, int64_t depth, int ngram_max, int ngram_min) {
  const int64_t n = static_cast<int64_t>(history.size());
  for (int64_t len = std::min<int64_t>(ngram_max, n - 1); len >= ngram_min; --len) {
    const int32_t* suffix = history.data() + n - len;
    // Most recent earlier occurrence (its continuation must exist).
    for (int64_t start = n - len - 1; start >= 0; --start) {
      if (!std::equal(suffix, suffix + len, history.data() + start)) continue;
      std::vector<int32_t> out;
      for (int64_t i = start + len; i < n && static_cast<int64_t>(out.size()) < depth; ++i) out.push_back(history[i]);
      return out;
    }
  }
  return {};
}

Verdict VerifyDrafts(Sampler& sampler, std::span<const int32_t> drafts, std::span<const float> draft_logits,
                     const float* target, int64_t vocab) {
  Verdict v;
  const int64_t k = static_cast<int64_t>(drafts.size());
  const bool greedy = sampler.params().temperature == 0.0;
  std::vector<double> p, q;
  for (int64_t i = 0; i < k; ++i) {
    const float* lt = target + i * vocab;
    sampler.Distribution(lt, vocab, &p);
    const int32_t d = drafts[i];
    if (d < 0 || d >= vocab) {  // a drafter bug must not index out of range: treat as rejected
      v.tokens.push_back(sampler.Sample(lt, vocab));
      sampler.Accept(v.tokens.back());
      return v;
    }
    if (!draft_logits.empty()) {
      sampler.Distribution(draft_logits.data() + i * vocab, vocab, &q);
    } else {
      q.assign(static_cast<size_t>(vocab), 0.0);
      q[d] = 1.0;
    }
    const double ratio = q[d] > 0 ? p[d] / q[d] : 0.0;
    const bool accept = greedy ? p[d] > 0.5 : sampler.Uniform() < std::min(1.0, ratio);
    if (accept) {
      v.tokens.push_back(d);
      sampler.Accept(d);  // the next position's distributions see it (penalties)
      ++v.accepted;
      continue;
    }
    double mass = 0.0;
    for (int64_t t = 0; t < vocab; ++t) {
      p[t] = std::max(0.0, p[t] - q[t]);
      mass += p[t];
    }
    v.tokens.push_back(mass > 0 ? sampler.SampleFrom(p) : sampler.Sample(lt, vocab));
    sampler.Accept(v.tokens.back());
    return v;
  }
  v.tokens.push_back(sampler.Sample(target + k * vocab, vocab));
  sampler.Accept(v.tokens.back());
  return v;
}

}  // namespace numoe
