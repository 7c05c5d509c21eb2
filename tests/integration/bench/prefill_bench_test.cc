// numoe-bench prefill end to end on tests/data/tiny-v4 (context 1024): it starts `numoe serve`, times the first
// token of each prompt length that fits, skips the one that does not, and prints the documented JSON last line
// (prefill tok/s = length / TTFT; bound = peak / routed FLOPs per token from the shapes). Label integration (~5 s).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "nlohmann/json.hpp"
#include "tests/support/files.h"
#include "tests/support/fixtures.h"
#include "tests/support/process.h"

namespace numoe::test {
namespace {

using ::testing::HasSubstr;

nlohmann::json LastJsonLine(const std::string& out) {
  std::string last = out.substr(0, out.find_last_not_of('\n') + 1);
  return nlohmann::json::parse(last.substr(last.rfind('\n') + 1));
}

TEST(PrefillBenchTest, TimesEachPromptLengthThatFits) {
  TempDir dir("prefill-bench");
  RunResult r = RunCommand({BinPath("numoe-bench"), "prefill", "--model", TinyDir(), "--prompt-lens", "16,300,2048",
                            "--runs", "2", "--log-dir", (dir.path() / "logs").string()},
                           {.merge_stderr = true});
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("numoe serve ready"));
  EXPECT_THAT(r.out, HasSubstr("skipped (longer than the context of 1024 positions): 2048"));
  const auto j = LastJsonLine(r.out);
  ASSERT_EQ(j["prompt_len"], nlohmann::json({16, 300}));
  ASSERT_EQ(j["skipped"], nlohmann::json({2048}));
  ASSERT_EQ(j["ttft_s"].size(), 2u);
  // tiny-v4: 5 layers, top-2 experts of hidden 64 and moe_intermediate 128.
  EXPECT_DOUBLE_EQ(j["flops_per_token"], 6.0 * 64 * 128 * 2 * 5);
  for (int i = 0; i < 2; ++i) {
    const double ttft = j["ttft_s"][i], rate = j["prefill_tok_s"][i];
    EXPECT_GT(ttft, 0);
    EXPECT_NEAR(rate, static_cast<double>(j["prompt_len"][i]) / ttft, 1e-6 * rate);
    const double bound = j["bound_tok_s"];
    if (bound > 0) {
      EXPECT_NEAR(static_cast<double>(j["ratio"][i]), rate / bound, 1e-9);
    }
  }
  const double peak = j["peak_tflops"];
  if (peak > 0) {
    EXPECT_NEAR(static_cast<double>(j["bound_tok_s"]), peak * 1e12 / (6.0 * 64 * 128 * 2 * 5),
                1e-6 * static_cast<double>(j["bound_tok_s"]));
  }
}

TEST(PrefillBenchTest, BadInputIsAClearError) {
  RunResult zero = RunCommand({BinPath("numoe-bench"), "prefill", "--model", TinyDir(), "--prompt-lens", "16,0"},
                              {.merge_stderr = true});
  EXPECT_EQ(zero.rc, 1);
  EXPECT_THAT(zero.out, HasSubstr("--prompt-lens values must be in [1, 4194304]"));
  RunResult none = RunCommand({BinPath("numoe-bench"), "prefill", "--model", TinyDir(), "--prompt-lens", "5000"},
                              {.merge_stderr = true});
  EXPECT_EQ(none.rc, 1);
  EXPECT_THAT(none.out, HasSubstr("no --prompt-lens value fits the model's context"));
  RunResult missing =
      RunCommand({BinPath("numoe-bench"), "prefill", "--model", "/nonexistent/model"}, {.merge_stderr = true});
  EXPECT_EQ(missing.rc, 1);
  EXPECT_THAT(missing.out, HasSubstr("/nonexistent/model"));
}

}  // namespace
}  // namespace numoe::test
