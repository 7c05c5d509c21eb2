// The bounds of the sampling extras a request may ask for, shared by the router (which checks them with the
// API's field names), the worker's engine and sampler (model/sampling.h) and the shared-memory channel
// (common/shm_channel.h), which is sized by them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace numoe {

// Choices (n) of one prompt.
inline constexpr int32_t kMaxChoices = 16;
// Top log-probs per token (OpenAI's chat top_logprobs bound; its completions allow 5, numoe like vLLM 20).
inline constexpr int32_t kMaxTopLogprobs = 20;
// logit_bias entries of one request, and the largest bias magnitude (OpenAI's range).
inline constexpr size_t kMaxLogitBias = 300;
inline constexpr double kMaxLogitBiasValue = 100.0;

}  // namespace numoe
