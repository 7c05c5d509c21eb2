// numoe-bench spec end to end on the tiny-v4 fixture (n-gram, DSpark) and a tiny MTP checkpoint: one run of
// each mode, the last line is the JSON object with sane numbers (the bench itself fails when greedy outputs
// with and without speculation differ), and bad flags fail with a message naming them.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>

#include "tests/support/files.h"
#include "tests/support/fixtures.h"
#include "tests/support/process.h"

namespace {

using numoe::test::BinPath;
using numoe::test::CommandLine;
using numoe::test::DemoDir;
using numoe::test::RunCommand;
using numoe::test::RunResult;

// numoe-bench spec ARGS, stdout and stderr together.
RunResult RunBench(const std::string& args) {
  return RunCommand(CommandLine(BinPath("numoe-bench"), "spec " + args), {.merge_stderr = true});
}

std::string LastLine(const std::string& s) {
  std::istringstream in(s);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return last;
}

const std::string kTiny = numoe::test::TinyDir();

void ExpectSane(const nlohmann::json& j, int64_t batch, int64_t max_tokens) {
  EXPECT_EQ(j["bench"], "spec");
  EXPECT_EQ(j["batch"], batch);
  EXPECT_EQ(j["max_tokens"], max_tokens);
  EXPECT_EQ(j["runs"], 1);
  EXPECT_EQ(j["threads"], 1);
  EXPECT_EQ(j["greedy_identical"], true);
  // tiny-v4: 5 layers, 8 experts top-2, MXFP4 experts 3 x 64 x 128 params + E8M0 scales per 32.
  EXPECT_EQ(j["layers"], 5);
  EXPECT_EQ(j["experts"], 8);
  EXPECT_EQ(j["top_k"], 2);
  EXPECT_EQ(j["expert_bytes"], 3 * (64 * 128 / 2 + 64 * 128 / 32));
  for (const char* k : {"base_tok_s", "spec_tok_s", "speedup", "read_gbps", "base_predicted_tok_s",
                        "spec_predicted_tok_s", "base_measured_over_predicted", "spec_measured_over_predicted"}) {
    ASSERT_TRUE(j.contains(k)) << k;
    EXPECT_GT(j[k].get<double>(), 0.0) << k;
  }
  const int64_t drafted = j["drafted"], accepted = j["accepted"], steps = j["verify_steps"];
  EXPECT_GT(drafted, 0);
  EXPECT_GE(accepted, 0);
  EXPECT_LE(accepted, drafted);
  EXPECT_GT(steps, 0);
  EXPECT_LE(drafted, steps * j["depth"].get<int64_t>());
  EXPECT_NEAR(j["mean_accepted"].get<double>(), static_cast<double>(accepted) / steps, 1e-3);
  EXPECT_NEAR(j["emitted_per_verify_step"].get<double>(), 1.0 + static_cast<double>(accepted) / steps, 1e-3);
  EXPECT_NEAR(j["speedup"].get<double>(), j["spec_tok_s"].get<double>() / j["base_tok_s"].get<double>(),
              2e-3 * j["speedup"].get<double>() + 2e-3);
  // Plain decode of one sequence reads top-k experts per layer (fewer only where a hash layer repeats one);
  // verify steps feed more rows, so their union is at least that and at most every expert.
  const double base_union = j["base_union_experts_per_layer"], spec_union = j["spec_union_experts_per_layer"];
  EXPECT_LE(base_union, 2.0 * batch + 1e-9);
  EXPECT_GT(base_union, 1.0);
  EXPECT_LE(spec_union, 8.0);
  EXPECT_GE(j["spec_union_bytes_per_step"].get<int64_t>(), j["base_union_bytes_per_step"].get<int64_t>());
  EXPECT_LE(j["spec_union_bytes_per_step"].get<int64_t>(), j["spec_row_bytes_per_step"].get<int64_t>());
  // predicted = tokens per step / (bytes per step / bandwidth)
  const double predicted = j["base_tokens_per_step"].get<double>() /
                           (j["base_union_bytes_per_step"].get<double>() / (j["read_gbps"].get<double>() * 1e9));
  EXPECT_NEAR(j["base_predicted_tok_s"].get<double>(), predicted, 5e-3 * predicted);
}

TEST(SpecBench, NgramOnTinyPrintsTheJsonObject) {
  const RunResult r = RunBench("--model " + kTiny + " --spec ngram --depth 3 --runs 1 --threads 1 --max-tokens 24 " +
                            "--read-mib 64");
  ASSERT_EQ(r.rc, 0) << r.out;
  const auto j = nlohmann::json::parse(LastLine(r.out));
  EXPECT_EQ(j["spec"], "ngram");
  EXPECT_EQ(j["depth"], 3);
  ExpectSane(j, 1, 24);
  EXPECT_NE(r.out.find("mean accepted"), std::string::npos) << r.out;
}

// DSpark on tiny-v4 (random stages: acceptance near zero, so rollback runs every step), two sequences.
TEST(SpecBench, DsparkBatchOfTwo) {
  const RunResult r = RunBench("--model " + kTiny + " --spec dspark --runs 1 --threads 1 --batch 2 --max-tokens 16 " +
                            "--prompt-len 40 --read-mib 64 --json");
  ASSERT_EQ(r.rc, 0) << r.out;
  const auto j = nlohmann::json::parse(LastLine(r.out));
  EXPECT_EQ(j["spec"], "dspark");
  EXPECT_EQ(j["depth"], 5);  // the checkpoint's DSpark block size
  EXPECT_EQ(j["prompt_len"], 40);
  ExpectSane(j, 2, 16);
  EXPECT_GT(j["spec_draft_bytes_per_step"].get<int64_t>(), 0);
}

// MTP on a tiny-preset checkpoint with a random MTP block (numoe mkmodel --drafter mtp).
TEST(SpecBench, MtpOnATinyMtpCheckpoint) {
  numoe::test::TempDir tmp("spec-bench");
  const std::string dir = tmp / "m";
  const RunResult mk = RunCommand({BinPath("numoe"), "mkmodel", "--preset", "tiny", "--drafter", "mtp", "--quiet",
                                   "--out", dir}, {.merge_stderr = true});
  ASSERT_EQ(mk.rc, 0) << mk.out;
  const RunResult r = RunBench("--model " + dir + " --spec mtp --depth 2 --runs 1 --threads 1 --max-tokens 16 " +
                            "--prompt-len 24 --read-mib 64 --json");
  ASSERT_EQ(r.rc, 0) << r.out;
  const auto j = nlohmann::json::parse(LastLine(r.out));
  EXPECT_EQ(j["spec"], "mtp");
  EXPECT_EQ(j["depth"], 2);
  ExpectSane(j, 1, 16);
  EXPECT_GT(j["spec_draft_bytes_per_step"].get<int64_t>(), 0);
}

TEST(SpecBench, BadFlagsFailWithAMessage) {
  struct Case {
    std::string args, needle;
  };
  const Case cases[] = {
      {"--model " + kTiny + " --spec bogus", "bogus"},
      {"--model " + kTiny + " --spec none", "--spec none"},
      {"--model " + kTiny + " --depth 0", "--depth"},
      {"--model " + kTiny + " --experts gpu", "--experts"},
      {"--model " + kTiny + " --batch x", "--batch"},
      {"--model " + kTiny + " --prompt /nonexistent/prompt.txt", "/nonexistent/prompt.txt"},
      {"--model /nonexistent/model", "/nonexistent/model"},
      // The one --spec policy's messages (model/spec_policy.h), as numoe serve prints them.
      {"--model " + DemoDir() + " --spec dspark", "has no drafter stages"},
      {"--model " + kTiny + " --spec mtp", "has a dspark drafter"},
      {"--frobnicate", "--frobnicate"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    const RunResult r = RunBench(c.args);
    EXPECT_NE(r.rc, 0) << r.out;
    EXPECT_NE(r.out.find(c.needle), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("\"bench\""), std::string::npos) << r.out;
  }
}

}  // namespace
