// SimExperts (numoe-worker --sim-expert-gbps): the bytes of one expert from the tiny-v4 shapes, a sleep of
// the distinct experts' bytes / G per call (duplicates read once), zeros out, bad ids refused, and no
// spinning (the thread's CPU time stays far below the wall time it waits).
#include <gtest/gtest.h>
#include <time.h>

#include <chrono>
#include <vector>

#include "common/config.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"
#include "worker/experts/sim_experts.h"

namespace numoe {
namespace {

double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

ModelConfig TinyConfig() {
  auto c = LoadModelConfig(test::TinyDir() + "/config.json");
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : ModelConfig{};
}

TEST(SimExperts, OneExpertsBytesFromTheShapes) {
  // tiny-v4: w1/w3 [64, 128] and w2 [128, 64] in MXFP4: codes (2 per byte) + one E8M0 scale per 32.
  EXPECT_EQ(SimExperts::ExpertBytes(TinyConfig()), 2 * (64 * 64 + 64 * 4) + 128 * 32 + 128 * 2);
}

TEST(SimExperts, SleepsForTheDistinctExpertsAndReturnsZeros) {
  const ModelConfig config = TinyConfig();
  const int64_t D = config.hidden_size, bytes = SimExperts::ExpertBytes(config);
  // 1e-3 GB/s: 13056 bytes per expert is 13 ms.
  SimExperts sim(config, 1e-3);
  EXPECT_DOUBLE_EQ(sim.Seconds(3), 3.0 * static_cast<double>(bytes) / 1e6);
  // 4 rows x top-2 over experts {1, 2, 5}: three distinct.
  const std::vector<int32_t> ids = {1, 2, 2, 1, 5, 1, 2, 5};
  const std::vector<float> weights(ids.size(), 0.5f), x(4 * D, 1.0f);
  std::vector<float> out(4 * D, 7.0f);
  MoeRequest r{.layer = 1, .rows = 4, .top_k = 2, .x = x.data(), .expert_ids = ids.data(),
               .expert_weights = weights.data(), .out = out.data()};
  const auto t0 = std::chrono::steady_clock::now();
  const double cpu0 = ThreadCpuSeconds();
  ASSERT_OK(sim.RunRouted(r));
  const double cpu = ThreadCpuSeconds() - cpu0;
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(wall, sim.Seconds(3));
  EXPECT_LT(cpu, 0.25 * sim.Seconds(3)) << "SimExperts spun instead of sleeping";
  for (float v : out) ASSERT_EQ(v, 0.0f);
  // No rows: no wait (at 1e-5 GB/s one expert would be 1.3 s).
  SimExperts slow(config, 1e-5);
  r.rows = 0;
  const auto t1 = std::chrono::steady_clock::now();
  ASSERT_OK(slow.RunRouted(r));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count(), 0.5 * slow.Seconds(1));
}

TEST(SimExperts, RefusesExpertIdsOutOfRange) {
  const ModelConfig config = TinyConfig();
  SimExperts sim(config, 100);
  const int32_t E = static_cast<int32_t>(config.n_routed_experts);
  std::vector<float> out(config.hidden_size), x(config.hidden_size);
  for (int32_t bad : {-1, E}) {
    const std::vector<int32_t> ids = {0, bad};
    const std::vector<float> w = {0.5f, 0.5f};
    MoeRequest r{.layer = 3, .rows = 1, .top_k = 2, .x = x.data(), .expert_ids = ids.data(),
                 .expert_weights = w.data(), .out = out.data()};
    const Status st = sim.RunRouted(r);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find("expert_ids[0][1]"), std::string::npos) << st;
  }
}

}  // namespace
}  // namespace numoe
