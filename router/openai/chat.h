// DeepSeek V4 chat for the router, on router/chat/chat_encoding.h: OpenAI chat requests -> prompt ids,
// and generated text -> reasoning_content / content / tool-call deltas in OpenAI's streaming shapes.
//
// Server policy (docs/dsv4-chat-encoding.md §3): "developer" means "system" (OpenAI clients); request tools
// go on the first system message (unless tool_choice is "none"); reasoning_effort maps through
// chat::MapReasoningEffort for the checkpoint's encoder profile ("none" = chat mode); a final assistant
// message with "prefix": true is continued (no EOS).
// Client text never becomes special tokens: text fields that contain one of the tokenizer's special-token
// strings (e.g. "<｜end▁of▁sentence｜>", "<｜User｜>") are rejected with 400 naming the field, because the
// rendered prompt is tokenized with special tokens recognised and such text could forge turns.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "router/chat/chat_encoding.h"
#include "common/tokenizer/tokenizer.h"
#include "router/openai/request.h"

namespace numoe::router::openai {

struct ChatPrompt {
  std::string text;                  // the rendered prompt
  std::vector<int32_t> ids;
  bool starts_in_reasoning = false;  // the prompt ends with <think>: output begins as reasoning
  bool tools = false;                // tools were rendered (tool-call parsing inside reasoning enabled)
  // Constrained output (SamplingRequest::grammar): response_format's, or the forced tool call of tool_choice
  // "required" / a named function (one DSML call of those tools); after </think> in thinking mode.
  std::string grammar;
};

class ChatEncoder {
 public:
  ChatEncoder(const tokenizer::Tokenizer& tok, chat::EncoderProfile profile);
  // The profile from DIR/encoding/encoding_dsv4.py when present, else preview.
  static chat::EncoderProfile DetectProfile(const std::string& model_dir);

  // Errors name the field (e.g. "messages[1].content", "reasoning_effort").
  StatusOr<ChatPrompt> Encode(const ChatRequest& request) const;

 private:
  Status CheckClientText(std::string_view text, const std::string& field) const;
  StatusOr<std::string> Grammar(const ChatRequest& request, bool starts_in_reasoning) const;

  const tokenizer::Tokenizer& tok_;
  chat::EncoderProfile profile_;
  std::vector<std::string> specials_[256];  // special-token strings by first byte
};

// What one piece of output adds. tool_calls are OpenAI streaming deltas:
//   {"index", "id", "type": "function", "function": {"name", "arguments"}} (first delta of a call) and
//   {"index", "function": {"arguments"}} (later argument text).
struct ChatDelta {
  std::string reasoning;
  std::string content;
  nlohmann::json tool_calls = nlohmann::json::array();
  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
  void Append(ChatDelta other);
};

// Incremental output parser (chat::StreamingOutputParser): never emits a byte of a marker as text.
class ChatStreamParser {
 public:
  // `make_call_id` mints tool-call ids (default "call_" + 24 random alphanumerics).
  ChatStreamParser(bool starts_in_reasoning, bool tools, std::function<std::string()> make_call_id = nullptr);
  ChatDelta Add(std::string_view text);
  // End of output: flushes held text.
  ChatDelta Finish();
  // Complete tool calls so far (finish_reason "tool_calls" when > 0).
  int tool_calls() const;

 private:
  ChatDelta Convert(chat::OutputDelta d);
  chat::StreamingOutputParser parser_;
  int started_calls_ = 0;
};

}  // namespace numoe::router::openai
