// The one-process generation loop over a ModelBackend + ExpertBackend: prefill (whole, chunked or
// token by token), then decode with sampling and stop conditions. Several requests run as one batch:
// every step carries all unfinished sequences.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/backend.h"
#include "model/sampling.h"
#include "model/spec.h"

namespace numoe {

struct GenerateRequest {
  std::vector<int32_t> prompt;  // token ids, non-empty
  int64_t max_new_tokens = 64;
  SamplingParams sampling;
  bool ignore_eos = false;
  int64_t eos_token_id = 1;
  int64_t prefill_chunk = 0;  // 0 = whole prompt in one step, K = chunks of K tokens (1 = token by token)
  bool keep_logits = false;   // keep prefill and step logits in the result
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated ids (an EOS that stopped generation is included)
  std::string finish_reason;    // "stop" (EOS) or "length"
  std::vector<float> prefill_logits;  // [prompt, vocab] when keep_logits
  std::vector<float> step_logits;     // [tokens, vocab]: step_logits[t] chose tokens[t] (keep_logits)
  SpecStats spec;                     // speculative decoding counters (zero without speculation)
};

// Called for every generated token: (request index, token id).
using TokenCallback = std::function<void(size_t, int32_t)>;

// Errors name the field (empty prompt, ids >= vocab, negative max_new_tokens, bad sampling values).
Status ValidateRequest(const GenerateRequest& r, int64_t vocab_size);

// With `spec.method` != kNone, decode steps verify drafts (see spec.h); kDspark and kMtp need a model whose
// drafter() is that method (the drafts come from ModelBackend::Draft); kNgram needs no weights. The spec is
// checked against model.capabilities() first (CheckSpecAgainstModel, model/spec_policy.h).
StatusOr<std::vector<GenerateResult>> GenerateBatch(ModelBackend& model, ExpertBackend& experts,
                                                    const std::vector<GenerateRequest>& requests,
                                                    const TokenCallback& on_token = nullptr,
                                                    const SpecConfig& spec = {});

}  // namespace numoe
