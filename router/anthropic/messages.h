// The Anthropic Messages API (POST /v1/messages, POST /v1/messages/count_tokens) as a second surface over
// the one chat path: a Messages body maps onto openai::ChatRequest, which the one chat encoder
// (openai::ChatEncoder, docs/dsv4-chat-encoding.md §2-3) renders and tokenizes; the one output parser
// (openai::ChatStreamParser, §4) splits the generated text, and MessageBuilder turns its deltas into
// Anthropic content blocks, whole or as stream events.
//
// Request mapping (ParseMessagesRequest; errors are InvalidArgument naming the Anthropic field, e.g.
// "messages[1].content[0].type"):
//   system (string or text blocks)      -> a system message first (text blocks joined with "\n")
//   messages[i] user, text blocks       -> a user message (text blocks joined with "\n")
//   messages[i] user, tool_result block -> a tool message (tool_call_id = tool_use_id; content a string or
//                                          text blocks joined with "\n"); the encoder merges the run of
//                                          tool results and user text into one <｜User｜> turn (§2.1)
//   messages[i] assistant: thinking     -> reasoning_content; text -> content; tool_use -> a tool call
//                                          (arguments = the input object as JSON, key order kept)
//   a final assistant message           -> continued (prefill: rendered without EOS, §3 "prefix")
//   tools [{name, description, input_schema}] -> OpenAI function tools {name, description, parameters}
//   tool_choice auto | none | any | tool -> tools rendered | not rendered | OpenAI's "required" | a named
//                                          function (one forced call, constrained sampling: router/openai/chat.h);
//                                          disable_parallel_tool_use keeps the first tool_use only
//   thinking enabled | disabled         -> thinking | chat mode (absent: chat mode); budget_tokens is checked
//                                          (integer >= 1) but V4 has no thinking budget: max_tokens bounds it
//   max_tokens (required), temperature, top_p, top_k, stop_sequences, stream -> as on the OpenAI path
//   metadata ({user_id}) is checked and ignored; cache_control and citations on blocks are ignored.
// Refused by name: image / document / other non-text blocks, server tools (typed tools such as
// web_search_*), redacted_thinking, mcp_servers, output_format. Other fields
// (service_tier, ...) are ignored, as on the OpenAI path.
//
// Thread-safety: the functions are pure; a MessageBuilder is per-request state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "router/openai/chat.h"
#include "router/openai/request.h"

namespace numoe::router::anthropic {

using Json = openai::Json;

struct MessagesRequest {
  openai::ChatRequest chat;                // messages, tools, thinking, sampling, stop, stream, max_tokens
  bool disable_parallel_tool_use = false;  // at most one tool_use block in the answer
};

// `count_tokens`: the body of /v1/messages/count_tokens (max_tokens, sampling and stream not read).
StatusOr<MessagesRequest> ParseMessagesRequest(const Json& body, bool count_tokens = false);

// Anthropic's error shape {"type": "error", "error": {"type", "message"}}, with the HTTP status the OpenAI
// path uses for the same status (openai::ToApiError): 400 invalid_request_error, 401 authentication_error,
// 404 not_found_error, 413 request_too_large, 429 rate_limit_error, 503 overloaded_error, 504 timeout_error,
// else 500 api_error.
struct ApiError {
  int http_status = 500;
  std::string type;
  std::string message;
  int retry_after_s = 0;
};
ApiError ToApiError(const Status& status);
Json ErrorJson(const ApiError& e);

// Serialises without throwing (invalid UTF-8 becomes U+FFFD). Responses are ordered JSON: keys in the order
// written, and tool_use inputs in the order the model wrote the parameters.
std::string Dump(const Json& j);
// One server-sent event in Anthropic's framing: "event: <data.type>\ndata: <data>\n\n".
std::string SseEvent(const Json& data);

// "msg_<24 hex>" / "toolu_<24 alphanumerics>".
std::string NewMessageId();
std::string NewToolUseId();

// stop_reason for how the choice ended: "tool_use" when the answer has a complete tool call and generation
// stopped, "stop_sequence" when a stop string matched, "max_tokens" on length, else "end_turn".
std::string StopReason(const std::string& finish_reason, const std::string& stop_string, int tool_calls);

// One assistant message built from the output parser's deltas. Content blocks follow the order of arrival:
// a thinking block for reasoning, a text block for content, a tool_use block per call (a block closes when
// a different kind starts). Within one delta the order is reasoning, content, tool calls.
class MessageBuilder {
 public:
  struct Options {
    std::string id;     // "msg_..."
    std::string model;
    bool disable_parallel_tool_use = false;
  };
  explicit MessageBuilder(Options options);

  // message_start (usage.input_tokens) and a ping.
  std::vector<Json> Start(uint64_t input_tokens);
  // content_block_start / content_block_delta (thinking_delta, text_delta, input_json_delta) /
  // content_block_stop events for one delta.
  std::vector<Json> Add(const openai::ChatDelta& delta);
  // Closes the open block, then message_delta (stop_reason, stop_sequence, usage) and message_stop.
  // `complete_tool_calls`: calls the parser completed; a tool_use block cut off by the end of generation
  // stays in the stream but is left out of Message().
  std::vector<Json> Finish(const std::string& stop_reason, const std::string& stop_sequence,
                                     uint64_t output_tokens, int complete_tool_calls);
  // Before Finish: of input_tokens, the ones numoe-gpu restored from its prefix cache (the final usage's
  // cache_read_input_tokens; input_tokens stays the whole prompt, as count_tokens says).
  void set_cache_read_input_tokens(uint64_t n) { cache_read_input_tokens_ = n; }
  // The whole message ({"id", "type": "message", "role", "model", "content", "stop_reason",
  // "stop_sequence", "usage"}), after Finish.
  Json Message() const;

 private:
  enum class Kind { kThinking, kText, kToolUse };
  struct Block {
    Kind kind;
    std::string text;  // thinking or text
    std::string id, name, arguments;
    int call_index = -1;
  };
  void Open(Kind kind, std::vector<Json>* events, const std::string& id = "",
            const std::string& name = "", int call_index = -1);
  void Close(std::vector<Json>* events);

  Options options_;
  std::vector<Block> blocks_;
  bool open_ = false;  // blocks_.back() is open
  uint64_t input_tokens_ = 0, output_tokens_ = 0, cache_read_input_tokens_ = 0;
  std::string stop_reason_, stop_sequence_;
  int complete_tool_calls_ = 0;
};

}  // namespace numoe::router::anthropic
