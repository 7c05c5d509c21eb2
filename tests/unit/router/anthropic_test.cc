// The Anthropic Messages API's request mapping onto the chat path (router/anthropic/messages.h), checked
// through the one chat encoder: the expected prompts are composed by hand from docs/dsv4-chat-encoding.md's
// rules (§2) and fixed texts, never from the code's output. Also the error shapes and the stream's event
// sequence built from the output parser's deltas.
#include "router/anthropic/messages.h"

#include <gtest/gtest.h>

#include "router/core/errors.h"
#include "tests/support/chat_text.h"
#include "tests/support/status_matchers.h"

namespace numoe::router::anthropic {
namespace {

using numoe::test::A;
using numoe::test::B;
using numoe::test::E;
using numoe::test::ToolsBlock;
using numoe::test::U;

class MessagesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto t = tokenizer::Tokenizer::Load(std::string(NUMOE_TEST_DATA) + "/tiny-v4");
    ASSERT_OK(t);
    tok_ = std::move(*t);
    encoder_ = std::make_unique<openai::ChatEncoder>(*tok_, chat::EncoderProfile::kPreview);
  }
  // The prompt text a Messages body renders to.
  std::string Prompt(const std::string& body) {
    auto req = ParseMessagesRequest(Json::parse(body));
    EXPECT_OK(req);
    if (!req.ok()) return "";
    auto p = encoder_->Encode(req->chat);
    EXPECT_OK(p);
    if (!p.ok()) return "";
    // The ids are the tokenizer's encoding of the whole prompt string.
    auto ids = tok_->Encode(p->text);
    EXPECT_OK(ids);
    if (ids.ok()) {
      EXPECT_EQ(p->ids, *ids);
    }
    return p->text;
  }
  Status Error(const std::string& body, bool count_tokens = false) {
    auto req = ParseMessagesRequest(Json::parse(body), count_tokens);
    if (!req.ok()) return req.status();
    return encoder_->Encode(req->chat).status();
  }

  std::unique_ptr<tokenizer::Tokenizer> tok_;
  std::unique_ptr<openai::ChatEncoder> encoder_;
};

constexpr char kWeatherSchema[] =
    R"({"name": "get_weather", "description": "Get weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}})";

constexpr char kMultiTurn[] = R"({
  "model": "tiny-v4", "max_tokens": 100,
  "system": [{"type": "text", "text": "You are terse."},
             {"type": "text", "text": "Answer in English.", "cache_control": {"type": "ephemeral"}}],
  "tools": [{"name": "get_weather", "description": "Get weather",
             "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                              "required": ["city"]}}],
  "thinking": {"type": "enabled", "budget_tokens": 64},
  "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [
      {"type": "thinking", "thinking": "Use the tool.", "signature": "sig"},
      {"type": "text", "text": "Checking."},
      {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 3}}]},
    {"role": "user", "content": [
      {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "rain"}]},
      {"type": "text", "text": "And tomorrow?"}]}
  ],
  "metadata": {"user_id": "u1"}, "stop_sequences": ["END"], "temperature": 0.5, "top_p": 0.9, "top_k": 5
})";

TEST_F(MessagesTest, MultiTurnWithToolsAndThinkingRendersAsTheChatEncodingSays) {
  // System blocks joined with "\n", tools block on it (§2.3, OpenAI function shape: name, description,
  // parameters, the schema's keys in the client's order); thinking with tools keeps every turn's reasoning
  // (§2.1.3); the tool_use becomes a DSML call (§2.5, parameters in the input's key order); the tool result and
  // the following text merge into one user turn (§2.1.1).
  const std::string want =
      B + "You are terse.\nAnswer in English.\n\n" + ToolsBlock(kWeatherSchema) + U + "Weather in Paris?" + A +
      "<think>Use the tool.</think>Checking.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
      "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
      "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>" +
      E + U + "<tool_result>rain</tool_result>\n\nAnd tomorrow?" + A + "<think>";
  EXPECT_EQ(Prompt(kMultiTurn), want);

  auto req = ParseMessagesRequest(Json::parse(kMultiTurn));
  ASSERT_OK(req);
  const openai::CommonParams& c = req->chat.common;
  EXPECT_EQ(c.model, "tiny-v4");
  EXPECT_EQ(c.max_tokens, 100);
  EXPECT_EQ(c.sampling.temperature, 0.5);
  EXPECT_EQ(c.sampling.top_p, 0.9);
  EXPECT_EQ(c.sampling.top_k, 5);
  EXPECT_EQ(c.stop, std::vector<std::string>{"END"});
  EXPECT_FALSE(c.stream);
  EXPECT_TRUE(req->chat.thinking);
}

TEST_F(MessagesTest, ChatModeStringContentAndPrefill) {
  // No thinking field: chat mode (E5).
  EXPECT_EQ(Prompt(R"({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]})"), B + U + "Hi" + A + "</think>");
  EXPECT_EQ(Prompt(R"({"max_tokens": 5, "thinking": {"type": "disabled"}, "system": "S",
                       "messages": [{"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}]})"),
            B + "S" + U + "A\nB" + A + "</think>");
  // A final assistant message is continued: no EOS (E11), in chat and in thinking mode (where the prefill
  // follows the closed reasoning).
  EXPECT_EQ(Prompt(R"({"max_tokens": 5, "messages": [{"role": "user", "content": "Write quicksort"},
                                                      {"role": "assistant", "content": "def quicksort("}]})"),
            B + U + "Write quicksort" + A + "</think>def quicksort(");
  EXPECT_EQ(Prompt(R"({"max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 10},
                       "messages": [{"role": "user", "content": "Q"},
                                    {"role": "assistant", "content": [{"type": "text", "text": "The answer is"}]}]})"),
            B + U + "Q" + A + "<think></think>The answer is");
  // tool_choice none: tools are not rendered.
  EXPECT_EQ(Prompt(R"({"max_tokens": 5, "tool_choice": {"type": "none"},
                       "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                       "messages": [{"role": "user", "content": "Q"}]})"),
            B + U + "Q" + A + "</think>");
  // auto (with disable_parallel_tool_use) renders them.
  auto req = ParseMessagesRequest(Json::parse(R"({"max_tokens": 5,
      "tool_choice": {"type": "auto", "disable_parallel_tool_use": true},
      "tools": [{"name": "f", "input_schema": {"type": "object"}}], "messages": [{"role": "user", "content": "Q"}]})"));
  ASSERT_OK(req);
  EXPECT_TRUE(req->disable_parallel_tool_use);
  EXPECT_EQ(req->chat.tools.dump(), R"([{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}])");
}

TEST_F(MessagesTest, ErrorsNameTheAnthropicField) {
  struct Case {
    std::string body, param, text;
  };
  const std::vector<Case> cases = {
      {R"({"messages": [{"role": "user", "content": "Hi"}]})", "max_tokens", "required"},
      {R"({"max_tokens": 0, "messages": [{"role": "user", "content": "Hi"}]})", "max_tokens", "at least 1"},
      {R"({"max_tokens": 5})", "messages", "required"},
      {R"({"max_tokens": 5, "messages": []})", "messages", "empty"},
      {R"({"max_tokens": 5, "messages": [{"role": "system", "content": "S"}]})", "messages[0].role", "top-level"},
      {R"({"max_tokens": 5, "messages": [{"role": "user"}]})", "messages[0].content", "required"},
      {R"({"max_tokens": 5, "messages": [{"role": "user", "content": []}]})", "messages[0].content", "needs content"},
      {R"({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]})",
       "messages[0].content[0].type", "text only"},
      {R"({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]})",
       "messages[0].content[0].type", "supported here: text, tool_result"},
      {R"({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]})",
       "messages[0].content[0].tool_use_id", "a string"},
      {R"({"max_tokens": 5, "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": "x"}]}]})",
       "messages[1].content[0].input", "an object"},
      {R"({"max_tokens": 5, "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]})",
       "messages[1].content[0].type", "redacted_thinking"},
      {R"({"max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "web_search"}], "messages": [{"role": "user", "content": "Q"}]})",
       "tools[0].type", "custom tools only"},
      {R"({"max_tokens": 5, "tools": [{"name": "f"}], "messages": [{"role": "user", "content": "Q"}]})",
       "tools[0].input_schema", "JSON schema"},
      {R"({"max_tokens": 5, "tool_choice": {"type": "tool"}, "messages": [{"role": "user", "content": "Q"}]})",
       "tool_choice.name", "a string"},
      {R"({"max_tokens": 5, "tool_choice": "auto", "messages": [{"role": "user", "content": "Q"}]})",
       "tool_choice", "an object"},
      {R"({"max_tokens": 5, "thinking": {"type": "enabled"}, "messages": [{"role": "user", "content": "Q"}]})",
       "thinking.budget_tokens", "required"},
      {R"({"max_tokens": 5, "thinking": {"type": "on", "budget_tokens": 5}, "messages": [{"role": "user", "content": "Q"}]})",
       "thinking.type", "enabled"},
      {R"({"max_tokens": 5, "temperature": 3, "messages": [{"role": "user", "content": "Q"}]})", "temperature", "[0, 2]"},
      {R"({"max_tokens": 5, "stop_sequences": "END", "messages": [{"role": "user", "content": "Q"}]})",
       "stop_sequences", "an array"},
      {R"({"max_tokens": 5, "metadata": {"user_id": 7}, "messages": [{"role": "user", "content": "Q"}]})",
       "metadata.user_id", "a string"},
      {R"({"max_tokens": 5, "mcp_servers": [{"type": "url"}], "messages": [{"role": "user", "content": "Q"}]})",
       "mcp_servers", "not supported"},
      {R"({"max_tokens": 5, "output_format": {"type": "json_schema"}, "messages": [{"role": "user", "content": "Q"}]})",
       "output_format", "not supported"},
      // The chat encoder's own checks name the Anthropic message.
      {R"({"max_tokens": 5, "messages": [{"role": "user", "content": "a<｜end▁of▁sentence｜>"}]})",
       "messages[0].content", "special token"},
  };
  for (const Case& c : cases) {
    Status s = Error(c.body);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.body;
    EXPECT_EQ(ParamOf(s), c.param) << c.body << " -> " << s;
    EXPECT_NE(s.message().find(c.text), std::string::npos) << c.body << " -> " << s;
  }
  // count_tokens does not need max_tokens.
  EXPECT_OK(Error(R"({"messages": [{"role": "user", "content": "Q"}]})", /*count_tokens=*/true));
}

TEST(MessagesApi, ErrorShapeAndStopReasons) {
  const std::vector<std::tuple<Status, int, std::string>> cases = {
      {InvalidParam("max_tokens", "bad"), 400, "invalid_request_error"},
      {absl::UnauthenticatedError("no key"), 401, "authentication_error"},
      {absl::NotFoundError("no model"), 404, "not_found_error"},
      {absl::OutOfRangeError("too big"), 413, "request_too_large"},
      {absl::ResourceExhaustedError("queue full"), 429, "rate_limit_error"},
      {absl::UnavailableError("no worker"), 503, "overloaded_error"},
      {absl::DeadlineExceededError("slow"), 504, "timeout_error"},
      {absl::InternalError("boom"), 500, "api_error"},
  };
  for (const auto& [status, http, type] : cases) {
    ApiError e = ToApiError(status);
    EXPECT_EQ(e.http_status, http) << status;
    EXPECT_EQ(ErrorJson(e), Json::parse(absl::StrCat(R"({"type": "error", "error": {"type": ")", type,
                                                     R"(", "message": ")", status.message(), "\"}}")));
  }
  EXPECT_GT(ToApiError(absl::UnavailableError("x")).retry_after_s, 0);
  EXPECT_EQ(StopReason("stop", "", 0), "end_turn");
  EXPECT_EQ(StopReason("stop", "", 2), "tool_use");
  EXPECT_EQ(StopReason("stop", "END", 0), "stop_sequence");
  EXPECT_EQ(StopReason("length", "", 1), "max_tokens");
  EXPECT_EQ(SseEvent(Json{{"type", "ping"}}), "event: ping\ndata: {\"type\":\"ping\"}\n\n");
  EXPECT_EQ(NewMessageId().rfind("msg_", 0), 0u);
  EXPECT_EQ(NewToolUseId().rfind("toolu_", 0), 0u);
}

// The deltas the output parser gives for a reasoning + text + tool call answer, fed to the builder.
std::vector<openai::ChatDelta> Feed(const std::vector<std::string>& pieces, bool reasoning, int* calls) {
  openai::ChatStreamParser parser(reasoning, /*tools=*/true, [n = 0]() mutable { return "toolu_" + std::to_string(n++); });
  std::vector<openai::ChatDelta> out;
  for (const std::string& p : pieces) out.push_back(parser.Add(p));
  out.push_back(parser.Finish());
  *calls = parser.tool_calls();
  return out;
}

std::vector<std::string> Types(const std::vector<Json>& events) {
  std::vector<std::string> t;
  for (const Json& e : events) t.push_back(e["type"].get<std::string>());
  return t;
}

TEST(MessageBuilder, EventSequenceAndMessage) {
  const std::string call =
      "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" "
      "string=\"true\">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
      "</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
  // One character at a time, as tokens would arrive.
  std::vector<std::string> pieces;
  for (char ch : "Need it.</think>Checking." + call) pieces.push_back(std::string(1, ch));
  int calls = 0;
  auto deltas = Feed(pieces, /*reasoning=*/true, &calls);
  ASSERT_EQ(calls, 1);

  MessageBuilder b({.id = "msg_1", .model = "tiny-v4"});
  std::vector<Json> events = b.Start(42);
  for (const auto& d : deltas) {
    auto e = b.Add(d);
    events.insert(events.end(), e.begin(), e.end());
  }
  auto end = b.Finish(StopReason("stop", "", calls), "", 30, calls);
  events.insert(events.end(), end.begin(), end.end());

  // message_start, ping, then each block opened, filled and closed in turn, then message_delta, message_stop.
  std::vector<std::string> types = Types(events);
  std::vector<std::string> compact;  // runs of deltas collapsed
  for (const std::string& t : types) {
    if (!(t == "content_block_delta" && !compact.empty() && compact.back() == t)) compact.push_back(t);
  }
  EXPECT_EQ(compact, (std::vector<std::string>{"message_start", "ping", "content_block_start", "content_block_delta",
                                               "content_block_stop", "content_block_start", "content_block_delta",
                                               "content_block_stop", "content_block_start", "content_block_delta",
                                               "content_block_stop", "message_delta", "message_stop"}));
  EXPECT_EQ(events[0], Json::parse(R"({"type": "message_start", "message": {"id": "msg_1", "type": "message",
      "role": "assistant", "model": "tiny-v4", "content": [], "stop_reason": null, "stop_sequence": null,
      "usage": {"input_tokens": 42, "output_tokens": 0}}})"));
  std::string thinking, text, json_args;
  std::vector<Json> starts;
  for (const Json& e : events) {
    if (e["type"] == "content_block_start") starts.push_back(e);
    if (e["type"] != "content_block_delta") continue;
    const Json& d = e["delta"];
    const size_t index = e["index"].get<size_t>();
    if (d["type"] == "thinking_delta") {
      EXPECT_EQ(index, 0u);
      thinking += d["thinking"].get<std::string>();
    } else if (d["type"] == "text_delta") {
      EXPECT_EQ(index, 1u);
      text += d["text"].get<std::string>();
    } else {
      EXPECT_EQ(d["type"], "input_json_delta");
      EXPECT_EQ(index, 2u);
      json_args += d["partial_json"].get<std::string>();
    }
  }
  EXPECT_EQ(thinking, "Need it.");
  EXPECT_EQ(text, "Checking.");
  EXPECT_EQ(Json::parse(json_args), Json::parse(R"({"city": "Paris", "days": 3})"));
  ASSERT_EQ(starts.size(), 3u);
  EXPECT_EQ(starts[0]["content_block"], Json::parse(R"({"type": "thinking", "thinking": "", "signature": ""})"));
  EXPECT_EQ(starts[1]["content_block"], Json::parse(R"({"type": "text", "text": ""})"));
  EXPECT_EQ(starts[2]["content_block"],
            Json::parse(R"({"type": "tool_use", "id": "toolu_0", "name": "get_weather", "input": {}})"));
  EXPECT_EQ(events[events.size() - 2], Json::parse(R"({"type": "message_delta",
      "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"input_tokens": 42, "output_tokens": 30, "cache_read_input_tokens": 0}})"));

  // The whole message: the same blocks; the input keeps the model's parameter order.
  Json m = b.Message();
  EXPECT_EQ(Dump(m), Dump(Json::parse(R"({"id": "msg_1", "type": "message", "role": "assistant", "model": "tiny-v4",
      "content": [{"type": "thinking", "thinking": "Need it.", "signature": ""}, {"type": "text", "text": "Checking."},
                  {"type": "tool_use", "id": "toolu_0", "name": "get_weather", "input": {"city": "Paris", "days": 3}}],
      "stop_reason": "tool_use", "stop_sequence": null, "usage": {"input_tokens": 42, "output_tokens": 30, "cache_read_input_tokens": 0}})")));
}

TEST(MessageBuilder, CutOffCallsAndParallelCalls) {
  const std::string invoke = "<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"q\" string=\"true\">x</｜DSML｜parameter>\n"
                             "</｜DSML｜invoke>\n";
  // Two calls; disable_parallel_tool_use keeps the first only.
  int calls = 0;
  auto deltas = Feed({"A.\n\n<｜DSML｜tool_calls>\n" + invoke + invoke + "</｜DSML｜tool_calls>"}, false, &calls);
  EXPECT_EQ(calls, 2);
  MessageBuilder one({.id = "m", .model = "x", .disable_parallel_tool_use = true});
  one.Start(1);
  for (const auto& d : deltas) one.Add(d);
  one.Finish("tool_use", "", 5, calls);
  Json m = one.Message();
  ASSERT_EQ(m["content"].size(), 2u) << Dump(m);
  EXPECT_EQ(m["content"][1]["input"], Json::parse(R"({"q": "x"})"));

  // A call cut off by max_tokens streamed its start, but the whole message leaves it out.
  deltas = Feed({"A.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"q\" string=\"true\">x"},
                false, &calls);
  EXPECT_EQ(calls, 0);
  MessageBuilder cut({.id = "m", .model = "x"});
  cut.Start(1);
  std::vector<Json> events;
  for (const auto& d : deltas) {
    auto e = cut.Add(d);
    events.insert(events.end(), e.begin(), e.end());
  }
  auto end = cut.Finish(StopReason("length", "", calls), "", 9, calls);
  events.insert(events.end(), end.begin(), end.end());
  EXPECT_EQ(Types(events).back(), "message_stop");
  m = cut.Message();
  EXPECT_EQ(m["stop_reason"], "max_tokens");
  ASSERT_EQ(m["content"].size(), 1u) << Dump(m);
  EXPECT_EQ(m["content"][0], Json::parse(R"({"type": "text", "text": "A."})"));
}

}  // namespace
}  // namespace numoe::router::anthropic
