// Speculative decoding: drafters and the verification rule.
//
// A step feeds [last sampled token, d_0 .. d_{k-1}] to the target as one speculative step, then accepts
// drafts left to right: d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)) (p = the target's
// sampling distribution at that position, q = the distribution d_i was drawn from); at the first
// rejection a token is drawn from norm(max(0, p_i - q_i)); if every draft is kept, a bonus token is drawn
// from p_k. At temperature 0 both are one-hot, so this is "longest matching prefix + the target's token at
// the first mismatch" and the output is exactly plain greedy decoding. Rejected positions are rolled back
// in every cache (ModelBackend::Rollback).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/status.h"
#include "model/sampling.h"

namespace numoe {

struct SpecConfig {
  SpecMethod method = SpecMethod::kNone;
  int64_t depth = 5;       // drafts per step (the maximum when adaptive)
  bool adaptive = false;   // per sequence: +1 after a fully accepted step, -1 after a step with none kept
  int ngram_max = 4;       // n-gram drafter: longest suffix tried
  int ngram_min = 1;       // shortest suffix tried
};

// Errors name the field: depth outside [1, 16], bad n-gram bounds.
Status ValidateSpec(const SpecConfig& c);

// Prompt-lookup drafter (no weights): finds the most recent earlier occurrence of the longest suffix of
// `history` (ngram_max down to ngram_min tokens) and proposes up to `depth` tokens that followed it.
std::vector<int32_t> NgramPropose(std::span<const int32_t> history, int64_t depth, int ngram_max, int ngram_min);

// The outcome of verifying one sequence's drafts.
struct Verdict {
  std::vector<int32_t> tokens;  // emitted, in order: the kept drafts, then the correction or bonus token
  int64_t accepted = 0;         // drafts kept (tokens.size() - 1)
};

// Verifies `drafts` (k tokens) against the target's logits `target` [k + 1, vocab] (row i: the logits
// after [last token, d_0 .. d_{i-1}]) with the rule in the header comment. `draft_logits` [k, vocab] are
// the logits the drafts were drawn from (sampled through the same sampler settings), or empty for a
// deterministic drafter (n-gram: q is one-hot). `sampler` is the sequence's: its RNG advances, and every
// emitted token is Accept()ed as it is decided (the next position's penalties see it).
// Target row i chose tokens[i], so the rows behind the emitted tokens are 0 .. accepted. The caller rolls
// back k - accepted positions.
Verdict VerifyDrafts(Sampler& sampler, std::span<const int32_t> drafts, std::span<const float> draft_logits,
                     const float* target, int64_t vocab);

struct SpecStats {
  int64_t steps = 0;     // verify steps
  int64_t drafted = 0;   // draft tokens proposed
  int64_t accepted = 0;  // draft tokens kept
  double mean_accepted_per_step() const { return steps ? static_cast<double>(accepted) / steps : 0.0; }
};

}  // namespace numoe
