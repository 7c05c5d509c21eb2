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
//           continue_final_message (vLLM: the final assistant message is continued, as with "prefix": true),
//           add_generation_prompt (vLLM; only false with continue_final_message, or true),
//           thinking (bool, or {"type": "enabled"|"disabled"}), chat_template_kwargs.thinking /
//           chat_template_kwargs.enable_thinking (bool), reasoning_effort (string), tools (array of
//           {type: "function", function: {...}}), tool_choice ("auto" | "none" | "required" |
//           {"type": "function", "function": {"name"}}: one DSML tool call, forced by constrained sampling).
//   both:   response_format ({"type": "text"} | {"type": "json_object"} | {"type": "json_schema",
//           "json_schema": {"name", "schema", "strict"}}: constrained sampling, common/tokenizer/grammar.h; an
//           unsupported schema keyword is refused by name).
//
// Bodies are parsed into nlohmann::ordered_json: object keys keep the client's order, because tool schemas
// (and tool-call arguments given as objects) are pasted into the prompt as Python's json.dumps writes them
// (docs/dsv4-chat-encoding.md §2.3), and a re-sorted schema is a different prompt.
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

// The JSON type of request bodies (key order kept, see above).
using Json = nlohmann::ordered_json;

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
  Json response_format;   // null, or a json_object / json_schema response_format (sampling.grammar enforces it)
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
  std::string field;    // how errors name this message; "" = "messages[i]" (another API's mapping sets it)
};

struct ChatRequest {
  CommonParams common;
  std::vector<ChatMessage> messages;
  bool thinking = false;
  std::optional<std::string> reasoning_effort;
  Json tools;  // null or the request's array, each a {type: function, function: {...}}
  bool tool_choice_none = false;
  // Forced tool calls: tool_choice "required" (one call of any tool) or a named function.
  bool tool_choice_required = false;
  std::string tool_choice_name;
};

// Parses a JSON body (must be an object, nested at most kMaxJsonDepth deep). Malformed JSON is
// InvalidArgument with param "" and the parser's position in the message.
StatusOr<Json> ParseJsonBody(std::string_view body);
StatusOr<CompletionRequest> ParseCompletionRequest(const Json& body);
StatusOr<ChatRequest> ParseChatRequest(const Json& body);

// Name of a JSON value's type for messages: "string", "integer", "number", "boolean", "array", "object",
// "null".
const char* JsonTypeName(const Json& v);

// Field readers shared by the request parsers (also the Anthropic Messages API's, router/anthropic/).
// Absent and null fields leave the output untouched; a wrong type is InvalidArgument naming `param`
// ("'temperature' must be a number (got string)").
const Json* Field(const Json& obj, const char* name);  // nullptr when absent or null
Status TypeError(const std::string& param, const char* want, const Json& got);
// Integer in int64 range; unsigned values above INT64_MAX saturate (they are out of every valid range).
StatusOr<int64_t> AsInt(const Json& v, const std::string& param);
Status ReadBool(const Json& obj, const char* name, bool* out);
Status ReadString(const Json& obj, const char* name, std::string* out);
Status ReadInt(const Json& obj, const char* name, std::optional<int64_t>* out);
Status ReadNumber(const Json& obj, const char* name, std::optional<double>* out);
// Deepest array/object nesting in JSON text (strings are skipped); no full parse.
size_t JsonNestingDepth(std::string_view text);

}  // namespace numoe::router::openai
