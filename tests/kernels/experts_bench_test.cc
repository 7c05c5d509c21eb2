// numoe-bench experts end to end on a small preset: the last line is the documented JSON object.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "tests/support/process.h"

namespace {

using numoe::test::BinPath;
using numoe::test::CommandLine;
using numoe::test::RunCommand;
using numoe::test::RunResult;

// numoe-bench experts ARGS; stderr (the log) is not part of the output the test reads.
RunResult RunBench(const std::string& args) {
  return RunCommand(CommandLine(BinPath("numoe-bench"), "experts " + args));
}

std::string LastLine(const std::string& s) {
  std::istringstream in(s);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return last;
}

// The small preset's 0.01 GB of weights sit in the cache, where the kernel/read ratio means nothing and a loaded
// machine's read passes can come out below the kernel: the tests that are not about that check turn it off
// (RatioAboveMaxFails tests it).
constexpr char kNoRatioCheck[] = " --max-ratio 1e9";

TEST(ExpertsBench, LastLineIsTheJsonObject) {
  for (const char* isa : {"generic", ""}) {
    SCOPED_TRACE(isa);
    std::string args = "--preset small --tokens 3 --threads 1 --runs 2 --seconds 0.02";
    if (*isa != '\0') args += std::string(" --isa ") + isa;
    const RunResult r = RunBench(args + kNoRatioCheck);
    ASSERT_EQ(r.rc, 0) << r.out;
    const auto j = nlohmann::json::parse(LastLine(r.out));
    ASSERT_EQ(j.size(), 16u) << j.dump();
    EXPECT_EQ(j["precision"], "high");
    EXPECT_TRUE(j["read_method"].is_string() && !j["read_method"].get<std::string>().empty()) << j.dump();
    EXPECT_TRUE(j["isa"].is_string());
    if (*isa != '\0') {
      EXPECT_EQ(j["isa"], isa);
    }
    EXPECT_EQ(j["tokens"], 3);
    EXPECT_EQ(j["threads"], 1);
    const double k = j["kernel_gbps"], rd = j["read_gbps"], ratio = j["ratio"], tflops = j["tflops"];
    EXPECT_GT(k, 0.0);
    EXPECT_GT(rd, 0.0);
    EXPECT_GT(tflops, 0.0);
    EXPECT_NEAR(ratio, k / rd, 1e-3 * ratio + 1e-3);
    // From the printed (rounded) figures: tflops at the read's GB/s instead of the kernel's.
    EXPECT_NEAR(j["read_bound_tflops"].get<double>(), tflops * rd / k, 1e-2 * tflops * rd / k + 1e-4);
    // The hand-off figures: a step's share outside the threads' work, and the pool's on an empty job (the
    // last thread starts before the call returns).
    EXPECT_GT(j["step_ms"].get<double>(), 0.0);
    EXPECT_GE(j["step_handoff_us"].get<double>(), 0.0);
    EXPECT_LT(j["step_handoff_us"].get<double>(), 1e3 * j["step_ms"].get<double>());
    for (const char* job : {"empty_job", "idle_job"}) {
      const double started = j[std::string(job) + "_started_us"], finished = j[std::string(job) + "_finished_us"];
      EXPECT_GE(started, 0.0) << job;
      EXPECT_LE(started, finished) << job;
    }
  }
}

// Every --compare-* variant runs and prints its medians; --compare-set names a bad key.
TEST(ExpertsBench, CompareVariantsRun) {
  const RunResult r = RunBench(
      "--preset small --tokens 2 --threads 1 --runs 1 --seconds 0.01 --compare-gate-up-chunk 2 --compare-down-chunk 8 "
      "--compare-huge-pages --compare-set 'streams=1,prefetch=0;gate-up-chunk=1'" +
      std::string(kNoRatioCheck));
  ASSERT_EQ(r.rc, 0) << r.out;
  for (const char* name : {"compared, gate/up units of 2:", "compared, down units of 8:", "compared, main on 4k pages:",
                           "compared, streams=1,prefetch=0:", "compared, gate-up-chunk=1:"}) {
    EXPECT_NE(r.out.find(name), std::string::npos) << name << "\n" << r.out;
  }
  const RunResult bad = RunBench("--preset small --runs 1 --seconds 0.01 --compare-set 'streams=1;nope=3'");
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE((bad.out + bad.err).find("nope=3"), std::string::npos) << bad.out << bad.err;
}

// --peak adds the instruction's peak, the share of it reached and the share the issued instructions use
// (twice that share with two-level activations, once with one).
TEST(ExpertsBench, PeakFieldsCountIssuedInstructions) {
  for (const char* precision : {"high", "low"}) {
    SCOPED_TRACE(precision);
    const RunResult r = RunBench(std::string("--preset small --tokens 40 --threads 1 --runs 1 --seconds 0.02 --isa "
                                             "avx512 --peak --precision ") + precision + kNoRatioCheck);
    if (r.rc != 0 && r.err.find("not available") != std::string::npos) GTEST_SKIP() << "no AVX-512 VNNI here";
    ASSERT_EQ(r.rc, 0) << r.out;
    const auto j = nlohmann::json::parse(LastLine(r.out));
    EXPECT_EQ(j["precision"], precision);
    const double peak = j["peak_tflops"], share = j["tflops_ratio"], issued = j["issued_ratio"];
    EXPECT_GT(peak, 0.0);
    EXPECT_NEAR(share, j["tflops"].get<double>() / peak, 1e-3 * share + 1e-4);
    EXPECT_NEAR(issued, (std::string(precision) == "high" ? 2 : 1) * share, 1e-3 * issued + 1e-4);
  }
}

// A kernel ratio above --max-ratio means the yardstick read slower than a kernel streams: the run must fail,
// loudly, after printing its figures.
TEST(ExpertsBench, RatioAboveMaxFails) {
  const RunResult r = RunBench("--preset small --tokens 3 --threads 1 --runs 1 --seconds 0.02 --max-ratio 0");
  EXPECT_EQ(r.rc, 1) << r.out;
  const auto j = nlohmann::json::parse(LastLine(r.out));
  EXPECT_GT(j["ratio"].get<double>(), 0.0);
}

TEST(ExpertsBench, BadFlagsFail) {
  EXPECT_NE(RunBench("--preset nope").rc, 0);
  EXPECT_NE(RunBench("--preset small --isa sse9").rc, 0);
  EXPECT_NE(RunBench("--preset small --threads 100000").rc, 0);
}

}  // namespace
