// The fixtures' transformers goldens with the packed expert kernels of every ISA present (default
// activation precision, as `numoe generate` runs them): all greedy tokens identical, and logits within the
// fp32 tolerance of tests/data/README.md (1e-3) for generic and 5e-3 for the fast kernels (README allows 5e-2).
// Whole-prompt prefill sends ~60 rows to an expert, so on AMX machines the tile kernel is covered too.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/checkpoint.h"
#include "common/quant.h"
#include "common/safetensors.h"
#include "common/thread_pool.h"
#include "backends/cpu/cpu_model.h"
#include "model/generation.h"
#include "worker/experts/inprocess.h"
#include "worker/experts/isa.h"
#include "tests/support/compare.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"

namespace numoe {
namespace {

struct Case {
  std::string model;
  Isa isa;
};

class ExpertGoldenTest : public ::testing::TestWithParam<Case> {};

TEST_P(ExpertGoldenTest, GreedyTokensMatchTheGoldens) {
  const Case& c = GetParam();
  if (!IsaAvailable(c.isa)) GTEST_SKIP() << IsaName(c.isa) << " not available on this CPU/OS";
  const std::string dir = std::string(NUMOE_TEST_DATA) + "/" + c.model;
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_OK(ckpt);
  ThreadPool pool(2);
  auto model = cpu::CpuModel::Create(**ckpt, &pool);
  ASSERT_OK(model);
  InProcessExpertsOptions options;
  options.isa = c.isa;
  auto experts = InProcessExperts::Load(**ckpt, &pool, options);
  ASSERT_OK(experts);
  ASSERT_EQ((*experts)->isa(), c.isa);
  ASSERT_OK_AND_ASSIGN(const test::Goldens goldens, test::Goldens::Load(dir));
  ASSERT_EQ(goldens.size(), 4u);  // p0..p3
  // Two-level activations (the default) land near 1e-4..1e-3 here; 5e-3 catches a precision regression
  // long before the README's 5e-2 reduced-precision bound would.
  const float tol = c.isa == Isa::kGeneric ? 1e-3f : 5e-3f;
  for (const test::GoldenPrompt& g : goldens) {
    SCOPED_TRACE(g.name);
    GenerateRequest req;
    req.prompt = g.input_ids;
    req.max_new_tokens = static_cast<int64_t>(g.greedy.size());
    req.ignore_eos = true;
    req.keep_logits = true;
    auto res = GenerateBatch(**model, **experts, {req});
    ASSERT_OK(res);
    const GenerateResult& r = (*res)[0];
    EXPECT_EQ(r.tokens, g.greedy);
    const float prefill = test::MaxAbsDiff(r.prefill_logits, g.prefill_logits);
    const float step = test::MaxAbsDiff(r.step_logits, g.step_logits);
    EXPECT_LE(prefill, tol);
    EXPECT_LE(step, tol);
    RecordProperty(g.name + "_max_logit_diff", std::to_string(std::max(prefill, step)));
  }
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (const char* m : {"tiny-v4", "demo-v4"}) {
    for (Isa isa : {Isa::kGeneric, Isa::kAvx2, Isa::kAvx512, Isa::kAmx}) cases.push_back({m, isa});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ExpertGoldenTest, ::testing::ValuesIn(Cases()), [](const auto& info) {
  std::string m = info.param.model;
  for (char& ch : m) {
    if (ch == '-') ch = '_';
  }
  return m + "_" + IsaName(info.param.isa);
});

}  // namespace
}  // namespace numoe
