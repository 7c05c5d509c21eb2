// The REST gateway end to end without sockets: a recording HttpExchange, the real Frontend/Balancer and
// in-process fake workers. Covers SSE framing, prompt shapes, chat output parsing, every error status,
// failures before and after the first token, and cancellation when the client goes away.
#include "router/http/rest_gateway.h"

#include <gtest/gtest.h>

#include "router/openai/chat.h"
#include "tests/unit/router/fake_worker_client.h"
#include "tests/support/status_matchers.h"

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

  void Build(int workers, RestGatewayOptions options, bool health = true) {
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
    frontend_ = std::make_unique<Frontend>(*tok_, m, *balancer_, metrics_, FrontendOptions{16});
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
  EXPECT_EQ(r["usage"], json::parse(R"({"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13})"));
  // The worker got BOS + the prompt, max_tokens and greedy-by-default fields.
  auto call = cluster_->Calls().back();
  EXPECT_EQ(std::vector<int32_t>(call->request.prompt_ids().begin(), call->request.prompt_ids().end()),
            (std::vector<int32_t>{0, 47, 477, 86, 19, 707, 8}));
  EXPECT_EQ(call->request.max_new_tokens(), 6u);
  EXPECT_FLOAT_EQ(call->request.sampling().temperature(), 1.0f);
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
  Build(1, {"k3y"});
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

}  // namespace
}  // namespace numoe::router
