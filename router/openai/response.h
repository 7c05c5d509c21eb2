// OpenAI-compatible response bodies: errors, completions / chat completions (whole and as stream chunks),
// models, and the SSE framing.
//
// Error mapping (status code -> HTTP, OpenAI "type", "code"):
//   InvalidArgument    400 invalid_request_error   (param names the field)
//   Unauthenticated    401 authentication_error    invalid_api_key
//   NotFound           404 invalid_request_error   model_not_found (param "model") / not_found
//   OutOfRange         413 invalid_request_error   request_too_large (the body)
//   ResourceExhausted  429 server_overloaded       queue_full (with Retry-After)
//   Unavailable        503 service_unavailable     no_worker (with Retry-After)
//   DeadlineExceeded   504 timeout                 request_timeout
//   anything else      500 internal_error
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "router/core/frontend.h"

namespace numoe::router::openai {

struct ApiError {
  int http_status = 500;
  std::string type;
  std::string code;
  std::string param;
  std::string message;
  int retry_after_s = 0;  // > 0: send a Retry-After header
};

ApiError ToApiError(const Status& status);
// {"error": {"message", "type", "param", "code"}} (param/code null when empty).
nlohmann::json ErrorJson(const ApiError& e);

// Serialises without throwing: invalid UTF-8 in strings is replaced by U+FFFD.
std::string Dump(const nlohmann::json& j);
// One SSE event: "data: <payload>\n\n".
std::string SseData(const std::string& payload);
inline constexpr char kSseDone[] = "data: [DONE]\n\n";

// A random id with a prefix: "cmpl-<24 hex>" / "chatcmpl-<24 hex>".
std::string NewId(const std::string& prefix);

// usage.prompt_tokens_details.cached_tokens: of the prompt tokens, the ones served from the prefix cache.
nlohmann::json UsageJson(uint64_t prompt_tokens, uint64_t completion_tokens, uint64_t cached_tokens = 0);

// One finished choice of a (chat) completion.
struct ChoiceResult {
  std::string text;  // completions: text; chat: content
  std::string reasoning_content;
  nlohmann::json tool_calls = nlohmann::json::array();  // chat: [{id, type, function: {name, arguments}}]
  std::string finish_reason;
  std::string stop_reason;  // the stop string that matched (vLLM "stop_reason"), "" = null
  std::optional<std::vector<int32_t>> token_ids;  // with return_token_ids
  std::optional<std::vector<TokenLogprobs>> logprobs;  // with logprobs
};

// Log-probs in OpenAI's shapes; "token" is the token's text, or "bytes:\xNN..." when its bytes are not
// valid UTF-8 on their own ("bytes" has them exactly). Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
// "logprob", "bytes"}]}], "refusal": null}. Completions: {"tokens", "token_logprobs", "top_logprobs": [{token:
// logprob}], "text_offset"}, where text_offset counts characters of the tokens' text from *text_offset (the
// choice's text so far; advanced past these tokens, so stream chunks continue it).
nlohmann::json ChatLogprobsJson(const std::vector<TokenLogprobs>& logprobs);
nlohmann::json CompletionLogprobsJson(const std::vector<TokenLogprobs>& logprobs, size_t* text_offset);

nlohmann::json CompletionChoiceJson(size_t index, const ChoiceResult& c);
nlohmann::json ChatChoiceJson(size_t index, const ChoiceResult& c, bool thinking);

// {"id", "object", "created", "model", "choices": [...], "usage"} for object "text_completion" or
// "chat.completion".
nlohmann::json ResponseJson(const std::string& object, const std::string& id, int64_t created,
                            const std::string& model, nlohmann::json choices, uint64_t prompt_tokens,
                            uint64_t completion_tokens, uint64_t cached_tokens = 0);

// Stream chunk envelope: {"id", "object", "created", "model", "choices": [choice]} ("text_completion" or
// "chat.completion.chunk"). Pass choices = [] and usage for the final usage chunk.
nlohmann::json ChunkJson(const std::string& object, const std::string& id, int64_t created,
                         const std::string& model, nlohmann::json choices,
                         std::optional<nlohmann::json> usage = std::nullopt);

// Streaming choice objects. finish_reason "" = null; token_ids only when given; logprobs null unless given
// (ChatLogprobsJson / CompletionLogprobsJson of the chunk's tokens).
nlohmann::json CompletionChunkChoice(size_t index, const std::string& text, const std::string& finish_reason,
                                     const std::vector<int32_t>* token_ids, const std::string& stop_reason = "",
                                     nlohmann::json logprobs = nullptr);
nlohmann::json ChatChunkChoice(size_t index, nlohmann::json delta, const std::string& finish_reason,
                               const std::vector<int32_t>* token_ids, const std::string& stop_reason = "",
                               nlohmann::json logprobs = nullptr);

}  // namespace numoe::router::openai
