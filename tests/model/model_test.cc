// Model-side unit tests that need no goldens: state size accounting, sampling, request validation,
// and step errors.
#include <gtest/gtest.h>

#include <map>
#include <vector>

#include "common/checkpoint.h"
#include "common/config.h"
#include "backends/cpu/cpu_model.h"
#include "worker/experts/reference_experts.h"
#include "model/generation.h"
#include "model/sampling.h"
#include "model/state_size.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"

namespace numoe {
namespace {

TEST(StateSize, V4FlashGrowsBy3440ValuesPerToken) {
  auto cfg = LoadModelConfig(test::TestDataDir() + "/v4-flash-0731.config.json");
  ASSERT_OK(cfg);
  StateSize s = ComputeStateSize(*cfg);
  EXPECT_DOUBLE_EQ(s.growing_values_per_token, 3440.0);
  // Fixed: 43 windows of 128 x 512; 20 HCA pending windows of 128 tokens x (kv + gate) 512;
  // 21 CSA layers with pending 4 x (kv + gate) 1024 + overlap 4 x (kv + gate) 512, and the indexer's
  // (256 / 128 wide).
  EXPECT_EQ(s.fixed_values, 43 * 128 * 512 + 20 * 2 * 128 * 512 + 21 * (2 * 4 * 1024 + 2 * 4 * 512) +
                                21 * (2 * 4 * 256 + 2 * 4 * 128));
  EXPECT_EQ(s.GrowingValuesAt(*cfg, 1024), 3440 * 1024);
}

TEST(StateSize, CpuModelHoldsExactlyTheAccountedState) {
  ASSERT_OK_AND_ASSIGN(test::TinyModel* t, test::TinyModel::Get());
  cpu::CpuModel* model = t->model.get();
  const ModelConfig& cfg = t->ckpt->config();
  StateSize want = ComputeStateSize(cfg);
  auto seq = model->CreateSequence();
  ASSERT_OK(seq);
  std::vector<int32_t> toks(300);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<int32_t>((i * 37) % cfg.vocab_size);
  std::vector<SequenceLogits> out;
  int64_t fed = 0;
  for (int64_t chunk : {37, 100, 1, 162}) {
    SequenceStep st{*seq, std::span<const int32_t>(toks.data() + fed, static_cast<size_t>(chunk)), false};
    ASSERT_OK(model->Forward({&st, 1}, t->experts.get(), &out));
    fed += chunk;
    auto mem = model->Memory(*seq);
    ASSERT_OK(mem);
    EXPECT_EQ(mem->position, fed);
    EXPECT_EQ(mem->growing_bytes, want.GrowingValuesAt(cfg, fed) * 4) << "after " << fed << " tokens";
    EXPECT_GE(mem->fixed_bytes, want.fixed_values * 4);
    EXPECT_GE(mem->capacity_bytes, mem->fixed_bytes + mem->growing_bytes);
  }
  EXPECT_OK(model->ReleaseSequence(*seq));  // the fixture is shared
}

TEST(Forward, RejectsBadSteps) {
  ASSERT_OK_AND_ASSIGN(test::TinyModel* t, test::TinyModel::Get());
  cpu::CpuModel* model = t->model.get();
  ExpertBackend* experts = t->experts.get();
  std::vector<SequenceLogits> out;
  std::vector<int32_t> ok_tokens = {1, 2, 3}, bad_tokens = {1, 5000};
  SequenceStep missing{999, ok_tokens, false};
  Status st = model->Forward({&missing, 1}, experts, &out);
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
  auto seq = model->CreateSequence();
  ASSERT_OK(seq);
  SequenceStep bad{*seq, bad_tokens, false};
  st = model->Forward({&bad, 1}, experts, &out);
  EXPECT_NE(st.message().find("token id 5000"), std::string::npos) << st;
  SequenceStep twice[2] = {{*seq, ok_tokens, false}, {*seq, ok_tokens, false}};
  st = model->Forward({twice, 2}, experts, &out);
  EXPECT_NE(st.message().find("twice"), std::string::npos) << st;
  EXPECT_OK(model->ReleaseSequence(*seq));
  EXPECT_FALSE(model->ReleaseSequence(*seq).ok());
}

TEST(Sampling, GreedyAndSeededSampling) {
  std::vector<float> logits = {0.1f, 2.0f, 1.9f, -1.0f, 1.95f};
  Sampler greedy(SamplingParams{});
  EXPECT_EQ(greedy.Sample(logits.data(), 5), 1);
  SamplingParams p;
  p.temperature = 1.0;
  p.seed = 42;
  Sampler a(p), b(p);
  std::vector<int32_t> sa, sb;
  for (int i = 0; i < 200; ++i) {
    sa.push_back(a.Sample(logits.data(), 5));
    sb.push_back(b.Sample(logits.data(), 5));
  }
  EXPECT_EQ(sa, sb);  // same seed, same output
  std::map<int32_t, int> hist;
  for (int32_t t : sa) hist[t]++;
  EXPECT_GE(hist.size(), 3u);  // temperature 1 spreads over the close logits
  p.top_k = 1;
  Sampler k1(p);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(k1.Sample(logits.data(), 5), 1);
  p.top_k = 0;
  p.top_p = 1e-6;
  Sampler p1(p);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(p1.Sample(logits.data(), 5), 1);
  p.top_k = 2;
  p.top_p = 1.0;
  Sampler k2(p);
  for (int i = 0; i < 100; ++i) {
    int32_t t = k2.Sample(logits.data(), 5);
    EXPECT_TRUE(t == 1 || t == 4) << t;
  }
}

TEST(Sampling, ValidationNamesTheField) {
  SamplingParams p;
  p.temperature = -1;
  EXPECT_NE(ValidateSampling(p).message().find("temperature"), std::string::npos);
  p = {};
  p.top_p = 0;
  EXPECT_NE(ValidateSampling(p).message().find("top_p"), std::string::npos);
  p = {};
  p.top_k = -3;
  EXPECT_NE(ValidateSampling(p).message().find("top_k"), std::string::npos);
}

TEST(Generate, ValidatesRequests) {
  GenerateRequest r;
  EXPECT_NE(ValidateRequest(r, 100).message().find("prompt"), std::string::npos);
  r.prompt = {1, 100};
  EXPECT_NE(ValidateRequest(r, 100).message().find("prompt[1]"), std::string::npos);
  r.prompt = {1};
  r.max_new_tokens = -1;
  EXPECT_NE(ValidateRequest(r, 100).message().find("max_new_tokens"), std::string::npos);
}

}  // namespace
}  // namespace numoe
