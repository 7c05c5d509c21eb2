// Fuzzes the REST request path (router/http/rest_gateway.h): RestGateway::Handle, the function the HTTP
// server calls, on every endpoint, with the real Frontend, Balancer and chat encoder over the fixture
// tokenizer and in-process echo workers (tests/unit/router/fake_worker_client.h). Byte 0 picks the route
// (and a wrong method now and then), the rest is the body.
// Properties: every request gets exactly one complete answer (a response, or events closed by EndEvents);
// no 500; a JSON answer is valid JSON; a stream is "data: ..." frames.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "router/http/rest_gateway.h"
#include "router/openai/chat.h"
#include "tests/support/fixtures.h"
#include "tests/unit/router/fake_worker_client.h"

namespace numoe::router {
namespace {

[[noreturn]] void Fail(const std::string& why) {
  std::fprintf(stderr, "rest fuzz: %s\n", why.c_str());
  std::abort();
}

// Checks the exchange protocol of exchange.h as it goes.
class CheckingExchange : public HttpExchange {
 public:
  void Respond(int status, const std::string& content_type, std::string body, HttpHeaders) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_ || events_ > 0) Fail("Respond after the exchange completed or after events");
    done_ = true;
    if (status < 200 || status >= 600) Fail("status " + std::to_string(status));
    if (status == 500) Fail("500: " + body);
    if (content_type == "application/json" && !nlohmann::json::accept(body)) Fail("invalid JSON body: " + body);
    gone_ = nullptr;
  }
  void SendEvent(std::string event) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) Fail("an event after the end");
    ++events_;
    const bool openai = event.rfind("data: ", 0) == 0, anthropic = event.rfind("event: ", 0) == 0;
    if ((!openai && !anthropic) || event.size() < 2 || event.substr(event.size() - 2) != "\n\n") {
      Fail("bad SSE frame: " + event);
    }
    if (event.find("\"api_error\"") != std::string::npos || event.find("\"internal_error\"") != std::string::npos) {
      Fail("an internal error event: " + event);
    }
  }
  void EndEvents() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) Fail("EndEvents after the end");
    done_ = true;
    gone_ = nullptr;
  }
  void OnClientGone(std::function<void()> fn) override {
    std::lock_guard<std::mutex> lock(mu_);
    gone_ = std::move(fn);
  }
  bool done() {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }

 private:
  std::mutex mu_;
  bool done_ = false;
  int events_ = 0;
  std::function<void()> gone_;
};

struct Server {
  Server() {
    auto t = tokenizer::Tokenizer::Load(test::TinyDir());
    if (!t.ok()) Fail(t.status().ToString());
    tok = std::move(*t);
    cluster = std::make_shared<testing::FakeCluster>();
    cluster->mode = testing::FakeCluster::Mode::kEcho;
    BalancerOptions bo;
    bo.workers = {"w0", "w1"};
    bo.health_interval_s = 0;
    balancer = std::make_unique<Balancer>(bo, testing::FakeFactory(cluster));
    balancer->CheckHealthNow();
    // A short context keeps the echoed generations small (the default max_tokens is 8).
    frontend = std::make_unique<Frontend>(*tok, ModelInfo{"tiny-v4", 1024, 96, 1700000000}, *balancer, metrics,
                                          FrontendOptions{8});
    chat = std::make_unique<openai::ChatEncoder>(*tok, chat::EncoderProfile::kPreview);
    gateway = std::make_unique<RestGateway>(*frontend, *chat, *balancer, metrics, RestGatewayOptions{});
  }
  Metrics metrics;
  std::unique_ptr<tokenizer::Tokenizer> tok;
  std::shared_ptr<testing::FakeCluster> cluster;
  std::unique_ptr<Balancer> balancer;
  std::unique_ptr<Frontend> frontend;
  std::unique_ptr<openai::ChatEncoder> chat;
  std::unique_ptr<RestGateway> gateway;
};

struct Route {
  const char* method;
  const char* target;
};
constexpr Route kRoutes[] = {{"POST", "/v1/completions"}, {"POST", "/v1/chat/completions"},
                             {"POST", "/v1/messages"},    {"POST", "/v1/messages/count_tokens"},
                             {"POST", "/tokenize"},       {"POST", "/detokenize"},
                             {"GET", "/v1/models"},       {"GET", "/health"},
                             {"GET", "/metrics"},         {"GET", "/v1/completions"},
                             {"POST", "/v1/nothing?x=1"}};

}  // namespace
}  // namespace numoe::router

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace numoe::router;
  static Server* server = new Server();
  if (size == 0) return 0;
  const Route& r = kRoutes[data[0] % (sizeof(kRoutes) / sizeof(kRoutes[0]))];
  HttpRequest request{r.method, r.target, {{"content-type", "application/json"}},
                      std::string(reinterpret_cast<const char*>(data) + 1, size - 1)};
  auto ex = std::make_shared<CheckingExchange>();
  server->gateway->Handle(request, ex);
  // The echo workers answer inside Generate: every exchange is complete when Handle returns.
  if (!ex->done()) Fail(std::string("no answer on ") + r.target);
  {
    std::lock_guard<std::mutex> lock(server->cluster->mu);
    server->cluster->calls.clear();
  }
  return 0;
}
