// The CUDA backend against the transformers goldens of tests/data/tiny-v4/golden.safetensors: prefill all at
// once, in chunks of 5 and token by token, then 32 greedy steps, for each prompt; fp32 mode within 1e-3 and
// bf16 mode within 5e-2 with every greedy token equal (tests/data/README.md "matches"); FP8 weights kept and
// dequantized; one GPU and --tp 2. Plus the device argmax path and all prompts in one batch.
// Skips when the build has no CUDA or the machine has too few GPUs.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/checkpoint.h"
#include "common/log.h"
#include "worker/experts/reference_experts.h"
#include "backends/cuda/cuda_model.h"
#include "model/generation.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"

namespace numoe {
namespace {

using Golden = test::GoldenPrompt;
using Fixture = test::TinyModel;

// tiny-v4 with its reference experts and goldens (the shared tests/support fixture).
Fixture* Tiny() {
  auto t = test::TinyModel::Get();
  if (!t.ok()) ADD_FAILURE() << t.status();
  return t.ok() ? *t : nullptr;
}

// The golden prompt `name` ("p0" .. "p3") of the fixture.
const Golden& Prompt(const Fixture& fx, const std::string& name) {
  auto p = fx.goldens.Find(name);
  EXPECT_OK(p);
  return p.ok() ? **p : fx.goldens[0];
}

struct Mode {
  std::string name;
  bool fp32;
  bool fp8_weights;
  int tp;
  bool bf16_cache = false;
  float tol() const { return fp32 ? 1e-3f : 5e-2f; }
};

// One CUDA model per mode for the whole binary (weights upload once).
CudaBackend* Model(const Mode& m) {
  static std::map<std::string, std::unique_ptr<CudaBackend>> cache;
  auto& slot = cache[m.name];
  if (slot) return slot.get();
  Fixture* fx = Tiny();
  if (fx == nullptr) return nullptr;
  CudaOptions opt;
  opt.fp32 = m.fp32;
  opt.fp8_weights = m.fp8_weights;
  opt.tp = m.tp;
  opt.bf16_cache = m.bf16_cache;
  opt.max_sequences = 8;
  auto b = CreateCudaBackend(*fx->ckpt, opt);
  if (!b.ok()) {
    ADD_FAILURE() << b.status();
    return nullptr;
  }
  slot = std::move(*b);
  return slot.get();
}

bool SkipReason(const Mode& m, std::string* why) {
  if (!CudaCompiledIn()) {
    *why = "built without CUDA";
    return true;
  }
  if (CudaDeviceCount() < m.tp) {
    *why = absl::StrCat("needs ", m.tp, " GPU(s), found ", CudaDeviceCount());
    return true;
  }
  return false;
}

std::pair<float, size_t> MaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
  float worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const float d = std::fabs(a[i] - b[i]);
    if (!(d <= worst)) {
      worst = d;
      at = i;
    }
  }
  return {worst, at};
}

void ExpectMatches(const Golden& g, const GenerateResult& r, float tol, const std::string& what) {
  ASSERT_EQ(r.prefill_logits.size(), g.prefill_logits.size()) << what;
  ASSERT_EQ(r.step_logits.size(), g.step_logits.size()) << what;
  const auto [pd, pat] = MaxDiff(r.prefill_logits, g.prefill_logits);
  const auto [sd, sat] = MaxDiff(r.step_logits, g.step_logits);
  NLOG(INFO) << what << ": max |prefill - golden| " << pd << ", max |step - golden| " << sd;
  EXPECT_LE(pd, tol) << what << ": prefill logit " << pat << " differs by " << pd;
  EXPECT_LE(sd, tol) << what << ": step logit " << sat << " differs by " << sd;
  EXPECT_EQ(r.tokens, g.greedy) << what;
}

GenerateRequest Request(const Golden& g, int64_t chunk) {
  GenerateRequest r;
  r.prompt = g.input_ids;
  r.max_new_tokens = static_cast<int64_t>(g.greedy.size());
  r.ignore_eos = true;
  r.prefill_chunk = chunk;
  r.keep_logits = true;
  return r;
}

std::vector<Mode> Modes() {
  return {{"fp32_fp8w", true, true, 1},  {"bf16_fp8w", false, true, 1}, {"bf16_bf16w", false, false, 1},
          {"fp32_bf16w", true, false, 1}, {"fp32_fp8w_tp2", true, true, 2}, {"bf16_fp8w_tp2", false, true, 2}};
}

struct Case {
  Mode mode;
  std::string prompt;
  int64_t chunk;
};

class CudaGoldenTest : public ::testing::TestWithParam<Case> {};

TEST_P(CudaGoldenTest, LogitsAndGreedyTokensMatch) {
  const Case& c = GetParam();
  std::string why;
  if (SkipReason(c.mode, &why)) GTEST_SKIP() << why;
  Fixture* fx = Tiny();
  ASSERT_NE(fx, nullptr);
  CudaBackend* m = Model(c.mode);
  ASSERT_NE(m, nullptr);
  const Golden& g = Prompt(*fx, c.prompt);
  auto res = GenerateBatch(*m, *fx->experts, {Request(g, c.chunk)});
  ASSERT_OK(res);
  ExpectMatches(g, (*res)[0], c.mode.tol(), c.mode.name + "/" + c.prompt + "/chunk" + std::to_string(c.chunk));
}

std::vector<Case> Cases() {
  std::vector<Case> v;
  for (const Mode& m : Modes()) {
    for (const char* p : {"p0", "p1", "p2", "p3"}) {
      for (int64_t chunk : {0, 5, 1}) v.push_back({m, p, chunk});
    }
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Tiny, CudaGoldenTest, ::testing::ValuesIn(Cases()), [](const auto& info) {
  return info.param.mode.name + "_" + info.param.prompt + "_chunk" + std::to_string(info.param.chunk);
});

class CudaGoldenModeTest : public ::testing::TestWithParam<Mode> {};

// All four prompts (lengths 37, 250, 1, 150) in one batch: every step mixes prefill chunks and decode rows.
TEST_P(CudaGoldenModeTest, AllPromptsInOneBatch) {
  const Mode& mode = GetParam();
  std::string why;
  if (SkipReason(mode, &why)) GTEST_SKIP() << why;
  Fixture* fx = Tiny();
  ASSERT_NE(fx, nullptr);
  CudaBackend* m = Model(mode);
  ASSERT_NE(m, nullptr);
  for (int64_t chunk : {0, 7}) {
    std::vector<GenerateRequest> reqs;
    std::vector<std::string> names;
    for (const Golden& g : fx->goldens) {
      reqs.push_back(Request(g, chunk));
      names.push_back(g.name);
    }
    auto res = GenerateBatch(*m, *fx->experts, reqs);
    ASSERT_OK(res);
    for (size_t i = 0; i < reqs.size(); ++i) {
      ExpectMatches(Prompt(*fx, names[i]), (*res)[i], mode.tol(),
                    mode.name + "/batch/" + names[i] + "/chunk" + std::to_string(chunk));
    }
  }
}

// Greedy decoding with the argmax on the device (only token ids come back).
TEST_P(CudaGoldenModeTest, DeviceArgmaxGreedy) {
  const Mode& mode = GetParam();
  std::string why;
  if (SkipReason(mode, &why)) GTEST_SKIP() << why;
  Fixture* fx = Tiny();
  ASSERT_NE(fx, nullptr);
  CudaBackend* m = Model(mode);
  ASSERT_NE(m, nullptr);
  for (const Golden& g : fx->goldens) {
    auto seq = m->CreateSequence();
    ASSERT_OK(seq);
    std::vector<int32_t> got, tok;
    SequenceStep st;
    st.seq = *seq;
    st.tokens = g.input_ids;
    ASSERT_OK(m->ForwardGreedy({&st, 1}, fx->experts.get(), &tok));
    got.push_back(tok[0]);
    while (got.size() < g.greedy.size()) {
      int32_t last = got.back();
      st.tokens = std::span<const int32_t>(&last, 1);
      const Status s = m->ForwardGreedy({&st, 1}, fx->experts.get(), &tok);
      ASSERT_OK(s);
      got.push_back(tok[0]);
    }
    EXPECT_EQ(got, g.greedy) << mode.name << "/" << g.name;
    ASSERT_OK(m->ReleaseSequence(*seq));
  }
}

// p0's residual streams after the embedding and after each layer against the golden p0.hidden.* (localises a
// mismatch to the first layer that drifts). One GPU only (the hook is not called with tp > 1).
TEST_P(CudaGoldenModeTest, HiddenStreamsLayerByLayer) {
  const Mode& mode = GetParam();
  std::string why;
  if (SkipReason(mode, &why)) GTEST_SKIP() << why;
  if (mode.tp != 1) GTEST_SKIP() << "hidden hook is single-GPU";
  Fixture* fx = Tiny();
  ASSERT_NE(fx, nullptr);
  CudaBackend* m = Model(mode);
  ASSERT_NE(m, nullptr);
  std::map<int64_t, std::vector<float>> seen;
  m->set_hidden_hook([&](int64_t layer, const std::vector<float>& x) { seen[layer] = x; });
  auto seq = m->CreateSequence();
  ASSERT_OK(seq);
  SequenceStep step;
  step.seq = *seq;
  step.tokens = Prompt(*fx, "p0").input_ids;
  step.all_logits = true;
  std::vector<SequenceLogits> out;
  const Status st = m->Forward({&step, 1}, fx->experts.get(), &out);
  m->set_hidden_hook(nullptr);
  ASSERT_OK(st);
  ASSERT_OK(m->ReleaseSequence(*seq));
  const int64_t L = fx->ckpt->config().num_hidden_layers;
  for (int64_t i = 0; i < L; ++i) {  // hidden.L is the final normed hidden, not a residual stream
    const std::string name = "p0.hidden." + std::to_string(i);
    auto hidden = fx->goldens.Floats(name);
    if (absl::IsNotFound(hidden.status())) continue;
    ASSERT_OK(hidden) << name;
    ASSERT_TRUE(seen.count(i - 1)) << name;
    const std::vector<float>& want = *hidden;
    ASSERT_EQ(seen[i - 1].size(), want.size()) << name;
    const auto [d, at] = MaxDiff(seen[i - 1], want);
    float scale = 1.0f;
    for (float v : want) scale = std::max(scale, std::fabs(v));
    NLOG(INFO) << mode.name << " " << name << ": max diff " << d << " (scale " << scale << ") at " << at;
    EXPECT_LE(d, mode.tol() * scale) << name << " first drifts at element " << at << " by " << d;
  }
}

INSTANTIATE_TEST_SUITE_P(Tiny, CudaGoldenModeTest, ::testing::ValuesIn(Modes()),
                         [](const auto& info) { return info.param.name; });

// bf16 caches: the 2^-9 rounding of cached keys moves indexer scores by more than the fixture's top-k margins
// (>= 1.4e-4), so later layers pick other compressed entries and the logits drift past 5e-2 (documented in
// cuda_model.h). What must still hold: a one-token prompt (no cache read but its own key) and the residual
// streams up to the first CSA flip stay within the bf16 tolerance.
TEST(CudaBf16CacheTest, CloseBeforeTheFirstTopKFlip) {
  const Mode mode{"bf16_cache", false, true, 1, true};
  std::string why;
  if (SkipReason(mode, &why)) GTEST_SKIP() << why;
  Fixture* fx = Tiny();
  ASSERT_NE(fx, nullptr);
  CudaBackend* m = Model(mode);
  ASSERT_NE(m, nullptr);
  const Golden& g2 = Prompt(*fx, "p2");
  GenerateRequest r = Request(g2, 0);
  r.max_new_tokens = 1;
  auto res = GenerateBatch(*m, *fx->experts, {r});
  ASSERT_OK(res);
  const auto [pd, pat] = MaxDiff((*res)[0].prefill_logits, g2.prefill_logits);
  NLOG(INFO) << "bf16 cache p2 prefill: max diff " << pd;
  EXPECT_LE(pd, 5e-2f) << "at " << pat;

  std::map<int64_t, std::vector<float>> seen;
  m->set_hidden_hook([&](int64_t layer, const std::vector<float>& x) { seen[layer] = x; });
  auto seq = m->CreateSequence();
  ASSERT_OK(seq);
  SequenceStep step;
  step.seq = *seq;
  step.tokens = Prompt(*fx, "p0").input_ids;
  std::vector<SequenceLogits> out;
  const Status st = m->Forward({&step, 1}, fx->experts.get(), &out);
  m->set_hidden_hook(nullptr);
  ASSERT_OK(st);
  ASSERT_OK(m->ReleaseSequence(*seq));
  for (float v : out[0].logits) ASSERT_TRUE(std::isfinite(v));
  for (int64_t i = 1; i <= 3; ++i) {  // after layers 0 (sliding), 1 (CSA) and 2 (HCA)
    ASSERT_OK_AND_ASSIGN(const std::vector<float> want, fx->goldens.Floats("p0.hidden." + std::to_string(i)));
    ASSERT_EQ(seen[i - 1].size(), want.size());
    const auto [d, at] = MaxDiff(seen[i - 1], want);
    float scale = 1.0f;
    for (float v : want) scale = std::max(scale, std::fabs(v));
    NLOG(INFO) << "bf16 cache p0.hidden." << i << ": max diff " << d << " (scale " << scale << ")";
    EXPECT_LE(d, 5e-2f * scale) << "p0.hidden." << i << " at " << at;
  }
}

}  // namespace
}  // namespace numoe
