// numoe-bench experts end to end on a small preset: the last line is the documented JSON object.
#include <gtest/gtest.h>
#include <stdio.h>
#include <sys/wait.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

namespace {

struct Result {
  int exit_code = -1;
  std::string out;
};

Result RunBench(const std::string& args) {
  Result r;
  const std::string cmd = std::string(NUMOE_BIN_DIR) + "/numoe-bench experts " + args + " 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string LastLine(const std::string& s) {
  std::istringstream in(s);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return last;
}

TEST(ExpertsBench, LastLineIsTheJsonObject) {
  for (const char* isa : {"generic", ""}) {
    SCOPED_TRACE(isa);
    std::string args = "--preset small --tokens 3 --threads 1 --runs 2 --seconds 0.02";
    if (*isa != '\0') args += std::string(" --isa ") + isa;
    const Result r = RunBench(args);
    ASSERT_EQ(r.exit_code, 0) << r.out;
    const auto j = nlohmann::json::parse(LastLine(r.out));
    ASSERT_EQ(j.size(), 8u) << j.dump();
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
  }
}

// A kernel ratio above --max-ratio means the yardstick read slower than a kernel streams: the run must fail,
// loudly, after printing its figures.
TEST(ExpertsBench, RatioAboveMaxFails) {
  const Result r = RunBench("--preset small --tokens 3 --threads 1 --runs 1 --seconds 0.02 --max-ratio 0");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  const auto j = nlohmann::json::parse(LastLine(r.out));
  EXPECT_GT(j["ratio"].get<double>(), 0.0);
}

TEST(ExpertsBench, BadFlagsFail) {
  EXPECT_NE(RunBench("--preset nope").exit_code, 0);
  EXPECT_NE(RunBench("--preset small --isa sse9").exit_code, 0);
  EXPECT_NE(RunBench("--preset small --threads 100000").exit_code, 0);
}

}  // namespace
