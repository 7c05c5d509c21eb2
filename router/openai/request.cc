#include "router/openai/request.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/tokenizer/grammar.h"
#include "router/core/errors.h"

namespace numoe::router::openai {

using json = Json;  // ordered (request.h)

const char* JsonTypeName(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "boolean";
    case json::value_t::string:
      return "string";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "integer";
    case json::value_t::number_float:
      return "number";
    case json::value_t::array:
      return "array";
    case json::value_t::object:
      return "object";
    default:
      return "value";
  }
}

Status TypeError(const std::string& param, const char* want, const json& got) {
  return InvalidParam(param, absl::StrCat("'", param, "' must be ", want, " (got ", JsonTypeName(got), ")"));
}

const json* Field(const json& obj, const char* name) {
  auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

Status ReadBool(const json& obj, const char* name, bool* out) {
  const json* v = Field(obj, name);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_boolean()) return TypeError(name, "a boolean", *v);
  *out = v->get<bool>();
  return absl::OkStatus();
}

Status ReadString(const json& obj, const char* name, std::string* out) {
  const json* v = Field(obj, name);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_string()) return TypeError(name, "a string", *v);
  *out = v->get<std::string>();
  return absl::OkStatus();
}

StatusOr<int64_t> AsInt(const json& v, const std::string& param) {
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    return u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ? std::numeric_limits<int64_t>::max()
                                                                            : static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  return TypeError(param, "an integer", v);
}

Status ReadInt(const json& obj, const char* name, std::optional<int64_t>* out) {
  const json* v = Field(obj, name);
  if (v == nullptr) return absl::OkStatus();
  ASSIGN_OR_RETURN(*out, AsInt(*v, name));
  return absl::OkStatus();
}

Status ReadNumber(const json& obj, const char* name, std::optional<double>* out) {
  const json* v = Field(obj, name);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_number()) return TypeError(name, "a number", *v);
  *out = v->get<double>();
  return absl::OkStatus();
}

namespace {

// A feature we do not implement: accepted only at its neutral value.
Status RejectUnless(const json& obj, const char* name, const std::function<bool(const json&)>& neutral,
                    const std::string& why) {
  const json* v = Field(obj, name);
  if (v == nullptr || neutral(*v)) return absl::OkStatus();
  return InvalidParam(name, absl::StrCat("'", name, "' is not supported by this server: ", why));
}

// response_format: text (nothing), json_object, json_schema {name, schema, strict} -> a grammar spec
// (common/tokenizer/grammar.h) without its end tokens, which the frontend adds.
Status ParseResponseFormat(const json& body, CommonParams* p) {
  const json* rf = Field(body, "response_format");
  if (rf == nullptr) return absl::OkStatus();
  if (!rf->is_object()) return TypeError("response_format", "an object ({\"type\": \"json_object\"})", *rf);
  const json* type = Field(*rf, "type");
  if (type == nullptr || !type->is_string()) return TypeError("response_format.type", "a string", type ? *type : json());
  const std::string t = type->get<std::string>();
  if (t == "text") return absl::OkStatus();
  if (t == "json_object") {
    p->sampling.grammar = R"({"type":"json_object"})";
    p->response_format = *rf;
    return absl::OkStatus();
  }
  if (t != "json_schema") {
    return InvalidParam("response_format.type", absl::StrCat("response_format.type must be \"text\", \"json_object\" or "
                                                             "\"json_schema\" (got \"", t, "\")"));
  }
  const json* js = Field(*rf, "json_schema");
  if (js == nullptr || !js->is_object()) {
    return TypeError("response_format.json_schema", "an object ({\"name\", \"schema\"})", js ? *js : json());
  }
  if (const json* strict = Field(*js, "strict"); strict != nullptr && !strict->is_boolean()) {
    return TypeError("response_format.json_schema.strict", "a boolean", *strict);
  }
  const json* schema = Field(*js, "schema");
  static const json kAny = json::object();
  if (schema == nullptr) schema = &kAny;  // OpenAI: no schema = any JSON value
  const std::string text = schema->dump();
  if (text.size() > tokenizer::kMaxGrammarSpecBytes - 256) {
    return InvalidParam("response_format.json_schema.schema",
                        absl::StrCat("the schema is ", text.size(), " bytes; at most ", tokenizer::kMaxGrammarSpecBytes - 256));
  }
  if (Status st = tokenizer::Grammar::CheckSchema(text, "response_format.json_schema.schema"); !st.ok()) {
    return InvalidParam("response_format.json_schema.schema", st.message());
  }
  p->sampling.grammar = absl::StrCat(R"({"type":"json_schema","schema":)", text, "}");
  p->response_format = *rf;
  return absl::OkStatus();
}

Status ParseCommon(const json& body, bool chat, CommonParams* p) {
  RETURN_IF_ERROR(ReadString(body, "model", &p->model));
  if (chat) RETURN_IF_ERROR(ReadInt(body, "max_completion_tokens", &p->max_tokens));
  RETURN_IF_ERROR(ReadInt(body, "max_tokens", &p->max_tokens));
  if (p->max_tokens && *p->max_tokens < 1) {
    return InvalidParam("max_tokens", absl::StrCat("max_tokens must be at least 1 (got ", *p->max_tokens, ")"));
  }
  RETURN_IF_ERROR(ReadNumber(body, "temperature", &p->sampling.temperature));
  RETURN_IF_ERROR(ReadNumber(body, "top_p", &p->sampling.top_p));
  RETURN_IF_ERROR(ReadInt(body, "top_k", &p->sampling.top_k));
  if (const json* v = Field(body, "seed")) {
    if (v->is_number_unsigned()) {
      p->sampling.seed = v->get<uint64_t>();
    } else if (v->is_number_integer()) {
      p->sampling.seed = static_cast<uint64_t>(v->get<int64_t>());  // negative seeds wrap, as in two's complement
    } else {
      return TypeError("seed", "an integer", *v);
    }
  }

  if (const json* v = Field(body, "stop")) {
    if (v->is_string()) {
      p->stop.push_back(v->get<std::string>());
    } else if (v->is_array()) {
      if (v->size() > kMaxStops) {
        return InvalidParam("stop", absl::StrCat("'stop' has ", v->size(), " strings; at most ", kMaxStops));
      }
      for (size_t i = 0; i < v->size(); ++i) {
        if (!(*v)[i].is_string()) return TypeError(absl::StrCat("stop[", i, "]"), "a string", (*v)[i]);
        p->stop.push_back((*v)[i].get<std::string>());
      }
    } else {
      return TypeError("stop", "a string or an array of strings", *v);
    }
  }
  if (const json* v = Field(body, "stop_token_ids")) {
    if (!v->is_array()) return TypeError("stop_token_ids", "an array of integers", *v);
    for (size_t i = 0; i < v->size(); ++i) {
      ASSIGN_OR_RETURN(int64_t id, AsInt((*v)[i], absl::StrCat("stop_token_ids[", i, "]")));
      p->stop_token_ids.push_back(id);
    }
  }
  RETURN_IF_ERROR(ReadBool(body, "stream", &p->stream));
  if (const json* v = Field(body, "stream_options")) {
    if (!v->is_object()) return TypeError("stream_options", "an object", *v);
    if (!p->stream) return InvalidParam("stream_options", "'stream_options' is only allowed with \"stream\": true");
    if (const json* u = Field(*v, "include_usage")) {
      if (!u->is_boolean()) return TypeError("stream_options.include_usage", "a boolean", *u);
      p->include_usage = u->get<bool>();
    }
  }
  RETURN_IF_ERROR(ReadBool(body, "ignore_eos", &p->ignore_eos));
  RETURN_IF_ERROR(ReadBool(body, "return_token_ids", &p->return_token_ids));
  RETURN_IF_ERROR(ReadBool(body, "skip_special_tokens", &p->skip_special_tokens));
  RETURN_IF_ERROR(ReadBool(body, "include_stop_str_in_output", &p->include_stop_str_in_output));

  if (const json* v = Field(body, "n")) {
    ASSIGN_OR_RETURN(int64_t n, AsInt(*v, "n"));
    if (n < 1 || n > kMaxChoices) {
      return InvalidParam("n", absl::StrCat("n must be in [1, ", kMaxChoices, "] (got ", n, ")"));
    }
    p->n = static_cast<int32_t>(n);
  }
  RETURN_IF_ERROR(ReadNumber(body, "min_p", &p->sampling.min_p));
  RETURN_IF_ERROR(ReadNumber(body, "presence_penalty", &p->sampling.presence_penalty));
  RETURN_IF_ERROR(ReadNumber(body, "frequency_penalty", &p->sampling.frequency_penalty));
  RETURN_IF_ERROR(ReadNumber(body, "repetition_penalty", &p->sampling.repetition_penalty));
  if (const json* v = Field(body, "logit_bias")) {
    if (!v->is_object()) return TypeError("logit_bias", "an object mapping token ids to biases", *v);
    for (const auto& [key, bias] : v->items()) {
      const std::string param = absl::StrCat("logit_bias[\"", key, "\"]");
      int64_t id = 0;
      if (key.empty() || !absl::SimpleAtoi(key, &id)) {
        return InvalidParam("logit_bias", absl::StrCat(param, ": the key must be a token id (an integer as a string)"));
      }
      if (!bias.is_number()) return InvalidParam("logit_bias", absl::StrCat(param, " must be a number (got ",
                                                                            JsonTypeName(bias), ")"));
      p->sampling.logit_bias.emplace_back(id, bias.get<double>());
    }
  }
  RETURN_IF_ERROR(Frontend::CheckSampling(p->sampling));
  auto max_logprobs = [&](const char* field, int64_t n) -> Status {
    if (n < 0 || n > kMaxTopLogprobs) {
      return InvalidParam(field, absl::StrCat(field, " must be in [0, ", kMaxTopLogprobs, "] (got ", n, ")"));
    }
    return absl::OkStatus();
  };
  if (chat) {
    bool logprobs = false;
    RETURN_IF_ERROR(ReadBool(body, "logprobs", &logprobs));
    std::optional<int64_t> top;
    RETURN_IF_ERROR(ReadInt(body, "top_logprobs", &top));
    if (top) {
      RETURN_IF_ERROR(max_logprobs("top_logprobs", *top));
      if (!logprobs) return InvalidParam("top_logprobs", "'top_logprobs' needs \"logprobs\": true");
    }
    if (logprobs) p->logprobs = static_cast<int32_t>(top.value_or(0));
  } else {
    std::optional<int64_t> logprobs;
    RETURN_IF_ERROR(ReadInt(body, "logprobs", &logprobs));
    if (logprobs) {
      RETURN_IF_ERROR(max_logprobs("logprobs", *logprobs));
      p->logprobs = static_cast<int32_t>(*logprobs);
    }
  }
  auto is_one = [](const json& v) { return v.is_number_integer() && v.get<int64_t>() == 1; };
  auto is_false = [](const json& v) { return v.is_boolean() && !v.get<bool>(); };
  RETURN_IF_ERROR(RejectUnless(body, "best_of", is_one, "only best_of=1 (use n for several samples)"));
  if (!chat) {
    RETURN_IF_ERROR(RejectUnless(body, "echo", is_false, "the prompt is not echoed"));
    RETURN_IF_ERROR(RejectUnless(
        body, "suffix", [](const json& v) { return v.is_string() && v.get<std::string>().empty(); },
        "no suffix (fill-in-the-middle)"));
  }
  return ParseResponseFormat(body, p);
}

StatusOr<std::vector<int64_t>> ParseIdList(const json& arr, const std::string& param) {
  std::vector<int64_t> ids;
  ids.reserve(arr.size());
  for (size_t i = 0; i < arr.size(); ++i) {
    ASSIGN_OR_RETURN(int64_t id, AsInt(arr[i], absl::StrCat(param, "[", i, "]")));
    ids.push_back(id);
  }
  return ids;
}

StatusOr<std::string> ParseContent(const json& v, const std::string& param) {
  if (v.is_string()) return v.get<std::string>();
  if (!v.is_array()) return TypeError(param, "a string, null or an array of text parts", v);
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    const json& part = v[i];
    std::string pp = absl::StrCat(param, "[", i, "]");
    if (part.is_string()) {  // lenient: a bare string part
      if (!out.empty()) out += "\n";
      out += part.get<std::string>();
      continue;
    }
    if (!part.is_object()) return TypeError(pp, "an object", part);
    std::string type;
    RETURN_IF_ERROR(ReadString(part, "type", &type));
    if (type != "text") {
      return InvalidParam(pp + ".type", absl::StrCat(pp, ".type: only \"text\" content parts are supported (got \"",
                                                     type, "\")"));
    }
    const json* text = Field(part, "text");
    if (text == nullptr || !text->is_string()) {
      return TypeError(pp + ".text", "a string", text ? *text : json());
    }
    // Text parts are joined with newlines, as vLLM does for DeepSeek V4.
    if (!out.empty()) out += "\n";
    out += text->get<std::string>();
  }
  return out;
}

StatusOr<ChatMessage> ParseMessage(const json& m, size_t index) {
  const std::string p = absl::StrCat("messages[", index, "]");
  if (!m.is_object()) return TypeError(p, "an object", m);
  ChatMessage msg;
  const json* role = Field(m, "role");
  if (role == nullptr) return InvalidParam(p + ".role", absl::StrCat(p, ".role is required"));
  if (!role->is_string()) return TypeError(p + ".role", "a string", *role);
  msg.role = role->get<std::string>();
  if (msg.role != "system" && msg.role != "developer" && msg.role != "user" && msg.role != "assistant" &&
      msg.role != "tool") {
    return InvalidParam(p + ".role", absl::StrCat(p, ".role must be system, developer, user, assistant or tool (got \"",
                                                  msg.role, "\")"));
  }
  if (const json* c = Field(m, "content")) {
    ASSIGN_OR_RETURN(msg.content, ParseContent(*c, p + ".content"));
    msg.has_content = true;
  }
  for (const char* key : {"reasoning_content", "reasoning"}) {
    if (const json* r = Field(m, key)) {
      if (!r->is_string()) return TypeError(absl::StrCat(p, ".", key), "a string", *r);
      msg.reasoning_content = r->get<std::string>();
    }
  }
  if (const json* tc = Field(m, "tool_calls")) {
    if (!tc->is_array()) return TypeError(p + ".tool_calls", "an array", *tc);
    for (size_t i = 0; i < tc->size(); ++i) {
      const json& call = (*tc)[i];
      std::string cp = absl::StrCat(p, ".tool_calls[", i, "]");
      if (!call.is_object()) return TypeError(cp, "an object", call);
      ChatToolCall out;
      RETURN_IF_ERROR(ReadString(call, "id", &out.id));
      const json* fn = Field(call, "function");
      if (fn == nullptr || !fn->is_object()) return TypeError(cp + ".function", "an object", fn ? *fn : json());
      const json* name = Field(*fn, "name");
      if (name == nullptr || !name->is_string()) return TypeError(cp + ".function.name", "a string", name ? *name : json());
      out.name = name->get<std::string>();
      if (const json* args = Field(*fn, "arguments")) {
        if (args->is_string()) {
          out.arguments = args->get<std::string>();
        } else if (args->is_object()) {
          out.arguments = args->dump();  // lenient: an object instead of its JSON text
        } else {
          return TypeError(cp + ".function.arguments", "a JSON string", *args);
        }
      }
      msg.tool_calls.push_back(std::move(out));
    }
    if (msg.role != "assistant" && !msg.tool_calls.empty()) {
      return InvalidParam(p + ".tool_calls", absl::StrCat(p, ".tool_calls: only assistant messages carry tool calls"));
    }
  }
  RETURN_IF_ERROR(ReadString(m, "tool_call_id", &msg.tool_call_id));
  RETURN_IF_ERROR(ReadBool(m, "prefix", &msg.prefix));
  if (msg.role != "assistant" && !msg.has_content) {
    return InvalidParam(p + ".content", absl::StrCat(p, ".content is required for role ", msg.role));
  }
  return msg;
}

}  // namespace

size_t JsonNestingDepth(std::string_view text) {
  size_t depth = 0, max_depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      max_depth = std::max(max_depth, ++depth);
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return max_depth;
}

StatusOr<json> ParseJsonBody(std::string_view body) {
  // Deep nesting is refused before parsing: serialising such a value later (e.g. tool schemas) recurses.
  if (size_t depth = JsonNestingDepth(body); depth > kMaxJsonDepth) {
    return InvalidParam("", absl::StrCat("the request body nests arrays/objects ", depth, " deep; at most ",
                                         kMaxJsonDepth));
  }
  json j;
  try {
    j = json::parse(body.begin(), body.end());
  } catch (const json::exception& e) {
    return InvalidParam("", absl::StrCat("the request body is not valid JSON: ", e.what()));
  }
  if (!j.is_object()) return InvalidParam("", absl::StrCat("the request body must be a JSON object (got ", JsonTypeName(j), ")"));
  return j;
}

StatusOr<CompletionRequest> ParseCompletionRequest(const json& body) {
  CompletionRequest req;
  RETURN_IF_ERROR(ParseCommon(body, /*chat=*/false, &req.common));
  RETURN_IF_ERROR(ReadBool(body, "add_special_tokens", &req.add_special_tokens));
  const json* prompt = Field(body, "prompt");
  if (prompt == nullptr) return InvalidParam("prompt", "'prompt' is required");
  if (prompt->is_string()) {
    req.prompts.emplace_back(prompt->get<std::string>());
  } else if (prompt->is_array()) {
    if (prompt->empty()) return InvalidParam("prompt", "'prompt' is an empty array");
    const json& first = prompt->front();
    if (first.is_number()) {
      ASSIGN_OR_RETURN(auto ids, ParseIdList(*prompt, "prompt"));
      req.prompts.emplace_back(std::move(ids));
    } else {
      if (prompt->size() > kMaxPrompts) {
        return InvalidParam("prompt", absl::StrCat("'prompt' has ", prompt->size(), " prompts; at most ", kMaxPrompts));
      }
      for (size_t i = 0; i < prompt->size(); ++i) {
        const json& el = (*prompt)[i];
        std::string ep = absl::StrCat("prompt[", i, "]");
        if (el.is_string() && first.is_string()) {
          req.prompts.emplace_back(el.get<std::string>());
        } else if (el.is_array() && first.is_array()) {
          ASSIGN_OR_RETURN(auto ids, ParseIdList(el, ep));
          req.prompts.emplace_back(std::move(ids));
        } else {
          return InvalidParam(ep, absl::StrCat("'prompt' must be a string, an array of token ids, an array of strings "
                                               "or an array of token-id arrays; ",
                                               ep, " is ", JsonTypeName(el)));
        }
      }
    }
  } else {
    return TypeError("prompt", "a string or an array", *prompt);
  }
  return req;
}

StatusOr<ChatRequest> ParseChatRequest(const json& body) {
  ChatRequest req;
  RETURN_IF_ERROR(ParseCommon(body, /*chat=*/true, &req.common));
  const json* messages = Field(body, "messages");
  if (messages == nullptr) return InvalidParam("messages", "'messages' is required");
  if (!messages->is_array()) return TypeError("messages", "an array", *messages);
  if (messages->empty()) return InvalidParam("messages", "'messages' is empty");
  for (size_t i = 0; i < messages->size(); ++i) {
    ASSIGN_OR_RETURN(ChatMessage m, ParseMessage((*messages)[i], i));
    if (m.prefix && i + 1 != messages->size()) {
      return InvalidParam(absl::StrCat("messages[", i, "].prefix"), "only the last message may have \"prefix\": true");
    }
    if (m.prefix && m.role != "assistant") {
      return InvalidParam(absl::StrCat("messages[", i, "].prefix"), "\"prefix\": true is only for an assistant message");
    }
    req.messages.push_back(std::move(m));
  }
  // vLLM's continue_final_message: the same as "prefix": true on the final (assistant) message.
  bool continue_final = false;
  RETURN_IF_ERROR(ReadBool(body, "continue_final_message", &continue_final));
  if (continue_final) {
    if (req.messages.back().role != "assistant") {
      return InvalidParam("continue_final_message",
                          absl::StrCat("continue_final_message needs an assistant message last (the last message is "
                                       "from the ", req.messages.back().role, ")"));
    }
    req.messages.back().prefix = true;
  }
  // vLLM's add_generation_prompt: the V4 encoding opens the assistant turn after a final user/tool message by
  // itself, so false is only meaningful with a continued assistant message.
  bool generation_prompt = true;
  RETURN_IF_ERROR(ReadBool(body, "add_generation_prompt", &generation_prompt));
  if (!generation_prompt && !req.messages.back().prefix) {
    return InvalidParam("add_generation_prompt",
                        "add_generation_prompt false is only supported with a continued final assistant message "
                        "(continue_final_message, or \"prefix\": true): the DeepSeek V4 encoding always opens the "
                        "assistant turn after a user or tool message");
  }

  if (const json* t = Field(body, "thinking")) {
    if (t->is_boolean()) {
      req.thinking = t->get<bool>();
    } else if (t->is_object()) {  // DeepSeek API style: {"type": "enabled" | "disabled"}
      std::string type;
      RETURN_IF_ERROR(ReadString(*t, "type", &type));
      if (type != "enabled" && type != "disabled") {
        return InvalidParam("thinking.type", absl::StrCat("thinking.type must be \"enabled\" or \"disabled\" (got \"",
                                                          type, "\")"));
      }
      req.thinking = type == "enabled";
    } else {
      return TypeError("thinking", "a boolean or {\"type\": \"enabled\"|\"disabled\"}", *t);
    }
  }
  if (const json* k = Field(body, "chat_template_kwargs")) {
    if (!k->is_object()) return TypeError("chat_template_kwargs", "an object", *k);
    for (const char* key : {"thinking", "enable_thinking"}) {
      if (const json* t = Field(*k, key)) {
        if (!t->is_boolean()) return TypeError(absl::StrCat("chat_template_kwargs.", key), "a boolean", *t);
        req.thinking = t->get<bool>();
      }
    }
    if (const json* e = Field(*k, "reasoning_effort")) {
      if (!e->is_string()) return TypeError("chat_template_kwargs.reasoning_effort", "a string", *e);
      req.reasoning_effort = e->get<std::string>();
    }
  }
  if (const json* e = Field(body, "reasoning_effort")) {
    if (!e->is_string()) return TypeError("reasoning_effort", "a string", *e);
    req.reasoning_effort = e->get<std::string>();
  }
  if (const json* tools = Field(body, "tools")) {
    if (!tools->is_array()) return TypeError("tools", "an array", *tools);
    for (size_t i = 0; i < tools->size(); ++i) {
      const json& tool = (*tools)[i];
      std::string tp = absl::StrCat("tools[", i, "]");
      if (!tool.is_object()) return TypeError(tp, "an object", tool);
      const json* fn = Field(tool, "function");
      if (fn == nullptr || !fn->is_object()) return TypeError(tp + ".function", "an object", fn ? *fn : json());
      const json* name = Field(*fn, "name");
      if (name == nullptr || !name->is_string()) {
        return TypeError(tp + ".function.name", "a string", name ? *name : json());
      }
    }
    if (!tools->empty()) req.tools = *tools;
  }
  if (const json* tc = Field(body, "tool_choice")) {
    if (tc->is_string()) {
      std::string c = tc->get<std::string>();
      if (c == "none") {
        req.tool_choice_none = true;
      } else if (c == "required") {
        req.tool_choice_required = true;
      } else if (c != "auto") {
        return InvalidParam("tool_choice", absl::StrCat("tool_choice must be \"auto\", \"none\", \"required\" or "
                                                        "{\"type\": \"function\", \"function\": {\"name\"}} (got \"", c, "\")"));
      }
    } else if (tc->is_object()) {
      const json* fn = Field(*tc, "function");
      const json* name = fn != nullptr && fn->is_object() ? Field(*fn, "name") : nullptr;
      if (name == nullptr || !name->is_string()) {
        return TypeError("tool_choice.function.name", "a string", name ? *name : json());
      }
      req.tool_choice_name = name->get<std::string>();
    } else {
      return TypeError("tool_choice", "a string or an object", *tc);
    }
    if (req.tool_choice_required || !req.tool_choice_name.empty()) {
      if (req.tools.is_null() || req.tools.empty()) {
        return InvalidParam("tool_choice", "a forced tool call (tool_choice \"required\" or a named function) needs tools");
      }
      if (!req.tool_choice_name.empty()) {
        bool found = false;
        for (const json& t : req.tools) found |= t["function"]["name"] == req.tool_choice_name;
        if (!found) {
          return InvalidParam("tool_choice.function.name",
                              absl::StrCat("tool_choice names \"", req.tool_choice_name, "\", which is not in tools"));
        }
      }
      if (!req.common.sampling.grammar.empty()) {
        return InvalidParam("tool_choice", "a forced tool call and a JSON response_format cannot be combined");
      }
      for (size_t i = 0; i < req.tools.size(); ++i) {
        const json& fn = req.tools[i]["function"];
        if (!fn.contains("parameters")) continue;
        const std::string field = absl::StrCat("tools[", i, "].function.parameters");
        if (Status st = tokenizer::Grammar::CheckSchema(fn["parameters"].dump(), field); !st.ok()) {
          return InvalidParam(field, st.message());
        }
      }
    }
  }
  return req;
}

}  // namespace numoe::router::openai
