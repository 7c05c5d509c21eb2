// The preview-Flash MTP drafter on the CPU backend (docs/dsv4-architecture.md §4.1), on a synthetic tiny
// checkpoint with one random `mtp.0` block (numoe mkmodel --preset tiny --drafter mtp): greedy speculation
// with --spec mtp emits exactly the plain greedy tokens for depths 1-7 and batches 1, 3, 8 (random weights
// accept almost nothing, which exercises rollback); with temperature > 0 the sampled tokens follow the
// same distribution with and without speculation; after a speculative step and its rollback the MTP
// state is bit-for-bit that of a sequence that never drafted.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/checkpoint.h"
#include "backends/cpu/cpu_model.h"
#include "worker/experts/reference_experts.h"
#include "model/generation.h"
#include "tests/model/chi_square.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"

namespace numoe {
namespace {

using Loaded = test::TinyModel;

// The synthetic tiny MTP checkpoint with its drafter (the shared tests/support fixture).
Loaded* GetMtp() {
  auto m = test::TinyModel::Get({.model = test::kTinyMtp, .drafter = true});
  if (!m.ok()) ADD_FAILURE() << m.status();
  return m.ok() ? *m : nullptr;
}

std::vector<GenerateRequest> Prompts(int64_t count, int64_t vocab, int64_t new_tokens) {
  std::vector<GenerateRequest> reqs;
  for (int64_t i = 0; i < count; ++i) {
    GenerateRequest r;
    const int64_t len = 5 + (i * 7) % 23;
    for (int64_t t = 0; t < len; ++t) r.prompt.push_back(static_cast<int32_t>((t * 37 + i * 11 + 3) % vocab));
    r.max_new_tokens = new_tokens;
    r.ignore_eos = true;
    reqs.push_back(r);
  }
  return reqs;
}

TEST(Mtp, LoadsTheBlockAsTheModelsDrafter) {
  Loaded* l = GetMtp();
  ASSERT_NE(l, nullptr);
  EXPECT_EQ(l->ckpt->mtp_stages(), 1);
  EXPECT_EQ(l->ckpt->config().dspark_block_size, 0);
  EXPECT_EQ(l->model->drafter(), SpecMethod::kMtp);
  // Without the drafter option nothing drafts, and asking for MTP is refused with the flag's name.
  auto plain = cpu::CpuModel::Create(*l->ckpt, nullptr);
  ASSERT_OK(plain);
  EXPECT_EQ((*plain)->drafter(), SpecMethod::kNone);
  auto got = GenerateBatch(**plain, *l->experts, Prompts(1, 64, 4), nullptr, SpecConfig{.method = SpecMethod::kMtp});
  ASSERT_FALSE(got.ok());
  EXPECT_NE(std::string(got.status().message()).find("--spec mtp"), std::string::npos) << got.status();
  // The MTP checkpoint has no DSpark drafter.
  got = GenerateBatch(*l->model, *l->experts, Prompts(1, 64, 4), nullptr, SpecConfig{.method = SpecMethod::kDspark});
  ASSERT_FALSE(got.ok());
  EXPECT_NE(std::string(got.status().message()).find("--spec dspark"), std::string::npos) << got.status();
}

TEST(Mtp, DraftRejectsBadRequests) {
  Loaded* l = GetMtp();
  ASSERT_NE(l, nullptr);
  cpu::CpuModel& m = *l->model;
  auto seq = m.CreateSequence();
  ASSERT_OK(seq);
  std::vector<DraftResult> out;
  std::vector<DraftRequest> q = {{*seq, 3, 2, nullptr}};
  EXPECT_EQ(m.Draft(q, l->experts.get(), &out).code(), absl::StatusCode::kFailedPrecondition);  // nothing consumed
  const std::vector<int32_t> prompt = {4, 5, 6};
  std::vector<SequenceLogits> logits;
  ASSERT_OK(m.Forward(std::vector<SequenceStep>{{*seq, prompt}}, l->experts.get(), &logits));
  q[0].depth = 0;
  EXPECT_EQ(m.Draft(q, l->experts.get(), &out).code(), absl::StatusCode::kInvalidArgument);
  q[0].depth = 2;
  q[0].next_token = static_cast<int32_t>(m.vocab_size());
  EXPECT_EQ(m.Draft(q, l->experts.get(), &out).code(), absl::StatusCode::kInvalidArgument);
  q[0] = {*seq + 100, 3, 2, nullptr};
  EXPECT_EQ(m.Draft(q, l->experts.get(), &out).code(), absl::StatusCode::kNotFound);
  q[0] = {*seq, 3, 2, nullptr};
  EXPECT_TRUE(m.Draft(q, nullptr, &out).code() == absl::StatusCode::kInvalidArgument);
  ASSERT_OK(m.Draft(q, l->experts.get(), &out));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].tokens.size(), 2u);
  EXPECT_EQ(out[0].logits.size(), static_cast<size_t>(2 * m.vocab_size()));
  ASSERT_OK(m.ReleaseSequence(*seq));
}

TEST(Mtp, GreedySpeculationEmitsExactlyThePlainGreedyTokens) {
  Loaded* l = GetMtp();
  ASSERT_NE(l, nullptr);
  const int64_t V = l->ckpt->config().vocab_size;
  int64_t drafted = 0, accepted = 0;
  for (int64_t batch : {1, 3, 8}) {
    const auto reqs = Prompts(batch, V, 24);
    auto plain = GenerateBatch(*l->model, *l->experts, reqs);
    ASSERT_OK(plain);
    for (int64_t depth = 1; depth <= 7; ++depth) {
      SpecConfig spec{.method = SpecMethod::kMtp, .depth = depth};
      auto got = GenerateBatch(*l->model, *l->experts, reqs, nullptr, spec);
      ASSERT_OK(got);
      for (size_t i = 0; i < reqs.size(); ++i) {
        EXPECT_EQ((*got)[i].tokens, (*plain)[i].tokens) << "batch " << batch << " depth " << depth << " seq " << i;
        drafted += (*got)[i].spec.drafted;
        accepted += (*got)[i].spec.accepted;
        // Every decode step after the first verified drafts (none is skipped), except the last one that
        // may not draft past max_new_tokens.
        EXPECT_GE((*got)[i].spec.steps, 1);
      }
    }
  }
  // 12 sequences x 7 depths, each drafting on (nearly) every one of its 23 decode steps.
  EXPECT_GT(drafted, 12 * 7 * 10);
  std::printf("mtp greedy: %lld drafted, %lld accepted\n", static_cast<long long>(drafted),
              static_cast<long long>(accepted));
}

TEST(Mtp, AdaptiveDepthAndLogitsKeepTheirMeaning) {
  Loaded* l = GetMtp();
  ASSERT_NE(l, nullptr);
  auto reqs = Prompts(2, l->ckpt->config().vocab_size, 16);
  for (auto& r : reqs) r.keep_logits = true;
  auto plain = GenerateBatch(*l->model, *l->experts, reqs);
  ASSERT_OK(plain);
  auto got = GenerateBatch(*l->model, *l->experts, reqs, nullptr,
                           SpecConfig{.method = SpecMethod::kMtp, .depth = 4, .adaptive = true});
  ASSERT_OK(got);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ((*got)[i].tokens, (*plain)[i].tokens);
    ASSERT_EQ((*got)[i].step_logits.size(), (*plain)[i].step_logits.size());
    float worst = 0;
    for (size_t j = 0; j < (*got)[i].step_logits.size(); ++j) {
      worst = std::max(worst, std::fabs((*got)[i].step_logits[j] - (*plain)[i].step_logits[j]));
    }
    EXPECT_LE(worst, 1e-4f);
  }
}

// A sequence that ran a speculative step and rolled back (all or part of) its drafts drafts exactly like one
// that consumed the same tokens without ever drafting: the MTP ring and the target streams it keeps are
// restored bit for bit, and drafting itself leaves no trace.
TEST(Mtp, RollbackRestoresTheMtpStateBitForBit) {
  Loaded* l = GetMtp();
  ASSERT_NE(l, nullptr);
  cpu::CpuModel& m = *l->model;
  ExpertBackend* ex = l->experts.get();
  const int64_t V = m.vocab_size();
  std::vector<int32_t> prompt;
  for (int t = 0; t < 9; ++t) prompt.push_back((t * 53 + 7) % static_cast<int32_t>(V));
  auto draft = [&](SequenceId s, int32_t next, int64_t depth) {
    std::vector<DraftResult> out;
    const std::vector<DraftRequest> q = {{s, next, depth, nullptr}};
    EXPECT_OK(m.Draft(q, ex, &out));
    return out.empty() ? DraftResult{} : out[0];
  };
  auto forward = [&](SequenceId s, const std::vector<int32_t>& tokens, bool speculative) {
    std::vector<SequenceLogits> out;
    SequenceStep st{s, tokens, /*all_logits=*/true, speculative};
    EXPECT_OK(m.Forward(std::span<const SequenceStep>(&st, 1), ex, &out));
    return out.empty() ? std::vector<float>{} : out[0].logits;
  };
  auto same = [](const DraftResult& a, const DraftResult& b) {
    return a.tokens == b.tokens && a.logits.size() == b.logits.size() &&
           std::memcmp(a.logits.data(), b.logits.data(), a.logits.size() * sizeof(float)) == 0;
  };
  const int32_t t = 17, x = 901;
  for (int64_t kept : {0, 2, 4}) {
    // A: prompt, drafts, speculative step [t, d0..d3], keep `kept` drafts (roll back the rest), draft again.
    auto a = m.CreateSequence();
    ASSERT_OK(a);
    forward(*a, prompt, false);
    const DraftResult a1 = draft(*a, t, 4);
    const DraftResult a1again = draft(*a, t, 4);
    EXPECT_TRUE(same(a1, a1again)) << "drafting changed the sequence's state";
    std::vector<int32_t> verify = {t};
    verify.insert(verify.end(), a1.tokens.begin(), a1.tokens.end());
    forward(*a, verify, true);
    ASSERT_OK(m.Rollback(*a, 4 - kept));
    const DraftResult a2 = draft(*a, x, 5);
    const std::vector<float> a3 = forward(*a, {x}, false);
    const DraftResult a4 = draft(*a, 5, 3);

    // B: the same tokens consumed without ever drafting.
    auto b = m.CreateSequence();
    ASSERT_OK(b);
    forward(*b, prompt, false);
    std::vector<int32_t> consumed(verify.begin(), verify.begin() + 1 + kept);
    forward(*b, consumed, false);
    const DraftResult b2 = draft(*b, x, 5);
    const std::vector<float> b3 = forward(*b, {x}, false);
    const DraftResult b4 = draft(*b, 5, 3);

    EXPECT_TRUE(same(a2, b2)) << "kept " << kept << ": drafts after the rollback differ";
    ASSERT_EQ(a3.size(), b3.size());
    EXPECT_EQ(std::memcmp(a3.data(), b3.data(), a3.size() * sizeof(float)), 0) << "kept " << kept;
    EXPECT_TRUE(same(a4, b4)) << "kept " << kept << ": drafts one step later differ";
    EXPECT_EQ(a4.tokens.size(), 3u);
    ASSERT_OK(m.ReleaseSequence(*a));
    ASSERT_OK(m.ReleaseSequence(*b));
  }
}

// The ring entries the MTP block needs at a chunk boundary come from the previous step's last streams: a
// prompt fed whole, in chunks of 7 or token by token (30 tokens, several times the tiny sliding window of 8)
// drafts the same tokens from the same distributions.
TEST(Mtp, PrefillChunkingDoesNotChangeTheDrafts) {
  Loaded* l = GetMtp();
  ASSERT_NE(l, nullptr);
  cpu::CpuModel& m = *l->model;
  ExpertBackend* ex = l->experts.get();
  std::vector<int32_t> prompt;
  for (int t = 0; t < 30; ++t) prompt.push_back((t * 71 + 13) % static_cast<int32_t>(m.vocab_size()));
  std::vector<DraftResult> results;
  for (size_t chunk : {prompt.size(), size_t{7}, size_t{1}}) {
    auto s = m.CreateSequence();
    ASSERT_OK(s);
    std::vector<SequenceLogits> out;
    for (size_t at = 0; at < prompt.size(); at += chunk) {
      const size_t n = std::min(chunk, prompt.size() - at);
      SequenceStep st{*s, std::span<const int32_t>(prompt.data() + at, n)};
      ASSERT_OK(m.Forward(std::span<const SequenceStep>(&st, 1), ex, &out));
    }
    std::vector<DraftResult> d;
    const std::vector<DraftRequest> q = {{*s, 42, 4, nullptr}};
    ASSERT_OK(m.Draft(q, ex, &d));
    results.push_back(d[0]);
    ASSERT_OK(m.ReleaseSequence(*s));
  }
  for (size_t i = 1; i < results.size(); ++i) {
    EXPECT_EQ(results[i].tokens, results[0].tokens) << "case " << i;
    ASSERT_EQ(results[i].logits.size(), results[0].logits.size());
    float worst = 0;
    for (size_t j = 0; j < results[0].logits.size(); ++j) {
      worst = std::max(worst, std::fabs(results[i].logits[j] - results[0].logits[j]));
    }
    EXPECT_LE(worst, 1e-4f) << "case " << i;
  }
}

// Batched drafting equals drafting each sequence alone (rows of different sequences never mix), also with
// different depths in one call.
TEST(Mtp, BatchedDraftsEqualSingleDrafts) {
  Loaded* l = GetMtp();
  ASSERT_NE(l, nullptr);
  cpu::CpuModel& m = *l->model;
  ExpertBackend* ex = l->experts.get();
  std::vector<SequenceId> seqs;
  std::vector<std::vector<int32_t>> prompts = {{3, 9, 27}, {100, 200, 300, 400, 500, 600, 700}};
  for (const auto& p : prompts) {
    auto s = m.CreateSequence();
    ASSERT_OK(s);
    std::vector<SequenceLogits> out;
    ASSERT_OK(m.Forward(std::vector<SequenceStep>{{*s, p}}, ex, &out));
    seqs.push_back(*s);
  }
  const std::vector<DraftRequest> both = {{seqs[0], 11, 3, nullptr}, {seqs[1], 12, 6, nullptr}};
  std::vector<DraftResult> together, alone;
  ASSERT_OK(m.Draft(both, ex, &together));
  ASSERT_EQ(together.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    ASSERT_OK(m.Draft(std::span<const DraftRequest>(&both[i], 1), ex, &alone));
    EXPECT_EQ(together[i].seq, seqs[i]);
    EXPECT_EQ(together[i].tokens, alone[0].tokens);
    EXPECT_EQ(together[i].logits, alone[0].logits);
    EXPECT_EQ(together[i].tokens.size(), static_cast<size_t>(both[i].depth));
  }
  for (SequenceId s : seqs) ASSERT_OK(m.ReleaseSequence(s));
}

// Two-sample chi-square homogeneity test on the 2nd and 3rd generated tokens with and without MTP
// speculation (as tests/model/spec_test.cc does for DSpark and n-gram): temperature 1, top-k 4, 3000
// samples each, significance 0.001 per comparison.
using test::ChiSquare;

// The category of generated token j: its id (top-k sampling keeps few), or its rank under the target's
// distribution at that position (the logits that chose it), 0..7, else 8.
enum class Category { kTokenId, kTargetRank };

int32_t CategoryOf(const GenerateResult& r, size_t j, Category c, int64_t V) {
  if (c == Category::kTokenId) return r.tokens[j];
  const float* lg = &r.step_logits[j * V];
  const float mine = lg[r.tokens[j]];
  int32_t rank = 0;
  for (int64_t v = 0; v < V && rank < 8; ++v) rank += lg[v] > mine ? 1 : 0;
  return rank;
}

struct SampledCase {
  double temperature;
  int64_t top_k;
  Category category;
  bool expect_accepts;
};

// 3000 sequences of 3 tokens with and without speculation (depth 2), other seeds; the 2nd and 3rd tokens'
// categories are compared. Significance 0.001 per comparison.
void CheckSampled(Loaded* l, const SampledCase& c) {
  const auto critical = test::ChiSquareCritical999;
  const int64_t V = l->model->vocab_size();
  std::map<int32_t, int> plain2, plain3, spec2, spec3;
  int64_t drafted = 0, accepted = 0;
  constexpr int kSamples = 3000, kBatch = 100;
  for (int round = 0; round < kSamples / kBatch; ++round) {
    std::vector<GenerateRequest> reqs;
    for (int i = 0; i < kBatch; ++i) {
      GenerateRequest r;
      r.prompt = {5, 17, 99, 5, 17, 99, 5, 17};
      r.max_new_tokens = 3;
      r.ignore_eos = true;
      r.keep_logits = c.category == Category::kTargetRank;
      r.sampling.temperature = c.temperature;
      r.sampling.top_k = c.top_k;
      r.sampling.seed = static_cast<uint64_t>(round * kBatch + i + 1);
      reqs.push_back(r);
    }
    auto a = GenerateBatch(*l->model, *l->experts, reqs);
    ASSERT_OK(a);
    for (auto& r : reqs) r.sampling.seed += 1000003;
    auto b = GenerateBatch(*l->model, *l->experts, reqs, nullptr, SpecConfig{.method = SpecMethod::kMtp, .depth = 2});
    ASSERT_OK(b);
    for (int i = 0; i < kBatch; ++i) {
      plain2[CategoryOf((*a)[i], 1, c.category, V)]++;
      plain3[CategoryOf((*a)[i], 2, c.category, V)]++;
      spec2[CategoryOf((*b)[i], 1, c.category, V)]++;
      spec3[CategoryOf((*b)[i], 2, c.category, V)]++;
      drafted += (*b)[i].spec.drafted;
      accepted += (*b)[i].spec.accepted;
    }
  }
  EXPECT_GE(drafted, kSamples);  // one draft per sequence at least (depth is capped by max_new_tokens)
  if (c.expect_accepts) {
    EXPECT_GT(accepted, kSamples / 20);
  }
  std::printf("mtp sampled T %.2f top-k %lld: %lld drafted, %lld accepted\n", c.temperature,
              static_cast<long long>(c.top_k), static_cast<long long>(drafted), static_cast<long long>(accepted));
  for (auto [x, y] : {std::make_pair(&plain2, &spec2), std::make_pair(&plain3, &spec3)}) {
    int dof = 0;
    const double chi = ChiSquare(*x, *y, &dof);
    ASSERT_GE(dof, 3);
    EXPECT_LT(chi, critical(dof)) << "chi-square " << chi << " with " << dof << " degrees of freedom";
    std::printf("  chi-square %.2f, dof %d, critical %.2f\n", chi, dof, critical(dof));
  }
}

// Top-k 4 at temperature 1: the random drafter's top 4 and the target's hardly overlap, so this checks the
// rejection path (the residual distribution).
TEST(Mtp, SampledTokensFollowTheSameDistributionWithAndWithoutSpeculation) {
  Loaded* l = GetMtp();
  ASSERT_NE(l, nullptr);
  CheckSampled(l, {1.0, 4, Category::kTokenId, false});
}

// The full vocabulary at temperature 0.3: draft and target distributions overlap, so a good share of drafts is
// kept (the acceptance path); tokens are compared by their rank under the target's distribution.
TEST(Mtp, SampledTokensKeepTheTargetDistributionWhenDraftsAreAccepted) {
  Loaded* l = GetMtp();
  ASSERT_NE(l, nullptr);
  CheckSampled(l, {0.3, 0, Category::kTargetRank, true});
}

}  // namespace
}  // namespace numoe
