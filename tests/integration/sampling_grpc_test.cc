// The sampling extras on numoe-router's gRPC API (numoe.v1.Inference.Generate) against `numoe serve` on
// tiny-v4 with the CPU backend: every golden prompt's greedy tokens come with log-probs equal to log-softmax
// of the golden logits (chosen and top 5, within 2e-3), n choices arrive tagged with their index and are
// reproducible with a seed, logit_bias forces a token, and out-of-range fields are INVALID_ARGUMENT naming
// the field.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <thread>

#include "numoe/v1/inference.grpc.pb.h"
#include "tests/support/files.h"
#include "tests/support/fixtures.h"
#include "tests/support/http.h"
#include "tests/support/process.h"
#include "tests/support/status_matchers.h"

namespace numoe::test {
namespace {

using namespace std::chrono_literals;

struct Streamed {
  grpc::Status status;
  std::map<uint32_t, std::vector<int32_t>> ids;                // by choice
  std::map<uint32_t, std::vector<v1::TokenLogprobs>> logprobs;  // by choice
  std::map<uint32_t, std::string> finish;
};

Streamed Generate(v1::Inference::Stub& stub, const v1::GenerateRequest& req) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 300s);
  auto reader = stub.Generate(&ctx, req);
  v1::GenerateResponse resp;
  Streamed out;
  while (reader->Read(&resp)) {
    auto& ids = out.ids[resp.index()];
    ids.insert(ids.end(), resp.token_ids().begin(), resp.token_ids().end());
    auto& lps = out.logprobs[resp.index()];
    lps.insert(lps.end(), resp.logprobs().begin(), resp.logprobs().end());
    if (!resp.finish_reason().empty()) out.finish[resp.index()] = resp.finish_reason();
  }
  out.status = reader->Finish();
  return out;
}

v1::GenerateRequest TokenRequest(const GoldenPrompt& g, uint32_t max_tokens) {
  v1::GenerateRequest req;
  req.set_model("tiny-v4");
  for (int32_t id : g.input_ids) req.mutable_token_ids()->add_ids(id);
  req.set_max_tokens(max_tokens);
  req.mutable_sampling()->set_temperature(0);
  req.set_ignore_eos(true);
  return req;
}

double LogSoftmax(const GoldenPrompt& g, int64_t vocab, size_t step, int32_t token) {
  const float* row = g.step_logits.data() + step * static_cast<size_t>(vocab);
  const double m = *std::max_element(row, row + vocab);
  double s = 0;
  for (int64_t i = 0; i < vocab; ++i) s += std::exp(row[i] - m);
  return row[token] - m - std::log(s);
}

TEST(SamplingGrpc, LogprobsNChoicesLogitBiasAndErrors) {
  ASSERT_OK_AND_ASSIGN(const Goldens goldens, Goldens::Load(TinyDir()));
  const int64_t vocab = static_cast<int64_t>(goldens[0].step_logits.size() / goldens[0].greedy.size());
  const TempDir tmp("numoe-sampling-grpc");
  const int http = FreePort(), grpc_port = FreePort();
  Child serve = Child::Start({BinPath("numoe"), "serve", "--model", TinyDir(), "--workers", "1", "--backend", "cpu",
                              "--no-numa-bind", "--threads-per-worker", "1", "--port", std::to_string(http),
                              "--grpc-port", std::to_string(grpc_port)},
                             {.log = tmp / "serve.log", .stdout_file = tmp / "serve.out", .new_group = true});
  const std::string line = serve.WaitForLine();
  ASSERT_FALSE(line.empty()) << serve.Log();
  auto stub = v1::Inference::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(grpc_port), grpc::InsecureChannelCredentials()));

  for (const GoldenPrompt& g : goldens) {
    v1::GenerateRequest req = TokenRequest(g, static_cast<uint32_t>(g.greedy.size()));
    req.set_logprobs(true);
    req.set_top_logprobs(5);
    Streamed r = Generate(*stub, req);
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    ASSERT_EQ(r.ids.size(), 1u);
    EXPECT_EQ(r.ids[0], g.greedy) << g.name;
    ASSERT_EQ(r.logprobs[0].size(), g.greedy.size()) << g.name;
    for (size_t t = 0; t < g.greedy.size(); ++t) {
      const v1::TokenLogprobs& lp = r.logprobs[0][t];
      EXPECT_EQ(lp.token_id(), g.greedy[t]);
      EXPECT_NEAR(lp.logprob(), LogSoftmax(g, vocab, t, g.greedy[t]), 2e-3) << g.name << " step " << t;
      ASSERT_EQ(lp.top_logprobs_size(), 5);
      EXPECT_EQ(lp.top_logprobs(0).token_id(), g.greedy[t]);
      for (const v1::TopLogprob& top : lp.top_logprobs()) {
        EXPECT_NEAR(top.logprob(), LogSoftmax(g, vocab, t, top.token_id()), 2e-3) << g.name << " step " << t;
      }
    }
  }

  // n = 3 with a seed: three choices by index, the same again, not all equal.
  v1::GenerateRequest n3 = TokenRequest(goldens[0], 8);
  n3.set_n(3);
  n3.mutable_sampling()->set_temperature(1.0f);
  n3.mutable_sampling()->set_seed(77);
  Streamed a = Generate(*stub, n3), b = Generate(*stub, n3);
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  ASSERT_EQ(a.ids.size(), 3u);
  for (uint32_t i = 0; i < 3; ++i) {
    EXPECT_EQ(a.ids[i].size(), 8u);
    EXPECT_EQ(a.finish[i], "length");
    EXPECT_EQ(a.ids[i], b.ids[i]) << "choice " << i;
  }
  EXPECT_FALSE(a.ids[0] == a.ids[1] && a.ids[1] == a.ids[2]);

  // logit_bias +100 forces a token; penalties pass through.
  v1::GenerateRequest forced = TokenRequest(goldens[3], 4);
  (*forced.mutable_sampling()->mutable_logit_bias())[77] = 100.0f;
  forced.mutable_sampling()->set_frequency_penalty(0.5f);
  Streamed f = Generate(*stub, forced);
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  EXPECT_EQ(f.ids[0], std::vector<int32_t>(4, 77));

  // Out of range: INVALID_ARGUMENT naming the field.
  struct Bad {
    std::function<void(v1::GenerateRequest*)> edit;
    std::string field;
  };
  const std::vector<Bad> bad = {
      {[](v1::GenerateRequest* r) { r->set_n(17); }, "n"},
      {[](v1::GenerateRequest* r) { r->set_logprobs(true);
         r->set_top_logprobs(21); }, "top_logprobs"},
      {[](v1::GenerateRequest* r) { r->mutable_sampling()->set_presence_penalty(3); }, "presence_penalty"},
      {[](v1::GenerateRequest* r) { r->mutable_sampling()->set_repetition_penalty(0); }, "repetition_penalty"},
      {[](v1::GenerateRequest* r) { r->mutable_sampling()->set_min_p(2); }, "min_p"},
      {[](v1::GenerateRequest* r) { (*r->mutable_sampling()->mutable_logit_bias())[5000] = 1; }, "logit_bias"},
  };
  for (const Bad& c : bad) {
    v1::GenerateRequest req = TokenRequest(goldens[0], 2);
    c.edit(&req);
    Streamed r = Generate(*stub, req);
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.field;
    EXPECT_NE(r.status.error_message().find(c.field), std::string::npos) << r.status.error_message();
  }
}

}  // namespace
}  // namespace numoe::test
