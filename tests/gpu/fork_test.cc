// ModelBackend::ForkSequence on the CUDA backend (n choices of one prompt share its prefill): a fork of a
// sequence continues exactly like a fresh sequence prefilled with the same tokens (every cache copied: window
// ring, compressor pending windows and overlap halves, indexer state, compressed entries in their pages),
// the parent and the fork then run independently, and a fork right after a speculative step is refused.
// Skips without a CUDA device.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/cuda_model.h"
#include "common/checkpoint.h"
#include "common/log.h"
#include "tests/support/compare.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"
#include "worker/experts/reference_experts.h"

namespace numoe {
namespace {

bool HaveGpus(int n) { return CudaCompiledIn() && CudaDeviceCount() >= n; }

Status Feed(ModelBackend& m, ExpertBackend& ex, SequenceId seq, std::span<const int32_t> toks, bool spec,
            std::vector<float>* logits) {
  SequenceStep st{.seq = seq, .tokens = toks, .all_logits = true, .speculative = spec};
  std::vector<SequenceLogits> out;
  RETURN_IF_ERROR(m.Forward({&st, 1}, &ex, &out));
  if (logits != nullptr) *logits = std::move(out[0].logits);
  return absl::OkStatus();
}

struct Mode {
  std::string name;
  bool fp32;
  int tp;
};
class CudaForkTest : public ::testing::TestWithParam<Mode> {};

TEST_P(CudaForkTest, ForkContinuesLikeAFreshPrefillAndRunsIndependently) {
  const Mode& mode = GetParam();
  if (!HaveGpus(mode.tp)) GTEST_SKIP() << "needs " << mode.tp << " GPU(s)";
  auto ck = Checkpoint::Open(test::TinyDir());
  ASSERT_OK(ck);
  auto experts = cpu::ReferenceExperts::Load(**ck, false);
  ASSERT_OK(experts);
  CudaOptions opt;
  opt.fp32 = mode.fp32;
  opt.tp = mode.tp;
  auto mm = CreateCudaBackend(**ck, opt);
  ASSERT_OK(mm);
  CudaBackend& m = **mm;
  ASSERT_TRUE(m.capabilities().fork);
  ExpertBackend& ex = **experts;
  const int64_t V = (*ck)->config().vocab_size;
  const float tol = mode.fp32 ? 1e-3f : 5e-2f;  // tests/data/README.md "matches"
  // tiny-v4: window 8, CSA rate 4, HCA rate 128: prompts that end inside and at the windows' edges.
  for (int64_t len : {1, 5, 37, 127, 128, 131, 250}) {
    const std::string what = mode.name + " prompt " + std::to_string(len);
    std::mt19937 rng(static_cast<uint32_t>(len));
    std::vector<int32_t> prompt, ca, cb;
    for (int64_t i = 0; i < len; ++i) prompt.push_back(static_cast<int32_t>(rng() % V));
    for (int i = 0; i < 19; ++i) ca.push_back(static_cast<int32_t>(rng() % V));
    for (int i = 0; i < 19; ++i) cb.push_back(static_cast<int32_t>(rng() % V));
    auto parent = m.CreateSequence();
    ASSERT_OK(parent);
    ASSERT_OK(Feed(m, ex, *parent, prompt, false, nullptr)) << what;
    auto child = m.ForkSequence(*parent);
    ASSERT_OK(child) << what;
    EXPECT_EQ(m.Memory(*child)->position, len) << what;
    // References: fresh sequences prefilled with the prompt, then the same continuations.
    auto ra = m.CreateSequence(), rb = m.CreateSequence();
    ASSERT_OK(ra);
    ASSERT_OK(rb);
    ASSERT_OK(Feed(m, ex, *ra, prompt, false, nullptr));
    ASSERT_OK(Feed(m, ex, *rb, prompt, false, nullptr));
    // Parent continues with ca, the fork with cb: a 13-token chunk, then decode steps in one batch.
    std::vector<float> la, lb, lra, lrb;
    ASSERT_OK(Feed(m, ex, *parent, std::span<const int32_t>(ca.data(), 13), false, &la));
    ASSERT_OK(Feed(m, ex, *child, std::span<const int32_t>(cb.data(), 13), false, &lb));
    ASSERT_OK(Feed(m, ex, *ra, std::span<const int32_t>(ca.data(), 13), false, &lra));
    ASSERT_OK(Feed(m, ex, *rb, std::span<const int32_t>(cb.data(), 13), false, &lrb));
    float worst = std::max(test::MaxAbsDiff(la, lra), test::MaxAbsDiff(lb, lrb));
    for (size_t t = 13; t < ca.size(); ++t) {
      std::vector<SequenceStep> steps(4);
      steps[0] = {.seq = *parent, .tokens = std::span<const int32_t>(ca.data() + t, 1)};
      steps[1] = {.seq = *child, .tokens = std::span<const int32_t>(cb.data() + t, 1)};
      steps[2] = {.seq = *ra, .tokens = std::span<const int32_t>(ca.data() + t, 1)};
      steps[3] = {.seq = *rb, .tokens = std::span<const int32_t>(cb.data() + t, 1)};
      std::vector<SequenceLogits> out;
      ASSERT_OK(m.Forward(steps, &ex, &out)) << what;
      worst = std::max({worst, test::MaxAbsDiff(out[0].logits, out[2].logits), test::MaxAbsDiff(out[1].logits, out[3].logits)});
    }
    NLOG(INFO) << what << ": max |fork - fresh| = " << worst;
    EXPECT_LE(worst, tol) << what;
    // Releasing the parent leaves the fork intact (its pages are its own).
    ASSERT_OK(m.ReleaseSequence(*parent));
    const int32_t next = cb[0];
    ASSERT_OK(Feed(m, ex, *child, std::span<const int32_t>(&next, 1), false, &lb));
    ASSERT_OK(Feed(m, ex, *rb, std::span<const int32_t>(&next, 1), false, &lrb));
    EXPECT_LE(test::MaxAbsDiff(lb, lrb), tol) << what << ": after the parent was released";
    for (SequenceId s : {*child, *ra, *rb}) ASSERT_OK(m.ReleaseSequence(s));
  }
}

TEST_P(CudaForkTest, ForkAfterASpeculativeStepIsRefused) {
  const Mode& mode = GetParam();
  if (!HaveGpus(mode.tp)) GTEST_SKIP() << "needs " << mode.tp << " GPU(s)";
  auto ck = Checkpoint::Open(test::TinyDir());
  ASSERT_OK(ck);
  auto experts = cpu::ReferenceExperts::Load(**ck, false);
  ASSERT_OK(experts);
  CudaOptions opt;
  opt.fp32 = mode.fp32;
  opt.tp = mode.tp;
  auto mm = CreateCudaBackend(**ck, opt);
  ASSERT_OK(mm);
  CudaBackend& m = **mm;
  if (!m.capabilities().verify) GTEST_SKIP() << "this build verifies no drafts";
  auto s = m.CreateSequence();
  ASSERT_OK(s);
  const std::vector<int32_t> toks = {5, 6, 7, 8};
  ASSERT_OK(Feed(m, **experts, *s, toks, true, nullptr));
  auto f = m.ForkSequence(*s);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition) << f.status();
  EXPECT_EQ(m.ForkSequence(12345).status().code(), absl::StatusCode::kNotFound);
  ASSERT_OK(m.ReleaseSequence(*s));
}

INSTANTIATE_TEST_SUITE_P(Modes, CudaForkTest,
                         ::testing::Values(Mode{"fp32", true, 1}, Mode{"bf16", false, 1}, Mode{"bf16_tp2", false, 2}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace numoe
