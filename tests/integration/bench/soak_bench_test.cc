// numoe-bench soak on tiny-v4 for 60 s at 256 concurrent clients (the CI soak): no request error, no process
// of the served tree restarted, no growth of RSS, open fds or threads past the stated bounds after warm-up, the
// documented JSON last line, every kind of request sent, and no process of the served stack left behind.
// Label integration (~80 s); and bad flags are clear errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>

#include "nlohmann/json.hpp"
#include "tests/support/files.h"
#include "tests/support/fixtures.h"
#include "tests/support/process.h"

namespace numoe::test {
namespace {

using ::testing::HasSubstr;

TEST(SoakBenchTest, SixtySecondsAt256StreamsWithoutErrorsOrGrowth) {
  const TempDir dir("soak-bench");
  const std::string logs = dir / "logs";
  const RunResult r = RunCommand({BinPath("numoe-bench"), "soak", "--model", TinyDir(), "--seconds", "60",
                                  "--concurrency", "256", "--warmup", "10", "--max-seqs", "64", "--log-dir", logs},
                                 {.merge_stderr = true});
  std::printf("%s", r.out.c_str());
  ASSERT_EQ(r.rc, 0) << r.out << "\n" << ReadFile(logs + "/numoe-router.log").substr(0, 4000);
  EXPECT_THAT(r.out, HasSubstr("numoe serve ready"));
  EXPECT_THAT(r.out, HasSubstr("soak: OK"));
  std::string last = r.out.substr(0, r.out.find_last_not_of('\n') + 1);
  last = last.substr(last.rfind('\n') + 1);
  const auto j = nlohmann::json::parse(last);
  EXPECT_EQ(j["ok"], true);
  EXPECT_EQ(j["errors"], 0);
  EXPECT_EQ(j["concurrency"], 256);
  EXPECT_GE(j["seconds"].get<double>(), 60.0);
  // Every kind of request was sent, many times.
  for (const char* kind : {"completion_stream", "completion", "chat_stream", "chat", "cancelled"}) {
    EXPECT_GT(j["requests_by_kind"][kind].get<int64_t>(), 50) << kind;
  }
  EXPECT_GT(j["tokens"].get<int64_t>(), 0);
  // serve, numoe-gpu, the router and two workers were sampled, each within the bounds.
  ASSERT_EQ(j["processes"].size(), 5u) << j["processes"].dump();
  for (const auto& p : j["processes"]) {
    // The growth checked is the RSS growth, less for numoe-gpu the growth of its prefix cache's stated bytes.
    const double raw = p["rss_mib"][1].get<double>() - p["rss_mib"][0].get<double>();
    const double cache = p["name"].get<std::string>().rfind("numoe-gpu", 0) == 0
                             ? std::max(0.0, j["prefix_cache_mib"][1].get<double>() - j["prefix_cache_mib"][0].get<double>())
                             : 0.0;
    EXPECT_NEAR(p["rss_growth_mib"].get<double>(), raw - cache, 0.01) << p.dump();
    EXPECT_LE(p["rss_growth_mib"].get<double>(), j["bounds"]["rss_growth_mib"].get<double>()) << p.dump();
    EXPECT_LE(p["fds"][1].get<int64_t>() - p["fds"][0].get<int64_t>(), j["bounds"]["fd_growth"].get<int64_t>());
    EXPECT_LE(p["threads"][1].get<int64_t>() - p["threads"][0].get<int64_t>(), j["bounds"]["thread_growth"].get<int64_t>());
    EXPECT_GT(p["rss_mib"][0].get<double>(), 0) << p.dump();
  }
  EXPECT_EQ(ProcessesMentioning(logs), 0);
}

TEST(SoakBenchTest, BadFlagsAreClearErrors) {
  const RunResult missing =
      RunCommand({BinPath("numoe-bench"), "soak", "--model", "/nonexistent/model"}, {.merge_stderr = true});
  EXPECT_EQ(missing.rc, 1);
  EXPECT_THAT(missing.out, HasSubstr("--model: /nonexistent/model/config.json does not exist"));
  const RunResult zero =
      RunCommand({BinPath("numoe-bench"), "soak", "--model", TinyDir(), "--seconds", "0"}, {.merge_stderr = true});
  EXPECT_NE(zero.rc, 0);
  EXPECT_THAT(zero.out, HasSubstr("--seconds"));
  const RunResult conc =
      RunCommand({BinPath("numoe-bench"), "soak", "--model", TinyDir(), "--concurrency", "0"}, {.merge_stderr = true});
  EXPECT_NE(conc.rc, 0);
  EXPECT_THAT(conc.out, HasSubstr("--concurrency"));
}

}  // namespace
}  // namespace numoe::test
