// Other members of the DeepSeek-V4 family (synthetic random-weight checkpoints written by
// numoe_synthetic): the same code must load and run them with no change. With no oracle for these shapes,
// the tests assert the invariants the goldens also pin down: prefill in one step, in chunks and token by
// token give the same logits; a batch of sequences at different positions gives each one's logits; the
// state grows exactly as accounted.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/checkpoint.h"
#include "common/synthetic/synthetic.h"
#include "backends/cpu/cpu_model.h"
#include "worker/experts/reference_experts.h"
#include "model/state_size.h"
#include "tests/support/compare.h"
#include "tests/support/files.h"
#include "tests/support/status_matchers.h"

namespace numoe {
namespace {

struct Variant {
  std::string name;
  std::vector<AttnType> schedule;
  int64_t hash_layers = 1;
  int64_t experts = 8, top_k = 2;
  int64_t window = 8;
  int64_t csa_rate = 4, hca_rate = 8;
  int64_t index_heads = 8, index_topk = 3;
  int num_shards = 2;
  DType tid2eid = DType::kI64;
};

std::vector<Variant> Variants() {
  using A = AttnType;
  return {
      {"csa_hca_i32_3shards", {A::kCSA, A::kHCA, A::kSliding}, 1, 8, 2, 8, 4, 8, 8, 3, 3, DType::kI32},
      {"hca_only_16experts_top4", {A::kHCA, A::kHCA}, 2, 16, 4, 4, 4, 16, 4, 2, 1, DType::kI64},
      {"sliding_then_csa_window16", {A::kSliding, A::kSliding, A::kCSA, A::kCSA}, 0, 6, 3, 16, 4, 8, 4, 16, 2,
       DType::kI32},
      {"csa_rate4_topk1_single_file", {A::kCSA, A::kHCA, A::kCSA}, 3, 4, 1, 5, 4, 128, 12, 1, 1, DType::kI64},
  };
}

class FamilyTest : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    const Variant& v = GetParam();
    ModelConfig cfg = synthetic::TinyConfig();
    synthetic::SetSchedule(&cfg, v.schedule, v.hash_layers);
    cfg.n_routed_experts = v.experts;
    cfg.num_experts_per_tok = v.top_k;
    cfg.sliding_window = v.window;
    cfg.csa_rate = v.csa_rate;
    cfg.hca_rate = v.hca_rate;
    cfg.index_n_heads = v.index_heads;
    cfg.index_topk = v.index_topk;
    synthetic::SyntheticOptions opt;
    opt.seed = 11;
    opt.num_shards = v.num_shards;
    opt.tid2eid_dtype = v.tid2eid;
    opt.write_index = v.num_shards > 1;
    Status st = synthetic::MakeSyntheticCheckpoint(cfg, dir_.str(), opt);
    ASSERT_OK(st);
    auto ck = Checkpoint::Open(dir_.str());
    ASSERT_OK(ck);
    ckpt_ = std::move(*ck);
    auto model = cpu::CpuModel::Create(*ckpt_, nullptr);
    ASSERT_OK(model);
    model_ = std::move(*model);
    auto ex = cpu::ReferenceExperts::Load(*ckpt_);
    ASSERT_OK(ex);
    experts_ = std::move(*ex);
  }

  // Logits for every token of `ids`, fed in chunks of `chunk` (0 = all at once).
  std::vector<float> RunChunked(const std::vector<int32_t>& ids, size_t chunk) {
    auto seq = model_->CreateSequence();
    EXPECT_OK(seq);
    std::vector<float> all;
    std::vector<SequenceLogits> out;
    for (size_t at = 0; at < ids.size();) {
      const size_t n = chunk == 0 ? ids.size() : std::min(chunk, ids.size() - at);
      SequenceStep st{*seq, std::span<const int32_t>(ids.data() + at, n), true};
      Status s = model_->Forward({&st, 1}, experts_.get(), &out);
      EXPECT_OK(s);
      if (!s.ok()) break;
      all.insert(all.end(), out[0].logits.begin(), out[0].logits.end());
      at += n;
    }
    const ModelConfig& cfg = ckpt_->config();
    auto mem = model_->Memory(*seq);
    EXPECT_OK(mem);
    EXPECT_EQ(mem->growing_bytes, ComputeStateSize(cfg).GrowingValuesAt(cfg, static_cast<int64_t>(ids.size())) * 4);
    EXPECT_OK(model_->ReleaseSequence(*seq));
    return all;
  }

  test::TempDir dir_{"numoe-family"};  // the variant's checkpoint; removed with the fixture
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<cpu::CpuModel> model_;
  std::unique_ptr<cpu::ReferenceExperts> experts_;
};

std::vector<int32_t> Tokens(int64_t n, int64_t vocab, int salt) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>((i * 131 + salt * 17 + (i * i) % 7) % vocab);
  return ids;
}

TEST_P(FamilyTest, ChunkingDoesNotChangeLogits) {
  const int64_t V = ckpt_->config().vocab_size;
  const auto ids = Tokens(45, V, 1);  // crosses several compression windows, not a multiple of any rate
  const auto whole = RunChunked(ids, 0);
  for (float v : whole) ASSERT_TRUE(std::isfinite(v));
  EXPECT_LE(test::MaxAbsDiff(whole, RunChunked(ids, 3)), 1e-4f);
  EXPECT_LE(test::MaxAbsDiff(whole, RunChunked(ids, 1)), 1e-4f);
}

TEST_P(FamilyTest, BatchOfSequencesAtDifferentPositions) {
  const int64_t V = ckpt_->config().vocab_size;
  const auto a = Tokens(30, V, 2), b = Tokens(13, V, 3);
  const auto a_alone = RunChunked(a, 0), b_alone = RunChunked(b, 0);
  // a gets 20 tokens first, then a's last 10 and all of b in one batched step.
  auto sa = model_->CreateSequence(), sb = model_->CreateSequence();
  ASSERT_OK(sa);
  ASSERT_OK(sb);
  std::vector<SequenceLogits> out;
  SequenceStep first{*sa, std::span<const int32_t>(a.data(), 20), true};
  ASSERT_OK(model_->Forward({&first, 1}, experts_.get(), &out));
  std::vector<float> a_batched = out[0].logits;
  SequenceStep both[2] = {{*sa, std::span<const int32_t>(a.data() + 20, 10), true}, {*sb, b, true}};
  ASSERT_OK(model_->Forward({both, 2}, experts_.get(), &out));
  a_batched.insert(a_batched.end(), out[0].logits.begin(), out[0].logits.end());
  EXPECT_LE(test::MaxAbsDiff(a_alone, a_batched), 1e-4f);
  EXPECT_LE(test::MaxAbsDiff(b_alone, out[1].logits), 1e-4f);
}

// Speculative steps that are rolled back leave no trace: windows, compressor pending buffers, CSA
// overlap state, compressed and indexer entries all behave as if the rejected tokens never ran.
TEST_P(FamilyTest, RollbackLeavesNoTrace) {
  const int64_t V = ckpt_->config().vocab_size;
  const auto ids = Tokens(40, V, 5);
  const auto reference = RunChunked(ids, 0);
  auto seq = model_->CreateSequence();
  ASSERT_OK(seq);
  std::vector<SequenceLogits> out;
  std::vector<float> got;
  // Feed 1..7 true tokens per step as a speculative step with up to 6 wrong drafts appended, keep only
  // the true ones: every step crosses window / compression boundaries at different offsets.
  size_t at = 0;
  int round = 0;
  while (at < ids.size()) {
    const size_t take = std::min<size_t>(1 + (round * 3) % 7, ids.size() - at);
    const size_t junk = static_cast<size_t>((round * 5) % 7);
    std::vector<int32_t> step(ids.begin() + at, ids.begin() + at + take);
    for (size_t j = 0; j < junk; ++j) step.push_back(static_cast<int32_t>((j * 97 + round * 13 + 3) % V));
    SequenceStep st{*seq, step, true, /*speculative=*/true};
    ASSERT_OK(model_->Forward({&st, 1}, experts_.get(), &out));
    got.insert(got.end(), out[0].logits.begin(), out[0].logits.begin() + take * V);
    ASSERT_OK(model_->Rollback(*seq, static_cast<int64_t>(junk)));
    auto mem = model_->Memory(*seq);
    ASSERT_OK(mem);
    EXPECT_EQ(mem->position, static_cast<int64_t>(at + take));
    at += take;
    ++round;
  }
  EXPECT_LE(test::MaxAbsDiff(reference, got), 1e-4f);
  // A non-speculative step cannot be rolled back.
  std::vector<int32_t> one = {1};
  SequenceStep plain{*seq, one, false, false};
  ASSERT_OK(model_->Forward({&plain, 1}, experts_.get(), &out));
  EXPECT_EQ(model_->Rollback(*seq, 1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_OK(model_->ReleaseSequence(*seq));
}

INSTANTIATE_TEST_SUITE_P(Synthetic, FamilyTest, ::testing::ValuesIn(Variants()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace numoe
