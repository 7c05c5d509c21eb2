// The CUDA backend against the CPU backend (the fp32 reference) on mixed batches — prefill chunks of
// different lengths and decode rows in the same steps — on the tiny fixture and on a wider synthetic
// checkpoint whose shapes take the stacked-FP8 paths; with one GPU and --tp 2. Plus the capacity contract
// (slots, per-sequence context, page pool: ResourceExhausted naming the limit, state untouched), memory
// accounting, and the no-CUDA / no-device behaviour.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/checkpoint.h"
#include "common/log.h"
#include "common/synthetic/synthetic.h"
#include "backends/cpu/cpu_model.h"
#include "worker/experts/reference_experts.h"
#include "backends/cuda/cuda_model.h"
#include "model/state_size.h"
#include "tests/support/files.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"

namespace numoe {
namespace {

using test::TinyModel;

bool HaveGpus(int n) { return CudaCompiledIn() && CudaDeviceCount() >= n; }

TEST(CudaFactoryTest, UnavailableWithoutCudaOrDevice) {
  ASSERT_OK_AND_ASSIGN(TinyModel* tiny, TinyModel::Get());
  const Checkpoint& ck = *tiny->ckpt;
  auto m = CreateCudaModel(ck, CudaOptions{});
  if (!CudaCompiledIn()) {
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_NE(m.status().message().find("without CUDA"), std::string::npos) << m.status();
    return;
  }
  if (CudaDeviceCount() == 0) {
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), absl::StatusCode::kUnavailable) << m.status();
    return;
  }
  ASSERT_OK(m);
  EXPECT_EQ((*m)->vocab_size(), ck.config().vocab_size);
  CudaOptions bad;
  bad.tp = 3;  // does not divide 4 heads / 2 groups
  auto b = CreateCudaModel(ck, bad);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("tp"), std::string::npos) << b.status();
}

// Runs the same schedule of steps on both backends and compares every logit row.
struct Schedule {
  std::vector<std::vector<int32_t>> prompts;
  // rounds: for each sequence, how many tokens it feeds in that round (0 = idle); tokens come from its prompt
  // first, then from a fixed pseudo-random continuation.
  std::vector<std::vector<int64_t>> rounds;
};

float Compare(ModelBackend& cpu, ModelBackend& gpu, ExpertBackend& experts, const Schedule& s, int64_t vocab,
              float tol, const std::string& what) {
  const size_t ns = s.prompts.size();
  std::vector<SequenceId> a(ns), b(ns);
  for (size_t i = 0; i < ns; ++i) {
    auto x = cpu.CreateSequence();
    auto y = gpu.CreateSequence();
    EXPECT_OK(x);
    EXPECT_OK(y);
    a[i] = *x;
    b[i] = *y;
  }
  std::vector<std::vector<int32_t>> stream(ns);
  std::mt19937 rng(5);
  for (size_t i = 0; i < ns; ++i) {
    stream[i] = s.prompts[i];
    for (int k = 0; k < 64; ++k) stream[i].push_back(static_cast<int32_t>(rng() % vocab));
  }
  std::vector<size_t> fed(ns, 0);
  float worst = 0;
  for (size_t r = 0; r < s.rounds.size(); ++r) {
    std::vector<SequenceStep> sa, sb;
    for (size_t i = 0; i < ns; ++i) {
      const int64_t k = s.rounds[r][i];
      if (k == 0) continue;
      SequenceStep st;
      st.tokens = std::span<const int32_t>(stream[i].data() + fed[i], static_cast<size_t>(k));
      st.all_logits = true;
      st.seq = a[i];
      sa.push_back(st);
      st.seq = b[i];
      sb.push_back(st);
      fed[i] += static_cast<size_t>(k);
    }
    std::vector<SequenceLogits> la, lb;
    Status x = cpu.Forward(sa, &experts, &la);
    Status y = gpu.Forward(sb, &experts, &lb);
    EXPECT_OK(x);
    EXPECT_OK(y);
    if (!x.ok() || !y.ok()) break;
    for (size_t j = 0; j < la.size(); ++j) {
      EXPECT_EQ(la[j].rows, lb[j].rows);
      float scale = 1.0f;
      for (float v : la[j].logits) scale = std::max(scale, std::fabs(v));
      for (size_t q = 0; q < std::min(la[j].logits.size(), lb[j].logits.size()); ++q) {
        const float d = std::fabs(la[j].logits[q] - lb[j].logits[q]) / scale;
        if (!(d <= worst)) worst = d;
      }
    }
  }
  NLOG(INFO) << what << ": max |cpu - cuda| / max(1, |logit|) = " << worst;
  EXPECT_LE(worst, tol) << what;
  for (size_t i = 0; i < ns; ++i) {
    auto ma = cpu.Memory(a[i]);
    auto mb = gpu.Memory(b[i]);
    EXPECT_OK(ma);
    EXPECT_OK(mb);
    if (ma.ok() && mb.ok()) {
      EXPECT_EQ(ma->position, mb->position) << what;
    }
    EXPECT_OK(cpu.ReleaseSequence(a[i]));
    EXPECT_OK(gpu.ReleaseSequence(b[i]));
  }
  return worst;
}

Schedule MixedSchedule(int64_t vocab) {
  Schedule s;
  std::mt19937 rng(11);
  for (int64_t len : {37, 13, 1, 150}) {
    std::vector<int32_t> p;
    for (int64_t i = 0; i < len; ++i) p.push_back(static_cast<int32_t>(rng() % vocab));
    s.prompts.push_back(p);
  }
  // Prefill in uneven chunks while other sequences decode; windows (8), CSA (4) and HCA (128) boundaries are
  // crossed inside and across steps.
  s.rounds = {{37, 5, 0, 64}, {1, 8, 1, 0}, {1, 0, 1, 86}, {1, 1, 1, 1}, {3, 1, 0, 1},
              {1, 1, 1, 1},   {0, 9, 1, 1}, {1, 1, 1, 1}, {1, 1, 1, 1}, {2, 7, 3, 1}};
  return s;
}

struct CmpMode {
  std::string name;
  bool fp32;
  int tp;
};

class CudaVsCpuTest : public ::testing::TestWithParam<CmpMode> {};

TEST_P(CudaVsCpuTest, TinyMixedBatch) {
  const CmpMode& mode = GetParam();
  if (!HaveGpus(mode.tp)) GTEST_SKIP() << "needs " << mode.tp << " GPU(s)";
  ASSERT_OK_AND_ASSIGN(TinyModel* tiny, TinyModel::Get());  // the fp32 CPU model and its reference experts
  CudaOptions opt;
  opt.fp32 = mode.fp32;
  opt.tp = mode.tp;
  opt.max_step_tokens = 48;  // the 64- and 86-token chunks run as several device passes
  auto gpu = CreateCudaModel(*tiny->ckpt, opt);
  ASSERT_OK(gpu);
  const int64_t vocab = tiny->ckpt->config().vocab_size;
  Compare(*tiny->model, **gpu, *tiny->experts, MixedSchedule(vocab), vocab, mode.fp32 ? 1e-3f : 3e-2f,
          "tiny/" + mode.name);
}

// Shapes that are multiples of the 128x128 FP8 blocks, so [wq_a; wkv] and the shared expert's [w1; w3] are
// stacked into single FP8 matrices, and a hidden size large enough for split-K.
TEST_P(CudaVsCpuTest, WideSyntheticMixedBatch) {
  const CmpMode& mode = GetParam();
  if (!HaveGpus(mode.tp)) GTEST_SKIP() << "needs " << mode.tp << " GPU(s)";
  ModelConfig cfg = synthetic::TinyConfig();
  cfg.hidden_size = 512;
  cfg.head_dim = 128;
  cfg.rope_dim = 32;
  cfg.q_lora_rank = 256;
  cfg.o_groups = 2;
  cfg.o_lora_rank = 128;
  cfg.index_head_dim = 64;
  cfg.moe_intermediate_size = 256;
  test::TempDir dir("numoe-gpu-wide-synthetic");
  synthetic::SyntheticOptions so;
  so.seed = 3;
  const Status st = synthetic::MakeSyntheticCheckpoint(cfg, dir.str(), so);
  ASSERT_OK(st);
  auto ck = Checkpoint::Open(dir.str());
  ASSERT_OK(ck);
  auto cpu = cpu::CpuModel::Create(**ck, nullptr);
  ASSERT_OK(cpu);
  auto ex = cpu::ReferenceExperts::Load(**ck);
  ASSERT_OK(ex);
  CudaOptions opt;
  opt.fp32 = mode.fp32;
  opt.tp = mode.tp;
  auto gpu = CreateCudaModel(**ck, opt);
  ASSERT_OK(gpu);
  Compare(**cpu, **gpu, **ex, MixedSchedule(cfg.vocab_size), cfg.vocab_size, mode.fp32 ? 1e-3f : 3e-2f, "wide/" + mode.name);
}

INSTANTIATE_TEST_SUITE_P(Modes, CudaVsCpuTest,
                         ::testing::Values(CmpMode{"fp32", true, 1}, CmpMode{"bf16", false, 1},
                                           CmpMode{"fp32_tp2", true, 2}, CmpMode{"bf16_tp2", false, 2}),
                         [](const auto& info) { return info.param.name; });

class CudaCapacityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpus(1)) GTEST_SKIP() << "no CUDA device";
    ASSERT_OK_AND_ASSIGN(TinyModel* tiny, TinyModel::Get());
    ckpt_ = tiny->ckpt.get();
    experts_ = tiny->experts.get();
  }
  Status Feed(ModelBackend& m, SequenceId seq, int64_t n) {
    std::vector<int32_t> toks(static_cast<size_t>(n), 7);
    SequenceStep st;
    st.seq = seq;
    st.tokens = toks;
    std::vector<SequenceLogits> out;
    return m.Forward({&st, 1}, experts_, &out);
  }
  // The shared tests/support fixture's.
  const Checkpoint* ckpt_ = nullptr;
  cpu::ReferenceExperts* experts_ = nullptr;
};

TEST_F(CudaCapacityTest, SlotsContextAndPagePool) {
  CudaOptions opt;
  opt.fp32 = true;  // fp32 pages of the tiny model are ~100 KB: 1 MiB holds 10 of them
  opt.max_sequences = 12;
  opt.max_context = 40;
  opt.cache_mb = 1;
  auto m = CreateCudaModel(*ckpt_, opt);
  ASSERT_OK(m);
  ModelBackend& b = **m;

  // Per-sequence context: a 41-token prompt is refused whole and the sequence stays empty.
  auto s0 = b.CreateSequence();
  ASSERT_OK(s0);
  Status st = Feed(b, *s0, 41);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("max_context"), std::string::npos) << st;
  EXPECT_EQ(b.Memory(*s0)->position, 0);
  EXPECT_OK(Feed(b, *s0, 40));
  EXPECT_EQ(b.Memory(*s0)->position, 40);

  // The page pool (1 MiB here) runs out before the slots do: a clear error naming cache_mb, then room again
  // once a sequence is released.
  std::vector<SequenceId> live = {*s0};
  Status full = absl::OkStatus();
  for (int i = 0; i < 11 && full.ok(); ++i) {
    auto s = b.CreateSequence();
    ASSERT_OK(s);
    live.push_back(*s);
    full = Feed(b, *s, 8);
  }
  ASSERT_FALSE(full.ok()) << "1 MiB of pages should not hold 12 sequences";
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("cache_mb"), std::string::npos) << full;
  EXPECT_EQ(b.Memory(live.back())->position, 0);
  ASSERT_OK(b.ReleaseSequence(live.front()));
  EXPECT_OK(Feed(b, live.back(), 8));

  // Slots: max_sequences live sequences, then ResourceExhausted naming the option.
  Status slots = absl::OkStatus();
  while (slots.ok()) {
    auto s = b.CreateSequence();
    slots = s.status();
  }
  EXPECT_EQ(slots.code(), absl::StatusCode::kResourceExhausted) << slots;
  EXPECT_NE(slots.message().find("max_sequences"), std::string::npos) << slots;
}

TEST_F(CudaCapacityTest, MemoryAccountingAndRollback) {
  struct Variant {
    bool fp32, bf16_cache;
    int64_t elem;
  };
  for (const Variant v : {Variant{true, false, 4}, Variant{false, false, 4}, Variant{false, true, 2}}) {
    CudaOptions opt;
    opt.fp32 = v.fp32;
    opt.bf16_cache = v.bf16_cache;
    auto m = CreateCudaModel(*ckpt_, opt);
    ASSERT_OK(m);
    auto s = (*m)->CreateSequence();
    ASSERT_OK(s);
    ASSERT_OK(Feed(**m, *s, 37));
    auto mem = (*m)->Memory(*s);
    ASSERT_OK(mem);
    const ModelConfig& cfg = ckpt_->config();
    EXPECT_EQ(mem->position, 37);
    EXPECT_EQ(mem->growing_bytes, ComputeStateSize(cfg).GrowingValuesAt(cfg, 37) * v.elem);
    EXPECT_GE(mem->capacity_bytes, mem->growing_bytes + mem->fixed_bytes);
    EXPECT_GT(mem->fixed_bytes, 0);
    EXPECT_EQ((*m)->Rollback(*s, 1).code(), absl::StatusCode::kFailedPrecondition);  // last step not speculative
    EXPECT_EQ((*m)->ReleaseSequence(*s + 1000).code(), absl::StatusCode::kNotFound);
  }
}

}  // namespace
}  // namespace numoe
