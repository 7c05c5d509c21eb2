// The prefix cache on the CPU backend (model/prefix_cache.h, model/prefix_step.h): a request served from
// cached state gives the same tokens and bit-identical logits as the same request with the cache off, for
// the fixtures' golden prompts (whole and chunked prefill, n-gram-style drafts, tiny-v4's DSpark drafter),
// the next turn of a conversation, a prompt diverging mid-interval, an evicted checkpoint under a running
// sequence and a prompt cancelled part-way; the same with a first tier so small that every checkpoint goes
// to the host tier and comes back from there, plus the host tier's pages shared by two conversations and
// eviction from the host tier under a running sequence.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "backends/cpu/cpu_model.h"
#include "model/prefix_cache.h"
#include "model/prefix_step.h"
#include "worker/experts/reference_experts.h"
#include "tests/support/cached_generate.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"

namespace numoe {
namespace {

using test::Drafts;
using Outcome = test::CachedOutcome;  // of test::GenerateCached, on the tiny model's CPU backend

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

// A first tier too small for any checkpoint: each is moved to the host tier as it is stored, and every hit
// imports it from there (too big to promote).
PrefixCacheOptions HostOnly(PrefixCacheOptions o) {
  o.budget_bytes = 1;
  o.host_budget_bytes = int64_t{1} << 30;
  return o;
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
    const Outcome cold = test::GenerateCached(*m->model, *m->experts, nullptr, g.input_ids, 0, steps);
    EXPECT_EQ(cold.tokens, g.greedy) << g.name;
    for (int64_t chunk : {0, 5}) for (bool host : {false, true}) {
      PrefixCache cache(m->model.get(), host ? HostOnly({.checkpoint_tokens = 0}) : PrefixCacheOptions{.checkpoint_tokens = 0});
      const std::string what =
          GetParam() + "/" + g.name + " chunk " + std::to_string(chunk) + (host ? " host tier" : "");
      const Outcome first = test::GenerateCached(*m->model, *m->experts, &cache, g.input_ids, chunk, steps);
      EXPECT_EQ(first.cached, 0) << what;
      ExpectSame(cold, first, what + " (first, cache empty)");
      const Outcome again = test::GenerateCached(*m->model, *m->experts, &cache, g.input_ids, chunk, steps);
      EXPECT_EQ(again.cached, static_cast<int64_t>(g.input_ids.size()) - 1) << what;
      ExpectSame(cold, again, what + " (again, from the cache)");
      // The next turn: the prompt, the answer but its last token (the state the answer ended in), more.
      std::vector<int32_t> turn2 = g.input_ids;
      turn2.insert(turn2.end(), g.greedy.begin(), g.greedy.end() - 1);
      turn2.insert(turn2.end(), g.input_ids.begin(), g.input_ids.begin() + std::min<size_t>(3, g.input_ids.size()));
      if (!test::Feedable(*m->model, turn2)) continue;
      const Outcome cold2 = test::GenerateCached(*m->model, *m->experts, nullptr, turn2, 0, 4);
      const Outcome warm2 = test::GenerateCached(*m->model, *m->experts, &cache, turn2, chunk, 4);
      EXPECT_EQ(warm2.cached, static_cast<int64_t>(g.input_ids.size() + g.greedy.size()) - 1) << what;
      ExpectSame(cold2, warm2, what + " (next turn)");
      const PrefixCacheStats st = cache.stats();
      EXPECT_EQ(st.hit_tokens, static_cast<uint64_t>(again.cached + warm2.cached));
      if (host) {
        EXPECT_EQ(st.entries, 0) << what;
        EXPECT_EQ(st.host_hits, st.hits) << what;
        EXPECT_EQ(st.host_hits, static_cast<uint64_t>((again.cached > 0 ? 1 : 0) + (warm2.cached > 0 ? 1 : 0))) << what;
        EXPECT_GT(st.host_bytes, 0) << what;
      } else {
        EXPECT_GT(st.bytes, 0) << what;
      }
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
    const Outcome cold = test::GenerateCached(*m->model, *m->experts, nullptr, g.input_ids, 0, 8, d, g.greedy);
    for (bool host : {false, true}) {
      PrefixCache cache(m->model.get(), host ? HostOnly({.checkpoint_tokens = 4}) : PrefixCacheOptions{.checkpoint_tokens = 4});
      const std::string w = what + (host ? " host tier" : "");
      ExpectSame(cold, test::GenerateCached(*m->model, *m->experts, &cache, g.input_ids, 3, 8, d, g.greedy),
                 w + " (first)");
      const Outcome again = test::GenerateCached(*m->model, *m->experts, &cache, g.input_ids, 3, 8, d, g.greedy);
      EXPECT_GT(again.cached, 0) << w;
      ExpectSame(cold, again, w + " (again)");
      // The next turn restores the whole first turn: the answer's last speculative step was settled and
      // checkpointed with only its accepted positions.
      std::vector<int32_t> turn2 = g.input_ids;
      turn2.insert(turn2.end(), cold.tokens.begin(), cold.tokens.end() - 1);
      turn2.insert(turn2.end(), g.input_ids.begin(), g.input_ids.begin() + 3);
      if (test::Feedable(*m->model, turn2)) {
        const Outcome cold2 = test::GenerateCached(*m->model, *m->experts, nullptr, turn2, 0, 4);
        const Outcome warm2 = test::GenerateCached(*m->model, *m->experts, &cache, turn2, 0, 4);
        EXPECT_EQ(warm2.cached, static_cast<int64_t>(g.input_ids.size() + cold.tokens.size()) - 1) << w;
        ExpectSame(cold2, warm2, w + " (next turn)");
      }
      if (host) {
        EXPECT_GT(cache.stats().host_hits, 0u) << w;
      }
    }
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
  (void)test::GenerateCached(*m->model, *m->experts, &cache, a, 7, 2);
  std::vector<int32_t> b(a.begin(), a.begin() + 37);  // diverges at 37: the checkpoint at 32 serves
  b.push_back((a[37] + 1) % static_cast<int32_t>(m->model->vocab_size()));
  b.insert(b.end(), a.begin(), a.begin() + 5);
  const Outcome cold = test::GenerateCached(*m->model, *m->experts, nullptr, b, 0, 4);
  const Outcome warm = test::GenerateCached(*m->model, *m->experts, &cache, b, 7, 4);
  EXPECT_EQ(warm.cached, 32);
  ExpectSame(cold, warm, GetParam() + " diverging at 37");
}

// A checkpoint evicted while a sequence restored from it still runs: the sequence owes it nothing.
TEST_P(PrefixCacheTest, EvictionUnderARunningSequence) {
  test::TinyModel* m = Load(GetParam());
  ASSERT_NE(m, nullptr);
  const auto& g = m->goldens[0];
  const Outcome cold = test::GenerateCached(*m->model, *m->experts, nullptr, g.input_ids, 0, 6);
  PrefixCache probe(m->model.get(), {.checkpoint_tokens = 0});
  (void)test::GenerateCached(*m->model, *m->experts, &probe, g.input_ids, 0, 1);
  const int64_t one = probe.stats().bytes / std::max<int64_t>(probe.stats().entries, 1);
  // Room for about two checkpoints.
  PrefixCache cache(m->model.get(), {.budget_bytes = 2 * one + one / 2, .checkpoint_tokens = 0});
  (void)test::GenerateCached(*m->model, *m->experts, &cache, g.input_ids, 0, 1);
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
      if (&o != &g) (void)test::GenerateCached(*m->model, *m->experts, &cache, o.input_ids, 0, 0);
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
  const Outcome cold = test::GenerateCached(*m->model, *m->experts, nullptr, g.input_ids, 0, 3);
  PrefixCache cache(m->model.get(), {.checkpoint_tokens = 0});
  (void)test::GenerateCached(*m->model, *m->experts, &cache, g.input_ids, 2, 3, Drafts::kNone, {},
                             /*stop_after_chunks=*/2);
  EXPECT_EQ(cache.stats().entries, 1);
  const Outcome warm = test::GenerateCached(*m->model, *m->experts, &cache, g.input_ids, 2, 3);
  EXPECT_EQ(warm.cached, 4);
  ExpectSame(cold, warm, GetParam() + " after a cancelled prefill");
}

// Runs `tokens` through `seq` in one step (every row's logits).
std::vector<float> Feed(test::TinyModel* m, SequenceId seq, std::span<const int32_t> tokens) {
  std::vector<SequenceLogits> out;
  const SequenceStep step{.seq = seq, .tokens = tokens, .all_logits = true};
  Status st = m->model->Forward({&step, 1}, m->experts.get(), &out);
  EXPECT_TRUE(st.ok()) << st;
  return st.ok() && !out.empty() ? out[0].logits : std::vector<float>{};
}

// A long prompt of the fixture's own golden tokens: `n` of them, from golden `from` on.
std::vector<int32_t> LongPrompt(test::TinyModel* m, size_t n, size_t from = 0) {
  std::vector<int32_t> a;
  for (size_t i = 0; a.size() < n; ++i) {
    const auto& g = m->goldens[(from + i) % m->goldens.size()];
    a.insert(a.end(), g.input_ids.begin(), g.input_ids.end());
  }
  a.resize(n);
  return a;
}

// The host tier's sizes for a sequence at `tokens`: its rest and one page (every page has the same size).
struct HostSizes {
  int64_t rest = 0, page = 0, pages = 0;
};
HostSizes SizesOf(test::TinyModel* m, std::span<const int32_t> tokens, int64_t page_tokens) {
  HostSizes z;
  auto seq = m->model->CreateSequence();
  EXPECT_TRUE(seq.ok());
  (void)Feed(m, *seq, tokens);
  auto hs = m->model->ExportSequence(*seq, page_tokens, 0);
  EXPECT_TRUE(hs.ok()) << hs.status();
  if (hs.ok()) {
    z.rest = hs->rest.size;
    z.pages = static_cast<int64_t>(hs->pages.size());
    z.page = hs->pages.empty() ? 0 : hs->pages[0].size;
  }
  (void)m->model->ReleaseSequence(*seq);
  return z;
}

// Stores a checkpoint of `tokens` (prefilled cold) in `cache`.
void StoreCold(test::TinyModel* m, PrefixCache* cache, std::span<const int32_t> tokens) {
  auto seq = m->model->CreateSequence();
  ASSERT_OK(seq);
  (void)Feed(m, *seq, tokens);
  ASSERT_OK(cache->Store(*seq, tokens));
  ASSERT_OK(m->model->ReleaseSequence(*seq));
}

// `tokens` then `more`: the logits of `more` computed cold, and restored from `cache` (which must restore
// exactly `want` tokens); bit for bit equal.
void ExpectRestoresExactly(test::TinyModel* m, PrefixCache* cache, std::span<const int32_t> tokens,
                           std::span<const int32_t> more, int64_t want, const std::string& what) {
  std::vector<int32_t> all(tokens.begin(), tokens.end());
  all.insert(all.end(), more.begin(), more.end());
  auto cold = m->model->CreateSequence();
  ASSERT_OK(cold);
  const std::vector<float> cold_logits = Feed(m, *cold, all);
  ASSERT_OK(m->model->ReleaseSequence(*cold));
  ASSERT_OK_AND_ASSIGN(PrefixCache::Restored r, cache->Restore(all, static_cast<int64_t>(all.size()) - 1));
  EXPECT_EQ(r.position, want) << what;
  const std::vector<float> warm = Feed(m, r.seq, std::span<const int32_t>(all).subspan(static_cast<size_t>(r.position)));
  ASSERT_OK(m->model->ReleaseSequence(r.seq));
  const size_t vocab = static_cast<size_t>(m->model->vocab_size());
  ASSERT_EQ(warm.size(), (all.size() - static_cast<size_t>(r.position)) * vocab) << what;
  // The rows of `more`, the last ones of both.
  const size_t rows = more.size() * vocab;
  EXPECT_EQ(std::memcmp(warm.data() + warm.size() - rows, cold_logits.data() + cold_logits.size() - rows,
                        rows * sizeof(float)),
            0)
      << what << ": logits differ (bitwise)";
}

// Two conversations with one system prompt, and a third that leaves it in the middle of a page: in the host
// tier their common whole pages are held once (pages and bytes counted once: checked against the backend's
// own export sizes), and each restores bit for bit.
TEST_P(PrefixCacheTest, HostTierSharesPages) {
  test::TinyModel* m = Load(GetParam());
  ASSERT_NE(m, nullptr);
  PrefixCache cache(m->model.get(), HostOnly({.checkpoint_tokens = 0, .page_tokens = 1}));
  const int64_t P = cache.stats().page_tokens;
  ASSERT_GT(P, 0);
  const std::vector<int32_t> system = LongPrompt(m, static_cast<size_t>(2 * P + P / 2));  // 2.5 pages
  std::vector<int32_t> x = system, y = system;
  const std::vector<int32_t> ux = LongPrompt(m, static_cast<size_t>(P), 1), uy = LongPrompt(m, static_cast<size_t>(P / 2 + 3), 2);
  x.insert(x.end(), ux.begin(), ux.end());  // 3.5 pages: pages 0, 1, 2 (2 is x's own)
  y.insert(y.end(), uy.begin(), uy.end());  // 3 pages + 3: pages 0, 1, 2 (2 is y's own)
  // z leaves the system prompt in the middle of page 1: only page 0 is common.
  std::vector<int32_t> z(system.begin(), system.begin() + P + P / 2);
  z.push_back((system[static_cast<size_t>(P + P / 2)] + 1) % static_cast<int32_t>(m->model->vocab_size()));
  z.insert(z.end(), ux.begin(), ux.end());  // 2.5 pages + 1: pages 0, 1 (1 is z's own)
  const HostSizes sx = SizesOf(m, x, P), sy = SizesOf(m, y, P), sz = SizesOf(m, z, P);
  ASSERT_GT(sx.page, 0);
  ASSERT_EQ(sx.pages, 3);
  ASSERT_EQ(sy.pages, 3);
  ASSERT_EQ(sz.pages, 2);

  StoreCold(m, &cache, x);
  PrefixCacheStats st = cache.stats();
  EXPECT_EQ(st.entries, 0);
  EXPECT_EQ(st.host_entries, 1);
  EXPECT_EQ(st.host_pages, 3);
  EXPECT_EQ(st.host_bytes, sx.rest + 3 * sx.page);
  StoreCold(m, &cache, y);
  st = cache.stats();
  EXPECT_EQ(st.host_entries, 2);
  EXPECT_EQ(st.host_pages, 4) << "y shares pages 0 and 1 with x";
  EXPECT_EQ(st.host_bytes, sx.rest + sy.rest + 4 * sx.page);
  StoreCold(m, &cache, z);
  st = cache.stats();
  EXPECT_EQ(st.host_pages, 5) << "z shares page 0 only";
  EXPECT_EQ(st.host_bytes, sx.rest + sy.rest + sz.rest + 5 * sx.page);

  const std::vector<int32_t> more = LongPrompt(m, 9, 3);
  ExpectRestoresExactly(m, &cache, x, more, static_cast<int64_t>(x.size()), GetParam() + " x from the host tier");
  ExpectRestoresExactly(m, &cache, y, more, static_cast<int64_t>(y.size()), GetParam() + " y from the host tier");
  ExpectRestoresExactly(m, &cache, z, more, static_cast<int64_t>(z.size()), GetParam() + " z from the host tier");
  // A prompt that stops inside y's own last page: no checkpoint is a prefix of it, so it runs cold.
  std::vector<int32_t> w(y.begin(), y.end() - 2);
  ExpectRestoresExactly(m, &cache, w, more, 0, GetParam() + " w (no checkpoint is a prefix of it)");
  EXPECT_EQ(cache.stats().host_hits, 3u);
}

// The host tier over its budget drops its least recently used checkpoint (the pages it shared stay with
// the others), while a sequence restored from it runs on unaffected; a checkpoint that fits the first tier
// is promoted there on a host hit.
TEST_P(PrefixCacheTest, HostTierEvictionUnderARunningSequence) {
  test::TinyModel* m = Load(GetParam());
  ASSERT_NE(m, nullptr);
  PrefixCache probe(m->model.get(), HostOnly({.checkpoint_tokens = 0, .page_tokens = 1}));
  const int64_t P = probe.stats().page_tokens;
  const std::vector<int32_t> system = LongPrompt(m, static_cast<size_t>(P + 5));
  auto conv = [&](size_t k) {
    std::vector<int32_t> c = system;
    const std::vector<int32_t> u = LongPrompt(m, 7 + k, k + 1);
    c.insert(c.end(), u.begin(), u.end());
    return c;
  };
  const HostSizes s = SizesOf(m, conv(0), P);
  // Room for the shared page and about two rests.
  PrefixCache cache(m->model.get(), {.budget_bytes = 1, .checkpoint_tokens = 0, .host_budget_bytes = s.page + 2 * s.rest + s.rest / 2, .page_tokens = 1});
  StoreCold(m, &cache, conv(0));
  StoreCold(m, &cache, conv(1));
  EXPECT_EQ(cache.stats().host_entries, 2);
  EXPECT_EQ(cache.stats().host_pages, 1);
  // A sequence restored from conv(0)'s checkpoint...
  std::vector<int32_t> all = conv(0);
  const std::vector<int32_t> more = LongPrompt(m, 6, 4);
  all.insert(all.end(), more.begin(), more.end());
  auto cold = m->model->CreateSequence();
  ASSERT_OK(cold);
  const std::vector<float> cold_logits = Feed(m, *cold, all);
  ASSERT_OK(m->model->ReleaseSequence(*cold));
  ASSERT_OK_AND_ASSIGN(PrefixCache::Restored r, cache.Restore(all, static_cast<int64_t>(all.size()) - 1));
  EXPECT_EQ(r.position, static_cast<int64_t>(conv(0).size()));
  // ...runs on while others push conv(0) out of the host tier.
  const uint64_t evicted = cache.stats().host_evicted;
  for (size_t k = 2; k < 6; ++k) StoreCold(m, &cache, conv(k));
  EXPECT_GT(cache.stats().host_evicted, evicted);
  EXPECT_LE(cache.stats().host_bytes, cache.stats().host_budget_bytes);
  EXPECT_EQ(cache.stats().host_pages, 1) << "the shared page stays with the checkpoints left";
  std::vector<float> warm;
  for (size_t i = static_cast<size_t>(r.position); i < all.size(); ++i) {
    const std::vector<float> row = Feed(m, r.seq, std::span<const int32_t>(all).subspan(i, 1));
    warm.insert(warm.end(), row.begin(), row.end());
  }
  ASSERT_OK(m->model->ReleaseSequence(r.seq));
  ASSERT_EQ(warm.size(), more.size() * static_cast<size_t>(m->model->vocab_size()));
  EXPECT_EQ(std::memcmp(warm.data(), cold_logits.data() + cold_logits.size() - warm.size(), warm.size() * sizeof(float)), 0)
      << GetParam() << ": logits differ (bitwise)";
  // Promotion: with a first tier that holds one checkpoint, a host hit leaves it there too.
  PrefixCache two(m->model.get(), {.budget_bytes = int64_t{1} << 30, .checkpoint_tokens = 0,
                                   .max_entries = 1, .host_budget_bytes = int64_t{1} << 30, .page_tokens = 1});
  StoreCold(m, &two, conv(0));
  StoreCold(m, &two, conv(1));  // conv(0) goes to the host tier (max_entries 1)
  EXPECT_EQ(two.stats().entries, 1);
  EXPECT_EQ(two.stats().host_entries, 1);
  ExpectRestoresExactly(m, &two, conv(0), more, static_cast<int64_t>(conv(0).size()), GetParam() + " promoted");
  EXPECT_EQ(two.stats().host_hits, 1u);
  ExpectRestoresExactly(m, &two, conv(0), more, static_cast<int64_t>(conv(0).size()), GetParam() + " from the first tier");
  EXPECT_EQ(two.stats().host_hits, 1u) << "the second hit is the promoted copy's";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, PrefixCacheTest, ::testing::Values("tiny-v4", "demo-v4"),
                         [](const auto& info) { return info.param == "tiny-v4" ? "tiny" : "demo"; });

}  // namespace
}  // namespace numoe
