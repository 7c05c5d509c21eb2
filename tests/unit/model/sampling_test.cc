// model/sampling: the penalties, logit bias, min-p and log-probs against hand-computed values, and that
// speculative verification sees the same penalised distributions as plain sampling.
#include "model/sampling.h"

#include <cmath>
#include <map>
#include <vector>

#include <gtest/gtest.h>

#include "model/spec.h"
#include "tests/support/status_matchers.h"

namespace numoe {
namespace {

// log_softmax of a row, in double: the reference TopLogprobs must match.
std::vector<double> LogSoftmax(const std::vector<float>& l) {
  double m = l[0];
  for (float x : l) m = std::max(m, static_cast<double>(x));
  double s = 0;
  for (float x : l) s += std::exp(x - m);
  std::vector<double> out;
  for (float x : l) out.push_back(x - m - std::log(s));
  return out;
}

TEST(Logprobs, ChosenAndTopAreLogSoftmaxOfTheRawRow) {
  const std::vector<float> logits = {1.0f, 3.0f, -2.0f, 3.0f, 0.5f, 2.5f};
  const std::vector<double> ref = LogSoftmax(logits);
  EmittedLogprobs lp;
  TopLogprobs(logits.data(), 6, /*chosen=*/4, /*n=*/3, &lp);
  EXPECT_EQ(lp.chosen.token, 4);
  EXPECT_NEAR(lp.chosen.logprob, ref[4], 1e-6);
  ASSERT_EQ(lp.top.size(), 3u);
  // Descending, ties by lower id: 1 and 3 tie at 3.0.
  EXPECT_EQ(lp.top[0].token, 1);
  EXPECT_EQ(lp.top[1].token, 3);
  EXPECT_EQ(lp.top[2].token, 5);
  for (const TokenLogprob& t : lp.top) EXPECT_NEAR(t.logprob, ref[static_cast<size_t>(t.token)], 1e-6);
  double mass = 0;
  for (double x : ref) mass += std::exp(x);
  EXPECT_NEAR(mass, 1.0, 1e-9);
  TopLogprobs(logits.data(), 6, 0, 0, &lp);
  EXPECT_TRUE(lp.top.empty());
  EXPECT_NEAR(lp.chosen.logprob, ref[0], 1e-6);
  TopLogprobs(logits.data(), 6, 0, 20, &lp);  // more than the vocabulary: all of it
  EXPECT_EQ(lp.top.size(), 6u);
}

TEST(Logprobs, LargeVocabularyKeepsTheTopN) {
  std::vector<float> logits(50000);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(static_cast<float>(i) * 0.37f) * 7.0f;
  EmittedLogprobs lp;
  TopLogprobs(logits.data(), 50000, 7, 20, &lp);
  ASSERT_EQ(lp.top.size(), 20u);
  std::vector<float> sorted = logits;
  std::sort(sorted.begin(), sorted.end(), std::greater<float>());
  const std::vector<double> ref = LogSoftmax(logits);
  for (size_t j = 0; j < 20; ++j) {
    EXPECT_EQ(logits[static_cast<size_t>(lp.top[j].token)], sorted[j]) << j;
    EXPECT_NEAR(lp.top[j].logprob, ref[static_cast<size_t>(lp.top[j].token)], 1e-5);
  }
}

TEST(Penalties, FrequencyAndPresenceSubtractPerGeneratedCount) {
  // Greedy: token 0 leads by 1.0; each generation of it costs frequency 0.3 + presence 0.5 (first time).
  const std::vector<float> logits = {2.0f, 1.0f, 0.0f};
  SamplingParams p;
  p.frequency_penalty = 0.3;
  p.presence_penalty = 0.5;
  Sampler s(p);
  EXPECT_EQ(s.Sample(logits.data(), 3), 0);
  s.Accept(0);  // 2.0 - 0.3 - 0.5 = 1.2 > 1.0
  EXPECT_EQ(s.Sample(logits.data(), 3), 0);
  s.Accept(0);  // 2.0 - 0.6 - 0.5 = 0.9 < 1.0
  EXPECT_EQ(s.Sample(logits.data(), 3), 1);
  // The prompt does not count for presence / frequency.
  Sampler fresh(p);
  const int32_t prompt[] = {0, 0, 0, 0};
  fresh.ObservePrompt(prompt);
  EXPECT_EQ(fresh.Sample(logits.data(), 3), 0);
  // Distribution agrees with Sample (greedy: one-hot at the penalised argmax).
  std::vector<double> dist;
  s.Distribution(logits.data(), 3, &dist);
  EXPECT_EQ(dist, (std::vector<double>{0.0, 1.0, 0.0}));
}

TEST(Penalties, FrequencyPenaltyShapesTheSampledDistribution) {
  // At temperature 1: p(t) ∝ exp(l_t - f * count_t - presence).
  const std::vector<float> logits = {1.0f, 1.0f, 1.0f};
  SamplingParams p;
  p.temperature = 1.0;
  p.frequency_penalty = 1.0;
  Sampler s(p);
  s.Accept(0);
  s.Accept(0);
  std::vector<double> dist;
  s.Distribution(logits.data(), 3, &dist);
  const double e = std::exp(-2.0);
  EXPECT_NEAR(dist[0], e / (e + 2), 1e-9);
  EXPECT_NEAR(dist[1], 1 / (e + 2), 1e-9);
}

TEST(Penalties, RepetitionDividesPositiveAndMultipliesNegativeOverPromptAndOutput) {
  // Token 0 (in the prompt) 2.0 -> 1.0 with r = 2; token 1 unseen stays 1.5; token 2 generated -0.5 -> -1.0.
  const std::vector<float> logits = {2.0f, 1.5f, -0.5f, -0.8f};
  SamplingParams p;
  p.temperature = 1.0;
  p.repetition_penalty = 2.0;
  Sampler s(p);
  const int32_t prompt[] = {0};
  s.ObservePrompt(prompt);
  s.Accept(2);
  std::vector<double> dist;
  s.Distribution(logits.data(), 4, &dist);
  const std::vector<double> want_logits = {1.0, 1.5, -1.0, -0.8};
  double z = 0;
  for (double l : want_logits) z += std::exp(l);
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(dist[i], std::exp(want_logits[i]) / z, 1e-6) << i;
  // Greedy flips to the unseen token.
  p.temperature = 0;
  Sampler g(p);
  g.ObservePrompt(prompt);
  EXPECT_EQ(g.Sample(logits.data(), 4), 1);
}

TEST(LogitBias, MinusOneHundredBansAndPlusOneHundredForces) {
  const std::vector<float> logits = {5.0f, 4.0f, -3.0f};
  SamplingParams p;
  p.logit_bias = {{0, -100.0f}};
  EXPECT_EQ(Sampler(p).Sample(logits.data(), 3), 1);
  p.logit_bias = {{2, 100.0f}};
  p.temperature = 1.0;
  p.seed = 9;
  Sampler forced(p);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(forced.Sample(logits.data(), 3), 2);
  // The raw row is untouched: log-probs come from the model's logits, not the biased ones.
  EXPECT_EQ(logits[2], -3.0f);
}

TEST(MinP, DropsTokensBelowTheFractionOfTheLargest) {
  // Temperature 1: probabilities ∝ e^{l}; p_i / p_max = e^{l_i - l_max}. With min_p 0.3: keep l >= l_max - 1.204.
  const std::vector<float> logits = {3.0f, 2.0f, 1.5f, 0.0f};
  SamplingParams p;
  p.temperature = 1.0;
  p.min_p = 0.3;
  Sampler s(p);
  std::vector<double> dist;
  s.Distribution(logits.data(), 4, &dist);
  EXPECT_GT(dist[0], 0);
  EXPECT_GT(dist[1], 0);  // e^-1 = 0.37 >= 0.3
  EXPECT_EQ(dist[2], 0);  // e^-1.5 = 0.22 < 0.3
  EXPECT_EQ(dist[3], 0);
  EXPECT_NEAR(dist[0] + dist[1], 1.0, 1e-12);
  EXPECT_NEAR(dist[0] / dist[1], std::exp(1.0), 1e-9);
  // Sampling draws only from what min_p keeps.
  for (int i = 0; i < 200; ++i) {
    const int32_t t = s.Sample(logits.data(), 4);
    EXPECT_TRUE(t == 0 || t == 1) << t;
  }
  // At a higher temperature the same min_p keeps more (the ratio flattens).
  p.temperature = 2.0;
  Sampler hot(p);
  hot.Distribution(logits.data(), 4, &dist);
  EXPECT_GT(dist[2], 0);  // e^-0.75 = 0.47
  EXPECT_EQ(dist[3], 0);  // e^-1.5 = 0.22
}

TEST(Sampling, NeutralExtrasSampleExactlyAsBefore) {
  // min_p 0, penalties off: the same seed gives the same draws whatever history was recorded.
  std::vector<float> logits = {0.1f, 2.0f, 1.9f, -1.0f, 1.95f};
  SamplingParams p{.temperature = 0.8, .top_p = 0.9, .top_k = 4, .seed = 5};
  Sampler a(p), b(p);
  for (int i = 0; i < 100; ++i) {
    const int32_t t = a.Sample(logits.data(), 5);
    a.Accept(t);
    EXPECT_EQ(t, b.Sample(logits.data(), 5));
  }
}

TEST(Sampling, DraftsCountUntilClearedAndForksCopyHistory) {
  const std::vector<float> logits = {2.0f, 1.0f};
  SamplingParams p;
  p.frequency_penalty = 2.0;
  Sampler s(p);
  EXPECT_EQ(s.SampleDraft(logits.data(), 2), 0);  // then 0 costs 2.0: the next draft is 1
  EXPECT_EQ(s.SampleDraft(logits.data(), 2), 1);
  s.ClearDrafts();
  EXPECT_EQ(s.Sample(logits.data(), 2), 0);
  s.Accept(0);
  Sampler child(p);
  child.CopyHistoryFrom(s);
  EXPECT_TRUE(child.generating());
  EXPECT_EQ(child.Sample(logits.data(), 2), 1);
}

TEST(Sampling, ChoiceSeedsDifferAndChoiceZeroKeepsTheSeed) {
  EXPECT_EQ(ChoiceSeed(1234, 0), 1234u);
  std::map<uint64_t, int> seen;
  for (uint64_t seed : {0ull, 1ull, 2ull}) {
    for (int i = 0; i < 16; ++i) seen[ChoiceSeed(seed, i)]++;
  }
  EXPECT_EQ(seen.size(), 48u);
  EXPECT_EQ(ChoiceSeed(77, 5), ChoiceSeed(77, 5));
}

TEST(Sampling, ValidationNamesTheFieldAndItsRange) {
  auto message = [](SamplingParams p, int64_t vocab = 0) { return std::string(ValidateSampling(p, vocab).message()); };
  SamplingParams p;
  EXPECT_OK(ValidateSampling(p));
  p.min_p = 1.5;
  EXPECT_NE(message(p).find("min_p must be in [0, 1]"), std::string::npos);
  p = {};
  p.presence_penalty = -2.5;
  EXPECT_NE(message(p).find("presence_penalty must be in [-2, 2]"), std::string::npos);
  p = {};
  p.frequency_penalty = 3;
  EXPECT_NE(message(p).find("frequency_penalty"), std::string::npos);
  p = {};
  p.repetition_penalty = 0;
  EXPECT_NE(message(p).find("repetition_penalty must be in (0, 2]"), std::string::npos);
  p = {};
  p.logprobs = 21;
  EXPECT_NE(message(p).find("logprobs"), std::string::npos);
  p = {};
  p.logit_bias = {{5, 101.0f}};
  EXPECT_NE(message(p).find("[-100, 100]"), std::string::npos);
  p.logit_bias = {{500, 1.0f}};
  EXPECT_NE(message(p, 100).find("token id 500"), std::string::npos);
  p.logit_bias.assign(kMaxLogitBias + 1, {1, 1.0f});
  EXPECT_NE(message(p).find("at most 300"), std::string::npos);
}

// Speculative verification with a frequency penalty is exactly the sequential greedy decode: each draft
// is judged with the drafts before it counted.
TEST(Verify, GreedyWithPenaltiesMatchesSequentialDecoding) {
  const int64_t V = 3;
  // Three identical target rows: without penalties the greedy answer is always 0; with frequency 1.5 the
  // second 0 costs 1.5 (2.0 - 1.5 = 0.5 < 1.0), so the sequence is 0, 1, then 0 again (0.5 vs 1 - 1.5).
  const std::vector<float> row = {2.0f, 1.0f, 0.0f};
  std::vector<float> target;
  for (int i = 0; i < 3; ++i) target.insert(target.end(), row.begin(), row.end());
  SamplingParams p;
  p.frequency_penalty = 1.5;
  Sampler seq(p);
  std::vector<int32_t> want;
  for (int i = 0; i < 3; ++i) {
    want.push_back(seq.Sample(row.data(), V));
    seq.Accept(want.back());
  }
  EXPECT_EQ(want, (std::vector<int32_t>{0, 1, 0}));
  // Drafts [0, 0]: the second is rejected (the penalised argmax there is 1).
  Sampler ver(p);
  const int32_t drafts[] = {0, 0};
  Verdict v = VerifyDrafts(ver, drafts, {}, target.data(), V);
  EXPECT_EQ(v.accepted, 1);
  EXPECT_EQ(v.tokens, (std::vector<int32_t>{0, 1}));
  // Drafts [0, 1]: both kept, then the bonus token is the third of the sequential decode.
  Sampler ver2(p);
  const int32_t good[] = {0, 1};
  v = VerifyDrafts(ver2, good, {}, target.data(), V);
  EXPECT_EQ(v.accepted, 2);
  EXPECT_EQ(v.tokens, want);
}

}  // namespace
}  // namespace numoe
