// OpenAI-compatible request bodies: JSON -> checked structs. Every error is InvalidArgument naming the field
// (errors.h ParamOf), e.g. param "temperature", message "temperature must be a number (got string)".
//
// Accepted fields (anything else is ignored, as OpenAI clients send extras such as "user"):
//   both:   model (string; absent = the served model), max_tokens (integer >= 1 or null;
//           chat also max_completion_tokens), temperature, top_p (numbers), top_k (integer), seed (integer),
//           stop (string or array of up to 16 strings), stream (bool), stream_options.include_usage (bool),
//           n (integer in [1, kMaxChoices]), presence_penalty, frequency_penalty ([-2, 2]), logit_bias
//           ({"token id": bias in [-100, 100]}, at most kMaxLogitBias), and the vLLM extensions min_p
//           ([0, 1]), repetition_penalty ((0, 2]), ignore_eos, return_token_ids, skip_special_tokens,
//           include_stop_str_in_output (bools), stop_token_ids (array of integers).
//           Unsupported features are rejected rather than silently ignored: best_of > 1, echo, suffix.
//   completions: prompt = string | [token ids] | [strings] | [[token ids]] (one choice per element of the
//           outer list, n choices each; at most kMaxPrompts), logprobs (integer in [0, kMaxTopLogprobs]).
//   chat:   logprobs (bool), top_logprobs (integer in [0, kMaxTopLogprobs], needs logprobs).
//   chat:   messages = [{role: system|developer|user|assistant|tool, content: string | null |
//           [{type: "text", text}], reasoning_content (or reasoning), tool_calls, tool_call_id, prefix}],
//           thinking (bool, or {"type": "enabled"|"disabled"}), chat_template_kwargs.thinking /
//           chat_template_kwargs.enable_thinking (bool), reasoning_effort (string), tools (array of
//           {type: "function", function: {...}}), tool_choice ("auto" | "none"), response_format
//           ({"type": "text"} only).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "router/core/frontend.h"

namespace numoe::router::openai {

inline constexpr size_t kMaxPrompts = 64;
inline constexpr size_t kMaxStops = 16;
inline constexpr size_t kMaxJsonDepth = 64;

struct CommonParams {
  std::string model;  // "" = the served model
  std::optional<int64_t> max_tokens;
  SamplingRequest sampling;
  std::vector<std::string> stop;
  std::vector<int64_t> stop_token_ids;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool ignore_eos = false;
  bool return_token_ids = false;
  bool skip_special_tokens = true;
  bool include_stop_str_in_output = false;
  int32_t n = 1;          // choices per prompt
  int32_t logprobs = -1;  // -1 = none; else the chosen token's log-prob and this many top ones
};

// One completions prompt: text, or token ids as given (range-checked later against the vocab).
using PromptInput = std::variant<std::string, std::vector<int64_t>>;

struct CompletionRequest {
  CommonParams common;
  std::vector<PromptInput> prompts;  // one choice each
  bool add_special_tokens = true;    // vLLM extension: BOS before text prompts
};

struct ChatToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // JSON text, as OpenAI sends it
};

struct ChatMessage {
  std::string role;
  std::string content;
  bool has_content = false;  // false for null/absent content
  std::string reasoning_content;
  std::vector<ChatToolCall> tool_calls;
  std::string tool_call_id;
  bool prefix = false;  // DeepSeek prefix completion: the last assistant message is continued
};

struct ChatRequest {
  CommonParams common;
  std::vector<ChatMessage> messages;
  bool thinking = false;
  std::optional<std::string> reasoning_effort;
  nlohmann::json tools;  // null or the request's array, each a {type: function, function: {...}}
  bool tool_choice_none = false;
};

// Parses a JSON body (must be an object, nested at most kMaxJsonDepth deep). Malformed JSON is
// InvalidArgument with param "" and the parser's position in the message.
StatusOr<nlohmann::json> ParseJsonBody(std::string_view body);
StatusOr<CompletionRequest> ParseCompletionRequest(const nlohmann::json& body);
StatusOr<ChatRequest> ParseChatRequest(const nlohmann::json& body);

// Name of a JSON value's type for messages: "string", "integer", "number", "boolean", "array", "object",
// "null".
const char* JsonTypeName(const nlohmann::json& v);
// Deepest array/object nesting in JSON text (strings are skipped); no full parse.
size_t JsonNestingDepth(std::string_view text);

}  // namespace numoe::router::openai
