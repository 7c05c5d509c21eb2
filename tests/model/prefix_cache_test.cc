// The prefix cache on the CPU backend (model/prefix_cache.h, model/prefix_step.h): a request served from
// cached state gives the same tokens and bit-identical logits as the same request with the cache off, for
// the fixtures' golden prompts (whole and chunked prefill, n-gram-style drafts, tiny-v4's DSpark drafter),
// the next turn of a conversation, a prompt diverging mid-interval, an evicted checkpoint under a running
// sequence and a prompt cancelled part-way.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "backends/cpu/cpu_model.h"
#include "model/prefix_cache.h"
#include "model/prefix_step.h"
#include "worker/experts/reference_experts.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"

namespace numoe {
namespace {

enum class Drafts { kNone, kGiven, kModel };

struct Outcome {
  std::vector<int32_t> tokens;  // emitted
  std::vector<float> logits;    // every logits row returned, in order
  int64_t cached = 0;
};

// One request through RunCachedStep: the prompt in chunks of `chunk` (0 = whole), then `steps` decode
// steps. With Drafts::kGiven each decode step carries up to 3 drafts taken from `oracle` (the cold greedy
// continuation) with every third one corrupted, so some are accepted and some rejected.
Outcome Generate(test::TinyModel* m, PrefixCache* cache, const std::vector<int32_t>& prompt, int64_t chunk,
             int64_t steps, Drafts drafts = Drafts::kNone, const std::vector<int32_t>& oracle = {},
             int64_t stop_after_chunks = -1) {
  Outcome r;
  ModelBackend& model = *m->model;
  auto opened = OpenCachedSequence(model, cache);
  EXPECT_TRUE(opened.ok()) << opened.status();
  CachedSequence seq = std::move(*opened);
  Sampler sampler(SamplingParams{});
  StepScratch scratch;
  StepOutput out;
  std::vector<int32_t> cached;
  CachedSequence* seqs[1] = {&seq};
  Sampler* samplers[1] = {&sampler};
  size_t fed = 0;
  int64_t chunks = 0;
  while (fed < prompt.size()) {
    if (stop_after_chunks >= 0 && chunks == stop_after_chunks) {  // the client went away
      ReleaseCachedSequence(model, cache, &seq);
      return r;
    }
    const size_t n = chunk > 0 ? std::min<size_t>(static_cast<size_t>(chunk), prompt.size() - fed) : prompt.size();
    const bool completes = fed + n == prompt.size();
    StepItem it{.tokens = std::span<const int32_t>(prompt).subspan(fed, n), .sample = completes, .logits = completes};
    Status st = RunCachedStep(model, *m->experts, cache, 0, {&it, 1}, seqs, samplers, &scratch, &out, &cached);
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) return r;
    r.cached += cached[0];
    fed += n;
    ++chunks;
    for (const auto& l : out.logits) r.logits.insert(r.logits.end(), l.begin(), l.end());
    if (completes) r.tokens.push_back(out.tokens[0]);
  }
  std::vector<int32_t> feed;
  for (int64_t s = 0; s < steps; ++s) {
    feed.assign(1, r.tokens.back());
    StepItem it{.sample = true, .logits = drafts == Drafts::kNone};  // speculative items return no logits
    if (drafts == Drafts::kGiven) {
      for (size_t k = 0; k < 3 && r.tokens.size() + k < oracle.size(); ++k) {
        int32_t d = oracle[r.tokens.size() + k];
        if ((r.tokens.size() + k) % 3 == 2) d = (d + 1) % static_cast<int32_t>(model.vocab_size());
        feed.push_back(d);
      }
      it.drafts = static_cast<int32_t>(feed.size() - 1);
    } else if (drafts == Drafts::kModel) {
      it.model_drafts = 3;
    }
    it.tokens = feed;
    Status st = RunCachedStep(model, *m->experts, cache, 0, {&it, 1}, seqs, samplers, &scratch, &out, &cached);
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) return r;
    r.tokens.insert(r.tokens.end(), out.emitted.begin(), out.emitted.end());
    for (const auto& l : out.logits) r.logits.insert(r.logits.end(), l.begin(), l.end());
  }
  ReleaseCachedSequence(model, cache, &seq);
  return r;
}

void ExpectSame(const Outcome& cold, const Outcome& warm, const std::string& what) {
  EXPECT_EQ(warm.tokens, cold.tokens) << what;
  ASSERT_EQ(warm.logits.size(), cold.logits.size()) << what;
  EXPECT_EQ(std::memcmp(warm.logits.data(), cold.logits.data(), cold.logits.size() * sizeof(float)), 0)
      << what << ": logits differ (bitwise)";
}

test::TinyModel* Load(const std::string& name, bool drafter = false) {
  auto m = test::TinyModel::Get({.model = name, .drafter = drafter});
  if (!m.ok()) ADD_FAILURE() << m.status();
  return m.ok() ? *m : nullptr;
}

class PrefixCacheTest : public ::testing::TestWithParam<std::string> {};

// Every golden prompt: cold (cache off) matches transformers' greedy tokens; served again from the cache,
// whole and chunked, it restores all but the last token and gives bit-identical logits; the next turn
// (prompt + answer + more) restores the whole first turn.
TEST_P(PrefixCacheTest, WarmEqualsColdForEveryGolden) {
  test::TinyModel* m = Load(GetParam());
  ASSERT_NE(m, nullptr);
  for (const auto& g : m->goldens) {
    const int64_t steps = static_cast<int64_t>(g.greedy.size()) - 1;
    const Outcome cold = Generate(m, nullptr, g.input_ids, 0, steps);
    EXPECT_EQ(cold.tokens, g.greedy) << g.name;
    for (int64_t chunk : {0, 5}) {
      PrefixCache cache(m->model.get(), {.checkpoint_tokens = 0});
      const std::string what = GetParam() + "/" + g.name + " chunk " + std::to_string(chunk);
      const Outcome first = Generate(m, &cache, g.input_ids, chunk, steps);
      EXPECT_EQ(first.cached, 0) << what;
      ExpectSame(cold, first, what + " (first, cache empty)");
      const Outcome again = Generate(m, &cache, g.input_ids, chunk, steps);
      EXPECT_EQ(again.cached, static_cast<int64_t>(g.input_ids.size()) - 1) << what;
      ExpectSame(cold, again, what + " (again, from the cache)");
      // The next turn: the prompt, the answer but its last token (the state the answer ended in), more.
      std::vector<int32_t> turn2 = g.input_ids;
      turn2.insert(turn2.end(), g.greedy.begin(), g.greedy.end() - 1);
      turn2.insert(turn2.end(), g.input_ids.begin(), g.input_ids.begin() + std::min<size_t>(3, g.input_ids.size()));
      bool feedable = true;  // an id the head emits past the embedding's vocabulary cannot be fed back
      for (int32_t t : turn2) feedable &= t < m->model->vocab_size();
      if (!feedable) continue;
      const Outcome cold2 = Generate(m, nullptr, turn2, 0, 4);
      const Outcome warm2 = Generate(m, &cache, turn2, chunk, 4);
      EXPECT_EQ(warm2.cached, static_cast<int64_t>(g.input_ids.size() + g.greedy.size()) - 1) << what;
      ExpectSame(cold2, warm2, what + " (next turn)");
      const PrefixCacheStats st = cache.stats();
      EXPECT_EQ(st.hit_tokens, static_cast<uint64_t>(again.cached + warm2.cached));
      EXPECT_GT(st.bytes, 0);
    }
  }
}

// Drafts verified on a restored sequence: the given drafts (some rejected) and, on tiny-v4, its DSpark
// drafter; only accepted positions are checkpointed.
TEST_P(PrefixCacheTest, SpeculativeStepsMatch) {
  const bool dspark = GetParam() == "tiny-v4";
  test::TinyModel* m = Load(GetParam(), dspark);
  ASSERT_NE(m, nullptr);
  const auto& g = m->goldens[0];
  for (Drafts d : {Drafts::kGiven, Drafts::kModel}) {
    if (d == Drafts::kModel && m->model->drafter() == SpecMethod::kNone) continue;
    const std::string what = GetParam() + (d == Drafts::kGiven ? " given drafts" : " model drafter");
    const Outcome cold = Generate(m, nullptr, g.input_ids, 0, 8, d, g.greedy);
    PrefixCache cache(m->model.get(), {.checkpoint_tokens = 4});
    ExpectSame(cold, Generate(m, &cache, g.input_ids, 3, 8, d, g.greedy), what + " (first)");
    const Outcome again = Generate(m, &cache, g.input_ids, 3, 8, d, g.greedy);
    EXPECT_GT(again.cached, 0) << what;
    ExpectSame(cold, again, what + " (again)");
  }
}

// A prompt that shares only part of a cached one, diverging between two interval checkpoints, resumes
// from the checkpoint before the divergence.
TEST_P(PrefixCacheTest, DivergesMidInterval) {
  test::TinyModel* m = Load(GetParam());
  ASSERT_NE(m, nullptr);
  std::vector<int32_t> a;
  for (int i = 0; i < 3; ++i) for (const auto& g : m->goldens) a.insert(a.end(), g.input_ids.begin(), g.input_ids.end());
  ASSERT_GE(a.size(), 40u);
  a.resize(std::min<size_t>(a.size(), 96));
  PrefixCache cache(m->model.get(), {.checkpoint_tokens = 16});
  (void)Generate(m, &cache, a, 7, 2);
  std::vector<int32_t> b(a.begin(), a.begin() + 37);  // diverges at 37: the checkpoint at 32 serves
  b.push_back((a[37] + 1) % static_cast<int32_t>(m->model->vocab_size()));
  b.insert(b.end(), a.begin(), a.begin() + 5);
  const Outcome cold = Generate(m, nullptr, b, 0, 4);
  const Outcome warm = Generate(m, &cache, b, 7, 4);
  EXPECT_EQ(warm.cached, 32);
  ExpectSame(cold, warm, GetParam() + " diverging at 37");
}

// A checkpoint evicted while a sequence restored from it still runs: the sequence owes it nothing.
TEST_P(PrefixCacheTest, EvictionUnderARunningSequence) {
  test::TinyModel* m = Load(GetParam());
  ASSERT_NE(m, nullptr);
  const auto& g = m->goldens[0];
  const Outcome cold = Generate(m, nullptr, g.input_ids, 0, 6);
  PrefixCache probe(m->model.get(), {.checkpoint_tokens = 0});
  (void)Generate(m, &probe, g.input_ids, 0, 1);
  const int64_t one = probe.stats().bytes / std::max<int64_t>(probe.stats().entries, 1);
  // Room for about two checkpoints.
  PrefixCache cache(m->model.get(), {.budget_bytes = 2 * one + one / 2, .checkpoint_tokens = 0});
  (void)Generate(m, &cache, g.input_ids, 0, 1);
  ModelBackend& model = *m->model;
  auto opened = OpenCachedSequence(model, &cache);
  ASSERT_OK(opened);
  CachedSequence seq = std::move(*opened);
  Sampler sampler(SamplingParams{});
  StepScratch scratch;
  StepOutput out;
  std::vector<int32_t> cached;
  CachedSequence* seqs[1] = {&seq};
  Sampler* samplers[1] = {&sampler};
  StepItem it{.tokens = g.input_ids, .sample = true, .logits = true};
  ASSERT_OK(RunCachedStep(model, *m->experts, &cache, 0, {&it, 1}, seqs, samplers, &scratch, &out, &cached));
  EXPECT_EQ(cached[0], static_cast<int32_t>(g.input_ids.size()) - 1);
  Outcome warm;
  warm.tokens.push_back(out.tokens[0]);
  warm.logits = out.logits[0];
  const uint64_t evicted_before = cache.stats().evicted;
  for (int64_t s = 0; s < 6; ++s) {
    // Other requests fill the cache meanwhile: the checkpoint this sequence came from goes.
    for (const auto& o : m->goldens) {
      if (&o != &g) (void)Generate(m, &cache, o.input_ids, 0, 0);
    }
    std::vector<int32_t> feed = {warm.tokens.back()};
    StepItem d{.tokens = feed, .sample = true, .logits = true};
    ASSERT_OK(RunCachedStep(model, *m->experts, &cache, 0, {&d, 1}, seqs, samplers, &scratch, &out, &cached));
    warm.tokens.push_back(out.tokens[0]);
    warm.logits.insert(warm.logits.end(), out.logits[0].begin(), out.logits[0].end());
  }
  ReleaseCachedSequence(model, &cache, &seq);
  EXPECT_GT(cache.stats().evicted, evicted_before);
  EXPECT_LE(cache.stats().bytes, cache.stats().budget_bytes);
  ExpectSame(cold, warm, GetParam() + " evicted under a running sequence");
}

// A client that goes away part-way through its prompt leaves a checkpoint of what was computed; the
// same prompt then resumes from it.
TEST_P(PrefixCacheTest, CancelledMidPrefill) {
  test::TinyModel* m = Load(GetParam());
  ASSERT_NE(m, nullptr);
  const auto& g = m->goldens.prompts().back();
  ASSERT_GE(g.input_ids.size(), 6u);
  const Outcome cold = Generate(m, nullptr, g.input_ids, 0, 3);
  PrefixCache cache(m->model.get(), {.checkpoint_tokens = 0});
  (void)Generate(m, &cache, g.input_ids, 2, 3, Drafts::kNone, {}, /*stop_after_chunks=*/2);
  EXPECT_EQ(cache.stats().entries, 1);
  const Outcome warm = Generate(m, &cache, g.input_ids, 2, 3);
  EXPECT_EQ(warm.cached, 4);
  ExpectSame(cold, warm, GetParam() + " after a cancelled prefill");
}

INSTANTIATE_TEST_SUITE_P(Fixtures, PrefixCacheTest, ::testing::Values("tiny-v4", "demo-v4"),
                         [](const auto& info) { return info.param == "tiny-v4" ? "tiny" : "demo"; });

}  // namespace
}  // namespace numoe
