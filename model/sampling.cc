#include "model/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "common/hash.h"

namespace numoe {

Status ValidateSampling(const SamplingParams& p, int64_t vocab) {
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (!(p.temperature >= 0.0) || !std::isfinite(p.temperature)) {
    return bad("temperature must be >= 0 (got ", p.temperature, ")");
  }
  if (!(p.top_p > 0.0 && p.top_p <= 1.0)) return bad("top_p must be in (0, 1] (got ", p.top_p, ")");
  if (p.top_k < 0) return bad("top_k must be >= 0 (got ", p.top_k, ")");
  if (!(p.min_p >= 0.0 && p.min_p <= 1.0)) return bad("min_p must be in [0, 1] (got ", p.min_p, ")");
  if (!(p.presence_penalty >= -2.0 && p.presence_penalty <= 2.0)) {
    return bad("presence_penalty must be in [-2, 2] (got ", p.presence_penalty, ")");
  }
  if (!(p.frequency_penalty >= -2.0 && p.frequency_penalty <= 2.0)) {
    return bad("frequency_penalty must be in [-2, 2] (got ", p.frequency_penalty, ")");
  }
  if (!(p.repetition_penalty > 0.0 && p.repetition_penalty <= 2.0)) {
    return bad("repetition_penalty must be in (0, 2] (got ", p.repetition_penalty, ")");
  }
  if (p.logprobs < -1 || p.logprobs > kMaxTopLogprobs) {
    return bad("logprobs must be in [-1, ", kMaxTopLogprobs, "] (-1 = none; got ", p.logprobs, ")");
  }
  if (p.grammar.size() > tokenizer::kMaxGrammarSpecBytes) {
    return bad("grammar has ", p.grammar.size(), " bytes; at most ", tokenizer::kMaxGrammarSpecBytes);
  }
  if (p.logit_bias.size() > kMaxLogitBias) {
    return bad("logit_bias has ", p.logit_bias.size(), " entries; at most ", kMaxLogitBias);
  }
  for (const auto& [token, bias] : p.logit_bias) {
    if (token < 0 || (vocab > 0 && token >= vocab)) {
      return bad("logit_bias: token id ", token, " is out of range [0, ", vocab > 0 ? vocab : int64_t{1} << 31, ")");
    }
    if (!(std::abs(bias) <= kMaxLogitBiasValue)) {
      return bad("logit_bias[", token, "] must be in [-100, 100] (got ", bias, ")");
    }
  }
  return absl::OkStatus();
}

uint64_t ChoiceSeed(uint64_t seed, int64_t index) {
  if (index == 0) return seed;
  // splitmix64 of the seed mixed with the index: neighbouring seeds and indices give unrelated streams.
  return SplitMix64Finalize(seed + kSplitMix64Gamma * static_cast<uint64_t>(index + 1));
}

int32_t Argmax(const float* logits, int64_t vocab) {
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

void TopLogprobs(const float* logits, int64_t vocab, int32_t chosen, int32_t n, EmittedLogprobs* out) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < vocab; ++i) m = std::max(m, static_cast<double>(logits[i]));
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i]) - m);
  const double lse = m + std::log(sum);
  out->chosen = TokenLogprob{chosen, static_cast<float>(static_cast<double>(logits[chosen]) - lse)};
  out->top.clear();
  n = std::clamp<int32_t>(n, 0, static_cast<int32_t>(std::min<int64_t>(vocab, kMaxTopLogprobs)));
  if (n == 0) return;
  // The n largest, kept sorted (descending, ties by lower id) in a small array: O(vocab x n) worst case,
  // O(vocab) in practice since most logits fall below the smallest kept.
  auto better = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::vector<int32_t> best;
  best.reserve(static_cast<size_t>(n) + 1);
  for (int64_t i = 0; i < vocab; ++i) {
    const int32_t t = static_cast<int32_t>(i);
    if (static_cast<int32_t>(best.size()) == n && !better(t, best.back())) continue;
    best.insert(std::upper_bound(best.begin(), best.end(), t, better), t);
    if (static_cast<int32_t>(best.size()) > n) best.pop_back();
  }
  for (int32_t t : best) out->top.push_back(TokenLogprob{t, static_cast<float>(static_cast<double>(logits[t]) - lse)});
}

// ---- history ----

void Sampler::ObservePrompt(std::span<const int32_t> tokens) {
  if (p_.repetition_penalty == 1.0) return;
  prompt_seen_.insert(tokens.begin(), tokens.end());
}

StatusOr<Sampler> MakeSampler(const SamplingParams& p, tokenizer::GrammarCache* cache) {
  if (p.grammar.empty()) return Sampler(p);
  if (cache == nullptr) {
    return absl::FailedPreconditionError(
        "sampling.grammar: constrained output needs the model's tokenizer.json, which this process did not load");
  }
  auto g = cache->Get(p.grammar);
  if (!g.ok()) return absl::InvalidArgumentError(absl::StrCat("sampling.", g.status().message()));
  return Sampler(p, *std::move(g));
}

void Sampler::Accept(int32_t token) {
  generating_ = true;
  if (grammar_) grammar_->Accept(token);
  if (p_.penalized()) ++generated_[token];
}

void Sampler::Unaccept(int32_t token) {
  auto it = generated_.find(token);
  if (it == generated_.end()) return;
  if (--it->second == 0) generated_.erase(it);
}

int32_t Sampler::SampleDraft(const float* logits, int64_t vocab) {
  const int32_t t = Sample(logits, vocab);
  if (grammar_) {
    if (!grammar_before_drafts_) grammar_before_drafts_ = *grammar_;
    grammar_->Accept(t);
  }
  if (p_.penalized()) {
    ++generated_[t];
    drafts_.push_back(t);
  }
  return t;
}

void Sampler::ClearDrafts() {
  if (grammar_before_drafts_) {
    grammar_ = std::move(grammar_before_drafts_);
    grammar_before_drafts_.reset();
  }
  for (int32_t t : drafts_) Unaccept(t);
  drafts_.clear();
}

void Sampler::CopyHistoryFrom(const Sampler& parent) {
  generating_ = parent.generating_;
  // A fork follows its parent's grammar from where the parent is (before any drafts).
  if (parent.grammar_before_drafts_) {
    grammar_ = parent.grammar_before_drafts_;
  } else if (parent.grammar_) {
    grammar_ = parent.grammar_;
  }
  if (!p_.penalized()) return;
  if (p_.repetition_penalty != 1.0) prompt_seen_ = parent.prompt_seen_;
  generated_ = parent.generated_;
  for (int32_t t : parent.drafts_) Unaccept(t);
}

const float* Sampler::Process(const float* logits, int64_t vocab) {
  if (!p_.penalized() && !grammar_) return logits;
  scratch_.assign(logits, logits + vocab);
  float* l = scratch_.data();
  if (grammar_) {
    const auto mask = grammar_->Mask();
    const int64_t n = std::min<int64_t>(vocab, static_cast<int64_t>(mask->size()) * 64);
    constexpr float kOff = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) {
      if (!tokenizer::MaskAllows(*mask, static_cast<int32_t>(i))) l[i] = kOff;
    }
    for (int64_t i = n; i < vocab; ++i) l[i] = kOff;
  }
  for (const auto& [token, bias] : p_.logit_bias) {
    if (token >= 0 && token < vocab) l[token] += bias;
  }
  if (const double r = p_.repetition_penalty; r != 1.0) {
    auto penalize = [&](int32_t t) {
      if (t < 0 || t >= vocab) return;
      l[t] = l[t] > 0 ? static_cast<float>(l[t] / r) : static_cast<float>(l[t] * r);
    };
    for (int32_t t : prompt_seen_) penalize(t);
    for (const auto& [t, count] : generated_) {
      if (prompt_seen_.count(t) == 0) penalize(t);
    }
  }
  if (p_.frequency_penalty != 0.0 || p_.presence_penalty != 0.0) {
    for (const auto& [t, count] : generated_) {
      if (t < 0 || t >= vocab) continue;
      l[t] -= static_cast<float>(p_.frequency_penalty * count + p_.presence_penalty);
    }
  }
  return l;
}

int64_t Sampler::Candidates(const float* logits, int64_t vocab, double* sum) {
  const double t = p_.temperature;
  idx_.clear();
  // min_p: p_i >= min_p * p_max  <=>  l_i >= l_max + t * ln(min_p). Filtering first also keeps the sort short.
  if (p_.min_p > 0.0) {
    const float m = logits[Argmax(logits, vocab)];
    const double floor = static_cast<double>(m) + t * std::log(p_.min_p);
    for (int64_t i = 0; i < vocab; ++i) {
      if (static_cast<double>(logits[i]) >= floor) idx_.push_back(static_cast<int32_t>(i));
    }
  } else {
    idx_.resize(static_cast<size_t>(vocab));
    std::iota(idx_.begin(), idx_.end(), 0);
  }
  // Candidates sorted by logit (descending, ties by id), cut by top-k.
  const int64_t n = static_cast<int64_t>(idx_.size());
  int64_t keep = p_.top_k > 0 ? std::min<int64_t>(p_.top_k, n) : n;
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(idx_.begin(), idx_.begin() + keep, idx_.end(), by_logit);
  // Tokens a grammar dropped (-inf) are never candidates.
  while (keep > 1 && std::isinf(logits[idx_[keep - 1]]) && logits[idx_[keep - 1]] < 0) --keep;
  const double m = logits[idx_[0]];
  prob_.resize(static_cast<size_t>(keep));
  double s = 0.0;
  for (int64_t i = 0; i < keep; ++i) {
    prob_[i] = std::exp((static_cast<double>(logits[idx_[i]]) - m) / t);
    s += prob_[i];
  }
  // Nucleus: the smallest prefix whose mass reaches top_p (at least one token).
  if (p_.top_p < 1.0) {
    double acc = 0.0;
    int64_t cut = keep;
    for (int64_t i = 0; i < keep; ++i) {
      acc += prob_[i] / s;
      if (acc >= p_.top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    s = std::accumulate(prob_.begin(), prob_.begin() + keep, 0.0);
  }
  *sum = s;
  return keep;
}

int32_t Sampler::Sample(const float* raw, int64_t vocab) {
  const float* logits = Process(raw, vocab);
  if (p_.temperature == 0.0) return Argmax(logits, vocab);
  double sum = 0.0;
  const int64_t keep = Candidates(logits, vocab, &sum);
  const double u = std::uniform_real_distribution<double>(0.0, sum)(rng_);
  double acc = 0.0;
  for (int64_t i = 0; i < keep; ++i) {
    acc += prob_[i];
    if (u < acc) return idx_[i];
  }
  return idx_[keep - 1];
}

void Sampler::Distribution(const float* raw, int64_t vocab, std::vector<double>* probs) {
  const float* logits = Process(raw, vocab);
  probs->assign(static_cast<size_t>(vocab), 0.0);
  if (p_.temperature == 0.0) {
    (*probs)[static_cast<size_t>(Argmax(logits, vocab))] = 1.0;
    return;
  }
  double sum = 0.0;
  const int64_t keep = Candidates(logits, vocab, &sum);
  for (int64_t i = 0; i < keep; ++i) (*probs)[static_cast<size_t>(idx_[i])] = prob_[i] / sum;
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
