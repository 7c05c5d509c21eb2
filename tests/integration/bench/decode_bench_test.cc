// numoe-bench decode end to end on a tiny-preset checkpoint: it starts `numoe serve`, streams completions at
// concurrency 1 and 2, prints the documented JSON last line (ratio = tok_s / bound, bytes per token from the
// shapes) and leaves no process of the served stack behind. Label integration (real processes, ~10 s).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "nlohmann/json.hpp"
#include "tests/support/files.h"
#include "tests/support/process.h"

namespace numoe::test {
namespace {

using ::testing::HasSubstr;

TEST(DecodeBenchTest, ServesStreamsAndReportsTheRatio) {
  TempDir dir("mk-decode-bench");
  const std::string model = (dir.path() / "tiny").string();
  RunResult mk =
      RunCommand({BinPath("numoe"), "mkmodel", "--preset", "tiny", "--quiet", "--out", model}, {.merge_stderr = true});
  ASSERT_EQ(mk.rc, 0) << mk.out;

  RunResult r = RunCommand(
      {BinPath("numoe-bench"), "decode", "--model", model, "--concurrency", "1,2", "--prompt-len", "8", "--max-tokens",
       "12", "--read-mib", "64", "--read-passes", "2", "--log-dir", (dir.path() / "logs").string()},
      {.merge_stderr = true});
  ASSERT_EQ(r.rc, 0) << r.out;
  std::printf("%s", r.out.c_str());
  EXPECT_THAT(r.out, HasSubstr("numoe serve ready"));
  std::string last = r.out.substr(0, r.out.find_last_not_of('\n') + 1);
  last = last.substr(last.rfind('\n') + 1);
  const auto j = nlohmann::json::parse(last);
  ASSERT_EQ(j["concurrency"], nlohmann::json({1, 2}));
  ASSERT_EQ(j["tok_s"].size(), 2u);
  ASSERT_EQ(j["ratio"].size(), 2u);
  const double bound = j["bound_tok_s"];
  EXPECT_GT(bound, 0);
  for (int i = 0; i < 2; ++i) {
    const double tok_s = j["tok_s"][i], ratio = j["ratio"][i];
    EXPECT_GT(tok_s, 0);
    EXPECT_NEAR(ratio, tok_s / bound, 1e-9 * ratio);
  }
  // tiny-v4 shapes: top-2 of experts with w1/w3 [64, 128] and w2 [128, 64] in MXFP4 (codes + per-32 scales),
  // 5 layers: 5 x 2 x (2 x (64 x 64 + 64 x 4) + 128 x 32 + 128 x 2).
  EXPECT_EQ(j["routed_bytes_per_token"], 5 * 2 * (2 * (64 * 64 + 64 * 4) + 128 * 32 + 128 * 2));
  EXPECT_NEAR(static_cast<double>(j["read_gbps"]) * 1e9 / static_cast<double>(j["routed_bytes_per_token"]), bound,
              1e-6 * bound);
  EXPECT_EQ(j["output_len"], nlohmann::json({12, 12}));
  EXPECT_EQ(j["prompt_len"], 8);
  // The served stack is gone: nothing runs with this model directory on its command line.
  EXPECT_EQ(ProcessesMentioning(model), 0);
}

TEST(DecodeBenchTest, BadInputIsAClearError) {
  RunResult missing =
      RunCommand({BinPath("numoe-bench"), "decode", "--model", "/nonexistent/model"}, {.merge_stderr = true});
  EXPECT_EQ(missing.rc, 1);
  EXPECT_THAT(missing.out, HasSubstr("/nonexistent/model"));
  RunResult zero =
      RunCommand({BinPath("numoe-bench"), "decode", "--model", "/nonexistent/model", "--concurrency", "1,0"},
                 {.merge_stderr = true});
  EXPECT_EQ(zero.rc, 1);
  EXPECT_THAT(zero.out, HasSubstr("--concurrency values must be in [1, 1024]"));
}

}  // namespace
}  // namespace numoe::test
