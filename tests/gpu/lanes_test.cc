// CUDA lanes (CudaOptions::lanes): the steps of callers on different lanes interleave at their ExpertBackend
// calls, as numoe-gpu's worker sessions do while their workers compute a layer's experts. Here one lane's
// expert call runs a whole step of another lane (prefill, then graph-replayed decode) before it answers; every
// sequence's logits must equal those of the same steps run one after the other on lane 0. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backends/cuda/cuda_model.h"
#include "common/checkpoint.h"
#include "model/backend.h"
#include "tests/support/compare.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"
#include "worker/experts/reference_experts.h"

namespace numoe {
namespace {

// The reference experts on a chosen lane; `interrupt`, when set, runs once inside the call for `at_layer`.
class LaneExperts final : public ExpertBackend {
 public:
  LaneExperts(ExpertBackend* inner, int lane) : inner_(inner), lane_(lane) {}
  Status RunRouted(const MoeRequest& request) override {
    if (interrupt && request.layer == at_layer) {
      auto run = std::move(interrupt);
      interrupt = nullptr;
      run();
    }
    return inner_->RunRouted(request);
  }
  int lane() const override { return lane_; }
  std::function<void()> interrupt;
  int at_layer = 1;

 private:
  ExpertBackend* inner_;
  int lane_;
};

TEST(CudaLanes, InterleavedStepsOnTwoLanesEqualTheSameStepsInTurn) {
  if (!CudaCompiledIn() || CudaDeviceCount() < 1) GTEST_SKIP() << "no CUDA device";
  ASSERT_OK_AND_ASSIGN(test::TinyModel * tiny, test::TinyModel::Get());
  const Checkpoint& ck = *tiny->ckpt;
  ASSERT_GE(ck.config().num_hidden_layers, 2);
  CudaOptions o;
  o.lanes = 2;
  o.drafter = false;
  o.max_sequences = 8;
  ASSERT_OK_AND_ASSIGN(auto model, CreateCudaModel(ck, o));
  const Capabilities caps = model->capabilities();
  ASSERT_TRUE(caps.interleaved_steps);
  EXPECT_EQ(caps.lanes, 3);

  const std::vector<int32_t> prompt_x = tiny->goldens[0].input_ids, prompt_y = tiny->goldens[1].input_ids;
  constexpr int kDecode = 6;
  const int32_t vocab = static_cast<int32_t>(ck.config().vocab_size);
  auto next = [&](int32_t t, int k) { return static_cast<int32_t>((t * 31 + 7 * k + 3) % vocab); };

  // One sequence's steps: its prompt, then kDecode single tokens; returns every step's last-row logits.
  // `lane_experts` runs it; `between(k)` runs inside step k's expert call (another lane's work).
  auto run_steps = [&](SequenceId seq, const std::vector<int32_t>& prompt, LaneExperts& ex,
                       const std::function<void(int)>& between) {
    std::vector<std::vector<float>> logits;
    std::vector<int32_t> tokens = prompt;
    int32_t last = prompt.back();
    for (int k = 0; k <= kDecode; ++k) {
      if (k > 0) tokens = {next(last, k)};
      last = tokens.back();
      if (between) ex.interrupt = [&between, k] { between(k); };
      const SequenceStep step{.seq = seq, .tokens = tokens};
      std::vector<SequenceLogits> out;
      EXPECT_OK(model->Forward({&step, 1}, &ex, &out));
      EXPECT_EQ(out.size(), 1u);
      if (out.size() == 1) logits.push_back(out[0].logits);
      EXPECT_EQ(ex.interrupt, nullptr) << "step " << k << " never reached its interrupt";
    }
    return logits;
  };

  // In turn, on lane 0.
  LaneExperts lane0(tiny->experts.get(), 0);
  ASSERT_OK_AND_ASSIGN(SequenceId rx, model->CreateSequence());
  ASSERT_OK_AND_ASSIGN(SequenceId ry, model->CreateSequence());
  const auto want_x = run_steps(rx, prompt_x, lane0, nullptr);
  const auto want_y = run_steps(ry, prompt_y, lane0, nullptr);
  ASSERT_OK(model->ReleaseSequence(rx));
  ASSERT_OK(model->ReleaseSequence(ry));

  // Interleaved: each of x's steps (lane 1) pauses at layer 1's experts while y's step of the same index
  // runs whole on lane 2.
  LaneExperts lane1(tiny->experts.get(), 1), lane2(tiny->experts.get(), 2);
  ASSERT_OK_AND_ASSIGN(SequenceId x, model->CreateSequence());
  ASSERT_OK_AND_ASSIGN(SequenceId y, model->CreateSequence());
  std::vector<std::vector<float>> got_y;
  std::vector<int32_t> y_tokens = prompt_y;
  int32_t y_last = prompt_y.back();
  auto y_step = [&](int k) {
    if (k > 0) y_tokens = {next(y_last, k)};
    y_last = y_tokens.back();
    const SequenceStep step{.seq = y, .tokens = y_tokens};
    std::vector<SequenceLogits> out;
    EXPECT_OK(model->Forward({&step, 1}, &lane2, &out));
    if (out.size() == 1) got_y.push_back(out[0].logits);
  };
  const auto got_x = run_steps(x, prompt_x, lane1, y_step);
  ASSERT_EQ(got_x.size(), want_x.size());
  ASSERT_EQ(got_y.size(), want_y.size());
  for (size_t k = 0; k < want_x.size(); ++k) {
    SCOPED_TRACE(k);
    // The same kernels on the same inputs. Measured on an H200: up to ~3e-5 apart (the order of the
    // kernels' floating-point accumulation varies run to run); a step that read another lane's scratch or
    // staging is off by O(1).
    EXPECT_LE(test::MaxAbsDiff(got_x[k], want_x[k]), 1e-3f);
    EXPECT_LE(test::MaxAbsDiff(got_y[k], want_y[k]), 1e-3f);
    EXPECT_EQ(std::max_element(got_x[k].begin(), got_x[k].end()) - got_x[k].begin(),
              std::max_element(want_x[k].begin(), want_x[k].end()) - want_x[k].begin());
    EXPECT_EQ(std::max_element(got_y[k].begin(), got_y[k].end()) - got_y[k].begin(),
              std::max_element(want_y[k].begin(), want_y[k].end()) - want_y[k].begin());
  }
  ASSERT_OK(model->ReleaseSequence(x));
  ASSERT_OK(model->ReleaseSequence(y));

  // A lane the backend does not have is refused, naming it.
  LaneExperts lane9(tiny->experts.get(), 9);
  ASSERT_OK_AND_ASSIGN(SequenceId z, model->CreateSequence());
  const SequenceStep step{.seq = z, .tokens = prompt_x};
  std::vector<SequenceLogits> out;
  const Status st = model->Forward({&step, 1}, &lane9, &out);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("lane() = 9"), std::string::npos) << st;
  ASSERT_OK(model->ReleaseSequence(z));
}

// Without lanes (the default of CudaOptions), or with a drafter, steps take whole turns.
TEST(CudaLanes, NoLanesMeansWholeStepTurns) {
  if (!CudaCompiledIn() || CudaDeviceCount() < 1) GTEST_SKIP() << "no CUDA device";
  ASSERT_OK_AND_ASSIGN(test::TinyModel * tiny, test::TinyModel::Get());
  CudaOptions o;
  o.drafter = false;
  ASSERT_OK_AND_ASSIGN(auto model, CreateCudaModel(*tiny->ckpt, o));
  EXPECT_FALSE(model->capabilities().interleaved_steps);
  EXPECT_EQ(model->capabilities().lanes, 0);
}

}  // namespace
}  // namespace numoe
