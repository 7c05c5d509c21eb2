// The REST gateway end to end without sockets: a recording HttpExchange, the real Frontend/Balancer and
// in-process fake workers. Covers SSE framing, prompt shapes, chat output parsing, every error status,
// failures before and after the first token, and cancellation when the client goes away; the chat path's
// prompt ids against the tokenizer (and /tokenize), prompt_token_ids, and the Anthropic Messages API.
#include "router/http/rest_gateway.h"

#include <gtest/gtest.h>

#include "router/openai/chat.h"
#include "tests/support/chat_text.h"
#include "tests/support/status_matchers.h"
#include "tests/unit/router/fake_worker_client.h"

namespace numoe::router {
namespace {

using nlohmann::json;
using testing::FakeCluster;
using testing::FakeFactory;

class RecordingExchange : public HttpExchange {
 public:
  void Respond(int status, const std::string& content_type, std::string body, HttpHeaders headers) override {
    std::lock_guard<std::mutex> lock(mu_);
    ASSERT_FALSE(done_) << "two responses";
    ASSERT_TRUE(events_.empty()) << "a response after events";
    status_ = status;
    content_type_ = content_type;
    body_ = std::move(body);
    headers_ = std::move(headers);
    done_ = true;
    gone_ = nullptr;  // as the real exchange: dropped on completion (it owns the request)
  }
  void SendEvent(std::string event) override {
    std::lock_guard<std::mutex> lock(mu_);
    ASSERT_FALSE(done_) << "an event after the end";
    events_.push_back(std::move(event));
  }
  void EndEvents() override {
    std::lock_guard<std::mutex> lock(mu_);
    ASSERT_FALSE(done_);
    done_ = true;
    status_ = 200;
    gone_ = nullptr;
  }
  void OnClientGone(std::function<void()> fn) override {
    std::lock_guard<std::mutex> lock(mu_);
    gone_ = std::move(fn);
  }
  void ClientLeaves() {
    std::function<void()> fn;
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn = std::move(gone_);
    }
    if (fn) fn();
  }

  bool done() {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  int status() { return status_; }
  json body() { return json::parse(body_); }
  std::string raw_body() { return body_; }
  std::string header(const std::string& name) {
    for (auto& [k, v] : headers_) {
      if (k == name) return v;
    }
    return "";
  }
  std::vector<std::string> events() {
    std::lock_guard<std::mutex> lock(mu_);
    return events_;
  }
  // The events' JSON payloads (every event must be "data: ...\n\n"; the last must be [DONE]).
  std::vector<json> Chunks() {
    std::vector<json> out;
    auto ev = events();
    EXPECT_FALSE(ev.empty());
    for (size_t i = 0; i < ev.size(); ++i) {
      EXPECT_EQ(ev[i].rfind("data: ", 0), 0u) << ev[i];
      EXPECT_EQ(ev[i].substr(ev[i].size() - 2), "\n\n") << ev[i];
      std::string payload = ev[i].substr(6, ev[i].size() - 8);
      if (i + 1 == ev.size()) {
        EXPECT_EQ(payload, "[DONE]");
      } else {
        out.push_back(json::parse(payload));
      }
    }
    return out;
  }
  // Anthropic's framing: every event "event: TYPE\ndata: JSON\n\n" with TYPE the payload's "type"; no [DONE].
  std::vector<json> AnthropicEvents() {
    std::vector<json> out;
    for (const std::string& ev : events()) {
      const size_t nl = ev.find('\n');
      EXPECT_EQ(ev.rfind("event: ", 0), 0u) << ev;
      EXPECT_EQ(ev.substr(nl + 1, 6), "data: ") << ev;
      EXPECT_EQ(ev.substr(ev.size() - 2), "\n\n") << ev;
      json data = json::parse(ev.substr(nl + 7, ev.size() - nl - 9));
      EXPECT_EQ(ev.substr(7, nl - 7), data["type"].get<std::string>()) << ev;
      out.push_back(std::move(data));
    }
    return out;
  }

 private:
  std::mutex mu_;
  bool done_ = false;
  int status_ = 0;
  std::string content_type_, body_;
  HttpHeaders headers_;
  std::vector<std::string> events_;
  std::function<void()> gone_;
};

class GatewayTest : public ::testing::Test {
 protected:
  void SetUp() override { Build(1, {}); }

  void Build(int workers, RestGatewayOptions options, bool health = true, FrontendOptions fo = {16}) {
    gateway_.reset();
    frontend_.reset();
    balancer_.reset();
    auto t = tokenizer::Tokenizer::Load(std::string(NUMOE_TEST_DATA) + "/tiny-v4");
    ASSERT_OK(t);
    tok_ = std::move(*t);
    cluster_ = std::make_shared<FakeCluster>();
    cluster_->mode = FakeCluster::Mode::kEcho;
    BalancerOptions bo;
    for (int i = 0; i < workers; ++i) bo.workers.push_back("w" + std::to_string(i));
    bo.health_interval_s = 0;
    bo.unhealthy_after = 1;
    bo.max_queue = 1;
    bo.max_in_flight_per_worker = 2;
    balancer_ = std::make_unique<Balancer>(bo, FakeFactory(cluster_));
    if (health) balancer_->CheckHealthNow();
    ModelInfo m{"tiny-v4", 1024, 1024, 1700000000};
    frontend_ = std::make_unique<Frontend>(*tok_, m, *balancer_, metrics_, fo);
    chat_ = std::make_unique<openai::ChatEncoder>(*tok_, chat::EncoderProfile::kPreview);
    gateway_ = std::make_unique<RestGateway>(*frontend_, *chat_, *balancer_, metrics_, options);
  }

  std::shared_ptr<RecordingExchange> Call(const std::string& method, const std::string& path,
                                          const std::string& body = "", std::map<std::string, std::string> h = {}) {
    auto ex = std::make_shared<RecordingExchange>();
    HttpRequest r{method, path, std::move(h), body};
    gateway_->Handle(r, ex);
    return ex;
  }
  std::shared_ptr<RecordingExchange> Post(const std::string& path, const json& body) {
    return Call("POST", path, body.dump());
  }

  Metrics metrics_;
  std::unique_ptr<tokenizer::Tokenizer> tok_;
  std::shared_ptr<FakeCluster> cluster_;
  std::unique_ptr<Balancer> balancer_;
  std::unique_ptr<Frontend> frontend_;
  std::unique_ptr<openai::ChatEncoder> chat_;
  std::unique_ptr<RestGateway> gateway_;
};

TEST_F(GatewayTest, CompletionWhole) {
  auto ex = Post("/v1/completions", {{"prompt", "Hello, world!"}, {"max_tokens", 6}, {"return_token_ids", true}});
  ASSERT_TRUE(ex->done());
  ASSERT_EQ(ex->status(), 200) << ex->raw_body();
  json r = ex->body();
  EXPECT_EQ(r["id"].get<std::string>().rfind("cmpl-", 0), 0u);
  EXPECT_EQ(r["choices"][0]["text"], "Hello, world!");
  EXPECT_EQ(r["choices"][0]["token_ids"], json({47, 477, 86, 19, 707, 8}));
  EXPECT_EQ(r["usage"], json::parse(R"({"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0},
                                        "completion_tokens": 6, "total_tokens": 13})"));
  // The worker got BOS + the prompt, max_tokens and greedy-by-default fields.
  auto call = cluster_->Calls().back();
  EXPECT_EQ(std::vector<int32_t>(call->request.prompt_ids().begin(), call->request.prompt_ids().end()),
            (std::vector<int32_t>{0, 47, 477, 86, 19, 707, 8}));
  EXPECT_EQ(call->request.max_new_tokens(), 6u);
  EXPECT_FLOAT_EQ(call->request.sampling().temperature(), 1.0f);
}

// "" without BOS encodes to no tokens; that empty prompt used to reach the worker (found while writing
// tests/fuzz/fuzz_rest_request.cc, whose echo workers need a token to echo).
TEST_F(GatewayTest, AnEmptyPromptIsRefusedBeforeAnyWorker) {
  auto ex = Post("/v1/completions", {{"prompt", ""}, {"add_special_tokens", false}});
  ASSERT_EQ(ex->status(), 400) << ex->raw_body();
  EXPECT_EQ(ex->body()["error"]["param"], "prompt");
  EXPECT_NE(ex->body()["error"]["message"].get<std::string>().find("empty"), std::string::npos);
  EXPECT_TRUE(cluster_->Calls().empty());
  // With BOS the same text is a one-token prompt.
  ex = Post("/v1/completions", {{"prompt", ""}, {"max_tokens", 1}});
  EXPECT_EQ(ex->status(), 200) << ex->raw_body();
}

TEST_F(GatewayTest, DefaultMaxTokensIsCappedByTheContext) {
  // Context 1024, default 16: a 1020-token prompt gets 4.
  std::vector<int> ids(1020, 47);
  auto ex = Post("/v1/completions", {{"prompt", ids}});
  ASSERT_EQ(ex->status(), 200) << ex->raw_body();
  EXPECT_EQ(cluster_->Calls().back()->request.max_new_tokens(), 4u);
  ex = Post("/v1/completions", {{"prompt", {47}}});
  EXPECT_EQ(cluster_->Calls().back()->request.max_new_tokens(), 16u);
}

TEST_F(GatewayTest, SamplingFieldsReachTheWorker) {
  auto ex = Post("/v1/completions", {{"prompt", {47}}, {"max_tokens", 2}, {"temperature", 0}, {"top_p", 0.5},
                                     {"top_k", 7}, {"seed", 99}, {"ignore_eos", true}, {"stop_token_ids", {3}}});
  ASSERT_EQ(ex->status(), 200);
  const auto& r = cluster_->Calls().back()->request;
  EXPECT_EQ(r.sampling().temperature(), 0.0f);
  EXPECT_EQ(r.sampling().top_p(), 0.5f);
  EXPECT_EQ(r.sampling().top_k(), 7);
  EXPECT_EQ(r.sampling().seed(), 99u);
  EXPECT_TRUE(r.ignore_eos());
  ASSERT_EQ(r.stop_token_ids_size(), 1);
  EXPECT_EQ(r.stop_token_ids(0), 3);
}

TEST_F(GatewayTest, CompletionStreamFraming) {
  auto ex = Post("/v1/completions", {{"prompt", {47, 477, 86}}, {"max_tokens", 3}, {"stream", true},
                                     {"return_token_ids", true}, {"stream_options", {{"include_usage", true}}}});
  ASSERT_TRUE(ex->done());
  auto chunks = ex->Chunks();
  ASSERT_EQ(chunks.size(), 4u);  // one per token, then the usage chunk
  std::string text;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(chunks[i]["object"], "text_completion");
    EXPECT_EQ(chunks[i]["id"], chunks[0]["id"]);
    EXPECT_TRUE(chunks[i]["usage"].is_null());
    EXPECT_EQ(chunks[i]["choices"].size(), 1u);
    EXPECT_EQ(chunks[i]["choices"][0]["token_ids"].size(), 1u);
    text += chunks[i]["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(text, "Hello");
  EXPECT_TRUE(chunks[1]["choices"][0]["finish_reason"].is_null());
  EXPECT_EQ(chunks[2]["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(chunks[3]["choices"].empty());
  EXPECT_EQ(chunks[3]["usage"]["total_tokens"], 6);
}

TEST_F(GatewayTest, SeveralPromptsStreamWithTheirIndex) {
  auto ex = Post("/v1/completions", {{"prompt", {"Hello,", "world"}}, {"max_tokens", 2}, {"stream", true}});
  auto chunks = ex->Chunks();
  std::map<int, std::string> text;
  std::map<int, std::string> finish;
  for (const json& c : chunks) {
    int i = c["choices"][0]["index"];
    text[i] += c["choices"][0]["text"].get<std::string>();
    if (!c["choices"][0]["finish_reason"].is_null()) finish[i] = c["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(text[0], "Hell");
  EXPECT_EQ(finish[0], "length");
  EXPECT_EQ(finish[1], "length");
  EXPECT_EQ(text.size(), 2u);
}

TEST_F(GatewayTest, ChatThinkingAndToolCalls) {
  // Manual worker: the test writes the model's output.
  cluster_->mode = FakeCluster::Mode::kManual;
  auto ex = Post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"thinking", true},
                                          {"stream", true}, {"max_tokens", 50}});
  auto call = cluster_->Calls().back();
  // The prompt: BOS <｜User｜>Hi<｜Assistant｜><think> (doc E5).
  auto expect = tok_->Encode("<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>");
  ASSERT_OK(expect);
  EXPECT_EQ(std::vector<int32_t>(call->request.prompt_ids().begin(), call->request.prompt_ids().end()), *expect);
  auto out = tok_->Encode("Let me see.</think>Hello there.");
  ASSERT_OK(out);
  for (int32_t id : *out) call->Tokens({id});
  call->Tokens({tok_->special_ids().eos}, "stop");
  call->End();
  ASSERT_TRUE(ex->done());
  auto chunks = ex->Chunks();
  ASSERT_GE(chunks.size(), 3u);
  EXPECT_EQ(chunks[0]["choices"][0]["delta"], json::parse(R"({"role": "assistant", "content": ""})"));
  std::string reasoning, content;
  for (const json& c : chunks) {
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    const json& d = c["choices"][0]["delta"];
    reasoning += d.value("reasoning_content", "");
    content += d.value("content", "");
    // No marker byte ever reaches the client.
    EXPECT_EQ(d.dump().find("think>"), std::string::npos) << d.dump();
  }
  EXPECT_EQ(reasoning, "Let me see.");
  EXPECT_EQ(content, "Hello there.");
  EXPECT_EQ(chunks.back()["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(chunks.back()["choices"][0]["delta"], json::object());

  // Non-streaming, chat mode, with a tool call.
  ex = Post("/v1/chat/completions",
            {{"messages", {{{"role", "user"}, {"content", "Weather?"}}}},
             {"tools", {{{"type", "function"}, {"function", {{"name", "get_weather"}}}}}},
             {"max_tokens", 400}});
  call = cluster_->Calls().back();
  out = tok_->Encode(
      "Sure.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" "
      "string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>");
  ASSERT_OK(out);
  call->Tokens(*out);
  call->Tokens({tok_->special_ids().eos}, "stop");
  call->End();
  ASSERT_EQ(ex->status(), 200) << ex->raw_body();
  json msg = ex->body()["choices"][0]["message"];
  EXPECT_EQ(msg["content"], "Sure.");
  ASSERT_EQ(msg["tool_calls"].size(), 1u) << ex->raw_body();
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(msg["tool_calls"][0]["function"]["arguments"].get<std::string>()), json({{"city", "Paris"}}));
  EXPECT_EQ(ex->body()["choices"][0]["finish_reason"], "tool_calls");
  EXPECT_FALSE(msg.contains("reasoning_content"));
}

TEST_F(GatewayTest, ErrorsAndServiceContinues) {
  struct Case {
    std::string method, path, body;
    int status;
    std::string param;
  };
  std::vector<int> long_prompt(1024, 47);
  const std::vector<Case> cases = {
      {"POST", "/v1/completions", "{bad json", 400, ""},
      {"POST", "/v1/completions", R"({"prompt": [1024]})", 400, "prompt"},
      {"POST", "/v1/completions", json({{"prompt", long_prompt}}).dump(), 400, "prompt"},
      {"POST", "/v1/completions", R"({"prompt": [47], "max_tokens": 1024})", 400, "max_tokens"},
      {"POST", "/v1/completions", R"({"prompt": ["ok", [5]]})", 400, "prompt[1]"},
      {"POST", "/v1/completions", R"({"prompt": "x", "stop_token_ids": [5000]})", 400, "stop_token_ids"},
      {"POST", "/v1/completions", R"({"model": "other", "prompt": "x"})", 404, "model"},
      {"POST", "/v1/chat/completions", R"({"messages": [{"role": "user", "content": "<｜User｜>"}]})", 400,
       "messages[0].content"},
      {"POST", "/v1/chat/completions", R"({"messages": [{"role": "assistant", "content": "x"}]})", 400, "messages"},
      {"POST", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "thinking": true, "reasoning_effort": "extreme"})", 400,
       "reasoning_effort"},
      {"GET", "/v2/anything", "", 404, ""},
      {"DELETE", "/v1/models", "", 405, ""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.path + " " + c.body);
    auto ex = Call(c.method, c.path, c.body);
    ASSERT_TRUE(ex->done());
    EXPECT_EQ(ex->status(), c.status) << ex->raw_body();
    json e = ex->body();
    EXPECT_EQ(e["error"]["param"], c.param.empty() ? json(nullptr) : json(c.param)) << e.dump();
    auto ok = Post("/v1/completions", {{"prompt", {47}}, {"max_tokens", 1}});
    EXPECT_EQ(ok->status(), 200);
  }
  EXPECT_EQ(metrics_.requests("/v1/completions", "400"), 6u);
  EXPECT_EQ(metrics_.requests("other", "404"), 1u);
}

TEST_F(GatewayTest, NoWorkerIs503AndQueueFullIs429) {
  Build(1, {}, /*health=*/false);
  auto ex = Post("/v1/completions", {{"prompt", "x"}});
  EXPECT_EQ(ex->status(), 503);
  EXPECT_EQ(ex->header("Retry-After"), "1");
  ex = Post("/v1/completions", {{"prompt", "x"}, {"stream", true}});
  EXPECT_EQ(ex->status(), 503) << "errors before the first event are plain responses";
  EXPECT_TRUE(ex->events().empty());
  auto health = Call("GET", "/health");
  EXPECT_EQ(health->status(), 503);

  balancer_->CheckHealthNow();
  cluster_->mode = FakeCluster::Mode::kManual;
  // 2 slots + 1 queued; the 4th is refused, and a prompt list that does not fit is refused whole.
  std::vector<std::shared_ptr<RecordingExchange>> held;
  for (int i = 0; i < 3; ++i) held.push_back(Post("/v1/completions", {{"prompt", {47}}, {"max_tokens", 1}}));
  auto busy = Post("/v1/completions", {{"prompt", {47}}, {"max_tokens", 1}});
  EXPECT_EQ(busy->status(), 429);
  EXPECT_EQ(busy->header("Retry-After"), "1");
  EXPECT_EQ(busy->body()["error"]["code"], "queue_full");
  for (auto& c : cluster_->Calls()) c->End();
  for (auto& c : cluster_->Calls()) c->End();  // the queued one started when a slot freed
  for (auto& h : held) EXPECT_EQ(h->status(), 200);
}

TEST_F(GatewayTest, WorkerFailureMidStreamIsAnErrorEvent) {
  cluster_->mode = FakeCluster::Mode::kManual;
  auto ex = Post("/v1/completions", {{"prompt", {47, 477}}, {"max_tokens", 10}, {"stream", true}});
  auto call = cluster_->Calls().back();
  call->Tokens({47});
  call->End(absl::UnavailableError("connection reset"));
  ASSERT_TRUE(ex->done());
  auto chunks = ex->Chunks();
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[0]["choices"][0]["text"], "H");
  ASSERT_TRUE(chunks[1].contains("error"));
  EXPECT_EQ(chunks[1]["error"]["type"], "service_unavailable");
  EXPECT_EQ(chunks[1]["error"]["code"], 503);

  // Non-streaming: never a partial success.
  ex = Post("/v1/completions", {{"prompt", {47, 477}}, {"max_tokens", 10}});
  call = cluster_->Calls().back();
  call->Tokens({47});
  call->End(absl::UnavailableError("connection reset"));
  EXPECT_EQ(ex->status(), 503);
}

TEST_F(GatewayTest, ClientGoneCancelsTheWorkerCall) {
  cluster_->mode = FakeCluster::Mode::kManual;
  auto ex = Post("/v1/completions", {{"prompt", {47, 477}}, {"max_tokens", 10}, {"stream", true}});
  auto call = cluster_->Calls().back();
  call->Tokens({47});
  ex->ClientLeaves();
  EXPECT_TRUE(call->cancelled);
  EXPECT_EQ(balancer_->in_flight(), 0u);
}

TEST_F(GatewayTest, ApiKey) {
  Build(1, {ApiKeys({"k3y"})});
  EXPECT_EQ(Call("GET", "/v1/models")->status(), 401);
  EXPECT_EQ(Call("GET", "/v1/models", "", {{"authorization", "Bearer nope"}})->status(), 401);
  EXPECT_EQ(Call("GET", "/v1/models", "", {{"authorization", "Bearer k3y"}})->status(), 200);
  EXPECT_EQ(Call("GET", "/health")->status(), 200);
  auto ex = Call("GET", "/metrics");
  EXPECT_EQ(ex->status(), 401);
  EXPECT_EQ(ex->header("WWW-Authenticate"), "Bearer");
}

TEST_F(GatewayTest, ModelsHealthMetrics) {
  auto m = Call("GET", "/v1/models");
  ASSERT_EQ(m->status(), 200);
  EXPECT_EQ(m->body()["data"][0]["id"], "tiny-v4");
  EXPECT_EQ(m->body()["data"][0]["max_model_len"], 1024);
  auto h = Call("GET", "/health");
  ASSERT_EQ(h->status(), 200);
  EXPECT_EQ(h->body()["workers_up"], 1);
  Post("/v1/completions", {{"prompt", {47, 477}}, {"max_tokens", 3}});
  auto t = Call("GET", "/metrics");
  ASSERT_EQ(t->status(), 200);
  EXPECT_NE(t->raw_body().find("numoe_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 1"),
            std::string::npos);
  EXPECT_NE(t->raw_body().find("numoe_generation_tokens_total 3"), std::string::npos);
  EXPECT_NE(t->raw_body().find("numoe_prompt_tokens_total 2"), std::string::npos);
  EXPECT_NE(t->raw_body().find("numoe_worker_up{worker=\"w0\"} 1"), std::string::npos);
}

// The worker's prompt ids of the last call.
std::vector<int32_t> PromptOf(const std::shared_ptr<testing::FakeCall>& call) {
  return std::vector<int32_t>(call->request.prompt_ids().begin(), call->request.prompt_ids().end());
}

// A two-turn chat with one tool, with and without tools, in both modes: the ids a worker gets are the
// tokenizer's encoding of the whole prompt string the chat encoding defines (composed here from the doc's
// rules, the tool schema in the client's key order, which is not sorted), usage.prompt_tokens counts them,
// and /tokenize with the same fields returns them.
TEST_F(GatewayTest, ChatPromptIdsAreTheTokenizationOfTheWholeEncodedPrompt) {
  using numoe::test::A;
  using numoe::test::B;
  using numoe::test::E;
  using numoe::test::ToolsBlock;
  using numoe::test::U;
  const std::string tools =
      R"([{"type": "function", "function": {"name": "get_weather", "description": "Get the weather",)"
      R"( "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}])";
  const std::string schema =
      R"({"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}})";
  const std::string with_call =
      R"([{"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"location\": \"Paris\"}"}}]},
          {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])";
  const std::string calls =
      "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"location\" "
      "string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
  const std::string plain =
      R"([{"role": "user", "content": "Hi"}, {"role": "assistant", "reasoning_content": "R1", "content": "Hello!"},
          {"role": "user", "content": "Weather in Paris?"}])";
  struct Case {
    std::string body, prompt;
  };
  const std::vector<Case> cases = {
      // Tools (request tools on an inserted empty system, §3; E9's shape), thinking: every reasoning kept.
      {R"({"messages": )" + with_call + R"(, "tools": )" + tools + R"(, "thinking": true)",
       B + "\n\n" + ToolsBlock(schema) + U + "Weather in Paris?" + A + "<think></think>" + calls + E + U +
           "<tool_result>sunny</tool_result>" + A + "<think>"},
      {R"({"messages": )" + with_call + R"(, "tools": )" + tools + R"(, "thinking": false)",
       B + "\n\n" + ToolsBlock(schema) + U + "Weather in Paris?" + A + "</think>" + calls + E + U +
           "<tool_result>sunny</tool_result>" + A + "</think>"},
      // No tools (E10).
      {R"({"messages": )" + plain + R"(, "thinking": true)",
       B + U + "Hi" + A + "</think>Hello!" + E + U + "Weather in Paris?" + A + "<think>"},
      {R"({"messages": )" + plain + R"(, "thinking": false)",
       B + U + "Hi" + A + "</think>Hello!" + E + U + "Weather in Paris?" + A + "</think>"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.body);
    auto want = tok_->Encode(c.prompt);
    ASSERT_OK(want);
    auto ex = Call("POST", "/v1/chat/completions", c.body + R"(, "max_tokens": 2, "return_token_ids": true})");
    ASSERT_EQ(ex->status(), 200) << ex->raw_body();
    EXPECT_EQ(PromptOf(cluster_->Calls().back()), *want);
    EXPECT_EQ(ex->body()["usage"]["prompt_tokens"], want->size());
    EXPECT_EQ(ex->body()["prompt_token_ids"], json(*want));
    auto t = Call("POST", "/tokenize", c.body + "}");
    ASSERT_EQ(t->status(), 200) << t->raw_body();
    EXPECT_EQ(t->body()["tokens"], json(*want));
    EXPECT_EQ(t->body()["count"], want->size());
    EXPECT_EQ(t->body()["max_model_len"], 1024);
    EXPECT_TRUE(t->body()["token_strs"].is_null());
  }
}

TEST_F(GatewayTest, PromptTokenIdsWithReturnTokenIds) {
  const std::vector<int32_t> hello = {0, 47, 477, 86, 19, 707, 8};  // BOS + "Hello, world!"
  auto ex = Post("/v1/completions", {{"prompt", "Hello, world!"}, {"max_tokens", 2}, {"return_token_ids", true}});
  ASSERT_EQ(ex->status(), 200);
  EXPECT_EQ(ex->body()["choices"][0]["prompt_token_ids"], json(hello));
  EXPECT_FALSE(ex->body().contains("prompt_token_ids"));
  ex = Post("/v1/completions", {{"prompt", "Hello, world!"}, {"max_tokens", 2}});
  EXPECT_FALSE(ex->body()["choices"][0].contains("prompt_token_ids"));
  // Streaming: on the first chunk of the choice only.
  ex = Post("/v1/completions",
            {{"prompt", "Hello, world!"}, {"max_tokens", 3}, {"stream", true}, {"return_token_ids", true}});
  auto chunks = ex->Chunks();
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0]["choices"][0]["prompt_token_ids"], json(hello));
  EXPECT_FALSE(chunks[1]["choices"][0].contains("prompt_token_ids"));
  // Chat streaming: on the first (role) chunk.
  ex = Post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"max_tokens", 2},
                                     {"stream", true}, {"return_token_ids", true}});
  chunks = ex->Chunks();
  auto want = tok_->Encode("<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>");
  ASSERT_OK(want);
  EXPECT_EQ(chunks[0]["prompt_token_ids"], json(*want));
  EXPECT_EQ(chunks[0]["choices"][0]["delta"]["role"], "assistant");
  for (size_t i = 1; i < chunks.size(); ++i) EXPECT_FALSE(chunks[i].contains("prompt_token_ids"));
}

TEST_F(GatewayTest, ContinueFinalMessageIsAPrefill) {
  // vLLM's continue_final_message and DeepSeek's "prefix": true: the final assistant message without EOS (E11).
  auto want = tok_->Encode("<｜begin▁of▁sentence｜><｜User｜>Write quicksort<｜Assistant｜></think>def quicksort(");
  ASSERT_OK(want);
  const json messages = {{{"role", "user"}, {"content", "Write quicksort"}},
                         {{"role", "assistant"}, {"content", "def quicksort("}}};
  auto ex = Post("/v1/chat/completions", {{"messages", messages}, {"max_tokens", 2}, {"continue_final_message", true},
                                          {"add_generation_prompt", false}});
  ASSERT_EQ(ex->status(), 200) << ex->raw_body();
  EXPECT_EQ(PromptOf(cluster_->Calls().back()), *want);
  json prefixed = messages;
  prefixed[1]["prefix"] = true;
  ex = Post("/v1/chat/completions", {{"messages", prefixed}, {"max_tokens", 2}});
  ASSERT_EQ(ex->status(), 200) << ex->raw_body();
  EXPECT_EQ(PromptOf(cluster_->Calls().back()), *want);
  // /tokenize takes the same fields.
  auto t = Post("/tokenize", {{"messages", messages}, {"continue_final_message", true}});
  ASSERT_EQ(t->status(), 200) << t->raw_body();
  EXPECT_EQ(t->body()["tokens"], json(*want));

  ex = Post("/v1/chat/completions",
            {{"messages", {{{"role", "user"}, {"content", "Q"}}}}, {"continue_final_message", true}});
  EXPECT_EQ(ex->status(), 400);
  EXPECT_EQ(ex->body()["error"]["param"], "continue_final_message");
  ex = Post("/v1/chat/completions",
            {{"messages", {{{"role", "user"}, {"content", "Q"}}}}, {"add_generation_prompt", false}});
  EXPECT_EQ(ex->status(), 400);
  EXPECT_EQ(ex->body()["error"]["param"], "add_generation_prompt");
}

TEST_F(GatewayTest, TokenizeAndDetokenize) {
  // A prompt tokenizes as a completion with it would (BOS first unless add_special_tokens is false).
  auto t = Post("/tokenize", {{"prompt", "Hello, world!"}, {"return_token_strs", true}});
  ASSERT_EQ(t->status(), 200) << t->raw_body();
  EXPECT_EQ(t->body()["tokens"], json({0, 47, 477, 86, 19, 707, 8}));
  EXPECT_EQ(t->body()["count"], 7);
  EXPECT_EQ(t->body()["max_model_len"], 1024);
  ASSERT_EQ(t->body()["token_strs"].size(), 7u);
  EXPECT_EQ(t->body()["token_strs"][0], "<｜begin▁of▁sentence｜>");
  EXPECT_EQ(t->body()["token_strs"][3], *tok_->IdToToken(86));
  t = Post("/tokenize", {{"model", "tiny-v4"}, {"prompt", "Hello, world!"}, {"add_special_tokens", false}});
  EXPECT_EQ(t->body()["tokens"], json({47, 477, 86, 19, 707, 8}));

  auto d = Post("/detokenize", {{"tokens", {47, 477, 86, 19, 707, 8}}});
  ASSERT_EQ(d->status(), 200) << d->raw_body();
  EXPECT_EQ(d->body(), json({{"prompt", "Hello, world!"}}));
  d = Post("/detokenize", {{"tokens", {0, 47, 477, 86, 1}}});
  EXPECT_EQ(d->body()["prompt"], "<｜begin▁of▁sentence｜>Hello<｜end▁of▁sentence｜>");
  d = Post("/detokenize", {{"tokens", json::array()}});
  EXPECT_EQ(d->body()["prompt"], "");

  struct Case {
    std::string path, body;
    int status;
    std::string param;
  };
  const std::vector<Case> cases = {
      {"/tokenize", R"({})", 400, "prompt"},
      {"/tokenize", R"({"prompt": "x", "messages": []})", 400, "prompt"},
      {"/tokenize", R"({"prompt": [1, 2]})", 400, "prompt"},
      {"/tokenize", R"({"messages": [{"role": "user"}]})", 400, "messages[0].content"},
      {"/tokenize", R"({"model": "gpt-x", "prompt": "x"})", 404, "model"},
      {"/detokenize", R"({})", 400, "tokens"},
      {"/detokenize", R"({"tokens": [1, 4096]})", 400, "tokens"},
      {"/detokenize", R"({"tokens": ["a"]})", 400, "tokens[0]"},
  };
  for (const Case& c : cases) {
    auto ex = Call("POST", c.path, c.body);
    EXPECT_EQ(ex->status(), c.status) << c.body << " " << ex->raw_body();
    EXPECT_EQ(ex->body()["error"]["param"], c.param) << c.body;
  }
  EXPECT_EQ(Call("GET", "/tokenize")->status(), 405);
}

// The Anthropic Messages API through the gateway, the model's output written by the test.
TEST_F(GatewayTest, MessagesWholeAndStreamed) {
  cluster_->mode = FakeCluster::Mode::kManual;
  const json tools = {{{"name", "get_weather"}, {"input_schema", {{"type", "object"}}}}};
  const json body = {{"model", "tiny-v4"}, {"max_tokens", 300}, {"system", "Be brief."},
                     {"thinking", {{"type", "enabled"}, {"budget_tokens", 100}}}, {"tools", tools},
                     {"messages", {{{"role", "user"}, {"content", "Weather?"}}}}};
  const std::string output =
      "Need weather.</think>Checking.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
      "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
  auto out = tok_->Encode(output);
  ASSERT_OK(out);

  // count_tokens counts what a worker gets.
  auto count = Post("/v1/messages/count_tokens", body);
  ASSERT_EQ(count->status(), 200) << count->raw_body();

  auto ex = Post("/v1/messages", body);
  auto call = cluster_->Calls().back();
  const std::vector<int32_t> prompt = PromptOf(call);
  EXPECT_EQ(count->body(), json({{"input_tokens", prompt.size()}}));
  auto text = tok_->Encode("<｜Assistant｜><think>");
  ASSERT_OK(text);
  EXPECT_TRUE(std::equal(text->rbegin(), text->rend(), prompt.rbegin())) << "thinking mode";
  EXPECT_EQ(call->request.max_new_tokens(), 300u);
  call->Tokens(*out);
  call->Tokens({tok_->special_ids().eos}, "stop");
  call->End();
  ASSERT_EQ(ex->status(), 200) << ex->raw_body();
  json m = ex->body();
  EXPECT_EQ(m["id"].get<std::string>().rfind("msg_", 0), 0u);
  EXPECT_EQ(m["type"], "message");
  EXPECT_EQ(m["role"], "assistant");
  EXPECT_EQ(m["model"], "tiny-v4");
  ASSERT_EQ(m["content"].size(), 3u) << m.dump();
  EXPECT_EQ(m["content"][0], json::parse(R"({"type": "thinking", "thinking": "Need weather.", "signature": ""})"));
  EXPECT_EQ(m["content"][1], json::parse(R"({"type": "text", "text": "Checking."})"));
  EXPECT_EQ(m["content"][2]["type"], "tool_use");
  EXPECT_EQ(m["content"][2]["id"].get<std::string>().rfind("toolu_", 0), 0u);
  EXPECT_EQ(m["content"][2]["name"], "get_weather");
  EXPECT_EQ(m["content"][2]["input"], json({{"city", "Paris"}}));
  EXPECT_EQ(m["stop_reason"], "tool_use");
  EXPECT_TRUE(m["stop_sequence"].is_null());
  EXPECT_EQ(m["usage"], json({{"input_tokens", prompt.size()},
                              {"output_tokens", out->size() + 1},
                              {"cache_read_input_tokens", 0}}));

  // Streamed: the same blocks as Anthropic's event sequence.
  json streamed = body;
  streamed["stream"] = true;
  ex = Post("/v1/messages", streamed);
  call = cluster_->Calls().back();
  for (int32_t id : *out) call->Tokens({id});
  call->Tokens({tok_->special_ids().eos}, "stop");
  call->End();
  ASSERT_TRUE(ex->done());
  std::vector<json> events = ex->AnthropicEvents();
  ASSERT_GE(events.size(), 12u);
  EXPECT_EQ(events[0]["type"], "message_start");
  EXPECT_EQ(events[0]["message"]["usage"]["input_tokens"], prompt.size());
  EXPECT_EQ(events[1]["type"], "ping");
  std::string thinking, content, args;
  std::vector<std::string> blocks;
  int open = -1;
  for (size_t i = 2; i + 2 < events.size(); ++i) {
    const json& e = events[i];
    if (e["type"] == "content_block_start") {
      EXPECT_EQ(open, -1) << "a block opened inside another";
      open = e["index"].get<int>();
      EXPECT_EQ(open, static_cast<int>(blocks.size()));
      blocks.push_back(e["content_block"]["type"].get<std::string>());
    } else if (e["type"] == "content_block_stop") {
      EXPECT_EQ(e["index"], open);
      open = -1;
    } else {
      ASSERT_EQ(e["type"], "content_block_delta") << e.dump();
      EXPECT_EQ(e["index"], open);
      const json& d = e["delta"];
      if (d["type"] == "thinking_delta") thinking += d["thinking"].get<std::string>();
      if (d["type"] == "text_delta") content += d["text"].get<std::string>();
      if (d["type"] == "input_json_delta") args += d["partial_json"].get<std::string>();
    }
  }
  EXPECT_EQ(blocks, (std::vector<std::string>{"thinking", "text", "tool_use"}));
  EXPECT_EQ(thinking, "Need weather.");
  EXPECT_EQ(content, "Checking.");
  EXPECT_EQ(json::parse(args), json({{"city", "Paris"}}));
  EXPECT_EQ(events[events.size() - 2], json::parse(absl::StrCat(
      R"({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"input_tokens": )",
      prompt.size(), R"(, "output_tokens": )", out->size() + 1, R"(, "cache_read_input_tokens": 0}})")));
  EXPECT_EQ(events.back(), json({{"type", "message_stop"}}));

  // A stop sequence; max_tokens.
  cluster_->mode = FakeCluster::Mode::kEcho;  // echoes the prompt: "...<｜User｜>Say hi END now<｜Assistant｜>..."
  ex = Post("/v1/messages", {{"max_tokens", 50}, {"stop_sequences", {"END"}},
                             {"messages", {{{"role", "user"}, {"content", "Say hi END now"}}}}});
  ASSERT_EQ(ex->status(), 200) << ex->raw_body();
  EXPECT_EQ(ex->body()["stop_reason"], "stop_sequence");
  EXPECT_EQ(ex->body()["stop_sequence"], "END");
  EXPECT_EQ(ex->body()["content"], json::parse(R"([{"type": "text", "text": "<｜User｜>Say hi "}])"));
  ex = Post("/v1/messages", {{"max_tokens", 2}, {"messages", {{{"role", "user"}, {"content", "Hello, world!"}}}}});
  EXPECT_EQ(ex->body()["stop_reason"], "max_tokens");
  EXPECT_EQ(ex->body()["usage"]["output_tokens"], 2);
}

TEST_F(GatewayTest, MessagesErrorsInAnthropicsShape) {
  auto is_error = [](const std::shared_ptr<RecordingExchange>& ex, int status, const std::string& type,
                     const std::string& text) {
    EXPECT_EQ(ex->status(), status) << ex->raw_body();
    json e = ex->body();
    EXPECT_EQ(e["type"], "error") << e.dump();
    EXPECT_EQ(e["error"]["type"], type) << e.dump();
    EXPECT_NE(e["error"]["message"].get<std::string>().find(text), std::string::npos) << e.dump();
  };
  const json hi = {{{"role", "user"}, {"content", "Hi"}}};
  is_error(Post("/v1/messages", {{"messages", hi}}), 400, "invalid_request_error", "max_tokens");
  is_error(Call("POST", "/v1/messages", "{bad"), 400, "invalid_request_error", "not valid JSON");
  is_error(Post("/v1/messages", {{"model", "claude-x"}, {"max_tokens", 5}, {"messages", hi}}), 404, "not_found_error",
           "claude-x");
  is_error(Post("/v1/messages", {{"max_tokens", 2000}, {"messages", hi}}), 400, "invalid_request_error",
           "maximum context length");
  is_error(Call("GET", "/v1/messages"), 405, "invalid_request_error", "use POST");
  is_error(Call("POST", "/v1/messages/batches", "{}"), 404, "not_found_error", "no such endpoint");
  EXPECT_EQ(metrics_.requests("/v1/messages", "400"), 3u);

  // Mid-stream failure: an error event ends the stream.
  cluster_->mode = FakeCluster::Mode::kManual;
  auto ex = Post("/v1/messages", {{"max_tokens", 5}, {"messages", hi}, {"stream", true}});
  auto call = cluster_->Calls().back();
  call->Tokens({47});
  call->End(absl::UnavailableError("connection reset"));
  ASSERT_TRUE(ex->done());
  auto events = ex->AnthropicEvents();
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events.front()["type"], "message_start");
  EXPECT_EQ(events.back()["type"], "error");
  EXPECT_EQ(events.back()["error"]["type"], "overloaded_error");

  // No worker: 503 before any event, streamed or not.
  Build(1, {}, /*health=*/false);
  is_error(Post("/v1/messages", {{"max_tokens", 5}, {"messages", hi}, {"stream", true}}), 503, "overloaded_error",
           "");

  // x-api-key is accepted like the bearer token, on every endpoint; a wrong key is 401 in each API's shape.
  Build(1, {ApiKeys({"k3y"})});
  cluster_->mode = FakeCluster::Mode::kEcho;
  const std::string body = json({{"max_tokens", 2}, {"messages", hi}}).dump();
  EXPECT_EQ(Call("POST", "/v1/messages", body, {{"x-api-key", "k3y"}, {"anthropic-version", "2023-06-01"}})->status(),
            200);
  EXPECT_EQ(Call("POST", "/v1/messages", body, {{"authorization", "Bearer k3y"}})->status(), 200);
  EXPECT_EQ(Call("GET", "/v1/models", "", {{"x-api-key", "k3y"}})->status(), 200);
  is_error(Call("POST", "/v1/messages", body, {{"x-api-key", "nope"}}), 401, "authentication_error", "invalid API key");
  is_error(Call("POST", "/v1/messages", body), 401, "authentication_error", "x-api-key");
  auto openai_shape = Call("GET", "/v1/models", "", {{"x-api-key", "nope"}});
  EXPECT_EQ(openai_shape->status(), 401);
  EXPECT_EQ(openai_shape->body()["error"]["type"], "authentication_error");
}

}  // namespace
}  // namespace numoe::router

namespace numoe::router {
namespace {

TEST_F(GatewayTest, MaxPromptTokens) {
  // "Hello, world!" is 6 tokens + BOS = 7 (tests/data/tiny-v4/tokenizer_cases.json): 7 passes a limit of 7,
  // the limit of 6 is a 400 naming the limit and the prompt's field on each endpoint.
  Build(1, {}, true, FrontendOptions{.default_max_tokens = 16, .max_prompt_tokens = 7});
  auto ok = Post("/v1/completions", {{"prompt", "Hello, world!"}, {"max_tokens", 2}});
  ASSERT_EQ(ok->status(), 200) << ok->raw_body();
  EXPECT_EQ(ok->body()["usage"]["prompt_tokens"], 7);

  Build(1, {}, true, FrontendOptions{.default_max_tokens = 16, .max_prompt_tokens = 6});
  auto too_long = Post("/v1/completions", {{"prompt", "Hello, world!"}, {"max_tokens", 2}});
  ASSERT_EQ(too_long->status(), 400) << too_long->raw_body();
  json e = too_long->body()["error"];
  EXPECT_EQ(e["param"], "prompt");
  EXPECT_NE(e["message"].get<std::string>().find("at most 6 (--max-prompt-tokens)"), std::string::npos) << e;
  EXPECT_NE(e["message"].get<std::string>().find("has 7 tokens"), std::string::npos) << e;
  // Token ids count the same way (no BOS added to ids).
  EXPECT_EQ(Post("/v1/completions", {{"prompt", {1, 2, 3, 4, 5, 6}}, {"max_tokens", 2}})->status(), 200);
  EXPECT_EQ(Post("/v1/completions", {{"prompt", {1, 2, 3, 4, 5, 6, 7}}, {"max_tokens", 2}})->status(), 400);

  auto chat = Post("/v1/chat/completions",
                   {{"messages", {{{"role", "user"}, {"content", "Hello, world! Hello, world!"}}}}, {"max_tokens", 2}});
  ASSERT_EQ(chat->status(), 400) << chat->raw_body();
  EXPECT_EQ(chat->body()["error"]["param"], "messages");
  EXPECT_NE(chat->raw_body().find("--max-prompt-tokens"), std::string::npos);

  auto msg = Post("/v1/messages", {{"max_tokens", 2}, {"messages", {{{"role", "user"}, {"content", "Hello, world!"}}}}});
  EXPECT_EQ(msg->status(), 400) << msg->raw_body();
  EXPECT_NE(msg->raw_body().find("--max-prompt-tokens"), std::string::npos);
}

}  // namespace
}  // namespace numoe::router
