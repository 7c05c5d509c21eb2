// Speculative decoding on the CPU backend: greedy speculation emits exactly the tokens of plain greedy
// decoding for every depth and batch size with each drafter (tiny-v4's random DSpark stages accept almost
// nothing, which exercises rollback; the demo model with the n-gram drafter on a repetitive prompt accepts
// a lot, which exercises acceptance), and with temperature > 0 the sampled tokens follow the same
// distribution with and without speculation (chi-square homogeneity test).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/checkpoint.h"
#include "common/choices.h"
#include "backends/cpu/cpu_model.h"
#include "worker/experts/reference_experts.h"
#include "model/generation.h"
#include "tests/model/chi_square.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"

namespace numoe {
namespace {

using Loaded = test::TinyModel;

// A fixture of tests/data with its drafter when it has one (tiny-v4's DSpark stages; demo-v4 has none).
Loaded* Get(const std::string& name) {
  auto m = test::TinyModel::Get({.model = name, .drafter = name == "tiny-v4"});
  if (!m.ok()) ADD_FAILURE() << m.status();
  return m.ok() ? *m : nullptr;
}

// Repetitive prompts: a golden prompt of the model (real text for demo-v4) said three times, cut at
// different points, so the model's continuation repeats it and an n-gram drafter has something to find.
std::vector<GenerateRequest> Prompts(const Loaded& model, int64_t count, int64_t vocab, int64_t new_tokens,
                                     bool repetitive) {
  std::vector<int32_t> base;
  if (repetitive) {
    auto p0 = model.goldens.Find("p0");
    EXPECT_OK(p0);
    for (int rep = 0; rep < 3 && p0.ok(); ++rep) {
      base.insert(base.end(), (*p0)->input_ids.begin(), (*p0)->input_ids.end());
    }
  }
  std::vector<GenerateRequest> reqs;
  for (int64_t i = 0; i < count; ++i) {
    GenerateRequest r;
    if (repetitive) {
      r.prompt.assign(base.begin(), base.end() - (i * 5) % 30);
    } else {
      const int64_t len = 5 + (i * 7) % 23;
      for (int64_t t = 0; t < len; ++t) r.prompt.push_back(static_cast<int32_t>((t * 37 + i * 11 + 3) % vocab));
    }
    r.max_new_tokens = new_tokens;
    r.ignore_eos = true;
    reqs.push_back(r);
  }
  return reqs;
}

struct GreedyCase {
  std::string model;
  SpecMethod method;
  bool repetitive;
};

class GreedySpecTest : public ::testing::TestWithParam<GreedyCase> {};

TEST_P(GreedySpecTest, EmitsExactlyThePlainGreedyTokens) {
  const GreedyCase& c = GetParam();
  Loaded* l = Get(c.model);
  ASSERT_NE(l, nullptr);
  const int64_t V = l->ckpt->config().vocab_size;
  int64_t accepted = 0, drafted = 0;
  for (int64_t batch : {1, 3, 8}) {
    const auto reqs = Prompts(*l, batch, V, 24, c.repetitive);
    auto plain = GenerateBatch(*l->model, *l->experts, reqs);
    ASSERT_OK(plain);
    for (int64_t depth = 1; depth <= 7; ++depth) {
      SpecConfig spec{.method = c.method, .depth = depth};
      auto got = GenerateBatch(*l->model, *l->experts, reqs, nullptr, spec);
      ASSERT_OK(got);
      for (size_t i = 0; i < reqs.size(); ++i) {
        EXPECT_EQ((*got)[i].tokens, (*plain)[i].tokens)
            << c.model << " " << SpecMethodName(c.method) << " batch " << batch << " depth " << depth << " seq " << i;
        accepted += (*got)[i].spec.accepted;
        drafted += (*got)[i].spec.drafted;
      }
    }
  }
  EXPECT_GT(drafted, 0);
  if (c.model == "demo-v4") {
    // The trained model on its (repeated) golden prompt: the n-gram drafter's proposals are partly kept,
    // so acceptance, not only rollback, is exercised. (The small demo model copies context poorly; the
    // measured rate is ~7-17%.)
    EXPECT_GE(accepted, 20) << accepted << "/" << drafted;
  }
}

INSTANTIATE_TEST_SUITE_P(Drafters, GreedySpecTest,
                         ::testing::Values(GreedyCase{"tiny-v4", SpecMethod::kDspark, false},
                                           GreedyCase{"tiny-v4", SpecMethod::kNgram, true},
                                           GreedyCase{"demo-v4", SpecMethod::kNgram, true}),
                         [](const auto& info) {
                           std::string m = info.param.model == "tiny-v4" ? "tiny" : "demo";
                           return m + "_" + SpecMethodName(info.param.method);
                         });

TEST(GreedySpec, AdaptiveDepthAndLogitsKeepTheirMeaning) {
  Loaded* l = Get("tiny-v4");
  ASSERT_NE(l, nullptr);
  auto reqs = Prompts(*l, 2, l->ckpt->config().vocab_size, 20, true);
  for (auto& r : reqs) r.keep_logits = true;
  auto plain = GenerateBatch(*l->model, *l->experts, reqs);
  ASSERT_OK(plain);
  SpecConfig spec{.method = SpecMethod::kNgram, .depth = 6, .adaptive = true};
  auto got = GenerateBatch(*l->model, *l->experts, reqs, nullptr, spec);
  ASSERT_OK(got);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ((*got)[i].tokens, (*plain)[i].tokens);
    ASSERT_EQ((*got)[i].step_logits.size(), (*plain)[i].step_logits.size());
    float worst = 0;
    for (size_t j = 0; j < (*got)[i].step_logits.size(); ++j) {
      worst = std::max(worst, std::fabs((*got)[i].step_logits[j] - (*plain)[i].step_logits[j]));
    }
    EXPECT_LE(worst, 1e-4f);  // the logits that chose each emitted token
  }
}

// Two-sample chi-square homogeneity test on the distribution of the 2nd and 3rd generated tokens
// (the first comes from the prefill; later ones go through verification). Temperature 1 with top-k 4
// keeps the categories few. Significance 0.001 per comparison (4 comparisons: family-wise < 0.004).
using test::ChiSquare;

TEST(SampledSpec, SameDistributionWithAndWithoutSpeculation) {
  Loaded* l = Get("tiny-v4");
  ASSERT_NE(l, nullptr);
  const auto critical = test::ChiSquareCritical999;
  for (SpecMethod method : {SpecMethod::kNgram, SpecMethod::kDspark}) {
    std::map<int32_t, int> plain2, plain3, spec2, spec3;
    constexpr int kSamples = 3000, kBatch = 100;
    for (int round = 0; round < kSamples / kBatch; ++round) {
      std::vector<GenerateRequest> reqs;
      for (int i = 0; i < kBatch; ++i) {
        GenerateRequest r;
        r.prompt = {5, 17, 99, 5, 17, 99, 5, 17};
        r.max_new_tokens = 3;
        r.ignore_eos = true;
        r.sampling.temperature = 1.0;
        r.sampling.top_k = 4;
        r.sampling.seed = static_cast<uint64_t>(round * kBatch + i + 1);
        reqs.push_back(r);
      }
      auto a = GenerateBatch(*l->model, *l->experts, reqs);
      ASSERT_OK(a);
      for (auto& r : reqs) r.sampling.seed += 1000003;
      auto b = GenerateBatch(*l->model, *l->experts, reqs, nullptr, SpecConfig{.method = method, .depth = 2});
      ASSERT_OK(b);
      for (int i = 0; i < kBatch; ++i) {
        plain2[(*a)[i].tokens[1]]++;
        plain3[(*a)[i].tokens[2]]++;
        spec2[(*b)[i].tokens[1]]++;
        spec3[(*b)[i].tokens[2]]++;
      }
    }
    for (auto [x, y] : {std::make_pair(&plain2, &spec2), std::make_pair(&plain3, &spec3)}) {
      int dof = 0;
      const double chi = ChiSquare(*x, *y, &dof);
      ASSERT_GE(dof, 3);
      EXPECT_LT(chi, critical(dof)) << SpecMethodName(method) << ": chi-square " << chi << " with " << dof
                                     << " degrees of freedom";
    }
  }
}

TEST(Spec, NgramProposesTheContinuationOfTheLongestSuffix) {
  std::vector<int32_t> h = {1, 2, 3, 4, 9, 2, 3, 4, 7, 1, 2, 3};
  EXPECT_EQ(NgramPropose(h, 3, 4, 1), (std::vector<int32_t>{4, 9, 2}));
  EXPECT_EQ(NgramPropose(h, 10, 4, 1).size(), 9u);
  const std::vector<int32_t> short_history = {1, 2, 3};
  EXPECT_TRUE(NgramPropose(short_history, 3, 4, 1).empty());
  EXPECT_FALSE(ValidateSpec(SpecConfig{.depth = 0}).ok());
  EXPECT_FALSE(ParseChoice<SpecChoice>("bogus", "--spec").ok());  // --spec's one parser
}

}  // namespace
}  // namespace numoe
