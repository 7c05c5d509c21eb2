// DeepSeek V4 chat encoding tests. Every expected string is copied from the worked examples (E1-E14) and the
// fixed texts (tools block, effort prompts) of docs/dsv4-chat-encoding.md, which is the spec;
// where the doc elides a part ("…", SYS, Q1), the test fills it with its own input and the expected text is
// composed by hand from the doc's rules, never from the code's output.
#include "router/chat/chat_encoding.h"

#include <gtest/gtest.h>

#include "common/tokenizer/tokenizer.h"
#include "tests/support/chat_text.h"
#include "tests/support/status_matchers.h"

namespace numoe::chat {
namespace {

using test::A;
using test::B;
using test::E;
using test::ToolsBlock;
using test::U;

// §2.4, verbatim.
const std::string kEffortA =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough in your thinking and "
    "comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against "
    "all potential paths, edge cases, and adversarial scenarios.\nExplicitly write out your entire deliberation "
    "process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure "
    "absolutely no assumption is left unchecked.\n\n";
const std::string kEffortB =
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\nYou MUST reason with the utmost "
    "depth and rigor, leaving absolutely nothing to chance: exhaustively decompose the problem into its most "
    "fundamental components, trace every causal chain to its root, and resolve the underlying cause rather than any "
    "surface symptom.\nDo not stop reasoning until you have independently verified the solution from multiple angles "
    "and are certain that no assumption remains unchecked and no error remains undiscovered.\n\n";

EncodeOptions Thinking() { return EncodeOptions{}; }
EncodeOptions Chat() {
  EncodeOptions o;
  o.thinking_mode = ThinkingMode::kChat;
  return o;
}

std::string MustEncode(const Json& messages, const EncodeOptions& o) {
  auto s = EncodeMessages(messages, o);
  EXPECT_OK(s);
  return s.ok() ? *s : std::string();
}

// The tools of E2: a weather tool and a search tool, OpenAI format. Their schemas as Python's json.dumps writes
// them are spelled out by hand below.
Json E2Tools() {
  return Json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather",
      "parameters": {"type": "object", "properties": {"location": {"type": "string"},
                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web",
      "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}])");
}
const std::string kE2Schemas =
    R"({"name": "get_weather", "description": "Get the current weather", "parameters": {"type": "object", "properties": {"location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}})"
    "\n"
    R"({"name": "search", "description": "Search the web", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}})";

Json E2Messages() {
  Json m = Json::parse(R"([
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Beijing?"},
    {"role": "assistant", "content": "",
     "reasoning_content": "The user wants to know the weather in Beijing. I should use the get_weather tool.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather",
                     "arguments": "{\"location\": \"Beijing\", \"unit\": \"celsius\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1",
     "content": "{\"temperature\": 22, \"condition\": \"sunny\", \"humidity\": 45}"},
    {"role": "assistant", "reasoning_content": "Got the weather data. Let me format a nice response.",
     "content": "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity."}])");
  m[0]["tools"] = E2Tools();  // the official test attaches the tools to messages[0]
  return m;
}

const std::string kE2FirstAssistant =
    "The user wants to know the weather in Beijing. I should use the get_weather tool.</think>\n\n<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"location\" string=\"true\">Beijing</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"unit\" string=\"true\">celsius</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>" +
    E;

TEST(ChatEncoding, E1ThinkingNoToolsDropsEarlierReasoning) {
  const Json messages = Json::parse(R"([
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "reasoning_content": "The user said hello, I should greet back.",
     "content": "Hi there! How can I help you?"},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "reasoning_content": "The user asks about the capital of France. It is Paris.",
     "content": "The capital of France is Paris."}])");
  EXPECT_EQ(MustEncode(messages, Thinking()),
            "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>Hi there! How can I "
            "help you?<｜end▁of▁sentence｜><｜User｜>What is the capital of France?<｜Assistant｜><think>The user asks about "
            "the capital of France. It is Paris.</think>The capital of France is Paris.<｜end▁of▁sentence｜>");
}

TEST(ChatEncoding, E2ThinkingWithToolsKeepsEveryTurnsReasoning) {
  const std::string prompt = MustEncode(E2Messages(), Thinking());
  const std::string expected =
      B + "You are a helpful assistant.\n\n" + ToolsBlock(kE2Schemas) + U + "What's the weather in Beijing?" + A +
      "<think>" + kE2FirstAssistant + U +
      "<tool_result>{\"temperature\": 22, \"condition\": \"sunny\", \"humidity\": 45}</tool_result>" + A +
      "<think>Got the weather data. Let me format a nice response.</think>The weather in Beijing is currently sunny "
      "with a temperature of 22°C and 45% humidity." +
      E;
  EXPECT_EQ(prompt, expected);

  // The official assertions on parsing the assistant spans back.
  const std::string marker = A + "<think>";
  const size_t first = prompt.find(marker) + marker.size();
  const size_t first_end = prompt.find(U, first);
  auto parsed = ParseCompletion(std::string_view(prompt).substr(first, first_end - first), ThinkingMode::kThinking);
  ASSERT_OK(parsed);
  EXPECT_EQ(parsed->reasoning_content, "The user wants to know the weather in Beijing. I should use the get_weather tool.");
  EXPECT_EQ(parsed->content, "");
  ASSERT_EQ(parsed->tool_calls.size(), 1u);
  EXPECT_EQ(parsed->tool_calls[0].name, "get_weather");
  EXPECT_EQ(Json::parse(parsed->tool_calls[0].arguments), Json::parse(R"({"location":"Beijing","unit":"celsius"})"));
  EXPECT_EQ(parsed->tool_calls[0].arguments, R"({"location": "Beijing", "unit": "celsius"})");

  auto last = ParseCompletion(std::string_view(prompt).substr(prompt.rfind(marker) + marker.size()),
                              ThinkingMode::kThinking);
  ASSERT_OK(last);
  EXPECT_EQ(last->reasoning_content, "Got the weather data. Let me format a nice response.");
  EXPECT_NE(last->content.find("22°C"), std::string::npos);
  EXPECT_TRUE(last->tool_calls.empty());
}

TEST(ChatEncoding, E3ChatModeActionTask) {
  const Json messages = Json::parse(R"([
    {"role": "system", "content": "你是一个助手。"},
    {"role": "latest_reminder", "content": "2024-11-15,上海市,App,中文"},
    {"role": "user", "content": "今天天气怎么样"},
    {"role": "assistant", "content": "今天上海晴。"},
    {"role": "user", "content": "世界著名温泉有哪些", "task": "action"},
    {"role": "assistant", "content": "Search"}])");
  EXPECT_EQ(MustEncode(messages, Chat()), B + "你是一个助手。" + "<｜latest_reminder｜>2024-11-15,上海市,App,中文" + U +
                                              "今天天气怎么样" + A + "</think>" + "今天上海晴。" + E + U +
                                              "世界著名温泉有哪些" + A + "</think><｜action｜>Search" + E);
  // Thinking mode: the action transition uses <think>, and the answer to a task gets no reasoning part.
  const std::string thinking = MustEncode(messages, Thinking());
  EXPECT_NE(thinking.find(U + "世界著名温泉有哪些" + A + "<think><｜action｜>Search" + E), std::string::npos) << thinking;
}

TEST(ChatEncoding, E4DeveloperWithToolsAfterSystemAndReminder) {
  Json messages = Json::parse(R"([
    {"role": "system", "content": "SYS"},
    {"role": "latest_reminder", "content": "2025-01-01,北京市"},
    {"role": "developer", "content": "搜索并回答：头痛怎么办"},
    {"role": "assistant", "reasoning_content": "需要搜索。",
     "tool_calls": [{"id": "s1", "type": "function", "function": {"name": "search", "arguments": "{\"query\": \"头痛\"}"}}]},
    {"role": "tool", "tool_call_id": "s1", "content": "[0]"},
    {"role": "assistant", "reasoning_content": "现在开始组织回答。", "content": "请及时就医。"}])");
  messages[2]["tools"] = Json::array({E2Tools()[1]});
  const std::string search_schema =
      R"({"name": "search", "description": "Search the web", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}})";
  EXPECT_EQ(MustEncode(messages, Thinking()),
            B + "SYS" + "<｜latest_reminder｜>2025-01-01,北京市" + U + "搜索并回答：头痛怎么办" + "\n\n" +
                ToolsBlock(search_schema) + A +
                "<think>需要搜索。</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"search\">\n"
                "<｜DSML｜parameter name=\"query\" string=\"true\">头痛</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
                "</｜DSML｜tool_calls>" +
                E + U + "<tool_result>[0]</tool_result>" + A + "<think>现在开始组织回答。</think>请及时就医。" + E);
}

TEST(ChatEncoding, E5SingleUser) {
  const Json messages = Json::parse(R"([{"role": "user", "content": "Hi"}])");
  EXPECT_EQ(MustEncode(messages, Chat()), "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>");
  EXPECT_EQ(MustEncode(messages, Thinking()), "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>");
}

TEST(ChatEncoding, E6ReasoningEffort) {
  const Json messages = Json::parse(R"([{"role": "user", "content": "Hi"}])");
  const std::string tail = "<｜User｜>Hi<｜Assistant｜><think>";
  const auto with = [&](EncoderProfile p, std::optional<std::string> effort, ThinkingMode mode) {
    EncodeOptions o;
    o.profile = p;
    o.reasoning_effort = std::move(effort);
    o.thinking_mode = mode;
    return MustEncode(messages, o);
  };
  const auto kPreview = EncoderProfile::kPreview;
  const auto k0731 = EncoderProfile::kFlash0731;
  EXPECT_EQ(with(kPreview, "max", ThinkingMode::kThinking), B + kEffortA + tail);
  EXPECT_EQ(with(k0731, "high", ThinkingMode::kThinking), B + kEffortA + tail);
  EXPECT_EQ(with(k0731, "max", ThinkingMode::kThinking), B + kEffortB + tail);
  EXPECT_EQ(with(kPreview, "high", ThinkingMode::kThinking), B + tail);
  EXPECT_EQ(with(kPreview, std::nullopt, ThinkingMode::kThinking), B + tail);
  EXPECT_EQ(with(k0731, "low", ThinkingMode::kThinking), B + tail);
  EXPECT_EQ(with(k0731, std::nullopt, ThinkingMode::kThinking), B + tail);
  EXPECT_EQ(with(kPreview, "max", ThinkingMode::kChat), "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>");
  EXPECT_EQ(with(k0731, "max", ThinkingMode::kChat), "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>");
  // The effort text goes right after BOS, before the system text.
  const Json with_system = Json::parse(R"([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}])");
  EncodeOptions o;
  o.reasoning_effort = "max";
  EXPECT_EQ(MustEncode(with_system, o), B + kEffortA + "S" + tail);
  // Values outside the checkpoint's table are rejected.
  o.reasoning_effort = "low";
  EXPECT_EQ(EncodeMessages(messages, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.profile = k0731;
  o.reasoning_effort = "medium";
  EXPECT_EQ(EncodeMessages(messages, o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ChatEncoding, E7RequestToolsWithoutSystem) {
  Json messages = Json::parse(R"([{"role": "user", "content": "Weather in Paris?"}])");
  const Json tools = Json::parse(R"([{"type": "function", "function": {"name": "get_weather",
      "description": "Get weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"},
      "days": {"type": "integer"}}, "required": ["city"]}}}])");
  ASSERT_OK(AttachRequestTools(&messages, tools));
  const std::string schema =
      R"({"name": "get_weather", "description": "Get weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}})";
  const std::string prompt = MustEncode(messages, Thinking());
  EXPECT_EQ(prompt, "<｜begin▁of▁sentence｜>\n\n" + ToolsBlock(schema) + "<｜User｜>Weather in Paris?<｜Assistant｜><think>");
  // The doc's own rendering of E7's start and end.
  EXPECT_EQ(prompt.rfind("<｜begin▁of▁sentence｜>\n\n## Tools\n\nYou have access", 0), 0u);
  const std::string end =
      "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
      "<｜User｜>Weather in Paris?<｜Assistant｜><think>";
  EXPECT_EQ(prompt.substr(prompt.size() - end.size()), end);

  // With a system message first, the request tools go onto it.
  Json with_system = Json::parse(R"([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}])");
  ASSERT_OK(AttachRequestTools(&with_system, tools));
  EXPECT_EQ(with_system.size(), 2u);
  EXPECT_EQ(with_system[0]["tools"], tools);
  Json untouched = Json::parse(R"([{"role": "user", "content": "Q"}])");
  ASSERT_OK(AttachRequestTools(&untouched, Json::array()));
  EXPECT_EQ(untouched.size(), 1u);
}

Json E8Messages() {
  Json m = Json::parse(R"([
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Paris and Rome, 3 days"},
    {"role": "assistant", "reasoning_content": "Two calls.", "tool_calls": [
      {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 3}"}},
      {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\", \"days\": 3}"}}]},
    {"role": "tool", "tool_call_id": "c2", "content": "Rome: sun"},
    {"role": "tool", "tool_call_id": "c1", "content": "Paris: rain"}])");
  m[0]["tools"] = E2Tools();
  return m;
}

const std::string kE8Calls =
    "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" "
    "string=\"true\">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" "
    "string=\"true\">Rome</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>";

TEST(ChatEncoding, E8ParallelCallsResultsSortedByCallOrder) {
  const std::string head = B + "S\n\n" + ToolsBlock(kE2Schemas);
  EXPECT_EQ(MustEncode(E8Messages(), Thinking()),
            head + "<｜User｜>Paris and Rome, 3 days<｜Assistant｜><think>Two calls.</think>" + kE8Calls +
                "<｜end▁of▁sentence｜><｜User｜><tool_result>Paris: rain</tool_result>\n\n<tool_result>Rome: "
                "sun</tool_result><｜Assistant｜><think>");
  EXPECT_EQ(MustEncode(E8Messages(), Chat()),
            head + "<｜User｜>Paris and Rome, 3 days<｜Assistant｜></think>" + kE8Calls +
                "<｜end▁of▁sentence｜><｜User｜><tool_result>Paris: rain</tool_result>\n\n<tool_result>Rome: "
                "sun</tool_result><｜Assistant｜></think>");
}

TEST(ChatEncoding, E9ToolResultMergedWithFollowingUser) {
  Json messages = Json::parse(R"([
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Q"},
    {"role": "assistant", "tool_calls": [{"id": "w", "type": "function",
                                          "function": {"name": "get_weather", "arguments": "{\"location\": \"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "w", "content": "cold"},
    {"role": "user", "content": "thanks, and tomorrow?"}])");
  messages[0]["tools"] = E2Tools();
  EXPECT_EQ(MustEncode(messages, Thinking()),
            B + "S\n\n" + ToolsBlock(kE2Schemas) +
                "<｜User｜>Q<｜Assistant｜><think></think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                "<｜DSML｜parameter name=\"location\" string=\"true\">Oslo</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
                "</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>cold</tool_result>\n\nthanks, and "
                "tomorrow?<｜Assistant｜><think>");
}

TEST(ChatEncoding, E10HistoryReasoningDroppedUnlessTools) {
  Json messages = Json::parse(R"([
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Q1"},
    {"role": "assistant", "reasoning_content": "R1", "content": "A1"},
    {"role": "user", "content": "Q2"}])");
  EXPECT_EQ(MustEncode(messages, Chat()),
            "<｜begin▁of▁sentence｜>S<｜User｜>Q1<｜Assistant｜></think>A1<｜end▁of▁sentence｜><｜User｜>Q2<｜Assistant｜></think>");
  EXPECT_EQ(MustEncode(messages, Thinking()),
            "<｜begin▁of▁sentence｜>S<｜User｜>Q1<｜Assistant｜></think>A1<｜end▁of▁sentence｜><｜User｜>Q2<｜Assistant｜><think>");
  messages[0]["tools"] = E2Tools();
  EXPECT_EQ(MustEncode(messages, Thinking()),
            B + "S\n\n" + ToolsBlock(kE2Schemas) +
                "<｜User｜>Q1<｜Assistant｜><think>R1</think>A1<｜end▁of▁sentence｜><｜User｜>Q2<｜Assistant｜><think>");
  // "reasoning" (vLLM's name) is accepted as well as "reasoning_content".
  messages[2].erase("reasoning_content");
  messages[2]["reasoning"] = "R1";
  EXPECT_NE(MustEncode(messages, Thinking()).find("<think>R1</think>A1"), std::string::npos);
  // drop_thinking=false keeps history reasoning without tools too.
  messages[0].erase("tools");
  EncodeOptions keep;
  keep.drop_thinking = false;
  EXPECT_EQ(MustEncode(messages, keep),
            "<｜begin▁of▁sentence｜>S<｜User｜>Q1<｜Assistant｜><think>R1</think>A1<｜end▁of▁sentence｜><｜User｜>Q2<｜Assistant｜><think>");
}

TEST(ChatEncoding, E11PrefixCompletionAndConsecutiveUsers) {
  EXPECT_EQ(MustEncode(Json::parse(R"([{"role": "user", "content": "Write quicksort"},
                                       {"role": "assistant", "content": "def quicksort(", "wo_eos": true}])"),
                       Chat()),
            "<｜begin▁of▁sentence｜><｜User｜>Write quicksort<｜Assistant｜></think>def quicksort(");
  EXPECT_EQ(MustEncode(Json::parse(R"([{"role": "user", "content": "A"}, {"role": "user", "content": "B"}])"), Chat()),
            "<｜begin▁of▁sentence｜><｜User｜>A\n\nB<｜Assistant｜></think>");
}

TEST(ChatEncoding, E14HistoryArgumentEncodings) {
  const auto render = [](const std::string& arguments) {
    Json m = Json::parse(R"([{"role": "user", "content": "Q"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": ""}}]}])");
    m[1]["tool_calls"][0]["function"]["arguments"] = arguments;
    return MustEncode(m, Chat());
  };
  const std::string head = B + U + "Q" + A + "</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n";
  const std::string tail = "\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + E;
  EXPECT_EQ(render("{}"), head + tail);
  EXPECT_EQ(render(""), head + "<｜DSML｜parameter name=\"arguments\" string=\"true\"></｜DSML｜parameter>" + tail);
  EXPECT_EQ(render("not json"),
            head + "<｜DSML｜parameter name=\"arguments\" string=\"true\">not json</｜DSML｜parameter>" + tail);
  EXPECT_EQ(render("{\"q\": [1, 2], \"flag\": true}"),
            head + "<｜DSML｜parameter name=\"q\" string=\"false\">[1, 2]</｜DSML｜parameter>\n"
                   "<｜DSML｜parameter name=\"flag\" string=\"false\">true</｜DSML｜parameter>" + tail);
  // Strings are raw text (no escaping of <, ", &); other values are Python json.dumps (§2.5).
  EXPECT_EQ(render(R"({"s": "a<b \"c\" & d", "x": 1e2, "o": {"k": "é"}})"),
            head + "<｜DSML｜parameter name=\"s\" string=\"true\">a<b \"c\" & d</｜DSML｜parameter>\n"
                   "<｜DSML｜parameter name=\"x\" string=\"false\">100.0</｜DSML｜parameter>\n"
                   "<｜DSML｜parameter name=\"o\" string=\"false\">{\"k\": \"é\"}</｜DSML｜parameter>" + tail);
  // A JSON non-object raises in the official encoder: an error here.
  Json m = Json::parse(R"([{"role": "user", "content": "Q"}, {"role": "assistant", "tool_calls": [
      {"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}])");
  EXPECT_EQ(EncodeMessages(m, Chat()).status().code(), absl::StatusCode::kInvalidArgument);
  // An already-parsed object is used as the arguments rather than nested under "arguments" (§2.5 bug magnet).
  m[1]["tool_calls"][0]["function"]["arguments"] = Json::parse(R"({"q": "x"})");
  EXPECT_EQ(MustEncode(m, Chat()), head + "<｜DSML｜parameter name=\"q\" string=\"true\">x</｜DSML｜parameter>" + tail);
}

TEST(ChatEncoding, MessageErrorsNameTheField) {
  const auto error = [](const char* json) { return EncodeMessages(Json::parse(json), EncodeOptions{}).status(); };
  const auto expect = [](const Status& s, const std::string& needle) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(needle), std::string::npos) << s;
  };
  expect(error(R"({"role": "user"})"), "messages");
  expect(error(R"([{"content": "x"}])"), "messages[0].role");
  expect(error(R"([{"role": "wizard", "content": "x"}])"), "unknown role 'wizard'");
  expect(error(R"([{"role": "user", "content": 5}])"), "messages[0].content");
  expect(error(R"([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])"), "image_url");
  expect(error(R"([{"role": "user", "content": "x", "task": "dance"}])"), "messages[0].task");
  expect(error(R"([{"role": "developer", "content": ""}])"), "developer");
  expect(error(R"([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}])"),
         "messages[1].tool_calls[0].function.name");
  expect(error(R"([{"role": "system", "content": "x", "tools": [{"type": "function"}]}])"), "messages[0].tools[0]");
  // Content parts are joined with "\n" (server policy, §3); null content is "".
  EXPECT_EQ(MustEncode(Json::parse(R"([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]}])"), Chat()),
            B + U + "a\nb" + A + "</think>");
  EXPECT_EQ(MustEncode(Json::parse(R"([{"role": "user", "content": null}])"), Chat()), B + U + A + "</think>");
}

TEST(ChatEncoding, ResponseFormatAndToolResultParts) {
  const Json m = Json::parse(R"([
    {"role": "system", "content": "S", "response_format": {"type": "json_object"}},
    {"role": "user", "content": "Q"}, {"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
      "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "one"}, {"type": "image"},
                                                       {"type": "text", "text": "two"}]}])");
  EXPECT_EQ(MustEncode(m, Chat()),
            B + "S\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
                "{\"type\": \"json_object\"}" + U + "Q" + A + "</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n\n"
                "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + E + U +
                "<tool_result>one\n\n[Unsupported image]\n\ntwo</tool_result>" + A + "</think>");
}

TEST(ChatEncoding, PromptTokenizesWithSpecialTokens) {
  auto tok = tokenizer::Tokenizer::Load(std::string(NUMOE_TEST_DATA) + "/tiny-v4");
  ASSERT_OK(tok);
  const std::string prompt = MustEncode(Json::parse(R"([{"role": "user", "content": "Hi"}])"), Thinking());
  auto ids = (*tok)->Encode(prompt);
  ASSERT_OK(ids);
  const auto& s = (*tok)->special_ids();
  EXPECT_EQ(ids->front(), s.bos);
  EXPECT_EQ((*ids)[1], s.user);
  EXPECT_EQ((*ids)[ids->size() - 2], s.assistant);
  EXPECT_EQ(ids->back(), s.think);
  EXPECT_EQ((*tok)->Decode(*ids), prompt);
}

TEST(ChatEncoding, EffortMappingAndProfileDetection) {
  using P = EncoderProfile;
  EXPECT_EQ(*MapReasoningEffort(std::nullopt, P::kFlash0731), std::optional<std::string>("high"));
  EXPECT_EQ(*MapReasoningEffort("minimal", P::kFlash0731), std::optional<std::string>("low"));
  EXPECT_EQ(*MapReasoningEffort("medium", P::kFlash0731), std::optional<std::string>("high"));
  EXPECT_EQ(*MapReasoningEffort("xhigh", P::kFlash0731), std::optional<std::string>("high"));
  EXPECT_EQ(*MapReasoningEffort("ultra", P::kFlash0731), std::optional<std::string>("max"));
  EXPECT_EQ(*MapReasoningEffort("high", P::kPreview), std::nullopt);
  EXPECT_EQ(*MapReasoningEffort("low", P::kPreview), std::nullopt);
  EXPECT_EQ(*MapReasoningEffort("max", P::kPreview), std::optional<std::string>("max"));
  EXPECT_FALSE(MapReasoningEffort("turbo", P::kPreview).ok());
  EXPECT_EQ(DetectEncoderProfile("REASONING_EFFORT_MAX = (\n"), P::kPreview);
  EXPECT_EQ(DetectEncoderProfile("DEFAULT_REASONING_EFFORT = \"low\"\nREASONING_EFFORT_PROMPTS = {"), P::kFlash0731);
  EXPECT_EQ(DetectEncoderProfile(""), P::kPreview);
}

TEST(PythonJson, MatchesJsonDumps) {
  EXPECT_EQ(PythonFloatRepr(1e2), "100.0");
  EXPECT_EQ(PythonFloatRepr(1e16), "1e+16");
  EXPECT_EQ(PythonFloatRepr(1e15), "1000000000000000.0");
  EXPECT_EQ(PythonFloatRepr(0.0001), "0.0001");
  EXPECT_EQ(PythonFloatRepr(1e-05), "1e-05");
  EXPECT_EQ(PythonFloatRepr(-2.5), "-2.5");
  EXPECT_EQ(PythonFloatRepr(0.1), "0.1");
  EXPECT_EQ(PythonFloatRepr(1.5e300), "1.5e+300");
  EXPECT_EQ(PythonFloatRepr(-0.0), "-0.0");
  EXPECT_EQ(PythonJsonDumps(Json::parse(R"({"b": [1, 2.0, true, null], "a": "x\"\\\n\u0001é\t", "e": {}, "l": []})")),
            R"({"b": [1, 2.0, true, null], "a": "x\"\\\n\u0001é\t", "e": {}, "l": []})");
}

// ---- Output parsing ------------------------------------------------------------------------------------

TEST(ParseCompletion, E12ThinkingMode) {
  auto a = ParseCompletion("Simple arithmetic.</think>2 + 2 = 4.<｜end▁of▁sentence｜>", ThinkingMode::kThinking);
  ASSERT_OK(a);
  EXPECT_EQ(a->reasoning_content, "Simple arithmetic.");
  EXPECT_EQ(a->content, "2 + 2 = 4.");
  EXPECT_TRUE(a->tool_calls.empty());
  auto b = ParseCompletion("</think>\n\nAnswer<｜end▁of▁sentence｜>", ThinkingMode::kThinking);
  ASSERT_OK(b);
  EXPECT_EQ(b->reasoning_content, "");
  EXPECT_EQ(b->content, "\n\nAnswer");
  auto c = ParseCompletion("Need weather.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                           "<｜DSML｜parameter name=\"location\" string=\"true\">Oslo</｜DSML｜parameter>\n"
                           "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>",
                           ThinkingMode::kThinking);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("missing </think>"), std::string::npos) << c.status();
}

const std::string kE13 =
    "Let me check.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"q\" "
    "string=\"false\">[1, 2]</｜DSML｜parameter>\n<｜DSML｜parameter name=\"s\" string=\"true\">say \"hi\"\nok</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n<｜DSML｜invoke name=\"g\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>";
const std::string kE13ArgsF = "{\"q\": [1, 2], \"s\": \"say \\\"hi\\\"\\nok\"}";

TEST(ParseCompletion, E13ChatModeCallsAndErrors) {
  auto p = ParseCompletion(kE13, ThinkingMode::kChat);
  ASSERT_OK(p);
  EXPECT_EQ(p->content, "Let me check.");
  ASSERT_EQ(p->tool_calls.size(), 2u);
  EXPECT_EQ(p->tool_calls[0].name, "f");
  EXPECT_EQ(p->tool_calls[0].arguments, kE13ArgsF);
  EXPECT_EQ(p->tool_calls[1].name, "g");
  EXPECT_EQ(p->tool_calls[1].arguments, "{}");

  const auto error = [](const std::string& text) { return ParseCompletion(text, ThinkingMode::kChat).status(); };
  EXPECT_NE(error("text <｜DSML｜tool_calls>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>").message().find("Unexpected special token"),
            std::string::npos);
  std::string after = kE13;
  after.insert(after.size() - E.size(), "more");
  EXPECT_NE(error(after).message().find("Unexpected content after tool calls"), std::string::npos);
  EXPECT_NE(error("no end").message().find("missing EOS token"), std::string::npos);
  EXPECT_NE(error("</think>x" + E).message().find("Unexpected special token"), std::string::npos);
  std::string dup = kE13;
  dup.replace(dup.find("name=\"s\""), 8, "name=\"q\"");
  EXPECT_NE(error(dup).message().find("Duplicate parameter name"), std::string::npos);
}

TEST(ParseCompletion, RoundTripsEveryRenderedAssistantSpan) {
  // parse(render(assistant)) for the assistant turns of E2 and E8 (thinking, reasoning kept because of tools).
  for (const Json& messages : {E2Messages(), E8Messages()}) {
    const std::string prompt = MustEncode(messages, Thinking());
    const std::string marker = A + "<think>";
    size_t at = 0;
    size_t assistant = 0;
    while ((at = prompt.find(marker, at)) != std::string::npos) {
      at += marker.size();
      const size_t end = prompt.find(E, at);
      if (end == std::string::npos) break;
      auto parsed = ParseCompletion(std::string_view(prompt).substr(at, end + E.size() - at), ThinkingMode::kThinking);
      ASSERT_OK(parsed);
      while (messages[assistant]["role"] != "assistant") ++assistant;
      const Json& m = messages[assistant++];
      EXPECT_EQ(parsed->reasoning_content, m.value("reasoning_content", ""));
      EXPECT_EQ(parsed->content, m.value("content", ""));
      const size_t ncalls = m.contains("tool_calls") ? m["tool_calls"].size() : 0;
      ASSERT_EQ(parsed->tool_calls.size(), ncalls);
      for (size_t k = 0; k < ncalls; ++k) {
        EXPECT_EQ(parsed->tool_calls[k].name, m["tool_calls"][k]["function"]["name"]);
        EXPECT_EQ(parsed->tool_calls[k].arguments, m["tool_calls"][k]["function"]["arguments"]);
      }
    }
  }
}

// Feeds `chunks` and returns the concatenated deltas (checked against message()).
ParsedMessage Stream(const std::vector<std::string>& chunks, ParserStart start, bool tools) {
  StreamingParserOptions o;
  o.tools_enabled = tools;
  o.make_call_id = [](int i) { return "call_" + std::to_string(i); };
  StreamingOutputParser parser(start, o);
  ParsedMessage got;
  std::vector<std::string> ids;
  const auto take = [&](const OutputDelta& d) {
    got.reasoning_content += d.reasoning_content;
    got.content += d.content;
    for (const ToolCallDelta& t : d.tool_calls) {
      if (t.index >= static_cast<int>(got.tool_calls.size())) got.tool_calls.resize(t.index + 1);
      ToolCall& c = got.tool_calls[t.index];
      if (!t.id.empty()) c.id = t.id;
      if (!t.name.empty()) c.name = t.name;
      c.arguments += t.arguments;
    }
  };
  for (const std::string& c : chunks) take(parser.Feed(c));
  take(parser.Finish());
  EXPECT_EQ(got.reasoning_content, parser.message().reasoning_content);
  EXPECT_EQ(got.content, parser.message().content);
  return got;
}

void ExpectSameMessage(const ParsedMessage& got, const ParsedMessage& want, const std::string& what) {
  EXPECT_EQ(got.reasoning_content, want.reasoning_content) << what;
  EXPECT_EQ(got.content, want.content) << what;
  ASSERT_EQ(got.tool_calls.size(), want.tool_calls.size()) << what;
  for (size_t i = 0; i < want.tool_calls.size(); ++i) {
    EXPECT_EQ(got.tool_calls[i].name, want.tool_calls[i].name) << what;
    EXPECT_EQ(got.tool_calls[i].arguments, want.tool_calls[i].arguments) << what;
    EXPECT_EQ(got.tool_calls[i].id, "call_" + std::to_string(i)) << what;
  }
}

// §7: streaming with every split point (and byte by byte) gives the official parse, and no marker byte ever
// reaches reasoning or content.
TEST(StreamingOutputParser, EverySplitOfE2AndE13MatchesTheOfficialParse) {
  struct Case {
    std::string text;
    ParserStart start;
    ThinkingMode mode;
  };
  for (const Case& c : {Case{kE2FirstAssistant, ParserStart::kReasoning, ThinkingMode::kThinking},
                        Case{kE13, ParserStart::kContent, ThinkingMode::kChat}}) {
    auto want = ParseCompletion(c.text, c.mode);
    ASSERT_OK(want);
    for (size_t k = 0; k <= c.text.size(); ++k) {
      ExpectSameMessage(Stream({c.text.substr(0, k), c.text.substr(k)}, c.start, true), *want,
                        "split at " + std::to_string(k));
      if (HasFailure()) return;
    }
    std::vector<std::string> bytes;
    for (const char ch : c.text) bytes.emplace_back(1, ch);
    ExpectSameMessage(Stream(bytes, c.start, true), *want, "byte by byte");
    ExpectSameMessage(Stream(bytes, c.start, false), *want, "byte by byte, tools not offered");
  }
}

TEST(StreamingOutputParser, E12TextAndRecoveries) {
  ParsedMessage m = Stream({"Simple arith", "metic.</thi", "nk>2 + 2 = 4.", E}, ParserStart::kReasoning, false);
  EXPECT_EQ(m.reasoning_content, "Simple arithmetic.");
  EXPECT_EQ(m.content, "2 + 2 = 4.");
  m = Stream({"</think>\n\nAnswer"}, ParserStart::kReasoning, false);
  EXPECT_EQ(m.content, "\n\nAnswer");
  // §4.4.1: a tool block while still reasoning (no </think>) ends the reasoning when the request had tools.
  const std::string no_end_think =
      "Need weather.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"location\" "
      "string=\"true\">Oslo</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
  m = Stream({no_end_think}, ParserStart::kReasoning, true);
  EXPECT_EQ(m.reasoning_content, "Need weather.");
  ASSERT_EQ(m.tool_calls.size(), 1u);
  EXPECT_EQ(m.tool_calls[0].arguments, "{\"location\": \"Oslo\"}");
  // §4.4.7: EOS without </think>: everything is reasoning.
  m = Stream({"still thinking", E}, ParserStart::kReasoning, false);
  EXPECT_EQ(m.reasoning_content, "still thinking");
  EXPECT_EQ(m.content, "");
}

TEST(StreamingOutputParser, RobustnessRules) {
  // Held text that turns out not to be a marker is flushed at the end ("2 <").
  ParsedMessage m = Stream({"2 <"}, ParserStart::kContent, true);
  EXPECT_EQ(m.content, "2 <");
  // §4.4.2 no "\n\n" before the block; §4.4.3 bare invoke without the wrapper.
  m = Stream({"Checking <｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"},
             ParserStart::kContent, true);
  EXPECT_EQ(m.content, "Checking");
  ASSERT_EQ(m.tool_calls.size(), 1u);
  EXPECT_EQ(m.tool_calls[0].arguments, "{}");
  m = Stream({"X\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"n\" string=\"false\">7</｜DSML｜parameter>\n"
              "</｜DSML｜invoke>"},
             ParserStart::kContent, true);
  EXPECT_EQ(m.content, "X");
  ASSERT_EQ(m.tool_calls.size(), 1u);
  EXPECT_EQ(m.tool_calls[0].arguments, "{\"n\": 7}");
  // §4.4.4 a string="false" value that is not JSON becomes a JSON string.
  m = Stream({"<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"n\" string=\"false\">not json"
              "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"},
             ParserStart::kContent, true);
  ASSERT_EQ(m.tool_calls.size(), 1u);
  EXPECT_EQ(m.tool_calls[0].arguments, "{\"n\": \"not json\"}");
  // §4.4.5 text after the block returns to content; §4.4.8 stray BOS is stripped.
  m = Stream({"<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>\n\nDone<｜begin▁of▁sentence｜>."}, ParserStart::kContent, true);
  EXPECT_EQ(m.content, "Done.");
  // §4.4.6 cut off inside a call: the partial call is not in the message, and no DSML leaks into content.
  StreamingOutputParser cut(ParserStart::kContent, {true, nullptr});
  cut.Feed("Sure.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"q\" string=\"true\">par");
  cut.Finish();
  EXPECT_EQ(cut.message().content, "Sure.");
  EXPECT_TRUE(cut.message().tool_calls.empty());
  EXPECT_EQ(cut.FinishReason(/*hit_length=*/true), "length");
  StreamingOutputParser partial_tag(ParserStart::kContent, {true, nullptr});
  partial_tag.Feed("Answer\n\n<｜DSML｜tool_c");
  partial_tag.Finish();
  EXPECT_EQ(partial_tag.message().content, "Answer");
  // Minted ids look like OpenAI's; finish_reason reports the calls.
  StreamingOutputParser ids(ParserStart::kContent);
  ids.Feed(kE13);
  ids.Finish();
  ASSERT_EQ(ids.message().tool_calls.size(), 2u);
  EXPECT_EQ(ids.message().tool_calls[0].id.rfind("call_", 0), 0u);
  EXPECT_EQ(ids.message().tool_calls[0].id.size(), 29u);
  EXPECT_NE(ids.message().tool_calls[0].id, ids.message().tool_calls[1].id);
  EXPECT_EQ(ids.FinishReason(false), "tool_calls");
}

TEST(StreamingOutputParser, StringArgumentsStreamAsTheyArrive) {
  StreamingOutputParser p(ParserStart::kContent, {true, [](int) { return std::string("id0"); }});
  OutputDelta d = p.Feed("<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"write\">\n<｜DSML｜parameter name=\"text\" string=\"true\">Hello \"wor");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_EQ(d.tool_calls[0].id, "id0");
  EXPECT_EQ(d.tool_calls[0].name, "write");
  EXPECT_EQ(d.tool_calls[0].arguments, "{\"text\": \"Hello \\\"wor");
  d = p.Feed("ld\"</｜DSML｜parame");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_EQ(d.tool_calls[0].arguments, "ld\\\"");
  d = p.Feed("ter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_EQ(d.tool_calls[0].arguments, "\"}");
  EXPECT_EQ(p.message().tool_calls[0].arguments, "{\"text\": \"Hello \\\"world\\\"\"}");
  EXPECT_TRUE(p.Finish().empty());
  EXPECT_EQ(StartStateForPrompt("<｜User｜>Hi<｜Assistant｜><think>"), ParserStart::kReasoning);
  EXPECT_EQ(StartStateForPrompt("<｜User｜>Hi<｜Assistant｜></think>"), ParserStart::kContent);
  EXPECT_EQ(StartStateForPrompt("<｜Assistant｜></think><｜action｜>"), ParserStart::kContent);
}

}  // namespace
}  // namespace numoe::chat
