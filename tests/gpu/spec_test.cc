// Speculative decoding on the CUDA backend: speculative steps + Rollback leave every cache (window ring,
// compressor pending windows, CSA overlap halves, indexer state, compressed entries) as if the rolled-back
// tokens never ran; greedy speculative decoding with the n-gram drafter emits exactly the tokens of plain
// greedy decoding (depths 1-7, batches 1/3/8, tiny-v4 and demo-v4), which also equal the CPU backend's; the
// device DSpark drafter proposes what the CPU drafter proposes, and greedy DSpark speculation equals plain greedy.
// Every test skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/checkpoint.h"
#include "common/log.h"
#include "backends/cpu/cpu_model.h"
#include "worker/experts/reference_experts.h"
#include "backends/cuda/cuda_model.h"
#include "model/generation.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"

namespace numoe {
namespace {

bool HaveGpus(int n) { return CudaCompiledIn() && CudaDeviceCount() >= n; }

using Fixture = test::TinyModel;

// A fixture of tests/data with its drafter's experts when it has one (tiny-v4's DSpark stages; demo-v4 has
// none): the shared tests/support fixture.
Fixture* Get(const std::string& name) {
  auto f = test::TinyModel::Get({.model = name, .drafter = name == "tiny-v4"});
  if (!f.ok()) ADD_FAILURE() << f.status();
  return f.ok() ? *f : nullptr;
}

// ---- rollback: state after (speculative step of k + Rollback(k - j)) == state after consuming j ----------

Status Feed(ModelBackend& m, ExpertBackend& ex, SequenceId seq, std::span<const int32_t> toks, bool spec,
           std::vector<float>* logits) {
  SequenceStep st;
  st.seq = seq;
  st.tokens = toks;
  st.all_logits = true;
  st.speculative = spec;
  std::vector<SequenceLogits> out;
  RETURN_IF_ERROR(m.Forward({&st, 1}, &ex, &out));
  if (logits != nullptr) *logits = std::move(out[0].logits);
  return absl::OkStatus();
}

float MaxDiff(const std::vector<float>& a, const std::vector<float>& b, size_t rows_vals) {
  float worst = 0;
  for (size_t i = 0; i < rows_vals && i < a.size() && i < b.size(); ++i) {
    const float d = std::fabs(a[i] - b[i]);
    if (!(d <= worst)) worst = d;  // NaN counts as worst
  }
  return worst;
}

struct RollbackCase {
  int64_t prompt;  // tokens before the speculative step
  int64_t k;       // tokens of the speculative step
  std::vector<int64_t> rollbacks;  // successive Rollback amounts (usually one)
};

// Runs sequence A: prompt, speculative step of k, the rollbacks, then a 13-token chunk and 6 single-token
// steps; sequence B: prompt, the kept tokens as a plain step, the same continuation. Compares every logit
// row (the speculative step's kept rows too) and the positions.
void CheckRollback(CudaBackend& m, ExpertBackend& ex, int64_t vocab, const RollbackCase& c, float tol,
                   const std::string& what) {
  std::mt19937 rng(static_cast<uint32_t>(c.prompt * 131 + c.k));
  std::vector<int32_t> prompt, draft, cont;
  for (int64_t i = 0; i < c.prompt; ++i) prompt.push_back(static_cast<int32_t>(rng() % vocab));
  for (int64_t i = 0; i < c.k; ++i) draft.push_back(static_cast<int32_t>(rng() % vocab));
  for (int i = 0; i < 19; ++i) cont.push_back(static_cast<int32_t>(rng() % vocab));
  int64_t dropped = 0;
  for (int64_t r : c.rollbacks) dropped += r;
  const int64_t j = c.k - dropped;
  ASSERT_GE(j, 0) << what;

  auto a = m.CreateSequence();
  auto b = m.CreateSequence();
  ASSERT_OK(a);
  ASSERT_OK(b);
  std::vector<float> la, lb;
  if (!prompt.empty()) {
    ASSERT_OK(Feed(m, ex, *a, prompt, false, nullptr)) << what;
    ASSERT_OK(Feed(m, ex, *b, prompt, false, nullptr)) << what;
  }
  Status st = Feed(m, ex, *a, draft, true, &la);
  ASSERT_OK(st) << what << ": " << st;
  for (int64_t r : c.rollbacks) {
    st = m.Rollback(*a, r);
    ASSERT_OK(st) << what << ": " << st;
  }
  EXPECT_EQ(m.Memory(*a)->position, c.prompt + j) << what;
  if (j > 0) {
    ASSERT_OK(Feed(m, ex, *b, std::span<const int32_t>(draft.data(), static_cast<size_t>(j)), false, &lb));
    const float d = MaxDiff(la, lb, static_cast<size_t>(j * vocab));
    EXPECT_LE(d, tol) << what << ": kept rows of the speculative step";
  }
  EXPECT_EQ(m.Memory(*a)->position, m.Memory(*b)->position) << what;
  // The continuation: one chunk that closes the windows left open, then decode steps (CUDA graphs).
  float worst = 0;
  ASSERT_OK(Feed(m, ex, *a, std::span<const int32_t>(cont.data(), 13), false, &la));
  ASSERT_OK(Feed(m, ex, *b, std::span<const int32_t>(cont.data(), 13), false, &lb));
  worst = std::max(worst, MaxDiff(la, lb, static_cast<size_t>(13 * vocab)));
  for (size_t t = 13; t < cont.size(); ++t) {
    std::vector<SequenceStep> steps(2);
    steps[0].seq = *a;
    steps[1].seq = *b;
    steps[0].tokens = steps[1].tokens = std::span<const int32_t>(cont.data() + t, 1);
    std::vector<SequenceLogits> out;
    ASSERT_OK(m.Forward(steps, &ex, &out)) << what;
    worst = std::max(worst, MaxDiff(out[0].logits, out[1].logits, static_cast<size_t>(vocab)));
  }
  NLOG(INFO) << what << ": continuation max |spec+rollback - plain| = " << worst;
  EXPECT_LE(worst, tol) << what << ": logits after the rollback";
  EXPECT_OK(m.ReleaseSequence(*a));
  EXPECT_OK(m.ReleaseSequence(*b));
}

struct ModeCase {
  std::string name;
  bool fp32;
  int tp;
};

class CudaRollbackTest : public ::testing::TestWithParam<ModeCase> {};

// tiny-v4: window 8, CSA rate 4 (layers 1, 3), HCA rate 128 (layers 2, 4).
TEST_P(CudaRollbackTest, TinyStateEqualsKeptTokensOnly) {
  const ModeCase& mode = GetParam();
  if (!HaveGpus(mode.tp)) GTEST_SKIP() << "needs " << mode.tp << " GPU(s)";
  Fixture* f = Get("tiny-v4");
  ASSERT_NE(f, nullptr);
  CudaOptions opt;
  opt.fp32 = mode.fp32;
  opt.tp = mode.tp;
  auto m = CreateCudaBackend(*f->ckpt, opt);
  ASSERT_OK(m);
  const int64_t V = f->ckpt->config().vocab_size;
  const float tol = mode.fp32 ? 1e-3f : 5e-2f;  // tests/data/README.md "matches"
  const std::vector<RollbackCase> cases = {
      // Across the HCA (128) and CSA (124, 128) boundaries, keeping 0..k tokens; k = 8 = the window.
      {123, 8, {8}}, {123, 8, {7}}, {123, 8, {5}}, {123, 8, {4}}, {123, 8, {3}}, {123, 8, {1}}, {123, 8, {0}},
      // The kept tokens close an HCA window, the dropped ones open the next.
      {126, 6, {3}},
      // Longer than the window (twice over) and than a CSA window: kept rows overwritten ring slots.
      {120, 17, {13}}, {120, 17, {6}}, {5, 17, {16}}, {0, 17, {9}},
      // Rollback in two calls equals one.
      {61, 7, {2, 3}}, {125, 9, {1, 1, 1, 4}},
      // Mid-context, no boundary of the HCA rate.
      {37, 3, {2}}, {40, 1, {1}},
  };
  for (const RollbackCase& c : cases) {
    std::string rb;
    for (int64_t r : c.rollbacks) rb += std::to_string(r) + " ";
    CheckRollback(**m, *f->experts, V, c, tol,
                  mode.name + " prompt " + std::to_string(c.prompt) + " k " + std::to_string(c.k) + " rollback " + rb);
  }
}

// A batch step where speculative and plain sequences (prefill chunks) share the passes, with a small
// max_step_tokens so a speculative step is cut into several device passes.
TEST_P(CudaRollbackTest, MixedBatchAndMultiPassSteps) {
  const ModeCase& mode = GetParam();
  if (!HaveGpus(mode.tp)) GTEST_SKIP() << "needs " << mode.tp << " GPU(s)";
  Fixture* f = Get("tiny-v4");
  ASSERT_NE(f, nullptr);
  CudaOptions opt;
  opt.fp32 = mode.fp32;
  opt.tp = mode.tp;
  opt.max_step_tokens = 12;
  auto mm = CreateCudaBackend(*f->ckpt, opt);
  ASSERT_OK(mm);
  CudaBackend& m = **mm;
  ExpertBackend& ex = *f->experts;
  const int64_t V = f->ckpt->config().vocab_size;
  const float tol = mode.fp32 ? 1e-3f : 5e-2f;
  std::mt19937 rng(17);
  auto toks = [&](int n) {
    std::vector<int32_t> v;
    for (int i = 0; i < n; ++i) v.push_back(static_cast<int32_t>(rng() % V));
    return v;
  };
  // Speculative sequences s0 (k 17), s1 (k 4), plain p (a 20-token chunk); twins t0, t1 take the kept tokens.
  // s0 keeps 15 > max_step_tokens rows, so its replay runs in two chunks too.
  const auto pre0 = toks(30), pre1 = toks(126), prep = toks(7), d0 = toks(17), d1 = toks(4), chunk = toks(20);
  std::vector<SequenceId> ids;
  for (int i = 0; i < 5; ++i) {
    auto s = m.CreateSequence();
    ASSERT_OK(s);
    ids.push_back(*s);
  }
  const SequenceId s0 = ids[0], s1 = ids[1], p = ids[2], t0 = ids[3], t1 = ids[4];
  ASSERT_OK(Feed(m, ex, s0, pre0, false, nullptr));
  ASSERT_OK(Feed(m, ex, t0, pre0, false, nullptr));
  ASSERT_OK(Feed(m, ex, s1, pre1, false, nullptr));
  ASSERT_OK(Feed(m, ex, t1, pre1, false, nullptr));
  ASSERT_OK(Feed(m, ex, p, prep, false, nullptr));
  std::vector<SequenceStep> steps(3);
  steps[0] = {.seq = p, .tokens = chunk, .all_logits = true};
  steps[1] = {.seq = s0, .tokens = d0, .all_logits = true, .speculative = true};
  steps[2] = {.seq = s1, .tokens = d1, .all_logits = true, .speculative = true};
  std::vector<SequenceLogits> out;
  Status st = m.Forward(steps, &ex, &out);
  ASSERT_OK(st);
  ASSERT_OK(m.Rollback(s0, 2));  // keeps 15
  ASSERT_OK(m.Rollback(s1, 1));  // keeps 3: 126 + 3 crosses 128
  EXPECT_EQ(m.Memory(s0)->position, 45);
  EXPECT_EQ(m.Memory(s1)->position, 129);
  EXPECT_EQ(m.Memory(p)->position, 27);
  // A plain step on the rolled-back sequences disarms them: no second rollback.
  std::vector<float> la, lb;
  ASSERT_OK(Feed(m, ex, t0, std::span<const int32_t>(d0.data(), 15), false, &lb));
  EXPECT_LE(MaxDiff(out[1].logits, lb, static_cast<size_t>(15 * V)), tol);
  ASSERT_OK(Feed(m, ex, t1, std::span<const int32_t>(d1.data(), 3), false, &lb));
  EXPECT_LE(MaxDiff(out[2].logits, lb, static_cast<size_t>(3 * V)), tol);
  const auto cont = toks(15);
  for (auto [x, y] : {std::pair{s0, t0}, std::pair{s1, t1}}) {
    ASSERT_OK(Feed(m, ex, x, cont, false, &la));
    ASSERT_OK(Feed(m, ex, y, cont, false, &lb));
    EXPECT_LE(MaxDiff(la, lb, la.size()), tol) << "sequence " << x;
  }
  Status again = m.Rollback(s0, 1);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  for (SequenceId s : ids) EXPECT_OK(m.ReleaseSequence(s));
}

INSTANTIATE_TEST_SUITE_P(Modes, CudaRollbackTest,
                         ::testing::Values(ModeCase{"fp32", true, 1}, ModeCase{"bf16", false, 1},
                                           ModeCase{"fp32_tp2", true, 2}),
                         [](const auto& info) { return info.param.name; });

TEST(CudaRollbackErrors, RefusedWithClearErrors) {
  if (!HaveGpus(1)) GTEST_SKIP() << "no CUDA device";
  Fixture* f = Get("tiny-v4");
  ASSERT_NE(f, nullptr);
  CudaOptions opt;
  opt.max_spec_tokens = 5;
  auto mm = CreateCudaModel(*f->ckpt, opt);
  ASSERT_OK(mm);
  ModelBackend& m = **mm;
  ExpertBackend& ex = *f->experts;
  auto s = m.CreateSequence();
  ASSERT_OK(s);
  const std::vector<int32_t> six = {5, 9, 11, 13, 17, 19};
  ASSERT_OK(Feed(m, ex, *s, six, false, nullptr));
  // The last step was not speculative.
  EXPECT_EQ(m.Rollback(*s, 1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_OK(m.Rollback(*s, 0));
  EXPECT_EQ(m.Rollback(*s, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.Rollback(*s + 1000, 1).code(), absl::StatusCode::kNotFound);
  // Longer than max_spec_tokens: refused before anything runs.
  Status big = Feed(m, ex, *s, six, true, nullptr);
  EXPECT_EQ(big.code(), absl::StatusCode::kResourceExhausted) << big;
  EXPECT_NE(big.message().find("max_spec_tokens"), std::string::npos) << big;
  EXPECT_EQ(m.Memory(*s)->position, 6);
  // Within the step only.
  ASSERT_OK(Feed(m, ex, *s, std::span<const int32_t>(six.data(), 5), true, nullptr));
  EXPECT_EQ(m.Rollback(*s, 6).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_OK(m.Rollback(*s, 5));
  EXPECT_EQ(m.Memory(*s)->position, 6);
  EXPECT_EQ(m.Rollback(*s, 1).code(), absl::StatusCode::kFailedPrecondition);

  CudaOptions none;
  none.max_spec_tokens = 0;
  auto m0 = CreateCudaModel(*f->ckpt, none);
  ASSERT_OK(m0);
  auto s0 = (*m0)->CreateSequence();
  ASSERT_OK(s0);
  Status off = Feed(**m0, ex, *s0, std::span<const int32_t>(six.data(), 1), true, nullptr);
  EXPECT_EQ(off.code(), absl::StatusCode::kResourceExhausted) << off;
  EXPECT_NE(off.message().find("max_spec_tokens"), std::string::npos) << off;
  CudaOptions bad;
  bad.max_spec_tokens = -1;
  auto mb = CreateCudaModel(*f->ckpt, bad);
  ASSERT_FALSE(mb.ok());
  EXPECT_EQ(mb.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(mb.status().message().find("max_spec_tokens"), std::string::npos) << mb.status();
}

// ---- greedy speculative decoding == plain greedy --------------------------------------------------------

// Repetitive prompts (the model's golden prompt p0 three times, cut at different points), as in
// tests/model/spec_test.cc, so the n-gram drafter finds continuations to propose.
std::vector<GenerateRequest> Prompts(const Fixture& model, int64_t count, int64_t new_tokens) {
  std::vector<int32_t> base;
  auto p0 = model.goldens.Find("p0");
  EXPECT_OK(p0);
  for (int rep = 0; rep < 3 && p0.ok(); ++rep) {
    base.insert(base.end(), (*p0)->input_ids.begin(), (*p0)->input_ids.end());
  }
  std::vector<GenerateRequest> reqs;
  for (int64_t i = 0; i < count; ++i) {
    GenerateRequest r;
    r.prompt.assign(base.begin(), base.end() - (i * 5) % 30);
    r.max_new_tokens = new_tokens;
    r.ignore_eos = true;
    reqs.push_back(r);
  }
  return reqs;
}

struct GreedyCase {
  std::string model;
  bool fp32;
};

class CudaGreedySpecTest : public ::testing::TestWithParam<GreedyCase> {};

TEST_P(CudaGreedySpecTest, NgramEqualsPlainGreedyAndTheCpuBackend) {
  const GreedyCase& c = GetParam();
  if (!HaveGpus(1)) GTEST_SKIP() << "no CUDA device";
  Fixture* f = Get(c.model);
  ASSERT_NE(f, nullptr);
  CudaOptions opt;
  opt.fp32 = c.fp32;
  auto gpu = CreateCudaModel(*f->ckpt, opt);
  ASSERT_OK(gpu);
  auto cpu = cpu::CpuModel::Create(*f->ckpt, nullptr);
  ASSERT_OK(cpu);
  int64_t accepted = 0, drafted = 0;
  for (int64_t batch : {1, 3, 8}) {
    const auto reqs = Prompts(*f, batch, 24);
    auto plain = GenerateBatch(**gpu, *f->experts, reqs);
    ASSERT_OK(plain);
    if (c.fp32 && batch != 8) {  // the CPU reference (fp32: no near-tie flips; batches 1 and 3 cover it)
      auto ref = GenerateBatch(**cpu, *f->experts, reqs);
      ASSERT_OK(ref);
      for (size_t i = 0; i < reqs.size(); ++i) {
        EXPECT_EQ((*plain)[i].tokens, (*ref)[i].tokens) << c.model << " cuda vs cpu, batch " << batch << " seq " << i;
      }
    }
    for (int64_t depth = 1; depth <= 7; ++depth) {
      SpecConfig spec{.method = SpecMethod::kNgram, .depth = depth};
      auto got = GenerateBatch(**gpu, *f->experts, reqs, nullptr, spec);
      ASSERT_OK(got);
      for (size_t i = 0; i < reqs.size(); ++i) {
        EXPECT_EQ((*got)[i].tokens, (*plain)[i].tokens)
            << c.model << (c.fp32 ? " fp32" : " bf16") << " batch " << batch << " depth " << depth << " seq " << i;
        accepted += (*got)[i].spec.accepted;
        drafted += (*got)[i].spec.drafted;
      }
    }
  }
  NLOG(INFO) << c.model << (c.fp32 ? " fp32" : " bf16") << ": accepted " << accepted << " of " << drafted
             << " n-gram drafts";
  EXPECT_GT(drafted, 0);
  if (c.model == "demo-v4") {
    EXPECT_GE(accepted, 20) << accepted << "/" << drafted;
  }
}

// Adaptive depth and keep_logits: the logits that chose each token are the plain run's.
TEST(CudaGreedySpec, AdaptiveDepthKeepsLogits) {
  if (!HaveGpus(1)) GTEST_SKIP() << "no CUDA device";
  Fixture* f = Get("demo-v4");
  ASSERT_NE(f, nullptr);
  CudaOptions opt;
  opt.fp32 = true;
  auto gpu = CreateCudaModel(*f->ckpt, opt);
  ASSERT_OK(gpu);
  auto reqs = Prompts(*f, 2, 20);
  for (auto& r : reqs) r.keep_logits = true;
  auto plain = GenerateBatch(**gpu, *f->experts, reqs);
  ASSERT_OK(plain);
  SpecConfig spec{.method = SpecMethod::kNgram, .depth = 6, .adaptive = true};
  auto got = GenerateBatch(**gpu, *f->experts, reqs, nullptr, spec);
  ASSERT_OK(got);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ((*got)[i].tokens, (*plain)[i].tokens);
    ASSERT_EQ((*got)[i].step_logits.size(), (*plain)[i].step_logits.size());
    EXPECT_LE(MaxDiff((*got)[i].step_logits, (*plain)[i].step_logits, (*got)[i].step_logits.size()), 1e-3f);
  }
}

// ---- the DSpark drafter on the device ---------------------------------------------------------------------

// Drafts (tokens, Markov-corrected logits, confidence) equal the CPU drafter's for sequences at different
// positions, before and after a speculative step + rollback (the stages' rings are rolled back too).
TEST(CudaDspark, DraftsMatchTheCpuDrafter) {
  if (!HaveGpus(1)) GTEST_SKIP() << "no CUDA device";
  Fixture* f = Get("tiny-v4");
  ASSERT_NE(f, nullptr);
  auto cpu = cpu::CpuModel::Create(*f->ckpt, nullptr, {.drafter = true});
  ASSERT_OK(cpu);
  CudaOptions opt;
  opt.fp32 = true;
  auto gpu = CreateCudaModel(*f->ckpt, opt);
  ASSERT_OK(gpu);
  ASSERT_EQ((*gpu)->drafter(), SpecMethod::kDspark);
  ExpertBackend& ex = *f->experts;
  const int64_t V = f->ckpt->config().vocab_size;
  std::mt19937 rng(23);
  std::vector<std::vector<int32_t>> prompts;
  for (int len : {3, 40, 131}) {
    std::vector<int32_t> p;
    for (int i = 0; i < len; ++i) p.push_back(static_cast<int32_t>(rng() % V));
    prompts.push_back(p);
  }
  std::vector<SequenceId> a, b;
  for (const auto& p : prompts) {
    auto x = (*cpu)->CreateSequence();
    auto y = (*gpu)->CreateSequence();
    ASSERT_OK(x);
    ASSERT_OK(y);
    a.push_back(*x);
    b.push_back(*y);
    ASSERT_OK(Feed(**cpu, ex, *x, p, false, nullptr));
    ASSERT_OK(Feed(**gpu, ex, *y, p, false, nullptr));
  }
  auto compare = [&](const std::string& what) {
    std::vector<DraftRequest> ra, rb;
    for (size_t i = 0; i < a.size(); ++i) {
      const int64_t depth = 3 + static_cast<int64_t>(i);
      const int32_t next = static_cast<int32_t>((17 * i + 5) % V);
      ra.push_back(DraftRequest{a[i], next, depth, nullptr});
      rb.push_back(DraftRequest{b[i], next, depth, nullptr});
    }
    std::vector<DraftResult> da, db;
    Status x = (*cpu)->Draft(ra, &ex, &da);
    Status y = (*gpu)->Draft(rb, &ex, &db);
    ASSERT_OK(x);
    ASSERT_OK(y);
    ASSERT_EQ(da.size(), db.size());
    for (size_t i = 0; i < da.size(); ++i) {
      EXPECT_EQ(da[i].tokens, db[i].tokens) << what << " seq " << i;
      ASSERT_EQ(da[i].logits.size(), db[i].logits.size());
      ASSERT_EQ(da[i].confidence.size(), db[i].confidence.size());
      float scale = 1.0f;
      for (float v : da[i].logits) scale = std::max(scale, std::fabs(v));
      const float d = MaxDiff(da[i].logits, db[i].logits, da[i].logits.size()) / scale;
      NLOG(INFO) << what << " seq " << i << ": max |cpu - cuda| / max(1, |logit|) = " << d;
      EXPECT_LE(d, 1e-3f) << what << " seq " << i;
      EXPECT_LE(MaxDiff(da[i].confidence, db[i].confidence, da[i].confidence.size()), 1e-2f) << what;
    }
  };
  compare("after prefill");
  // A speculative step of 6 on every sequence, 4 rolled back; then one plain token.
  for (size_t i = 0; i < a.size(); ++i) {
    std::vector<int32_t> k6;
    for (int t = 0; t < 6; ++t) k6.push_back(static_cast<int32_t>(rng() % V));
    ASSERT_OK(Feed(**cpu, ex, a[i], k6, true, nullptr));
    ASSERT_OK(Feed(**gpu, ex, b[i], k6, true, nullptr));
    ASSERT_OK((*cpu)->Rollback(a[i], 4));
    ASSERT_OK((*gpu)->Rollback(b[i], 4));
  }
  compare("after a rollback");
  // Decode steps of one token per sequence, all sequences together (CUDA graphs on the device).
  for (int step = 0; step < 3; ++step) {
    std::vector<int32_t> next;
    for (size_t i = 0; i < a.size(); ++i) next.push_back(static_cast<int32_t>(rng() % V));
    std::vector<SequenceStep> sa(a.size()), sb(b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      sa[i].seq = a[i];
      sb[i].seq = b[i];
      sa[i].tokens = sb[i].tokens = std::span<const int32_t>(&next[i], 1);
    }
    std::vector<SequenceLogits> la, lb;
    ASSERT_OK((*cpu)->Forward(sa, &ex, &la));
    ASSERT_OK((*gpu)->Forward(sb, &ex, &lb));
  }
  compare("after decode steps");
  std::vector<DraftRequest> bad = {DraftRequest{b[0], 1, 0, nullptr}};
  std::vector<DraftResult> out;
  EXPECT_EQ((*gpu)->Draft(bad, &ex, &out).code(), absl::StatusCode::kInvalidArgument);
  bad = {DraftRequest{b[0] + 1000, 1, 2, nullptr}};
  EXPECT_EQ((*gpu)->Draft(bad, &ex, &out).code(), absl::StatusCode::kNotFound);
}

TEST(CudaDspark, GreedyEqualsPlainGreedy) {
  if (!HaveGpus(1)) GTEST_SKIP() << "no CUDA device";
  Fixture* f = Get("tiny-v4");
  ASSERT_NE(f, nullptr);
  const int64_t V = f->ckpt->config().vocab_size;
  for (bool fp32 : {true, false}) {
    CudaOptions opt;
    opt.fp32 = fp32;
    auto gpu = CreateCudaModel(*f->ckpt, opt);
    ASSERT_OK(gpu);
    int64_t drafted = 0;
    for (int64_t batch : {1, 3, 8}) {
      // Short non-repetitive prompts (the random stages accept almost nothing: rollback is what runs).
      std::vector<GenerateRequest> reqs;
      for (int64_t i = 0; i < batch; ++i) {
        GenerateRequest r;
        const int64_t len = 5 + (i * 7) % 23;
        for (int64_t t = 0; t < len; ++t) r.prompt.push_back(static_cast<int32_t>((t * 37 + i * 11 + 3) % V));
        r.max_new_tokens = 24;
        r.ignore_eos = true;
        reqs.push_back(r);
      }
      auto plain = GenerateBatch(**gpu, *f->experts, reqs);
      ASSERT_OK(plain);
      for (int64_t depth = 1; depth <= 7; ++depth) {
        SpecConfig spec{.method = SpecMethod::kDspark, .depth = depth};
        auto got = GenerateBatch(**gpu, *f->experts, reqs, nullptr, spec);
        ASSERT_OK(got);
        for (size_t i = 0; i < reqs.size(); ++i) {
          EXPECT_EQ((*got)[i].tokens, (*plain)[i].tokens)
              << (fp32 ? "fp32" : "bf16") << " batch " << batch << " depth " << depth << " seq " << i;
          drafted += (*got)[i].spec.drafted;
        }
      }
    }
    EXPECT_GT(drafted, 0);
  }
  // demo-v4 has no DSpark stages.
  Fixture* demo = Get("demo-v4");
  ASSERT_NE(demo, nullptr);
  auto m = CreateCudaModel(*demo->ckpt, CudaOptions{});
  ASSERT_OK(m);
  EXPECT_EQ((*m)->drafter(), SpecMethod::kNone);
  std::vector<DraftResult> out;
  EXPECT_EQ((*m)->Draft({}, demo->experts.get(), &out).code(), absl::StatusCode::kUnimplemented);
}

INSTANTIATE_TEST_SUITE_P(Models, CudaGreedySpecTest,
                         ::testing::Values(GreedyCase{"tiny-v4", true}, GreedyCase{"tiny-v4", false},
                                           GreedyCase{"demo-v4", true}, GreedyCase{"demo-v4", false}),
                         [](const auto& info) {
                           return info.param.model.substr(0, 4) + (info.param.fp32 ? "_fp32" : "_bf16");
                         });

}  // namespace
}  // namespace numoe
