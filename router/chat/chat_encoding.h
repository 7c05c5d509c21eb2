// DeepSeek V4 chat encoding (prompt rendering) and output parsing, per docs/dsv4-chat-encoding.md
// (the spec; section numbers below refer to it). V4 ships no Jinja template: this reproduces the official
// Python encoder (encoding_dsv4.py, `encode_messages` / `parse_message_from_completion_text`) byte for byte,
// plus a streaming output parser for the server.
//
//   Json messages = Json::parse(request_body)["messages"];            // nlohmann::ordered_json: key order matters
//   ASSIGN_OR_RETURN(std::string prompt, chat::EncodeMessages(messages, {.thinking_mode = kThinking}));
//   ASSIGN_OR_RETURN(auto ids, tok.Encode(prompt));                    // specials in the prompt are matched
//   chat::StreamingOutputParser parser(chat::StartStateForPrompt(prompt), {.tools_enabled = has_tools});
//   for each decoded text chunk: send(parser.Feed(chunk));  then: send(parser.Finish());
//
// Thread-safety: free functions are pure; a StreamingOutputParser is per-request state.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "router/chat/py_json.h"
#include "nlohmann/json.hpp"

namespace numoe::chat {

using Json = nlohmann::ordered_json;

// ---- Special strings (§1). Brackets are U+FF5C, "▁" is U+2581. ----------------------------------------
inline constexpr std::string_view kBos = "<｜begin▁of▁sentence｜>";
inline constexpr std::string_view kEos = "<｜end▁of▁sentence｜>";
inline constexpr std::string_view kUser = "<｜User｜>";
inline constexpr std::string_view kAssistant = "<｜Assistant｜>";
inline constexpr std::string_view kLatestReminder = "<｜latest_reminder｜>";
inline constexpr std::string_view kThink = "<think>";
inline constexpr std::string_view kEndThink = "</think>";
inline constexpr std::string_view kDsml = "｜DSML｜";

// ---- Prompt encoding (§2) ----------------------------------------------------------------------------

enum class ThinkingMode { kChat, kThinking };

// Which reasoning-effort table the checkpoint's encoder uses (§2.4).
enum class EncoderProfile {
  kPreview,    // V4-Flash/Pro preview: effort None | "high" | "max"; only "max" adds EFFORT_A
  kFlash0731,  // V4-Flash-0731: "low" | "high" | "max", None -> "low"; high -> EFFORT_A, max -> EFFORT_B
};

struct EncodeOptions {
  ThinkingMode thinking_mode = ThinkingMode::kThinking;
  // As the checkpoint's encoder accepts it (see EncoderProfile); values outside the table are InvalidArgument.
  // Use MapReasoningEffort() to turn an OpenAI/DeepSeek API value into this.
  std::optional<std::string> reasoning_effort;
  EncoderProfile profile = EncoderProfile::kPreview;
  // Drop reasoning of turns before the last user turn (ignored when any message has tools, §2.1.3).
  bool drop_thinking = true;
  bool add_bos = true;
};

// Renders `messages` (a JSON array in the official encoder's input format) into the prompt string.
// Per message: "role" (system | developer | user | assistant | tool | latest_reminder), "content" (string or
// null; a list of {"type":"text","text":...} parts is joined with "\n", except on tool messages where the
// list is rendered as the encoder does), "reasoning_content" (or "reasoning"), "tool_calls" (OpenAI format,
// "arguments" the raw JSON string; an already-parsed object is accepted and used as is), "tool_call_id",
// "tools" (OpenAI tools; rendered on system/developer), "response_format", "task", "wo_eos".
// Errors (InvalidArgument) name the message and field, e.g. "messages[3].tool_calls[0].function.name: missing".
StatusOr<std::string> EncodeMessages(const Json& messages, const EncodeOptions& options = {});

// Server policy (§3): attach request-level tools to messages[0] when it is a system/developer message,
// else insert {"role":"system","content":"","tools":tools} at the front. No-op for an empty/null `tools`.
Status AttachRequestTools(Json* messages, const Json& tools);

// Server policy (§3): maps an API reasoning_effort (DeepSeek API table: minimal/low -> low, medium/high/xhigh
// -> high, max/ultra -> max; omitted -> high, the API default) to the encoder's value for `profile` (preview
// collapses low/high to None). "none" is not an effort: the caller should use chat mode. Unknown values are
// InvalidArgument.
StatusOr<std::optional<std::string>> MapReasoningEffort(std::optional<std::string_view> requested,
                                                        EncoderProfile profile);

// Profile detection from the checkpoint's encoding/encoding_dsv4.py text (§2.4): 0731 when it sets
// DEFAULT_REASONING_EFFORT = "low" and has REASONING_EFFORT_PROMPTS; preview otherwise.
EncoderProfile DetectEncoderProfile(std::string_view encoder_source);

// ---- Output parsing (§4) -----------------------------------------------------------------------------

struct ToolCall {
  std::string id;         // minted by the streaming parser ("call_..."); empty from ParseCompletion
  std::string name;
  std::string arguments;  // JSON object text, as the official decoder builds it
};

struct ParsedMessage {
  std::string reasoning_content;
  std::string content;
  std::vector<ToolCall> tool_calls;
};

// The official non-streaming grammar (§4.1, §4.2), strict: `text` is one assistant completion including the
// final EOS. Malformed output is InvalidArgument with the official reason ("missing </think>", "missing EOS
// token", "Unexpected content after tool calls", "Unexpected special token ...", tool-call format errors).
StatusOr<ParsedMessage> ParseCompletion(std::string_view text, ThinkingMode mode);

enum class ParserStart { kReasoning, kContent };
// The parser's first state comes from the prompt tail (§4.3): "...<think>" -> reasoning, else content.
ParserStart StartStateForPrompt(std::string_view prompt);

struct ToolCallDelta {
  int index = 0;          // position of the call in this message
  std::string id, name;   // set on the first delta of a call only
  std::string arguments;  // the next fragment of the arguments JSON text
};

// What one Feed() adds. Concatenating every delta's fields gives message()'s fields.
struct OutputDelta {
  std::string reasoning_content;
  std::string content;
  std::vector<ToolCallDelta> tool_calls;
  bool empty() const { return reasoning_content.empty() && content.empty() && tool_calls.empty(); }
};

// Incremental parser for decoded completion text (decode with special tokens kept). Implements §4.3 with the
// robustness rules of §4.4: no byte of a marker (</think>, DSML tags, BOS/EOS) ever reaches reasoning or
// content; text that might be the start of a marker is held until the next chunk decides (or Finish()).
//   - REASONING -> CONTENT on </think>; EOS while reasoning keeps everything as reasoning (§4.4.7).
//   - With tools_enabled, a tool block (or bare <｜DSML｜invoke) inside reasoning ends the reasoning (§4.4.1).
//   - Content before a tool block loses its trailing whitespace (§4.4.2); a bare <｜DSML｜invoke without the
//     <｜DSML｜tool_calls> wrapper is accepted (§4.4.3); string="false" values that are not JSON become JSON
//     strings (§4.4.4); text after the block returns to content (§4.4.5); a call cut off by the end of
//     generation is dropped from message() (§4.4.6; its first deltas were already streamed); stray BOS and
//     </think> in content are removed (§4.4.8).
// String parameter values stream as JSON-escaped fragments; non-string values arrive whole at their close tag.
struct StreamingParserOptions {
  // The request offered tools: a tool block inside reasoning then ends the reasoning (§4.4.1).
  bool tools_enabled = false;
  // Mints tool-call ids; default "call_" + 24 random alphanumerics.
  std::function<std::string(int index)> make_call_id;
};

class StreamingOutputParser {
 public:
  using Options = StreamingParserOptions;

  explicit StreamingOutputParser(ParserStart start, Options options = {});

  OutputDelta Feed(std::string_view text);
  // End of generation (EOS token, stop, or length): flushes held text and closes the message.
  OutputDelta Finish();

  const ParsedMessage& message() const { return msg_; }
  bool in_reasoning() const { return state_ == State::kReasoning; }
  // "tool_calls" when the message has a complete call, else "length" if hit_length, else "stop" (§4.3).
  std::string FinishReason(bool hit_length) const;

 private:
  enum class State {
    kReasoning, kContent, kToolsBlock, kInvokeHeader, kInvokeBody, kParamHeader, kParamValue, kAfterTools, kDone
  };
  bool Step(bool final, OutputDelta* d);
  bool StepText(bool reasoning, bool final, OutputDelta* d);
  bool StepBetweenTags(bool final, OutputDelta* d);
  bool StepInvokeHeader(bool final, OutputDelta* d);
  bool StepParamHeader(bool final, OutputDelta* d);
  bool StepParamValue(bool final, OutputDelta* d);
  void EmitText(bool reasoning, std::string_view text, OutputDelta* d);
  void EmitArgs(std::string_view fragment, OutputDelta* d);
  void DropCall();

  State state_;
  Options options_;
  std::string buf_;  // text received but not yet consumed
  ParsedMessage msg_;
  bool wrapped_ = false;  // inside <｜DSML｜tool_calls> (else bare invokes)
  // The call being parsed.
  bool in_call_ = false;
  ToolCall call_;
  bool call_has_params_ = false;
  bool param_is_string_ = false;
  std::string param_value_;  // non-string values are buffered to their close tag
};

}  // namespace numoe::chat
