#include "router/anthropic/messages.h"

#include <random>

#include "absl/strings/str_cat.h"
#include "router/core/errors.h"
#include "router/openai/response.h"

namespace numoe::router::anthropic {

using openai::AsInt;
using openai::Field;
using openai::TypeError;

namespace {

constexpr char kImageRefusal[] = "this model reads text only";

// Text of a text block ({"type": "text", "text": ...}); `p` names the block.
StatusOr<std::string> TextOf(const Json& block, const std::string& p) {
  const Json* text = Field(block, "text");
  if (text == nullptr || !text->is_string()) return TypeError(p + ".text", "a string", text ? *text : Json());
  return text->get<std::string>();
}

StatusOr<std::string> BlockType(const Json& block, const std::string& p) {
  if (!block.is_object()) return TypeError(p, "an object (a content block)", block);
  const Json* type = Field(block, "type");
  if (type == nullptr || !type->is_string()) return TypeError(p + ".type", "a string", type ? *type : Json());
  return type->get<std::string>();
}

// A block type this server cannot render; `supported` lists the types it takes at this place.
Status UnsupportedBlock(const std::string& p, const std::string& type, const char* supported) {
  const char* why = type == "image" || type == "document" ? kImageRefusal : "not supported by this server";
  return InvalidParam(p + ".type", absl::StrCat(p, ".type: \"", type, "\" blocks are ", why, " (supported here: ",
                                                supported, ")"));
}

// A string, or an array of text blocks joined with "\n" (as the OpenAI path joins text parts).
StatusOr<std::string> TextBlocks(const Json& v, const std::string& p) {
  if (v.is_string()) return v.get<std::string>();
  if (!v.is_array()) return TypeError(p, "a string or an array of text blocks", v);
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string bp = absl::StrCat(p, "[", i, "]");
    ASSIGN_OR_RETURN(std::string type, BlockType(v[i], bp));
    if (type != "text") return UnsupportedBlock(bp, type, "text");
    ASSIGN_OR_RETURN(std::string text, TextOf(v[i], bp));
    if (i > 0) out += "\n";
    out += text;
  }
  return out;
}

openai::ChatMessage NewMessage(const std::string& role, const std::string& field) {
  openai::ChatMessage m;
  m.role = role;
  m.field = field;
  return m;
}

// One user message: runs of text blocks become user messages, each tool_result block a tool message.
Status AddUserMessage(const Json& content, const std::string& p, std::vector<openai::ChatMessage>* out) {
  if (content.is_string()) {
    openai::ChatMessage m = NewMessage("user", p);
    m.content = content.get<std::string>();
    m.has_content = true;
    out->push_back(std::move(m));
    return absl::OkStatus();
  }
  if (!content.is_array()) return TypeError(p + ".content", "a string or an array of content blocks", content);
  if (content.empty()) return InvalidParam(p + ".content", absl::StrCat(p, ".content: a user message needs content"));
  bool in_text = false;  // out->back() is this message's open text run
  for (size_t i = 0; i < content.size(); ++i) {
    const Json& b = content[i];
    const std::string bp = absl::StrCat(p, ".content[", i, "]");
    ASSIGN_OR_RETURN(std::string type, BlockType(b, bp));
    if (type == "text") {
      ASSIGN_OR_RETURN(std::string text, TextOf(b, bp));
      if (in_text) {
        out->back().content += "\n" + text;
      } else {
        openai::ChatMessage m = NewMessage("user", bp);
        m.content = std::move(text);
        m.has_content = true;
        out->push_back(std::move(m));
        in_text = true;
      }
    } else if (type == "tool_result") {
      in_text = false;
      openai::ChatMessage m = NewMessage("tool", bp);
      const Json* id = Field(b, "tool_use_id");
      if (id == nullptr || !id->is_string()) return TypeError(bp + ".tool_use_id", "a string", id ? *id : Json());
      m.tool_call_id = id->get<std::string>();
      if (const Json* c = Field(b, "content")) {
        ASSIGN_OR_RETURN(m.content, TextBlocks(*c, bp + ".content"));
      }
      if (const Json* e = Field(b, "is_error"); e != nullptr && !e->is_boolean()) {
        return TypeError(bp + ".is_error", "a boolean", *e);
      }
      m.has_content = true;
      out->push_back(std::move(m));
    } else {
      return UnsupportedBlock(bp, type, "text, tool_result");
    }
  }
  return absl::OkStatus();
}

// One assistant message: thinking -> reasoning_content, text -> content, tool_use -> tool calls.
Status AddAssistantMessage(const Json& content, const std::string& p, std::vector<openai::ChatMessage>* out) {
  openai::ChatMessage m = NewMessage("assistant", p);
  if (content.is_string()) {
    m.content = content.get<std::string>();
    m.has_content = true;
    out->push_back(std::move(m));
    return absl::OkStatus();
  }
  if (!content.is_array()) return TypeError(p + ".content", "a string or an array of content blocks", content);
  for (size_t i = 0; i < content.size(); ++i) {
    const Json& b = content[i];
    const std::string bp = absl::StrCat(p, ".content[", i, "]");
    ASSIGN_OR_RETURN(std::string type, BlockType(b, bp));
    if (type == "text") {
      ASSIGN_OR_RETURN(std::string text, TextOf(b, bp));
      if (m.has_content) m.content += "\n";
      m.content += text;
      m.has_content = true;
    } else if (type == "thinking") {
      const Json* t = Field(b, "thinking");
      if (t == nullptr || !t->is_string()) return TypeError(bp + ".thinking", "a string", t ? *t : Json());
      // The signature is Anthropic's; this server neither makes nor checks one.
      if (!m.reasoning_content.empty()) m.reasoning_content += "\n";
      m.reasoning_content += t->get<std::string>();
    } else if (type == "tool_use") {
      openai::ChatToolCall call;
      const Json* id = Field(b, "id");
      if (id == nullptr || !id->is_string()) return TypeError(bp + ".id", "a string", id ? *id : Json());
      const Json* name = Field(b, "name");
      if (name == nullptr || !name->is_string()) return TypeError(bp + ".name", "a string", name ? *name : Json());
      const Json* input = Field(b, "input");
      if (input == nullptr || !input->is_object()) {
        return TypeError(bp + ".input", "an object", input ? *input : Json());
      }
      call.id = id->get<std::string>();
      call.name = name->get<std::string>();
      call.arguments = input->dump();  // ordered: the DSML parameters follow the client's key order (§2.5)
      m.tool_calls.push_back(std::move(call));
    } else if (type == "redacted_thinking") {
      return InvalidParam(bp + ".type", absl::StrCat(bp, ".type: \"redacted_thinking\" blocks are encrypted by "
                                                         "another provider and cannot be rendered for this model"));
    } else {
      return UnsupportedBlock(bp, type, "text, thinking, tool_use");
    }
  }
  out->push_back(std::move(m));
  return absl::OkStatus();
}

Status ParseTools(const Json& body, openai::ChatRequest* req) {
  const Json* tools = Field(body, "tools");
  if (tools == nullptr) return absl::OkStatus();
  if (!tools->is_array()) return TypeError("tools", "an array", *tools);
  Json out = Json::array();
  for (size_t i = 0; i < tools->size(); ++i) {
    const Json& t = (*tools)[i];
    const std::string tp = absl::StrCat("tools[", i, "]");
    if (!t.is_object()) return TypeError(tp, "an object", t);
    if (const Json* type = Field(t, "type")) {
      if (!type->is_string()) return TypeError(tp + ".type", "a string", *type);
      if (type->get<std::string>() != "custom") {
        return InvalidParam(tp + ".type", absl::StrCat(tp, ".type: \"", type->get<std::string>(),
                                                       "\" is a tool Anthropic defines or hosts; this server "
                                                       "supports custom tools only ({name, description, "
                                                       "input_schema})"));
      }
    }
    const Json* name = Field(t, "name");
    if (name == nullptr || !name->is_string()) return TypeError(tp + ".name", "a string", name ? *name : Json());
    if (name->get<std::string>().empty()) return InvalidParam(tp + ".name", tp + ".name is empty");
    const Json* schema = Field(t, "input_schema");
    if (schema == nullptr || !schema->is_object()) {
      return TypeError(tp + ".input_schema", "an object (a JSON schema)", schema ? *schema : Json());
    }
    // The OpenAI function shape, which is what the encoder renders (§2.3): name, description, parameters.
    Json fn = Json::object();
    fn["name"] = *name;
    if (const Json* d = Field(t, "description")) {
      if (!d->is_string()) return TypeError(tp + ".description", "a string", *d);
      fn["description"] = *d;
    }
    fn["parameters"] = *schema;
    out.push_back(Json{{"type", "function"}, {"function", std::move(fn)}});
  }
  if (!out.empty()) req->tools = std::move(out);
  return absl::OkStatus();
}

Status ParseToolChoice(const Json& body, MessagesRequest* out) {
  const Json* tc = Field(body, "tool_choice");
  if (tc == nullptr) return absl::OkStatus();
  if (!tc->is_object()) return TypeError("tool_choice", "an object ({\"type\": \"auto\"})", *tc);
  const Json* type = Field(*tc, "type");
  if (type == nullptr || !type->is_string()) {
    return TypeError("tool_choice.type", "a string", type ? *type : Json());
  }
  const std::string t = type->get<std::string>();
  if (t == "none") {
    out->chat.tool_choice_none = true;
  } else if (t == "any") {
    out->chat.tool_choice_required = true;  // one forced DSML call (router/openai/chat.h)
  } else if (t == "tool") {
    const Json* name = Field(*tc, "name");
    if (name == nullptr || !name->is_string()) return TypeError("tool_choice.name", "a string", name ? *name : Json());
    out->chat.tool_choice_name = name->get<std::string>();
  } else if (t != "auto") {
    return InvalidParam("tool_choice.type",
                        absl::StrCat("tool_choice.type must be \"auto\", \"any\", \"tool\" or \"none\" (got \"", t,
                                     "\")"));
  }
  if (const Json* d = Field(*tc, "disable_parallel_tool_use")) {
    if (!d->is_boolean()) return TypeError("tool_choice.disable_parallel_tool_use", "a boolean", *d);
    out->disable_parallel_tool_use = d->get<bool>();
  }
  return absl::OkStatus();
}

Status ParseThinking(const Json& body, openai::ChatRequest* req) {
  const Json* t = Field(body, "thinking");
  if (t == nullptr) return absl::OkStatus();
  if (!t->is_object()) return TypeError("thinking", "an object ({\"type\": \"enabled\", \"budget_tokens\": N})", *t);
  const Json* type = Field(*t, "type");
  if (type == nullptr || !type->is_string()) return TypeError("thinking.type", "a string", type ? *type : Json());
  const std::string v = type->get<std::string>();
  if (v == "disabled") {
    req->thinking = false;
    return absl::OkStatus();
  }
  if (v != "enabled") {
    return InvalidParam("thinking.type",
                        absl::StrCat("thinking.type must be \"enabled\" or \"disabled\" (got \"", v, "\")"));
  }
  const Json* budget = Field(*t, "budget_tokens");
  if (budget == nullptr) return InvalidParam("thinking.budget_tokens", "thinking.budget_tokens is required");
  ASSIGN_OR_RETURN(int64_t b, AsInt(*budget, "thinking.budget_tokens"));
  if (b < 1) {
    return InvalidParam("thinking.budget_tokens",
                        absl::StrCat("thinking.budget_tokens must be at least 1 (got ", b, ")"));
  }
  req->thinking = true;
  return absl::OkStatus();
}

Status ParseSampling(const Json& body, openai::CommonParams* p) {
  const Json* max_tokens = Field(body, "max_tokens");
  if (max_tokens == nullptr) return InvalidParam("max_tokens", "'max_tokens' is required");
  ASSIGN_OR_RETURN(int64_t mt, AsInt(*max_tokens, "max_tokens"));
  if (mt < 1) return InvalidParam("max_tokens", absl::StrCat("max_tokens must be at least 1 (got ", mt, ")"));
  p->max_tokens = mt;
  RETURN_IF_ERROR(openai::ReadNumber(body, "temperature", &p->sampling.temperature));
  RETURN_IF_ERROR(openai::ReadNumber(body, "top_p", &p->sampling.top_p));
  RETURN_IF_ERROR(openai::ReadInt(body, "top_k", &p->sampling.top_k));
  RETURN_IF_ERROR(Frontend::CheckSampling(p->sampling));
  if (const Json* v = Field(body, "stop_sequences")) {
    if (!v->is_array()) return TypeError("stop_sequences", "an array of strings", *v);
    if (v->size() > openai::kMaxStops) {
      return InvalidParam("stop_sequences", absl::StrCat("'stop_sequences' has ", v->size(), " strings; at most ",
                                                         openai::kMaxStops));
    }
    for (size_t i = 0; i < v->size(); ++i) {
      if (!(*v)[i].is_string()) return TypeError(absl::StrCat("stop_sequences[", i, "]"), "a string", (*v)[i]);
      p->stop.push_back((*v)[i].get<std::string>());
    }
  }
  RETURN_IF_ERROR(openai::ReadBool(body, "stream", &p->stream));
  if (const Json* m = Field(body, "metadata")) {
    if (!m->is_object()) return TypeError("metadata", "an object", *m);
    if (const Json* u = Field(*m, "user_id"); u != nullptr && !u->is_string()) {
      return TypeError("metadata.user_id", "a string", *u);
    }
  }
  return absl::OkStatus();
}

std::string RandomAlnum(int n) {
  static constexpr char kAlnum[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  thread_local std::mt19937_64 rng{std::random_device{}()};
  std::string s;
  for (int i = 0; i < n; ++i) s.push_back(kAlnum[rng() % (sizeof(kAlnum) - 1)]);
  return s;
}

}  // namespace

StatusOr<MessagesRequest> ParseMessagesRequest(const Json& body, bool count_tokens) {
  MessagesRequest out;
  openai::ChatRequest& req = out.chat;
  RETURN_IF_ERROR(openai::ReadString(body, "model", &req.common.model));
  if (!count_tokens) RETURN_IF_ERROR(ParseSampling(body, &req.common));

  if (const Json* s = Field(body, "system")) {
    openai::ChatMessage m = NewMessage("system", "system");
    ASSIGN_OR_RETURN(m.content, TextBlocks(*s, "system"));
    m.has_content = true;
    req.messages.push_back(std::move(m));
  }
  const Json* messages = Field(body, "messages");
  if (messages == nullptr) return InvalidParam("messages", "'messages' is required");
  if (!messages->is_array()) return TypeError("messages", "an array", *messages);
  if (messages->empty()) return InvalidParam("messages", "'messages' is empty");
  for (size_t i = 0; i < messages->size(); ++i) {
    const Json& m = (*messages)[i];
    const std::string p = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return TypeError(p, "an object", m);
    const Json* role = Field(m, "role");
    if (role == nullptr || !role->is_string()) return TypeError(p + ".role", "a string", role ? *role : Json());
    const Json* content = Field(m, "content");
    if (content == nullptr) return InvalidParam(p + ".content", absl::StrCat(p, ".content is required"));
    const std::string r = role->get<std::string>();
    if (r == "user") {
      RETURN_IF_ERROR(AddUserMessage(*content, p, &req.messages));
    } else if (r == "assistant") {
      RETURN_IF_ERROR(AddAssistantMessage(*content, p, &req.messages));
    } else {
      return InvalidParam(p + ".role", absl::StrCat(p, ".role must be \"user\" or \"assistant\" (got \"", r,
                                                    "\"; the system prompt goes in the top-level \"system\")"));
    }
  }
  // Anthropic semantics: a final assistant message is a prefill the answer continues.
  if (req.messages.back().role == "assistant") req.messages.back().prefix = true;

  // Features that would change the answer and that this server does not have.
  if (const Json* m = Field(body, "mcp_servers"); m != nullptr && !(m->is_array() && m->empty())) {
    return InvalidParam("mcp_servers", "'mcp_servers' is not supported by this server (no MCP connector)");
  }
  if (Field(body, "output_format") != nullptr) {
    return InvalidParam("output_format",
                        "'output_format' (structured outputs) is not supported by this server on /v1/messages");
  }
  RETURN_IF_ERROR(ParseTools(body, &req));
  RETURN_IF_ERROR(ParseToolChoice(body, &out));
  RETURN_IF_ERROR(ParseThinking(body, &req));
  return out;
}

ApiError ToApiError(const Status& status) {
  const openai::ApiError o = openai::ToApiError(status);
  ApiError e;
  e.http_status = o.http_status;
  e.message = o.message;
  e.retry_after_s = o.retry_after_s;
  switch (o.http_status) {
    case 400:
    case 405:
      e.type = "invalid_request_error";
      break;
    case 401:
      e.type = "authentication_error";
      break;
    case 403:
      e.type = "permission_error";
      break;
    case 404:
      e.type = "not_found_error";
      break;
    case 413:
      e.type = "request_too_large";
      break;
    case 429:
      e.type = "rate_limit_error";
      break;
    case 503:
      e.type = "overloaded_error";
      break;
    case 504:
      e.type = "timeout_error";
      break;
    default:
      e.type = "api_error";
      break;
  }
  return e;
}

Json ErrorJson(const ApiError& e) {
  return Json{{"type", "error"}, {"error", {{"type", e.type}, {"message", e.message}}}};
}

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

std::string SseEvent(const Json& data) {
  return absl::StrCat("event: ", data.value("type", "message"), "\ndata: ", Dump(data), "\n\n");
}

std::string NewMessageId() {
  std::string id = openai::NewId("msg");
  id[3] = '_';  // "msg-<hex>" -> "msg_<hex>", Anthropic's shape
  return id;
}

std::string NewToolUseId() { return "toolu_" + RandomAlnum(24); }

std::string StopReason(const std::string& finish_reason, const std::string& stop_string, int tool_calls) {
  if (finish_reason == "length") return "max_tokens";
  if (!stop_string.empty()) return "stop_sequence";
  if (tool_calls > 0) return "tool_use";
  return "end_turn";
}

MessageBuilder::MessageBuilder(Options options) : options_(std::move(options)) {}

std::vector<Json> MessageBuilder::Start(uint64_t input_tokens) {
  input_tokens_ = input_tokens;
  Json message = {{"id", options_.id},
                  {"type", "message"},
                  {"role", "assistant"},
                  {"model", options_.model},
                  {"content", Json::array()},
                  {"stop_reason", nullptr},
                  {"stop_sequence", nullptr},
                  {"usage", {{"input_tokens", input_tokens}, {"output_tokens", 0}}}};
  return {Json{{"type", "message_start"}, {"message", std::move(message)}}, Json{{"type", "ping"}}};
}

void MessageBuilder::Open(Kind kind, std::vector<Json>* events, const std::string& id, const std::string& name,
                          int call_index) {
  Close(events);
  blocks_.push_back(Block{kind, "", id, name, "", call_index});
  open_ = true;
  Json block;
  switch (kind) {
    case Kind::kThinking:
      block = {{"type", "thinking"}, {"thinking", ""}, {"signature", ""}};
      break;
    case Kind::kText:
      block = {{"type", "text"}, {"text", ""}};
      break;
    case Kind::kToolUse:
      block = {{"type", "tool_use"}, {"id", id}, {"name", name}, {"input", Json::object()}};
      break;
  }
  events->push_back(
      {{"type", "content_block_start"}, {"index", blocks_.size() - 1}, {"content_block", std::move(block)}});
}

void MessageBuilder::Close(std::vector<Json>* events) {
  if (!open_) return;
  open_ = false;
  events->push_back({{"type", "content_block_stop"}, {"index", blocks_.size() - 1}});
}

std::vector<Json> MessageBuilder::Add(const openai::ChatDelta& d) {
  std::vector<Json> events;
  auto delta = [&](Json body) {
    events.push_back({{"type", "content_block_delta"}, {"index", blocks_.size() - 1}, {"delta", std::move(body)}});
  };
  if (!d.reasoning.empty()) {
    if (!open_ || blocks_.back().kind != Kind::kThinking) Open(Kind::kThinking, &events);
    blocks_.back().text += d.reasoning;
    delta({{"type", "thinking_delta"}, {"thinking", d.reasoning}});
  }
  if (!d.content.empty()) {
    if (!open_ || blocks_.back().kind != Kind::kText) Open(Kind::kText, &events);
    blocks_.back().text += d.content;
    delta({{"type", "text_delta"}, {"text", d.content}});
  }
  for (const auto& tc : d.tool_calls) {
    const int index = tc.value("index", 0);
    if (options_.disable_parallel_tool_use && index > 0) continue;
    // OpenAI-shaped deltas (openai::ChatStreamParser): {"index", "id", "type", "function": {"name",
    // "arguments"}} first, then {"index", "function": {"arguments"}}.
    const nlohmann::json fn = tc.contains("function") ? tc["function"] : nlohmann::json::object();
    const std::string args = fn.value("arguments", "");
    if (tc.contains("id")) {  // the first delta of a call
      Open(Kind::kToolUse, &events, tc.value("id", ""), fn.value("name", ""), index);
    } else if (!open_ || blocks_.back().kind != Kind::kToolUse || blocks_.back().call_index != index) {
      continue;  // arguments of a call whose block is closed: cannot happen with the parser's deltas
    }
    if (args.empty()) continue;
    blocks_.back().arguments += args;
    delta({{"type", "input_json_delta"}, {"partial_json", args}});
  }
  return events;
}

std::vector<Json> MessageBuilder::Finish(const std::string& stop_reason, const std::string& stop_sequence,
                                         uint64_t output_tokens, int complete_tool_calls) {
  std::vector<Json> events;
  Close(&events);
  stop_reason_ = stop_reason;
  stop_sequence_ = stop_sequence;
  output_tokens_ = output_tokens;
  complete_tool_calls_ = complete_tool_calls;
  events.push_back({{"type", "message_delta"},
                    {"delta", {{"stop_reason", stop_reason},
                               {"stop_sequence", stop_sequence.empty() ? Json(nullptr) : Json(stop_sequence)}}},
                    {"usage",
                     {{"input_tokens", input_tokens_},
                      {"output_tokens", output_tokens},
                      {"cache_read_input_tokens", cache_read_input_tokens_}}}});
  events.push_back({{"type", "message_stop"}});
  return events;
}

Json MessageBuilder::Message() const {
  Json content = Json::array();
  for (const Block& b : blocks_) {
    switch (b.kind) {
      case Kind::kThinking:
        content.push_back({{"type", "thinking"}, {"thinking", b.text}, {"signature", ""}});
        break;
      case Kind::kText:
        content.push_back({{"type", "text"}, {"text", b.text}});
        break;
      case Kind::kToolUse: {
        if (b.call_index >= complete_tool_calls_) break;  // cut off by the end of generation
        // The parser's arguments are a JSON object's text (non-JSON values already became strings, §4.4.4).
        Json input = Json::parse(b.arguments, nullptr, /*allow_exceptions=*/false);
        if (input.is_discarded() || !input.is_object()) input = Json{{"arguments", b.arguments}};
        content.push_back({{"type", "tool_use"}, {"id", b.id}, {"name", b.name},
                           {"input", std::move(input)}});
        break;
      }
    }
  }
  return Json{{"id", options_.id},
              {"type", "message"},
              {"role", "assistant"},
              {"model", options_.model},
              {"content", std::move(content)},
              {"stop_reason", stop_reason_},
              {"stop_sequence", stop_sequence_.empty() ? Json(nullptr) : Json(stop_sequence_)},
              {"usage",
               {{"input_tokens", input_tokens_},
                {"output_tokens", output_tokens_},
                {"cache_read_input_tokens", cache_read_input_tokens_}}}};
}

}  // namespace numoe::router::anthropic
