#include "router/openai/chat.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "router/core/errors.h"

namespace numoe::router::openai {

using nlohmann::json;

ChatEncoder::ChatEncoder(const tokenizer::Tokenizer& tok, chat::EncoderProfile profile) : tok_(tok), profile_(profile) {
  for (int32_t id = 0; id < tok.vocab_size(); ++id) {
    if (!tok.IsSpecialToken(id)) continue;
    std::optional<std::string> s = tok.IdToToken(id);
    if (s && !s->empty()) specials_[static_cast<unsigned char>((*s)[0])].push_back(*s);
  }
}

chat::EncoderProfile ChatEncoder::DetectProfile(const std::string& model_dir) {
  std::ifstream f(std::filesystem::path(model_dir) / "encoding" / "encoding_dsv4.py");
  if (!f) return chat::EncoderProfile::kPreview;
  std::stringstream ss;
  ss << f.rdbuf();
  return chat::DetectEncoderProfile(ss.str());
}

Status ChatEncoder::CheckClientText(std::string_view text, const std::string& field) const {
  for (size_t i = 0; i < text.size(); ++i) {
    for (const std::string& s : specials_[static_cast<unsigned char>(text[i])]) {
      if (text.compare(i, s.size(), s) == 0) {
        return InvalidParam(field, absl::StrCat(field, " contains the special token '", s,
                                                "'; special tokens are not allowed in message text"));
      }
    }
  }
  return absl::OkStatus();
}

StatusOr<ChatPrompt> ChatEncoder::Encode(const ChatRequest& request) const {
  chat::EncodeOptions options;
  options.profile = profile_;
  options.thinking_mode = request.thinking ? chat::ThinkingMode::kThinking : chat::ThinkingMode::kChat;
  if (request.reasoning_effort && *request.reasoning_effort == "none") {
    options.thinking_mode = chat::ThinkingMode::kChat;
  } else if (options.thinking_mode == chat::ThinkingMode::kThinking) {
    std::optional<std::string_view> requested;
    if (request.reasoning_effort) requested = *request.reasoning_effort;
    auto effort = chat::MapReasoningEffort(requested, profile_);
    if (!effort.ok()) return WithParam(effort.status(), "reasoning_effort");
    options.reasoning_effort = *effort;
  }

  chat::Json messages = chat::Json::array();
  for (size_t i = 0; i < request.messages.size(); ++i) {
    const ChatMessage& m = request.messages[i];
    const std::string p = m.field.empty() ? absl::StrCat("messages[", i, "]") : m.field;
    RETURN_IF_ERROR(CheckClientText(m.content, p + ".content"));
    RETURN_IF_ERROR(CheckClientText(m.reasoning_content, p + ".reasoning_content"));
    chat::Json msg = chat::Json::object();
    msg["role"] = m.role == "developer" ? "system" : m.role;
    msg["content"] = m.has_content ? chat::Json(m.content) : chat::Json(nullptr);
    if (!m.reasoning_content.empty()) msg["reasoning_content"] = m.reasoning_content;
    if (!m.tool_calls.empty()) {
      chat::Json calls = chat::Json::array();
      for (size_t k = 0; k < m.tool_calls.size(); ++k) {
        const ChatToolCall& c = m.tool_calls[k];
        const std::string cp = absl::StrCat(p, ".tool_calls[", k, "].function");
        RETURN_IF_ERROR(CheckClientText(c.name, cp + ".name"));
        RETURN_IF_ERROR(CheckClientText(c.arguments, cp + ".arguments"));
        calls.push_back({{"id", c.id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
      }
      msg["tool_calls"] = std::move(calls);
    }
    if (!m.tool_call_id.empty()) msg["tool_call_id"] = m.tool_call_id;
    if (m.prefix) msg["wo_eos"] = true;
    messages.push_back(std::move(msg));
  }
  const bool tools = !request.tools.is_null() && !request.tools.empty() && !request.tool_choice_none;
  if (tools) {
    // Tool schemas keep the client's key order (the body is parsed into ordered JSON): they are pasted into
    // the prompt as Python's json.dumps writes them.
    RETURN_IF_ERROR(CheckClientText(request.tools.dump(), "tools"));
    Status s = chat::AttachRequestTools(&messages, request.tools);
    if (!s.ok()) return WithParam(s, "tools");
  }
  if (!request.common.response_format.is_null()) {
    // The schema goes on the system message, as tools do (docs/dsv4-chat-encoding.md, response_format).
    if (!messages.empty() && messages[0]["role"] == "system") {
      messages[0]["response_format"] = request.common.response_format;
    } else {
      chat::Json system = {{"role", "system"}, {"content", ""}, {"response_format", request.common.response_format}};
      messages.insert(messages.begin(), std::move(system));
    }
  }
  if (request.messages.back().role != "user" && request.messages.back().role != "tool" &&
      !request.messages.back().prefix) {
    return InvalidParam("messages", "the last message must be from the user or a tool (or an assistant message with "
                                    "\"prefix\": true, which is continued)");
  }
  auto text = chat::EncodeMessages(messages, options);
  if (!text.ok()) return ParamOf(text.status()).empty() ? WithParam(text.status(), "messages") : text.status();

  ChatPrompt out;
  auto ids = tok_.Encode(*text);
  if (!ids.ok()) return WithParam(ids.status(), "messages");
  out.ids = std::move(*ids);
  out.starts_in_reasoning = chat::StartStateForPrompt(*text) == chat::ParserStart::kReasoning;
  out.tools = tools;
  out.text = std::move(*text);
  ASSIGN_OR_RETURN(out.grammar, Grammar(request, out.starts_in_reasoning));
  return out;
}

StatusOr<std::string> ChatEncoder::Grammar(const ChatRequest& request, bool starts_in_reasoning) const {
  chat::Json spec;
  if (request.tool_choice_required || !request.tool_choice_name.empty()) {
    // The ｜DSML｜ marker is one token in V4's tokenizer; a tokenizer without it spells the marker in text.
    const int32_t dsml = tok_.SpecialTokenId("｜DSML｜").value_or(-1);
    chat::Json tools = chat::Json::array();
    for (const chat::Json& t : request.tools) {
      const chat::Json& fn = t["function"];
      if (!request.tool_choice_name.empty() && fn["name"] != request.tool_choice_name) continue;
      tools.push_back({{"name", fn["name"]}, {"parameters", fn.contains("parameters") ? fn["parameters"] : chat::Json::object()}});
    }
    if (tools.empty()) {
      return InvalidParam("tool_choice", request.tools.is_null() || request.tools.empty()
                                             ? std::string("a forced tool call needs tools")
                                             : absl::StrCat("tool_choice names \"", request.tool_choice_name,
                                                            "\", which is not in tools"));
    }
    spec = {{"type", "dsml_tool_call"}, {"tools", std::move(tools)}, {"dsml", dsml}};
  } else if (!request.common.sampling.grammar.empty()) {
    spec = chat::Json::parse(request.common.sampling.grammar);
  } else {
    return std::string();
  }
  if (starts_in_reasoning) {
    // Thinking mode: the reasoning is free, the constrained part starts after </think>.
    const int32_t end_think = tok_.special_ids().end_think;
    if (end_think < 0) return InvalidParam("thinking", "this model's tokenizer has no </think> token");
    spec["think_end"] = end_think;
  }
  return spec.dump();
}

void ChatDelta::Append(ChatDelta other) {
  reasoning += other.reasoning;
  content += other.content;
  for (auto& t : other.tool_calls) tool_calls.push_back(std::move(t));
}

namespace {
chat::StreamingParserOptions ParserOptions(bool tools, std::function<std::string()> make_call_id) {
  chat::StreamingParserOptions o{.tools_enabled = tools};
  if (make_call_id) o.make_call_id = [f = std::move(make_call_id)](int) { return f(); };
  return o;
}
}  // namespace

ChatStreamParser::ChatStreamParser(bool starts_in_reasoning, bool tools, std::function<std::string()> make_call_id)
    : parser_(starts_in_reasoning ? chat::ParserStart::kReasoning : chat::ParserStart::kContent,
              ParserOptions(tools, std::move(make_call_id))) {}

ChatDelta ChatStreamParser::Convert(chat::OutputDelta d) {
  ChatDelta out;
  out.reasoning = std::move(d.reasoning_content);
  out.content = std::move(d.content);
  for (auto& t : d.tool_calls) {
    json delta = {{"index", t.index}};
    json fn = json::object();
    if (!t.id.empty() || !t.name.empty()) {
      delta["id"] = t.id;
      delta["type"] = "function";
      fn["name"] = t.name;
      started_calls_ = std::max(started_calls_, t.index + 1);
    }
    fn["arguments"] = t.arguments;
    delta["function"] = std::move(fn);
    out.tool_calls.push_back(std::move(delta));
  }
  return out;
}

ChatDelta ChatStreamParser::Add(std::string_view text) { return Convert(parser_.Feed(text)); }

ChatDelta ChatStreamParser::Finish() { return Convert(parser_.Finish()); }

int ChatStreamParser::tool_calls() const { return static_cast<int>(parser_.message().tool_calls.size()); }

}  // namespace numoe::router::openai
