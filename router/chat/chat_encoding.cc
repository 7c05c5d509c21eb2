// DeepSeek V4 prompt encoding (§2) and the official strict output grammar (§4.1-4.2).
#include "router/chat/chat_encoding.h"

#include <algorithm>
#include <array>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/tokenizer/utf8.h"

namespace numoe::chat {
namespace {

// absl::StrCat in Debian's absl takes absl::string_view, not std::string_view: concatenate by hand.
template <typename... Args>
std::string Cat(const Args&... args) {
  std::string out;
  (out.append(std::string_view(args)), ...);
  return out;
}
template <typename... Args>
void Append(std::string* out, const Args&... args) {
  (out->append(std::string_view(args)), ...);
}

constexpr std::string_view kToolsTemplateHead =
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    "\"<｜DSML｜tool_calls>\" block like the following:\n\n"
    "<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME\">\n"
    "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
    "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n";
constexpr std::string_view kToolsTemplateTail =
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";

constexpr std::string_view kResponseFormatHead =
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n";

constexpr std::string_view kEffortA =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";
constexpr std::string_view kEffortB =
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n";

struct Task {
  std::string_view name, token;
};
constexpr std::array<Task, 6> kTasks = {{{"action", "<｜action｜>"},
                                         {"query", "<｜query｜>"},
                                         {"authority", "<｜authority｜>"},
                                         {"domain", "<｜domain｜>"},
                                         {"title", "<｜title｜>"},
                                         {"read_url", "<｜read_url｜>"}}};

// A content block of a merged user turn (§2.1.1).
struct Block {
  bool is_tool_result = false;
  std::string text;          // text block
  std::string tool_use_id;   // tool_result block
  const Json* tool_content;  // tool_result block: the tool message's "content" (string, list, null, ...)
};

struct InCall {
  std::string id, name;
  const Json* arguments;  // string (normal), object (already parsed), or anything else
};

// One message after validation, in the shape the renderer needs.
struct Msg {
  std::string role;
  std::string content;
  const Json* raw_content = nullptr;  // tool messages keep their content as is
  bool has_blocks = false;
  std::vector<Block> blocks;
  bool has_reasoning = false;
  std::string reasoning;
  std::vector<InCall> tool_calls;
  std::string tool_call_id;
  const Json* tools = nullptr;            // non-empty array, or null
  const Json* response_format = nullptr;  // "truthy" value, or null
  std::optional<std::string> task;
  bool wo_eos = false;
};

Status Invalid(const std::string& field, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", message));
}

// Python truthiness of a JSON value (the encoder tests `if tools:` / `if response_format:`).
bool Truthy(const Json& v) {
  if (v.is_null()) return false;
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number()) return v.get<double>() != 0;
  if (v.is_string() || v.is_array() || v.is_object()) return !v.empty();
  return false;
}

StatusOr<std::string> TextContent(const Json& c, const std::string& field) {
  if (c.is_null()) return std::string();
  if (c.is_string()) return c.get<std::string>();
  if (!c.is_array()) return Invalid(field, "expected a string, null or a list of text parts");
  // The official encoder breaks on part lists; servers join text parts with "\n" (§3).
  std::vector<std::string> parts;
  for (size_t j = 0; j < c.size(); ++j) {
    const Json& p = c[j];
    const std::string pfield = absl::StrCat(field, "[", j, "]");
    if (p.is_string()) {
      parts.push_back(p.get<std::string>());
      continue;
    }
    if (!p.is_object() || !p.contains("type") || !p["type"].is_string()) return Invalid(pfield, "expected a content part");
    if (p["type"] != "text") return Invalid(pfield, absl::StrCat("unsupported content part type '", p["type"].get<std::string>(), "'"));
    if (!p.contains("text") || !p["text"].is_string()) return Invalid(pfield + ".text", "expected a string");
    parts.push_back(p["text"].get<std::string>());
  }
  return absl::StrJoin(parts, "\n");
}

StatusOr<std::optional<std::string>> OptionalString(const Json& m, const char* key, const std::string& field) {
  const auto it = m.find(key);
  if (it == m.end() || it->is_null()) return std::optional<std::string>();
  if (!it->is_string()) return Invalid(absl::StrCat(field, ".", key), "expected a string or null");
  return std::optional<std::string>(it->get<std::string>());
}

StatusOr<Msg> ReadMessage(const Json& m, size_t i) {
  const std::string field = absl::StrCat("messages[", i, "]");
  if (!m.is_object()) return Invalid(field, "expected an object");
  Msg msg;
  const auto role = m.find("role");
  if (role == m.end() || !role->is_string()) return Invalid(field + ".role", "missing or not a string");
  msg.role = role->get<std::string>();
  static constexpr std::array<std::string_view, 6> kRoles = {"system", "developer", "user", "assistant", "tool",
                                                             "latest_reminder"};
  if (std::find(kRoles.begin(), kRoles.end(), msg.role) == kRoles.end()) {
    return Invalid(field + ".role", absl::StrCat("unknown role '", msg.role, "'"));
  }
  static const Json kNull;
  const auto content = m.find("content");
  const Json& c = content == m.end() ? kNull : *content;
  if (msg.role == "tool") {
    msg.raw_content = &c;
  } else {
    ASSIGN_OR_RETURN(msg.content, TextContent(c, field + ".content"));
  }

  ASSIGN_OR_RETURN(std::optional<std::string> reasoning, OptionalString(m, "reasoning_content", field));
  if (!reasoning) {
    ASSIGN_OR_RETURN(reasoning, OptionalString(m, "reasoning", field));
  }
  msg.has_reasoning = reasoning.has_value();
  msg.reasoning = reasoning.value_or("");

  if (const auto tc = m.find("tool_calls"); tc != m.end() && !tc->is_null()) {
    if (!tc->is_array()) return Invalid(field + ".tool_calls", "expected an array");
    for (size_t j = 0; j < tc->size(); ++j) {
      const Json& call = (*tc)[j];
      const std::string cfield = absl::StrCat(field, ".tool_calls[", j, "]");
      if (!call.is_object()) return Invalid(cfield, "expected an object");
      // OpenAI {"id", "type", "function": {"name", "arguments"}}; a flat {"name", "arguments"} is accepted too.
      const bool nested = call.contains("function") && call["function"].is_object();
      const Json& fn = nested ? call["function"] : call;
      const std::string ffield = nested ? cfield + ".function" : cfield;
      InCall in;
      const auto name = fn.find("name");
      if (name == fn.end() || !name->is_string()) return Invalid(ffield + ".name", "missing or not a string");
      in.name = name->get<std::string>();
      const auto args = fn.find("arguments");
      if (args == fn.end()) return Invalid(ffield + ".arguments", "missing");
      in.arguments = &*args;
      if (call.contains("id") && call["id"].is_string()) {
        in.id = call["id"].get<std::string>();
      } else if (fn.contains("id") && fn["id"].is_string()) {
        in.id = fn["id"].get<std::string>();
      }
      msg.tool_calls.push_back(std::move(in));
    }
  }
  ASSIGN_OR_RETURN(std::optional<std::string> tool_call_id, OptionalString(m, "tool_call_id", field));
  msg.tool_call_id = tool_call_id.value_or("");

  if (const auto tools = m.find("tools"); tools != m.end() && Truthy(*tools)) {
    if (!tools->is_array()) return Invalid(field + ".tools", "expected an array");
    for (size_t j = 0; j < tools->size(); ++j) {
      const Json& t = (*tools)[j];
      if (!t.is_object() || !t.contains("function") || !t["function"].is_object()) {
        return Invalid(absl::StrCat(field, ".tools[", j, "]"), "expected {\"type\": \"function\", \"function\": {...}}");
      }
    }
    msg.tools = &*tools;
  }
  if (const auto rf = m.find("response_format"); rf != m.end() && Truthy(*rf)) msg.response_format = &*rf;

  ASSIGN_OR_RETURN(msg.task, OptionalString(m, "task", field));
  if (msg.task && std::none_of(kTasks.begin(), kTasks.end(), [&](const Task& t) { return t.name == *msg.task; })) {
    return Invalid(field + ".task", absl::StrCat("unknown task '", *msg.task,
                                                 "' (valid: action, query, authority, domain, title, read_url)"));
  }
  if (const auto w = m.find("wo_eos"); w != m.end() && !w->is_null()) {
    if (!w->is_boolean()) return Invalid(field + ".wo_eos", "expected true or false");
    msg.wo_eos = w->get<bool>();
  }
  return msg;
}

// §2.1.1: tool messages become tool_result blocks; runs of user/tool messages become one user turn.
std::vector<Msg> MergeToolMessages(std::vector<Msg> in) {
  std::vector<Msg> out;
  for (Msg& m : in) {
    const bool last_is_block_user = !out.empty() && out.back().role == "user" && out.back().has_blocks;
    if (m.role == "tool") {
      Block b;
      b.is_tool_result = true;
      b.tool_use_id = m.tool_call_id;
      b.tool_content = m.raw_content;
      if (last_is_block_user) {
        out.back().blocks.push_back(std::move(b));
      } else {
        Msg user;
        user.role = "user";
        user.has_blocks = true;
        user.blocks.push_back(std::move(b));
        out.push_back(std::move(user));
      }
    } else if (m.role == "user") {
      Block b;
      b.text = m.content;
      if (last_is_block_user && !out.back().task) {
        out.back().blocks.push_back(std::move(b));  // this message's own task/wo_eos are lost, as upstream
      } else {
        Msg user;
        user.role = "user";
        user.content = m.content;
        user.has_blocks = true;
        user.blocks.push_back(std::move(b));
        user.task = m.task;
        user.wo_eos = m.wo_eos;
        out.push_back(std::move(user));
      }
    } else {
      out.push_back(std::move(m));
    }
  }
  return out;
}

// §2.1.2: tool results follow the order of the calls of the latest assistant that made calls.
void SortToolResults(std::vector<Msg>* msgs) {
  std::vector<std::pair<std::string, int>> order;  // call id -> index; later duplicates win, as a dict would
  const auto key = [&order](const Block& b) {
    int k = 0;
    for (const auto& [id, idx] : order) {
      if (id == b.tool_use_id) k = idx;
    }
    return k;
  };
  for (Msg& m : *msgs) {
    if (m.role == "assistant" && !m.tool_calls.empty()) {
      order.clear();
      for (size_t i = 0; i < m.tool_calls.size(); ++i) {
        if (!m.tool_calls[i].id.empty()) order.emplace_back(m.tool_calls[i].id, static_cast<int>(i));
      }
    } else if (m.role == "user" && m.has_blocks) {
      std::vector<Block> results;
      for (const Block& b : m.blocks) {
        if (b.is_tool_result) results.push_back(b);
      }
      if (results.size() < 2 || order.empty()) continue;
      std::stable_sort(results.begin(), results.end(),
                       [&](const Block& a, const Block& b) { return key(a) < key(b); });
      size_t next = 0;
      for (Block& b : m.blocks) {
        if (b.is_tool_result) b = results[next++];
      }
    }
  }
}

int LastUserIndex(const std::vector<Msg>& msgs) {
  for (int i = static_cast<int>(msgs.size()) - 1; i >= 0; --i) {
    if (msgs[i].role == "user" || msgs[i].role == "developer") return i;
  }
  return -1;
}

// §2.1.4: before the last user turn keep user/system/latest_reminder, strip assistants' reasoning, drop the rest.
std::vector<Msg> DropThinking(std::vector<Msg> msgs) {
  const int last_user = LastUserIndex(msgs);
  std::vector<Msg> out;
  for (int i = 0; i < static_cast<int>(msgs.size()); ++i) {
    Msg& m = msgs[i];
    if (m.role == "user" || m.role == "system" || m.role == "tool" || m.role == "latest_reminder" || i >= last_user) {
      out.push_back(std::move(m));
    } else if (m.role == "assistant") {
      m.has_reasoning = false;
      m.reasoning.clear();
      out.push_back(std::move(m));
    }
  }
  return out;
}

std::string RenderTools(const Json& tools) {
  std::vector<std::string> schemas;
  for (const Json& t : tools) schemas.push_back(PythonJsonDumps(t["function"]));
  return Cat(kToolsTemplateHead, absl::StrJoin(schemas, "\n"), kToolsTemplateTail);
}

void AppendSystemSuffixes(const Msg& m, std::string* out) {
  if (m.tools != nullptr) Append(out, "\n\n", RenderTools(*m.tools));
  if (m.response_format != nullptr) {
    Append(out, "\n\n", kResponseFormatHead, PythonJsonDumps(*m.response_format));
  }
}

// §2.5: history arguments -> DSML parameters.
StatusOr<std::string> ArgumentsToDsml(const InCall& call, const std::string& field) {
  Json args;
  const Json& raw = *call.arguments;
  bool parsed = false;
  if (raw.is_string()) {
    args = Json::parse(raw.get_ref<const std::string&>(), nullptr, /*allow_exceptions=*/false);
    parsed = !args.is_discarded();
  } else if (raw.is_object()) {
    args = raw;  // already parsed by the client: use it rather than nesting it under "arguments"
    parsed = true;
  }
  if (!parsed) args = Json{{"arguments", raw}};
  if (!args.is_object()) {
    return Invalid(field + ".arguments", "the JSON arguments are not an object");  // the official encoder raises
  }
  std::vector<std::string> params;
  for (const auto& [key, value] : args.items()) {
    const bool is_string = value.is_string();
    params.push_back(absl::StrCat("<｜DSML｜parameter name=\"", key, "\" string=\"", is_string ? "true" : "false", "\">",
                                  is_string ? value.get<std::string>() : PythonJsonDumps(value),
                                  "</｜DSML｜parameter>"));
  }
  return absl::StrJoin(params, "\n");
}

StatusOr<std::string> ToolResultText(const Json& c) {
  if (c.is_null()) return std::string();
  if (c.is_string()) return c.get<std::string>();
  if (c.is_array()) {
    std::vector<std::string> parts;
    for (const Json& b : c) {
      const std::string type = b.is_object() && b.contains("type") && b["type"].is_string() ? b["type"].get<std::string>() : "None";
      if (type == "text" && b.contains("text") && b["text"].is_string()) {
        parts.push_back(b["text"].get<std::string>());
      } else if (type == "text") {
        parts.push_back("");
      } else {
        parts.push_back(absl::StrCat("[Unsupported ", type, "]"));
      }
    }
    return absl::StrJoin(parts, "\n\n");
  }
  return PythonJsonDumps(c);
}

std::string_view TaskToken(const std::string& task) {
  for (const Task& t : kTasks) {
    if (t.name == task) return t.token;
  }
  return {};
}

struct RenderContext {
  const std::vector<Msg>& msgs;
  bool thinking;
  bool drop;  // effective_drop
  int last_user;
  std::string_view effort_prefix;
};

StatusOr<std::string> RenderMessage(const RenderContext& ctx, int i) {
  const Msg& m = ctx.msgs[i];
  std::string out;
  if (i == 0 && ctx.thinking) out.append(ctx.effort_prefix);
  const std::string field = absl::StrCat("messages (after merging tool messages)[", i, "]");
  if (m.role == "system") {
    out.append(m.content);
    AppendSystemSuffixes(m, &out);
  } else if (m.role == "developer") {
    if (m.content.empty()) return Invalid(field + ".content", "a developer message needs non-empty content");
    Append(&out, kUser, m.content);
    AppendSystemSuffixes(m, &out);
  } else if (m.role == "user") {
    out.append(kUser);
    std::vector<std::string> parts;
    for (const Block& b : m.blocks) {
      if (b.is_tool_result) {
        ASSIGN_OR_RETURN(const std::string text, ToolResultText(*b.tool_content));
        parts.push_back(absl::StrCat("<tool_result>", text, "</tool_result>"));
      } else {
        parts.push_back(b.text);
      }
    }
    out.append(m.has_blocks ? absl::StrJoin(parts, "\n\n") : m.content);
  } else if (m.role == "latest_reminder") {
    Append(&out, kLatestReminder, m.content);
  } else if (m.role == "assistant") {
    std::string calls;
    if (!m.tool_calls.empty()) {
      std::vector<std::string> invokes;
      for (size_t j = 0; j < m.tool_calls.size(); ++j) {
        ASSIGN_OR_RETURN(const std::string params,
                         ArgumentsToDsml(m.tool_calls[j], absl::StrCat(field, ".tool_calls[", j, "]")));
        invokes.push_back(absl::StrCat("<｜DSML｜invoke name=\"", m.tool_calls[j].name, "\">\n", params,
                                       "\n</｜DSML｜invoke>"));
      }
      calls = absl::StrCat("\n\n<｜DSML｜tool_calls>\n", absl::StrJoin(invokes, "\n"), "\n</｜DSML｜tool_calls>");
    }
    const bool prev_has_task = i > 0 && ctx.msgs[i - 1].task.has_value();
    if (ctx.thinking && !prev_has_task && (!ctx.drop || i > ctx.last_user)) {
      Append(&out, m.reasoning, kEndThink);
    }
    Append(&out, m.content, calls);
    if (!m.wo_eos) out.append(kEos);
  } else {
    return Invalid(field + ".role", absl::StrCat("unexpected role '", m.role, "'"));
  }

  // Transition (§2.2c): only before an assistant/latest_reminder message, or at the end.
  const bool last = i + 1 == static_cast<int>(ctx.msgs.size());
  if (!last && ctx.msgs[i + 1].role != "assistant" && ctx.msgs[i + 1].role != "latest_reminder") return out;
  if (m.task) {
    if (*m.task == "action") {
      Append(&out, kAssistant, ctx.thinking ? kThink : kEndThink, TaskToken(*m.task));
    } else {
      out.append(TaskToken(*m.task));
    }
  } else if (m.role == "user" || m.role == "developer") {
    out.append(kAssistant);
    out.append(ctx.thinking && (!ctx.drop || i >= ctx.last_user) ? kThink : kEndThink);
  }
  return out;
}

StatusOr<std::string_view> EffortPrefix(const EncodeOptions& o) {
  const std::optional<std::string>& e = o.reasoning_effort;
  if (o.profile == EncoderProfile::kPreview) {
    if (!e) return std::string_view();
    if (*e == "high") return std::string_view();
    if (*e == "max") return kEffortA;
    return Invalid("reasoning_effort", absl::StrCat("'", *e, "' is not valid for this model (None, high or max)"));
  }
  const std::string level = e.value_or("low");
  if (level == "low") return std::string_view();
  if (level == "high") return kEffortA;
  if (level == "max") return kEffortB;
  return Invalid("reasoning_effort", absl::StrCat("'", level, "' is not valid for this model (low, high or max)"));
}

}  // namespace

StatusOr<std::string> EncodeMessages(const Json& messages, const EncodeOptions& options) {
  if (!messages.is_array()) return Invalid("messages", "expected an array");
  ASSIGN_OR_RETURN(const std::string_view effort, EffortPrefix(options));
  std::vector<Msg> msgs;
  msgs.reserve(messages.size());
  bool any_tools = false;
  for (size_t i = 0; i < messages.size(); ++i) {
    ASSIGN_OR_RETURN(Msg m, ReadMessage(messages[i], i));
    any_tools |= m.tools != nullptr;  // tools on any role disable dropping (§2.1.3), rendered or not
    msgs.push_back(std::move(m));
  }
  msgs = MergeToolMessages(std::move(msgs));
  SortToolResults(&msgs);
  const bool thinking = options.thinking_mode == ThinkingMode::kThinking;
  const bool drop = options.drop_thinking && !any_tools;
  if (thinking && drop) msgs = DropThinking(std::move(msgs));
  const RenderContext ctx{msgs, thinking, drop, LastUserIndex(msgs), effort};
  std::string prompt = options.add_bos ? std::string(kBos) : std::string();
  for (int i = 0; i < static_cast<int>(msgs.size()); ++i) {
    ASSIGN_OR_RETURN(const std::string part, RenderMessage(ctx, i));
    prompt += part;
  }
  return prompt;
}

Status AttachRequestTools(Json* messages, const Json& tools) {
  if (!Truthy(tools)) return absl::OkStatus();
  if (!tools.is_array()) return Invalid("tools", "expected an array");
  if (!messages->is_array()) return Invalid("messages", "expected an array");
  if (!messages->empty() && (*messages)[0].is_object() && (*messages)[0].contains("role") &&
      ((*messages)[0]["role"] == "system" || (*messages)[0]["role"] == "developer")) {
    (*messages)[0]["tools"] = tools;  // request tools win
    return absl::OkStatus();
  }
  Json system = Json::object();
  system["role"] = "system";
  system["content"] = "";
  system["tools"] = tools;
  messages->insert(messages->begin(), std::move(system));
  return absl::OkStatus();
}

StatusOr<std::optional<std::string>> MapReasoningEffort(std::optional<std::string_view> requested,
                                                        EncoderProfile profile) {
  const std::string_view r = requested.value_or("high");
  std::string level;
  if (r == "minimal" || r == "low") {
    level = "low";
  } else if (r == "medium" || r == "high" || r == "xhigh") {
    level = "high";
  } else if (r == "max" || r == "ultra") {
    level = "max";
  } else {
    return Invalid("reasoning_effort", absl::StrCat("unknown value '", std::string(r),
                                                    "' (minimal, low, medium, high, xhigh, max, ultra)"));
  }
  if (profile == EncoderProfile::kPreview) {
    if (level == "max") return std::optional<std::string>("max");
    return std::optional<std::string>();
  }
  return std::optional<std::string>(level);
}

EncoderProfile DetectEncoderProfile(std::string_view src) {
  const bool low_default = src.find("DEFAULT_REASONING_EFFORT = \"low\"") != std::string_view::npos ||
                           src.find("DEFAULT_REASONING_EFFORT = 'low'") != std::string_view::npos;
  if (low_default && src.find("REASONING_EFFORT_PROMPTS") != std::string_view::npos) return EncoderProfile::kFlash0731;
  return EncoderProfile::kPreview;
}

// ---- Strict parser (§4.1, §4.2) ------------------------------------------------------------------------

namespace {

struct ReadResult {
  size_t next;
  std::string_view before;
  std::string_view stop;  // empty: none of the stops was found
};

// Text from `index` up to the earliest of `stops` (ties: the first listed), and the index after it.
ReadResult ReadUntil(std::string_view text, size_t index, std::initializer_list<std::string_view> stops) {
  size_t best = std::string_view::npos;
  std::string_view which;
  for (std::string_view s : stops) {
    const size_t p = text.find(s, index);
    if (p != std::string_view::npos && p < best) {
      best = p;
      which = s;
    }
  }
  if (which.empty()) return {text.size(), text.substr(index), {}};
  return {best + which.size(), text.substr(index, best - index), which};
}

// Python's str `\s`: Unicode White_Space plus U+001C..U+001F.
size_t SkipPythonSpace(std::string_view s, size_t p) {
  while (p < s.size()) {
    size_t len = 1;
    const char32_t c = tokenizer::DecodeCodePoint(s, p, &len);
    if (!tokenizer::IsUnicodeWhiteSpace(c) && !(c >= 0x1C && c <= 0x1F)) break;
    p += len;
  }
  return p;
}

// ^\s*name="(.*?)">\n$  (DOTALL; `$` also matches before one final "\n").
bool MatchInvokeName(std::string_view s, std::string* name) {
  s.remove_prefix(SkipPythonSpace(s, 0));
  constexpr std::string_view kPrefix = "name=\"";
  if (s.substr(0, kPrefix.size()) != kPrefix) return false;
  s.remove_prefix(kPrefix.size());
  for (std::string_view tail : {std::string_view("\">\n"), std::string_view("\">\n\n")}) {
    if (s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail) {
      *name = std::string(s.substr(0, s.size() - tail.size()));
      return true;
    }
  }
  return false;
}

// ^ name="(.*?)" string="(true|false)">(.*?)<$  (DOTALL).
bool MatchParameter(std::string_view s, std::string* key, bool* is_string, std::string* value) {
  constexpr std::string_view kPrefix = " name=\"";
  if (s.substr(0, kPrefix.size()) != kPrefix) return false;
  s.remove_prefix(kPrefix.size());
  size_t end = std::string_view::npos;
  if (s.size() >= 2 && s.substr(s.size() - 2) == "<\n") {
    end = s.size() - 2;
  } else if (!s.empty() && s.back() == '<') {
    end = s.size() - 1;
  }
  if (end == std::string_view::npos) return false;
  constexpr std::string_view kTrue = "\" string=\"true\">";
  constexpr std::string_view kFalse = "\" string=\"false\">";
  const size_t t = s.find(kTrue);
  const size_t f = s.find(kFalse);
  const bool use_true = t != std::string_view::npos && (f == std::string_view::npos || t < f);
  const size_t at = use_true ? t : f;
  const size_t header = use_true ? kTrue.size() : kFalse.size();
  if (at == std::string_view::npos || at + header > end) return false;
  *key = std::string(s.substr(0, at));
  *is_string = use_true;
  *value = std::string(s.substr(at + header, end - at - header));
  return true;
}

constexpr std::string_view kInvokeOpen = "<｜DSML｜invoke";
constexpr std::string_view kInvokeEnd = "</｜DSML｜invoke";
constexpr std::string_view kParamOpen = "<｜DSML｜parameter";
constexpr std::string_view kParamEnd = "/｜DSML｜parameter";
constexpr std::string_view kCallsClose = "</｜DSML｜tool_calls>";

Status FormatError(std::string_view what, std::string_view got) {
  return absl::InvalidArgumentError(absl::StrCat(std::string(what), ": '", std::string(got), "'"));
}

// parse_tool_calls: from just after "\n\n<｜DSML｜tool_calls".
Status ParseToolCalls(std::string_view text, size_t* index, std::string_view* stop, std::vector<ToolCall>* calls) {
  *stop = {};
  while (*index < text.size()) {
    ReadResult r = ReadUntil(text, *index, {kInvokeOpen, kCallsClose});
    *index = r.next;
    *stop = r.stop;
    if (r.before != ">\n") return FormatError("Tool call format error: expected '>\\n' but got", r.before);
    if (r.stop == kCallsClose) break;
    if (r.stop.empty()) return absl::InvalidArgumentError("Missing special token in tool calls");
    r = ReadUntil(text, *index, {kParamOpen, kInvokeEnd});
    *index = r.next;
    *stop = r.stop;
    ToolCall call;
    if (!MatchInvokeName(r.before, &call.name)) return FormatError("Tool name format error", r.before);
    std::vector<std::string> keys;
    std::vector<std::string> parts;
    while (*stop == kParamOpen) {
      r = ReadUntil(text, *index, {kParamEnd});
      *index = r.next;
      *stop = r.stop;
      std::string key, value;
      bool is_string = false;
      if (!MatchParameter(r.before, &key, &is_string, &value)) return FormatError("Parameter format error", r.before);
      if (std::find(keys.begin(), keys.end(), key) != keys.end()) {
        return FormatError("Duplicate parameter name", key);
      }
      keys.push_back(key);
      // string="true" values are JSON-encoded; string="false" ones are pasted as written (unvalidated, §4.2).
      parts.push_back(absl::StrCat(PythonJsonDumps(Json(key)), ": ", is_string ? PythonJsonDumps(Json(value)) : value));
      r = ReadUntil(text, *index, {kParamOpen, kInvokeEnd});
      *index = r.next;
      *stop = r.stop;
      if (r.before != ">\n") return FormatError("Parameter format error: expected '>\\n' but got", r.before);
    }
    call.arguments = absl::StrCat("{", absl::StrJoin(parts, ", "), "}");
    calls->push_back(std::move(call));
  }
  return absl::OkStatus();
}

}  // namespace

StatusOr<ParsedMessage> ParseCompletion(std::string_view text, ThinkingMode mode) {
  const std::string tc_start = Cat("\n\n<", kDsml, "tool_calls");
  ParsedMessage out;
  size_t index = 0;
  if (mode == ThinkingMode::kThinking) {
    const ReadResult r = ReadUntil(text, 0, {kEndThink, tc_start});
    out.reasoning_content = std::string(r.before);
    if (r.stop != kEndThink) return absl::InvalidArgumentError("Invalid thinking format: missing </think>");
    index = r.next;
  }
  ReadResult r = ReadUntil(text, index, {kEos, tc_start});
  out.content = std::string(r.before);
  index = r.next;
  std::string_view stop = r.stop;
  if (stop == tc_start) {
    RETURN_IF_ERROR(ParseToolCalls(text, &index, &stop, &out.tool_calls));
    r = ReadUntil(text, index, {kEos});
    if (!r.before.empty()) return absl::InvalidArgumentError("Unexpected content after tool calls");
    index = r.next;
    stop = r.stop;
  } else if (stop != kEos) {
    return absl::InvalidArgumentError("Invalid format: missing EOS token");
  }
  if (index != text.size() || (stop != kEos && !stop.empty())) {
    return absl::InvalidArgumentError("Unexpected content at end");
  }
  for (std::string_view special : {kBos, kEos, kThink, kEndThink, kDsml}) {
    if (out.content.find(special) != std::string::npos || out.reasoning_content.find(special) != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("Unexpected special token '", std::string(special), "' in content"));
    }
  }
  return out;
}

ParserStart StartStateForPrompt(std::string_view prompt) {
  return prompt.size() >= kThink.size() && prompt.substr(prompt.size() - kThink.size()) == kThink
             ? ParserStart::kReasoning
             : ParserStart::kContent;
}

}  // namespace numoe::chat
