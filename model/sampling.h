// Token sampling: greedy, temperature, top-k, top-p, min-p, with a per-sequence seeded RNG (the same seed and
// logits give the same tokens), the penalties and logit bias of the OpenAI / vLLM APIs, and the log-probs
// that are reported back.
//
// What Sample / Distribution do to one row of logits, in order (vLLM's order):
//   1. logit_bias: bias[t] is added to logit t.
//   2. repetition_penalty r (vLLM): every token seen in the prompt or generated so far: l > 0 ? l / r : l * r.
//   3. frequency_penalty f, presence_penalty p (OpenAI): l[t] -= f * count(t) + p * (count(t) > 0), count =
//      how often t was generated (the prompt does not count).
//   4. temperature 0: the argmax (ties -> lowest id). Else softmax(l / temperature), then
//   5. min_p: tokens whose probability is below min_p x the largest are dropped,
//   6. top_k, 7. top_p (nucleus over what is left), renormalised, and one draw from the sequence's RNG.
//   0. grammar (constrained output, common/tokenizer/grammar.h): tokens the grammar does not allow next are
//      dropped (their logits become -inf) before everything else; every emitted token advances it.
// Steps 0-3 run only when a field is off its neutral value, on a copy of the row (the model's logits are
// never modified). Log-probs (TopLogprobs) are of the raw logits, before any of this (vLLM's default).
//
// History: the penalties need the tokens the sequence has seen. The sampler lives with its sequence (in
// the worker's LocalExecutor, numoe-gpu's session, GenerateBatch) and RunModelStep (model/step.h) tells
// it: ObservePrompt for the tokens fed before the first sampled token, Accept for every emitted token.
// A model drafter draws its drafts with SampleDraft (each draft counts as generated for the next), and
// RunModelStep calls ClearDrafts before verifying, so the target and draft distributions of draft i are
// both computed with exactly the tokens before it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/sampling_limits.h"
#include "common/status.h"
#include "common/tokenizer/grammar.h"

namespace numoe {

struct SamplingParams {
  double temperature = 0.0;  // 0 = greedy (argmax; ties -> lowest id)
  double top_p = 1.0;        // nucleus mass in (0, 1]
  int64_t top_k = 0;         // 0 = no top-k cut
  uint64_t seed = 0;         // RNG seed (used when temperature > 0)
  double min_p = 0.0;                 // [0, 1]; 0 = off
  double presence_penalty = 0.0;      // [-2, 2]
  double frequency_penalty = 0.0;     // [-2, 2]
  double repetition_penalty = 1.0;    // (0, 2]; 1 = off
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token id, bias in [-100, 100]), at most kMaxLogitBias
  int32_t logprobs = -1;  // -1 = none; 0..kMaxTopLogprobs: the chosen token's log-prob and this many top ones
  // Constrained output: a grammar spec (common/tokenizer/grammar.h), empty = none. The sampler's owner
  // compiles it (a GrammarCache over its tokenizer) and hands the Sampler the Grammar.
  std::string grammar;

  // Whether steps 1-3 of the header comment change anything.
  bool penalized() const {
    return presence_penalty != 0.0 || frequency_penalty != 0.0 || repetition_penalty != 1.0 || !logit_bias.empty();
  }
};

// Errors name the field: temperature < 0, top_p outside (0, 1], top_k < 0, min_p outside [0, 1], penalties
// outside their ranges (header comment), logprobs outside [-1, kMaxTopLogprobs], logit_bias too long, a
// bias outside [-100, 100], or (vocab > 0) a token id outside [0, vocab).
Status ValidateSampling(const SamplingParams& p, int64_t vocab = 0);

// The seed of choice `index` of a request with n choices and seed `seed`: choice 0 keeps the seed (so
// n = 1 samples exactly as before), the others get a well-mixed function of (seed, index).
uint64_t ChoiceSeed(uint64_t seed, int64_t index);

// One token and its log-probability (natural log, of the model's raw logits).
struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
};

// The log-probs reported for one emitted token: the chosen one and the `n` most likely (descending, ties by
// lower id).
struct EmittedLogprobs {
  TokenLogprob chosen;
  std::vector<TokenLogprob> top;
};

// log_softmax(logits)[chosen] and the n most likely tokens, from the raw row (n in [0, kMaxTopLogprobs]).
void TopLogprobs(const float* logits, int64_t vocab, int32_t chosen, int32_t n, EmittedLogprobs* out);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) {}
  // A constrained sampler: `grammar` compiled from p.grammar (null = unconstrained).
  Sampler(const SamplingParams& p, std::shared_ptr<const tokenizer::Grammar> grammar) : Sampler(p) {
    if (grammar != nullptr) grammar_.emplace(std::move(grammar));
  }
  bool constrained() const { return grammar_.has_value(); }
  // Picks a token from logits[vocab] (header comment). Does not record it: the caller calls Accept.
  int32_t Sample(const float* logits, int64_t vocab);
  // The distribution Sample draws from, dense over the vocabulary (zeros outside min-p / top-k / top-p;
  // one-hot at the argmax when greedy). Speculative verification compares target and draft distributions.
  void Distribution(const float* logits, int64_t vocab, std::vector<double>* probs);
  // Draws from an unnormalised distribution (sum > 0).
  int32_t SampleFrom(const std::vector<double>& probs);
  double Uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(rng_); }
  const SamplingParams& params() const { return p_; }

  // History (header comment). ObservePrompt before the first Accept; Accept for every emitted token.
  void ObservePrompt(std::span<const int32_t> tokens);
  void Accept(int32_t token);
  bool generating() const { return generating_; }
  // Model drafters: Sample, then count the draft as generated until ClearDrafts.
  int32_t SampleDraft(const float* logits, int64_t vocab);
  void ClearDrafts();
  // A forked sequence's sampler: this one's history (prompt seen, tokens generated), its own params and RNG.
  void CopyHistoryFrom(const Sampler& parent);

 private:
  // The row after steps 1-3: `logits` itself when nothing applies, else a processed copy in scratch_.
  const float* Process(const float* logits, int64_t vocab);
  // Steps 5-7 at temperature > 0: fills idx_[0, keep) (by processed logit, descending) and prob_ (unnormalised
  // weights); returns keep (>= 1) and the sum of the kept weights in *sum.
  int64_t Candidates(const float* logits, int64_t vocab, double* sum);
  void Unaccept(int32_t token);

  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<int32_t> idx_;
  std::vector<double> prob_;
  std::vector<float> scratch_;
  // History, kept only when params().penalized().
  bool generating_ = false;
  std::unordered_set<int32_t> prompt_seen_;
  std::unordered_map<int32_t, int32_t> generated_;  // token -> times generated
  std::vector<int32_t> drafts_;                     // counted by SampleDraft, removed by ClearDrafts
  // Constrained output: the grammar's position, and where it was before the first model draft.
  std::optional<tokenizer::GrammarState> grammar_;
  std::optional<tokenizer::GrammarState> grammar_before_drafts_;
};

// Compiles params' grammar with `cache` (null when the process has no tokenizer: FailedPrecondition) and
// makes the sampler; an unconstrained params needs no cache.
StatusOr<Sampler> MakeSampler(const SamplingParams& p, tokenizer::GrammarCache* cache);

int32_t Argmax(const float* logits, int64_t vocab);

}  // namespace numoe
