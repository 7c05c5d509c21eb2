// CudaOptions::drafter_experts = "gpu": the DSpark stages' routed experts computed on the device (MXFP4
// dequantized on the fly, backends/cuda/moe_experts.cu) give the drafts that the host experts give
// (ReferenceExperts: fp32 on dequantized weights), and greedy DSpark speculation with them emits exactly the
// tokens of plain greedy decoding. The stage layers are never sent to the host ExpertBackend (a guard fails
// the test if they are). Every test skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/checkpoint.h"
#include "common/log.h"
#include "worker/experts/reference_experts.h"
#include "backends/cuda/cuda_model.h"
#include "model/generation.h"
#include "tests/support/compare.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"

namespace numoe {
namespace {

bool HaveGpu() { return CudaCompiledIn() && CudaDeviceCount() >= 1; }

// Main layers go to the reference experts; a stage layer (>= num_hidden_layers) is an error: with
// drafter_experts = "gpu" the device must compute them.
class MainLayersOnly final : public ExpertBackend {
 public:
  MainLayersOnly(ExpertBackend* inner, int64_t layers) : inner_(inner), layers_(layers) {}
  Status RunRouted(const MoeRequest& r) override {
    if (r.layer >= layers_) {
      ++stage_calls;
      return absl::FailedPreconditionError(absl::StrCat("stage layer ", r.layer, " reached the host experts"));
    }
    return inner_->RunRouted(r);
  }
  int64_t stage_calls = 0;

 private:
  ExpertBackend* inner_;
  int64_t layers_;
};

// tiny-v4 with the reference experts of its main layers and DSpark stages (the shared tests/support fixture).
using Tiny = test::TinyModel;
Tiny* GetTiny() {
  auto t = test::TinyModel::Get({.drafter = true});
  if (!t.ok()) ADD_FAILURE() << t.status();
  return t.ok() ? *t : nullptr;
}

Status Prefill(ModelBackend& m, ExpertBackend& ex, SequenceId seq, const std::vector<int32_t>& toks) {
  SequenceStep st;
  st.seq = seq;
  st.tokens = toks;
  std::vector<SequenceLogits> out;
  return m.Forward({&st, 1}, &ex, &out);
}

// Drafts with device experts == drafts with host experts, in both numeric modes, for a few sequences (3-131
// token prompts, depths 3-5, after prefill and after a rollback) and for 40 sequences x depth 16 (640 rows:
// more than one 512-row group of the device kernel).
TEST(CudaDrafterExperts, DraftsMatchHostExperts) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Tiny* f = GetTiny();
  ASSERT_NE(f, nullptr);
  const ModelConfig& c = f->ckpt->config();
  const int64_t V = c.vocab_size;
  MainLayersOnly guard(f->experts.get(), c.num_hidden_layers);
  for (bool fp32 : {true, false}) {
    const std::string mode = fp32 ? "fp32" : "bf16";
    CudaOptions ow;
    ow.fp32 = fp32;
    CudaOptions og = ow;
    og.drafter_experts = "gpu";
    auto host = CreateCudaBackend(*f->ckpt, ow);
    auto dev = CreateCudaBackend(*f->ckpt, og);
    ASSERT_OK(host);
    ASSERT_OK(dev);
    ASSERT_EQ((*dev)->drafter(), SpecMethod::kDspark);
    EXPECT_EQ((*host)->drafter_expert_bytes(), 0);
    // At least the checkpoint's MXFP4 bytes: stages x experts x 3 matrices x (D·I/2 codes + D·I/32 scales).
    const int64_t DI = c.hidden_size * c.moe_intermediate_size;
    const int64_t want = f->ckpt->mtp_stages() * c.n_routed_experts * 3 * (DI / 2 + DI / 32);
    EXPECT_GE((*dev)->drafter_expert_bytes(), want);
    EXPECT_NE((*dev)->Describe().find("routed experts on the GPU"), std::string::npos) << (*dev)->Describe();

    std::mt19937 rng(41);
    std::vector<SequenceId> a, b;
    std::vector<int32_t> lens = {3, 40, 131};
    for (int i = 0; i < 40; ++i) lens.push_back(2 + i % 5);
    for (int32_t len : lens) {
      std::vector<int32_t> p;
      for (int32_t t = 0; t < len; ++t) p.push_back(static_cast<int32_t>(rng() % V));
      auto x = (*host)->CreateSequence();
      auto y = (*dev)->CreateSequence();
      ASSERT_OK(x);
      ASSERT_OK(y);
      a.push_back(*x);
      b.push_back(*y);
      ASSERT_OK(Prefill(**host, *f->experts, *x, p));
      ASSERT_OK(Prefill(**dev, guard, *y, p));
    }
    auto compare = [&](const std::string& what, size_t first, size_t count, auto depth_of) {
      std::vector<DraftRequest> ra, rb;
      for (size_t i = first; i < first + count; ++i) {
        const int32_t next = static_cast<int32_t>((17 * i + 5) % V);
        ra.push_back(DraftRequest{a[i], next, depth_of(i), nullptr});
        rb.push_back(DraftRequest{b[i], next, depth_of(i), nullptr});
      }
      std::vector<DraftResult> da, db;
      Status x = (*host)->Draft(ra, f->experts.get(), &da);
      Status y = (*dev)->Draft(rb, &guard, &db);
      ASSERT_OK(x);
      ASSERT_OK(y);
      ASSERT_EQ(da.size(), db.size());
      float worst = 0;
      for (size_t i = 0; i < da.size(); ++i) {
        EXPECT_EQ(da[i].tokens, db[i].tokens) << mode << " " << what << " seq " << i;
        float scale = 1.0f;
        for (float v : da[i].logits) scale = std::max(scale, std::fabs(v));
        const float d = test::MaxAbsDiff(da[i].logits, db[i].logits) / scale;
        worst = std::max(worst, d);
        // Both sides run the same dense device kernels; only the expert sums differ (fp32 on dequantized
        // weights vs fp32 on the fly, different summation order): rounding only.
        EXPECT_LE(d, 1e-4f) << mode << " " << what << " seq " << i;
        EXPECT_LE(test::MaxAbsDiff(da[i].confidence, db[i].confidence), 1e-3f) << mode << " " << what << " seq " << i;
      }
      NLOG(INFO) << mode << " " << what << ": max |host - device experts| / max(1, |logit|) = " << worst;
    };
    compare("3 sequences after prefill", 0, 3, [](size_t i) { return static_cast<int64_t>(3 + i); });
    for (size_t i = 0; i < 3; ++i) {  // a speculative step of 6, 4 rolled back
      std::vector<int32_t> k6;
      for (int t = 0; t < 6; ++t) k6.push_back(static_cast<int32_t>(rng() % V));
      SequenceStep sa, sb;
      sa.seq = a[i];
      sb.seq = b[i];
      sa.tokens = sb.tokens = k6;
      sa.speculative = sb.speculative = true;
      std::vector<SequenceLogits> la, lb;
      ASSERT_OK((*host)->Forward({&sa, 1}, f->experts.get(), &la));
      ASSERT_OK((*dev)->Forward({&sb, 1}, &guard, &lb));
      ASSERT_OK((*host)->Rollback(a[i], 4));
      ASSERT_OK((*dev)->Rollback(b[i], 4));
    }
    compare("3 sequences after a rollback", 0, 3, [](size_t i) { return static_cast<int64_t>(5 - i); });
    compare("40 sequences x depth 16", 3, 40, [](size_t) { return int64_t{16}; });
    EXPECT_EQ(guard.stage_calls, 0);
    // No host expert backend at all: the device has everything the draft needs.
    std::vector<DraftRequest> r1 = {DraftRequest{b[0], 7, 4, nullptr}};
    std::vector<DraftResult> d1;
    EXPECT_OK((*dev)->Draft(r1, nullptr, &d1));
    std::vector<DraftRequest> r0 = {DraftRequest{a[0], 7, 4, nullptr}};
    EXPECT_EQ((*host)->Draft(r0, nullptr, &d1).code(), absl::StatusCode::kInvalidArgument);
  }
}

// Greedy DSpark speculation with the device experts == plain greedy (depths 1-7, batches 1/3/8).
TEST(CudaDrafterExperts, GreedySpeculationEqualsPlainGreedy) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Tiny* f = GetTiny();
  ASSERT_NE(f, nullptr);
  const int64_t V = f->ckpt->config().vocab_size;
  MainLayersOnly guard(f->experts.get(), f->ckpt->config().num_hidden_layers);
  CudaOptions opt;
  opt.drafter_experts = "gpu";
  auto gpu = CreateCudaModel(*f->ckpt, opt);
  ASSERT_OK(gpu);
  int64_t drafted = 0;
  for (int64_t batch : {1, 3, 8}) {
    std::vector<GenerateRequest> reqs;
    for (int64_t i = 0; i < batch; ++i) {
      GenerateRequest r;
      const int64_t len = 5 + (i * 7) % 23;
      for (int64_t t = 0; t < len; ++t) r.prompt.push_back(static_cast<int32_t>((t * 37 + i * 11 + 3) % V));
      r.max_new_tokens = 24;
      r.ignore_eos = true;
      reqs.push_back(r);
    }
    auto plain = GenerateBatch(**gpu, guard, reqs);
    ASSERT_OK(plain);
    for (int64_t depth = 1; depth <= 7; ++depth) {
      SpecConfig spec{.method = SpecMethod::kDspark, .depth = depth};
      auto got = GenerateBatch(**gpu, guard, reqs, nullptr, spec);
      ASSERT_OK(got);
      for (size_t i = 0; i < reqs.size(); ++i) {
        EXPECT_EQ((*got)[i].tokens, (*plain)[i].tokens) << "batch " << batch << " depth " << depth << " seq " << i;
        drafted += (*got)[i].spec.drafted;
      }
    }
  }
  EXPECT_GT(drafted, 0);
  EXPECT_EQ(guard.stage_calls, 0);
}

TEST(CudaDrafterExperts, BadOptionIsRefused) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Tiny* f = GetTiny();
  ASSERT_NE(f, nullptr);
  CudaOptions opt;
  opt.drafter_experts = "cpu";
  auto m = CreateCudaModel(*f->ckpt, opt);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("drafter_experts"), std::string::npos) << m.status();
}

}  // namespace
}  // namespace numoe
