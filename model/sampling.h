// Token sampling: greedy, temperature, top-k, top-p, with a per-sequence seeded RNG
// (the same seed and logits give the same tokens).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "common/status.h"

namespace numoe {

struct SamplingParams {
  double temperature = 0.0;  // 0 = greedy (argmax; ties -> lowest id)
  double top_p = 1.0;        // nucleus mass in (0, 1]
  int64_t top_k = 0;         // 0 = no top-k cut
  uint64_t seed = 0;         // RNG seed (used when temperature > 0)
};

// Errors name the field: temperature < 0, top_p outside (0, 1], top_k < 0.
Status ValidateSampling(const SamplingParams& p);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) {}
  // Picks a token from logits[vocab]. Greedy when temperature == 0.
  int32_t Sample(const float* logits, int64_t vocab);
  // The distribution Sample draws from, dense over the vocabulary (zeros outside top-k / top-p; one-hot
  // at the argmax when greedy). Speculative verification compares target and draft distributions.
  void Distribution(const float* logits, int64_t vocab, std::vector<double>* probs);
  // Draws from an unnormalised distribution (sum > 0).
  int32_t SampleFrom(const std::vector<double>& probs);
  double Uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(rng_); }
  const SamplingParams& params() const { return p_; }

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<int32_t> idx_;
  std::vector<double> prob_;
};

int32_t Argmax(const float* logits, int64_t vocab);

}  // namespace numoe
