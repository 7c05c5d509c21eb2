// The prefix cache (model/prefix_cache.h, model/prefix_step.h) on the CUDA backend: a prompt served from a
// checkpoint (restored by ForkSequence) gives the same greedy tokens as with the cache off and logits within
// the fixtures' tolerance (tests/data/README.md "matches"), whole and chunked, for the next turn of a
// conversation and for a prompt diverging between interval checkpoints; the host tier (ExportSequence to
// pinned memory, ImportSequence back: the bytes survive the round trip exactly, and a prompt restored from
// there matches cold); speculative answers (given drafts, the DSpark drafter) checkpointed at their end so the
// next turn restores them. Skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "backends/cuda/cuda_model.h"
#include "common/checkpoint.h"
#include "model/prefix_cache.h"
#include "tests/support/cached_generate.h"
#include "tests/support/compare.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"
#include "worker/experts/reference_experts.h"

namespace numoe {
namespace {

using Outcome = test::CachedOutcome;
using test::GenerateCached;

TEST(CudaPrefixCache, WarmMatchesColdWithinTolerance) {
  if (!CudaCompiledIn() || CudaDeviceCount() < 1) GTEST_SKIP() << "needs a GPU";
  auto ck = Checkpoint::Open(test::TinyDir());
  ASSERT_OK(ck);
  auto experts = cpu::ReferenceExperts::Load(**ck, false);
  ASSERT_OK(experts);
  auto mm = CreateCudaBackend(**ck, CudaOptions{});
  ASSERT_OK(mm);
  ModelBackend& m = **mm;
  ASSERT_TRUE(m.capabilities().fork);
  ExpertBackend& ex = **experts;
  const float tol = 5e-2f;  // tests/data/README.md "matches" (bf16 path)
  auto goldens = test::Goldens::Load(test::TinyDir());
  ASSERT_OK(goldens);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 4; ++i) {
    for (const auto& g : *goldens) prompt.insert(prompt.end(), g.input_ids.begin(), g.input_ids.end());
  }
  prompt.resize(std::min<size_t>(prompt.size(), 150));
  for (int64_t chunk : {0, 7}) {
    // A cache of its own per chunking: the previous one holds the diverging prompt's own checkpoint (at 77).
    PrefixCache cache(&m, {.checkpoint_tokens = 32});
    const Outcome cold = GenerateCached(m, ex, nullptr, prompt, 0, 6);
    const Outcome first = GenerateCached(m, ex, &cache, prompt, chunk, 6);
    const Outcome again = GenerateCached(m, ex, &cache, prompt, chunk, 6);
    EXPECT_EQ(again.cached, static_cast<int64_t>(prompt.size()) - 1);
    EXPECT_EQ(first.tokens, cold.tokens);
    EXPECT_EQ(again.tokens, cold.tokens);
    EXPECT_LE(test::MaxAbsDiff(again.logits, cold.logits), tol);
    // Diverging at 77: the interval checkpoint at 64 serves.
    std::vector<int32_t> other(prompt.begin(), prompt.begin() + 77);
    other.push_back((prompt[77] + 1) % static_cast<int32_t>(m.vocab_size()));
    const Outcome cold2 = GenerateCached(m, ex, nullptr, other, 0, 4);
    const Outcome warm2 = GenerateCached(m, ex, &cache, other, chunk, 4);
    EXPECT_EQ(warm2.cached, 64);
    EXPECT_EQ(warm2.tokens, cold2.tokens);
    EXPECT_LE(test::MaxAbsDiff(warm2.logits, cold2.logits), tol);
  }
}

// The host tier: a first tier too small for any checkpoint, so each goes to pinned host memory and every hit
// imports it; the prompt spans more than one host page (the backend's page_tokens: 512 positions on tiny-v4).
TEST(CudaPrefixCache, HostTierMatchesCold) {
  if (!CudaCompiledIn() || CudaDeviceCount() < 1) GTEST_SKIP() << "needs a GPU";
  auto ck = Checkpoint::Open(test::TinyDir());
  ASSERT_OK(ck);
  auto experts = cpu::ReferenceExperts::Load(**ck, false);
  ASSERT_OK(experts);
  auto mm = CreateCudaBackend(**ck, CudaOptions{});
  ASSERT_OK(mm);
  ModelBackend& m = **mm;
  const int64_t align = m.capabilities().export_align;
  ASSERT_GT(align, 0);
  ExpertBackend& ex = **experts;
  const float tol = 5e-2f;  // tests/data/README.md "matches" (bf16 path)
  auto goldens = test::Goldens::Load(test::TinyDir());
  ASSERT_OK(goldens);
  std::vector<int32_t> prompt;
  while (prompt.size() < static_cast<size_t>(align + 90)) {
    for (const auto& g : *goldens) prompt.insert(prompt.end(), g.input_ids.begin(), g.input_ids.end());
  }
  prompt.resize(static_cast<size_t>(align + 90));
  // The round trip: export, import, export again gives the same bytes.
  {
    ASSERT_OK_AND_ASSIGN(SequenceId a, m.CreateSequence());
    std::vector<SequenceLogits> out;
    const SequenceStep step{.seq = a, .tokens = prompt};
    ASSERT_OK(m.Forward({&step, 1}, &ex, &out));
    ASSERT_OK_AND_ASSIGN(HostState hs, m.ExportSequence(a, align, 0));
    ASSERT_EQ(hs.pages.size(), 1u);
    ASSERT_OK_AND_ASSIGN(SequenceId b, m.ImportSequence(hs));
    ASSERT_OK_AND_ASSIGN(HostState again, m.ExportSequence(b, align, 0));
    ASSERT_EQ(again.pages.size(), 1u);
    ASSERT_EQ(again.pages[0].size, hs.pages[0].size);
    EXPECT_EQ(std::memcmp(again.pages[0].get(), hs.pages[0].get(), static_cast<size_t>(hs.pages[0].size)), 0);
    ASSERT_EQ(again.rest.size, hs.rest.size);
    EXPECT_EQ(std::memcmp(again.rest.get(), hs.rest.get(), static_cast<size_t>(hs.rest.size)), 0);
    ASSERT_OK(m.ReleaseSequence(a));
    ASSERT_OK(m.ReleaseSequence(b));
  }
  for (int64_t chunk : {0, 7}) {
    PrefixCache cache(&m, {.budget_bytes = 1, .checkpoint_tokens = 64, .host_budget_bytes = int64_t{1} << 30});
    const Outcome cold = GenerateCached(m, ex, nullptr, prompt, 0, 6);
    const Outcome first = GenerateCached(m, ex, &cache, prompt, chunk, 6);
    const Outcome again = GenerateCached(m, ex, &cache, prompt, chunk, 6);
    EXPECT_EQ(again.cached, static_cast<int64_t>(prompt.size()) - 1);
    EXPECT_GT(cache.stats().host_hits, 0u);
    EXPECT_EQ(cache.stats().entries, 0);
    EXPECT_EQ(first.tokens, cold.tokens);
    EXPECT_EQ(again.tokens, cold.tokens);
    EXPECT_LE(test::MaxAbsDiff(again.logits, cold.logits), tol);
  }
}

// Speculative answers (given drafts, some rejected, and tiny-v4's DSpark drafter on the device): served again
// from the cache they give the cold tokens, and the next turn restores the whole first turn, prompt and
// answer: the answer's last speculative step was made final (Settle) and checkpointed with only accepted
// positions.
TEST(CudaPrefixCache, SpeculativeAnswersAreCheckpointed) {
  if (!CudaCompiledIn() || CudaDeviceCount() < 1) GTEST_SKIP() << "needs a GPU";
  auto ck = Checkpoint::Open(test::TinyDir());
  ASSERT_OK(ck);
  auto experts = cpu::ReferenceExperts::Load(**ck, /*include_drafter=*/true);
  ASSERT_OK(experts);
  auto mm = CreateCudaBackend(**ck, CudaOptions{});
  ASSERT_OK(mm);
  ModelBackend& m = **mm;
  ASSERT_EQ(m.drafter(), SpecMethod::kDspark);
  ExpertBackend& ex = **experts;
  const float tol = 5e-2f;  // tests/data/README.md "matches" (bf16 path)
  auto goldens = test::Goldens::Load(test::TinyDir());
  ASSERT_OK(goldens);
  const auto& g = (*goldens)[0];
  for (test::Drafts d : {test::Drafts::kGiven, test::Drafts::kModel}) {
    const std::string what = d == test::Drafts::kGiven ? "given drafts" : "DSpark drafter";
    PrefixCache cache(&m, {.checkpoint_tokens = 4});
    const Outcome cold = GenerateCached(m, ex, nullptr, g.input_ids, 0, 8, d, g.greedy);
    EXPECT_EQ(std::vector<int32_t>(cold.tokens.begin(), cold.tokens.begin() + std::min(cold.tokens.size(), g.greedy.size())),
              std::vector<int32_t>(g.greedy.begin(), g.greedy.begin() + std::min(cold.tokens.size(), g.greedy.size())))
        << what << ": greedy speculation is plain greedy";
    const Outcome first = GenerateCached(m, ex, &cache, g.input_ids, 3, 8, d, g.greedy);
    EXPECT_EQ(first.tokens, cold.tokens) << what;
    const Outcome again = GenerateCached(m, ex, &cache, g.input_ids, 3, 8, d, g.greedy);
    EXPECT_EQ(again.cached, static_cast<int64_t>(g.input_ids.size()) - 1) << what;
    EXPECT_EQ(again.tokens, cold.tokens) << what;
    EXPECT_LE(test::MaxAbsDiff(again.logits, cold.logits), tol) << what;
    std::vector<int32_t> turn2 = g.input_ids;
    turn2.insert(turn2.end(), first.tokens.begin(), first.tokens.end() - 1);
    turn2.insert(turn2.end(), g.input_ids.begin(), g.input_ids.begin() + 3);
    if (!test::Feedable(m, turn2)) continue;
    const Outcome cold2 = GenerateCached(m, ex, nullptr, turn2, 0, 4);
    const Outcome warm2 = GenerateCached(m, ex, &cache, turn2, 0, 4);
    EXPECT_EQ(warm2.cached, static_cast<int64_t>(g.input_ids.size() + first.tokens.size()) - 1) << what;
    EXPECT_EQ(warm2.tokens, cold2.tokens) << what;
    EXPECT_LE(test::MaxAbsDiff(warm2.logits, cold2.logits), tol) << what;
  }
}

}  // namespace
}  // namespace numoe
