// The CPU backend against the transformers goldens in tests/data/{tiny-v4,demo-v4}/golden.safetensors:
// every prefill and step logit within 1e-3 and every greedy token equal, for whole, chunked and
// token-by-token prefill, one prompt at a time and all prompts in one batch; and p0's hidden streams
// layer by layer (localises a regression to the first layer that drifts).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/checkpoint.h"
#include "common/quant.h"
#include "common/safetensors.h"
#include "backends/cpu/cpu_model.h"
#include "worker/experts/reference_experts.h"
#include "model/generation.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"

namespace numoe {
namespace {

constexpr float kTol = 1e-3f;

using Golden = test::GoldenPrompt;

// A fixture model with its goldens (the shared tests/support TinyModel), by name.
using ModelUnderTest = test::TinyModel;
ModelUnderTest* Load(const std::string& name) {
  auto m = test::TinyModel::Get({.model = name});
  if (!m.ok()) ADD_FAILURE() << m.status();
  return m.ok() ? *m : nullptr;
}

// The golden prompt `name` ("p2") of m; the test fails (throws) when there is none.
const Golden& Prompt(const ModelUnderTest* m, const std::string& name) { return *m->goldens.Find(name).value(); }

// Max |a - b| and where.
std::pair<float, size_t> MaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
  float worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const float d = std::fabs(a[i] - b[i]);
    if (!(d <= worst)) {
      worst = d;
      at = i;
    }
  }
  return {worst, at};
}

void ExpectMatches(const Golden& g, const GenerateResult& r, const std::string& what) {
  ASSERT_EQ(r.prefill_logits.size(), g.prefill_logits.size()) << what;
  auto [pd, pat] = MaxDiff(r.prefill_logits, g.prefill_logits);
  EXPECT_LE(pd, kTol) << what << ": prefill logit " << pat << " differs by " << pd;
  EXPECT_EQ(r.tokens, g.greedy) << what;
  ASSERT_EQ(r.step_logits.size(), g.step_logits.size()) << what;
  auto [sd, sat] = MaxDiff(r.step_logits, g.step_logits);
  EXPECT_LE(sd, kTol) << what << ": step logit " << sat << " differs by " << sd;
}

GenerateRequest Request(const Golden& g, int64_t chunk) {
  GenerateRequest r;
  r.prompt = g.input_ids;
  r.max_new_tokens = static_cast<int64_t>(g.greedy.size());
  r.ignore_eos = true;
  r.prefill_chunk = chunk;
  r.keep_logits = true;
  return r;
}

struct Case {
  std::string model;
  std::string prompt;
  int64_t chunk;
};

class GoldenTest : public ::testing::TestWithParam<Case> {};

TEST_P(GoldenTest, LogitsAndGreedyTokensMatch) {
  const Case& c = GetParam();
  ModelUnderTest* m = Load(c.model);
  ASSERT_NE(m, nullptr);
  const Golden& g = Prompt(m, c.prompt);
  auto res = GenerateBatch(*m->model, *m->experts, {Request(g, c.chunk)});
  ASSERT_OK(res);
  ExpectMatches(g, (*res)[0], c.model + "/" + c.prompt + " chunk " + std::to_string(c.chunk));
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (const char* p : {"p0", "p1", "p2", "p3"}) {
    for (int64_t chunk : {0, 5, 1}) cases.push_back({"tiny-v4", p, chunk});
    for (int64_t chunk : {0, 7}) cases.push_back({"demo-v4", p, chunk});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenTest, ::testing::ValuesIn(AllCases()),
                         [](const auto& info) {
                           std::string m = info.param.model;
                           for (char& ch : m) {
                             if (ch == '-') ch = '_';
                           }
                           return m + "_" + info.param.prompt + "_chunk" + std::to_string(info.param.chunk);
                         });

class BatchTest : public ::testing::TestWithParam<std::pair<std::string, int64_t>> {};

TEST_P(BatchTest, AllPromptsInOneBatchMatch) {
  ModelUnderTest* m = Load(GetParam().first);
  ASSERT_NE(m, nullptr);
  std::vector<GenerateRequest> reqs;
  std::vector<std::string> names = {"p0", "p1", "p2", "p3"};
  for (const auto& p : names) reqs.push_back(Request(Prompt(m, p), GetParam().second));
  auto res = GenerateBatch(*m->model, *m->experts, reqs);
  ASSERT_OK(res);
  for (size_t i = 0; i < names.size(); ++i) {
    ExpectMatches(Prompt(m, names[i]), (*res)[i], GetParam().first + " batch/" + names[i]);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, BatchTest,
                         ::testing::Values(std::make_pair(std::string("tiny-v4"), int64_t{0}),
                                           std::make_pair(std::string("tiny-v4"), int64_t{5}),
                                           std::make_pair(std::string("demo-v4"), int64_t{0})));

TEST(HiddenStates, P0LayerByLayer) {
  ModelUnderTest* m = Load("tiny-v4");
  ASSERT_NE(m, nullptr);
  const int64_t L = m->ckpt->config().num_hidden_layers;
  std::map<int64_t, std::vector<float>> seen;
  m->model->set_hidden_hook([&](int64_t layer, const std::vector<float>& x) { seen[layer] = x; });
  auto seq = m->model->CreateSequence();
  ASSERT_OK(seq);
  const auto& ids = Prompt(m, "p0").input_ids;
  SequenceStep step{*seq, ids, true};
  std::vector<SequenceLogits> out;
  Status st = m->model->Forward({&step, 1}, m->experts.get(), &out);
  m->model->set_hidden_hook(nullptr);
  ASSERT_OK(st);
  ASSERT_OK(m->model->ReleaseSequence(*seq));
  // hidden.0 = embedding streams, hidden.i = streams after layer i-1, hidden.L = final normed hidden.
  for (int64_t i = 0; i <= L; ++i) {
    const std::string name = "p0.hidden." + std::to_string(i);
    auto golden = m->goldens.Floats(name);
    if (absl::IsNotFound(golden.status())) continue;
    ASSERT_OK(golden);
    const std::vector<float>& want = *golden;
    const int64_t layer = i == L ? L : i - 1;
    ASSERT_TRUE(seen.count(layer)) << name;
    ASSERT_EQ(seen[layer].size(), want.size()) << name;
    auto [d, at] = MaxDiff(seen[layer], want);
    // Hidden streams grow through the layers; compare relative to their scale.
    float scale = 1.0f;
    for (float v : want) scale = std::max(scale, std::fabs(v));
    EXPECT_LE(d, kTol * scale) << name << " first drifts at element " << at << " by " << d;
  }
}

}  // namespace
}  // namespace numoe
