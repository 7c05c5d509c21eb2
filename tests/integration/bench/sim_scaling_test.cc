// numoe-gpu serves workers at once: the CPU backend on tests/data/tiny-v4 with 4 simulated workers
// (numoe-worker --sim-expert-gbps 0.0026: each layer's top-2 experts, 2 x 13056 bytes, take 10 ms per token),
// driven by `numoe-bench decode` through `numoe serve`. While one worker waits out its experts, numoe-gpu runs
// the others' layers, so 4 streams (one per worker) decode at least 2.5x the aggregate rate of one stream
// (the benchmark target is 3.2x; README "Performance"). The JSON's expert_busy says why: at concurrency 4
// every worker is inside its MoE calls most of the decode window. And one worker with two micro-batches is
// busier in its experts than with one (below). Label integration (~45 s; run serially: throughput ratios).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "nlohmann/json.hpp"
#include "tests/support/files.h"
#include "tests/support/fixtures.h"
#include "tests/support/process.h"

namespace numoe::test {
namespace {

TEST(SimScaling, FourSimulatedWorkersDecodeFourStreamsAtLeast2_5xOne) {
  TempDir dir("sim-scaling");
  RunResult r = RunCommand({BinPath("numoe-bench"), "decode", "--model", TinyDir(), "--backend", "cpu", "--workers",
                            "4", "--sim-expert-gbps", "0.0026", "--concurrency", "1,4", "--prompt-len", "8",
                            "--max-tokens", "48", "--spec", "none", "--log-dir", (dir.path() / "logs").string()},
                           {.merge_stderr = true});
  ASSERT_EQ(r.rc, 0) << r.out;
  std::printf("%s", r.out.c_str());
  std::string last = r.out.substr(0, r.out.find_last_not_of('\n') + 1);
  last = last.substr(last.rfind('\n') + 1);
  const auto j = nlohmann::json::parse(last);
  ASSERT_EQ(j["concurrency"], nlohmann::json({1, 4}));
  EXPECT_EQ(j["read_method"], "sim-expert-gbps");
  EXPECT_EQ(j["sim_expert_gbps"], 0.0026);
  // The bound: 4 workers x 0.0026 GB/s over 5 layers x top-2 x 13056 bytes per token.
  EXPECT_NEAR(static_cast<double>(j["bound_tok_s"]), 4 * 0.0026e9 / (5 * 2 * 13056.0), 1e-6);
  const double one = j["tok_s"][0], four = j["tok_s"][1];
  EXPECT_GT(one, 0);
  EXPECT_GE(four, 2.5 * one) << "aggregate tok/s at concurrency 4 (" << four << ") over concurrency 1 (" << one
                             << ") = " << four / one;
  // Expert-busy: one value per level (the least busy worker), and each worker's. At concurrency 1 three
  // workers are idle; the one serving the stream spends most of its window in its (simulated) experts.
  ASSERT_EQ(j["expert_busy"].size(), 2u);
  ASSERT_EQ(j["expert_busy_workers"].size(), 2u);
  for (const auto& level : j["expert_busy_workers"]) {
    ASSERT_EQ(level.size(), 4u);
    for (double b : level) {
      EXPECT_GE(b, 0.0);
      EXPECT_LE(b, 1.05);  // the window's ends are interpolated between 50 ms samples
    }
  }
  std::vector<double> at1 = j["expert_busy_workers"][0];
  EXPECT_GT(*std::max_element(at1.begin(), at1.end()), 0.5);
  EXPECT_LT(static_cast<double>(j["expert_busy"][0]), 0.1);
  EXPECT_GT(static_cast<double>(j["expert_busy"][1]), 0.5);
}

// One worker, two micro-batches (numoe-worker --micro-batches 2): while it waits out one micro-batch's experts,
// numoe-gpu runs the other's layers. A tiny checkpoint with 256 experts (numoe mkmodel; two sequences rarely
// share an expert, as on V4-Flash, so splitting them reads no more) and --sim-expert-gbps 0.26 (0.1 ms per
// expert: numoe-gpu's part of a layer is as long as the experts'). Measured on the 2-vCPU box: expert-busy
// 0.48-0.50 -> 0.67-0.72 at concurrency 4, tok/s 856 -> 1111 (README "Performance"); the test asks for a
// clearly busier worker and no loss beyond noise.
double BusyAt(const nlohmann::json& j) { return j["expert_busy"][0]; }
TEST(SimScaling, TwoMicroBatchesKeepOneWorkersExpertsBusier) {
  TempDir dir("sim-micro");
  const std::string model = (dir.path() / "tiny256").string();
  RunResult mk = RunCommand({BinPath("numoe"), "mkmodel", "--preset", "tiny", "--experts", "256", "--drafter", "none",
                             "--out", model},
                            {.merge_stderr = true});
  ASSERT_EQ(mk.rc, 0) << mk.out;
  nlohmann::json runs[2];
  for (int mb = 1; mb <= 2; ++mb) {
    RunResult r = RunCommand({BinPath("numoe-bench"), "decode", "--model", model, "--backend", "cpu", "--workers", "1",
                              "--sim-expert-gbps", "0.26", "--concurrency", "4", "--prompt-len", "8", "--max-tokens",
                              "64", "--spec", "none", "--micro-batches", std::to_string(mb), "--log-dir",
                              (dir.path() / ("logs" + std::to_string(mb))).string()},
                             {.merge_stderr = true});
    ASSERT_EQ(r.rc, 0) << r.out;
    std::printf("%s", r.out.c_str());
    std::string last = r.out.substr(0, r.out.find_last_not_of('\n') + 1);
    last = last.substr(last.rfind('\n') + 1);
    runs[mb - 1] = nlohmann::json::parse(last);
    EXPECT_EQ(runs[mb - 1]["micro_batches"], mb);
    ASSERT_EQ(runs[mb - 1]["expert_busy"].size(), 1u);
  }
  const double busy1 = BusyAt(runs[0]), busy2 = BusyAt(runs[1]);
  const double tok1 = runs[0]["tok_s"][0], tok2 = runs[1]["tok_s"][0];
  EXPECT_LE(busy2, 1.05);
  EXPECT_GE(busy2, busy1 + 0.05) << "expert-busy with one micro-batch " << busy1 << ", with two " << busy2;
  EXPECT_GE(tok2, 0.7 * tok1) << "tok/s with one micro-batch " << tok1 << ", with two " << tok2;
}

}  // namespace
}  // namespace numoe::test
