#include "model/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace numoe {

Status ValidateSampling(const SamplingParams& p) {
  if (!(p.temperature >= 0.0) || !std::isfinite(p.temperature)) {
    return absl::InvalidArgumentError(absl::StrCat("temperature must be >= 0 (got ", p.temperature, ")"));
  }
  if (!(p.top_p > 0.0 && p.top_p <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1] (got ", p.top_p, ")"));
  }
  if (p.top_k < 0) return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0 (got ", p.top_k, ")"));
  return absl::OkStatus();
}

int32_t Argmax(const float* logits, int64_t vocab) {
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

int32_t Sampler::Sample(const float* logits, int64_t vocab) {
  if (p_.temperature == 0.0) return Argmax(logits, vocab);
  idx_.resize(static_cast<size_t>(vocab));
  std::iota(idx_.begin(), idx_.end(), 0);
  // Candidates sorted by logit (descending, ties by id), cut by top-k.
  int64_t keep = p_.top_k > 0 ? std::min<int64_t>(p_.top_k, vocab) : vocab;
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(idx_.begin(), idx_.begin() + keep, idx_.end(), by_logit);
  const double t = p_.temperature;
  const double m = logits[idx_[0]];
  prob_.resize(static_cast<size_t>(keep));
  double sum = 0.0;
  for (int64_t i = 0; i < keep; ++i) {
    prob_[i] = std::exp((static_cast<double>(logits[idx_[i]]) - m) / t);
    sum += prob_[i];
  }
  // Nucleus: the smallest prefix whose mass reaches top_p (at least one token).
  if (p_.top_p < 1.0) {
    double acc = 0.0;
    int64_t cut = keep;
    for (int64_t i = 0; i < keep; ++i) {
      acc += prob_[i] / sum;
      if (acc >= p_.top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    sum = std::accumulate(prob_.begin(), prob_.begin() + keep, 0.0);
  }
  const double u = std::uniform_real_distribution<double>(0.0, sum)(rng_);
  double acc = 0.0;
  for (int64_t i = 0; i < keep; ++i) {
    acc += prob_[i];
    if (u < acc) return idx_[i];
  }
  return idx_[keep - 1];
}

void Sampler::Distribution(const float* logits, int64_t vocab, std::vector<double>* probs) {
  probs->assign(static_cast<size_t>(vocab), 0.0);
  if (p_.temperature == 0.0) {
    (*probs)[static_cast<size_t>(Argmax(logits, vocab))] = 1.0;
    return;
  }
  idx_.resize(static_cast<size_t>(vocab));
  std::iota(idx_.begin(), idx_.end(), 0);
  int64_t keep = p_.top_k > 0 ? std::min<int64_t>(p_.top_k, vocab) : vocab;
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(idx_.begin(), idx_.begin() + keep, idx_.end(), by_logit);
  const double m = logits[idx_[0]];
  double sum = 0.0;
  for (int64_t i = 0; i < keep; ++i) {
    const double e = std::exp((static_cast<double>(logits[idx_[i]]) - m) / p_.temperature);
    (*probs)[static_cast<size_t>(idx_[i])] = e;
    sum += e;
  }
  if (p_.top_p < 1.0) {
    double acc = 0.0;
    int64_t cut = keep;
    for (int64_t i = 0; i < keep; ++i) {
      acc += (*probs)[static_cast<size_t>(idx_[i])] / sum;
      if (acc >= p_.top_p) {
        cut = i + 1;
        break;
      }
    }
    for (int64_t i = cut; i < keep; ++i) (*probs)[static_cast<size_t>(idx_[i])] = 0.0;
    keep = cut;
    sum = 0.0;
    for (int64_t i = 0; i < keep; ++i) sum += (*probs)[static_cast<size_t>(idx_[i])];
  }
  for (int64_t i = 0; i < keep; ++i) (*probs)[static_cast<size_t>(idx_[i])] /= sum;
}

int32_t Sampler::SampleFrom(const std::vector<double>& probs) {
  const double total = std::accumulate(probs.begin(), probs.end(), 0.0);
  const double u = std::uniform_real_distribution<double>(0.0, total)(rng_);
  double acc = 0.0;
  int32_t last = 0;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] <= 0.0) continue;
    acc += probs[i];
    last = static_cast<int32_t>(i);
    if (u < acc) return last;
  }
  return last;
}

}  // namespace numoe
