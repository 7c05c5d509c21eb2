// Fuzzes the gRPC request validation (router/grpc/generate_request.h): the input after byte 0 is parsed
// with ParseFromArray as a numoe.v1 GenerateRequest (byte 0 even) or TokenizeRequest (odd) and checked by
// PrepareGenerate / PrepareTokenize, the functions numoe.v1.Inference calls; a Generate call that passes is
// started on in-process echo workers (tests/unit/router/fake_worker_client.h) as the service starts it.
// Properties: a validated spec is within its documented bounds, and every choice ends with one final event.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "numoe/v1/inference.pb.h"
#include "router/grpc/generate_request.h"
#include "router/openai/chat.h"
#include "tests/support/fixtures.h"
#include "tests/unit/router/fake_worker_client.h"

namespace numoe::router {
namespace {

[[noreturn]] void Fail(const std::string& why) {
  std::fprintf(stderr, "grpc fuzz: %s\n", why.c_str());
  std::abort();
}

// What the service's reactor does with the events, minus the writes.
class Sink : public ChoiceSink {
 public:
  Sink(const GenerateCall& call) : finals_(static_cast<size_t>(call.spec.n), 0) {
    for (int32_t i = 0; i < call.spec.n; ++i) {
      if (call.chat) parsers_.push_back(std::make_unique<openai::ChatStreamParser>(call.starts_in_reasoning, call.tools));
    }
  }
  void OnEvent(ChoiceEvent ev) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (ev.final && !ev.status.ok()) {
      failed_ = true;
      return;
    }
    if (ev.index < 0 || static_cast<size_t>(ev.index) >= finals_.size()) Fail("event for choice " + std::to_string(ev.index));
    if (finals_[static_cast<size_t>(ev.index)] > 0) Fail("an event after the final one");
    if (!parsers_.empty()) {
      (void)parsers_[static_cast<size_t>(ev.index)]->Add(ev.text);
      if (ev.final) (void)parsers_[static_cast<size_t>(ev.index)]->Finish();
    }
    if (ev.final) ++finals_[static_cast<size_t>(ev.index)];
  }
  bool complete() {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_) return true;
    for (int f : finals_) {
      if (f != 1) return false;
    }
    return true;
  }

 private:
  std::mutex mu_;
  std::vector<int> finals_;
  std::vector<std::unique_ptr<openai::ChatStreamParser>> parsers_;
  bool failed_ = false;
};

struct Server {
  Server() {
    auto t = tokenizer::Tokenizer::Load(test::TinyDir());
    if (!t.ok()) Fail(t.status().ToString());
    tok = std::move(*t);
    cluster = std::make_shared<testing::FakeCluster>();
    cluster->mode = testing::FakeCluster::Mode::kEcho;
    BalancerOptions bo;
    bo.workers = {"w0"};
    bo.health_interval_s = 0;
    balancer = std::make_unique<Balancer>(bo, testing::FakeFactory(cluster));
    balancer->CheckHealthNow();
    frontend = std::make_unique<Frontend>(*tok, ModelInfo{"tiny-v4", 1024, 96, 1700000000}, *balancer, metrics,
                                          FrontendOptions{8});
    chat = std::make_unique<openai::ChatEncoder>(*tok, chat::EncoderProfile::kPreview);
  }
  Metrics metrics;
  std::unique_ptr<tokenizer::Tokenizer> tok;
  std::shared_ptr<testing::FakeCluster> cluster;
  std::unique_ptr<Balancer> balancer;
  std::unique_ptr<Frontend> frontend;
  std::unique_ptr<openai::ChatEncoder> chat;
};

}  // namespace
}  // namespace numoe::router

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace numoe::router;
  static Server* server = new Server();
  if (size == 0) return 0;
  const int len = static_cast<int>(size - 1);
  if ((data[0] & 1) != 0) {
    numoe::v1::TokenizeRequest req;
    if (!req.ParseFromArray(data + 1, len)) return 0;
    auto ids = PrepareTokenize(*server->frontend, req);
    if (ids.ok()) {
      for (int32_t id : *ids) {
        if (id < 0 || id >= server->tok->vocab_size()) Fail("token id out of the vocabulary");
      }
    }
    return 0;
  }
  numoe::v1::GenerateRequest req;
  if (!req.ParseFromArray(data + 1, len)) return 0;
  auto call = PrepareGenerate(*server->frontend, *server->chat, req);
  if (!call.ok()) return 0;
  const ChoiceSpec& spec = call->spec;
  const ModelInfo& m = server->frontend->model();
  if (spec.prompt_ids.empty() || spec.max_tokens < 1 ||
      spec.prompt_ids.size() + static_cast<size_t>(spec.max_tokens) > static_cast<size_t>(m.max_context)) {
    Fail("prompt/max_tokens outside the context");
  }
  for (int32_t id : spec.prompt_ids) {
    if (id < 0 || id >= m.vocab_size) Fail("prompt id out of the vocabulary");
  }
  if (spec.n < 1 || spec.n > numoe::kMaxChoices) Fail("n out of range");
  auto sink = std::make_shared<Sink>(*call);
  auto run = server->frontend->Start(call->spec, sink);
  if (run.ok() && !sink->complete()) Fail("a choice did not end");
  {
    std::lock_guard<std::mutex> lock(server->cluster->mu);
    server->cluster->calls.clear();
  }
  return 0;
}
