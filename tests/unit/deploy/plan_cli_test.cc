// `numoe plan` end to end: flags, exit codes, text/JSON output and --emit, on described machines with
// the full-size config (the binary is built by the same tree: NUMOE_BIN_DIR/numoe).
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/support/files.h"
#include "tests/support/process.h"

namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

using Result = numoe::test::RunResult;
using numoe::test::ReadFile;

class PlanCli : public ::testing::Test {
 protected:
  void SetUp() override {
    Write("4x192.json", R"({"name": "4x192", "nodes": [
        {"id": 0, "cpus": "0-23,96-119", "cores": 24, "memory_gb": 192, "dimms": 6},
        {"id": 1, "cpus": "24-47,120-143", "cores": 24, "memory_gb": 192, "dimms": 6},
        {"id": 2, "cpus": "48-71,144-167", "cores": 24, "memory_gb": 192, "dimms": 6},
        {"id": 3, "cpus": "72-95,168-191", "cores": 24, "memory_gb": 192, "dimms": 6}]})");
    Write("2x768.json", R"({"name": "2x768", "nodes": [
        {"id": 0, "cpus": 48, "memory_gb": 768}, {"id": 1, "cpus": 48, "memory_gb": 768}]})");
    Write("small.json", R"({"name": "small", "nodes": [{"id": 0, "cpus": 16, "memory_gb": 128, "dimms": 4}]})");
    Write("bad.json", R"({"nodes": [{"id": 0, "cpus": 4, "memory_gb": 8}, {"id": 1, "cpus": 4, "memory_gb": 8},
                                    {"id": 2, "cpus": 4, "memory_gb": 0}]})");
  }
  void Write(const std::string& name, const std::string& text) {
    ASSERT_TRUE(numoe::test::WriteFile(dir_ / name, text));
  }
  std::string Path(const std::string& name) const { return dir_ / name; }

  // `numoe plan ARGS` (named Plan, not Run: that is testing::Test::Run).
  Result Plan(const std::string& args) const {
    return numoe::test::RunCommand(numoe::test::CommandLine(numoe::test::BinPath("numoe"), "plan " + args));
  }
  std::string Config() const { return std::string(" --config ") + NUMOE_TEST_DATA + "/v4-flash-0731.config.json"; }

  numoe::test::TempDir dir_{"numoe-plan-cli"};
};

TEST_F(PlanCli, HelpDocumentsEveryFlag) {
  Result r = Plan("--help");
  EXPECT_EQ(r.rc, 0);
  for (const char* flag : {"--model DIR", "--config FILE", "--topology FILE.json", "--instances-per-node N", "--json",
                           "--emit systemd|k8s DIR", "--force", "--drafter-experts worker|gpu", "--available-memory",
                           "--os-headroom-gb GB", "--os-headroom-pct PCT", "--repack-overhead-pct PCT",
                           "--max-batch-tokens N", "--bin-dir DIR", "--gpu-node N", "--hostname NAME", "--image IMAGE",
                           "Exit status"}) {
    EXPECT_THAT(r.out, HasSubstr(flag));
  }
}

TEST_F(PlanCli, TextPlanForFourNodes) {
  Result r = Plan(Config() + " --topology " + Path("4x192.json"));
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("Plan: 4 workers"));
  EXPECT_THAT(r.out, HasSubstr("147.17 GB"));
  EXPECT_THAT(r.out, HasSubstr("163.73 GB"));
  EXPECT_THAT(r.out, HasSubstr("numactl --cpunodebind=3 --membind=3"));
}

TEST_F(PlanCli, JsonPlan) {
  Result r = Plan(Config() + " --topology " + Path("4x192.json") + " --json");
  ASSERT_EQ(r.rc, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["workers"].size(), 4u);
  EXPECT_EQ(j["workers"][2]["nodes"], nlohmann::json::array({2}));
  EXPECT_EQ(j["workers"][2]["threads"], 24);
  EXPECT_EQ(j["workers"][2]["cpus"], "48-71,144-167");
  EXPECT_DOUBLE_EQ(j["workers"][2]["need_gb"].get<double>(), 163.73);
}

TEST_F(PlanCli, TooSmallExitsThreeSayingWhatIsMissing) {
  Result r = Plan(Config() + " --topology " + Path("small.json"));
  EXPECT_EQ(r.rc, 3);
  EXPECT_THAT(r.out, HasSubstr("Plan: no worker fits (43.73 GB missing)"));
  Result j = Plan(Config() + " --topology " + Path("small.json") + " --json");
  EXPECT_EQ(j.rc, 3);
  EXPECT_EQ(nlohmann::json::parse(j.out)["fits"], false);
  // Without the drafter, and with a smaller reserve, it still does not fit: 120 + ... < 150.
  Result g = Plan(Config() + " --topology " + Path("small.json") + " --drafter-experts gpu");
  EXPECT_EQ(g.rc, 3);
  EXPECT_THAT(g.out, HasSubstr("on the GPU (--drafter-experts gpu)"));
}

TEST_F(PlanCli, BadInputsAreErrorsNamingTheField) {
  Result r = Plan(Config() + " --topology " + Path("bad.json"));
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, HasSubstr("bad.json: nodes[2].memory_gb must be > 0 (got 0)"));
  Result missing = Plan(Config() + " --topology " + Path("nope.json"));
  EXPECT_EQ(missing.rc, 1);
  EXPECT_THAT(missing.err, HasSubstr("nope.json: cannot open"));
  Result model = Plan("--model /nonexistent/dir --topology " + Path("4x192.json"));
  EXPECT_EQ(model.rc, 1);
  EXPECT_THAT(model.err, HasSubstr("/nonexistent/dir"));

  EXPECT_EQ(Plan("").rc, 2);
  EXPECT_THAT(Plan("").err, HasSubstr("give exactly one of --model DIR or --config FILE"));
  EXPECT_EQ(Plan(Config() + " --model /x").rc, 2);
  EXPECT_EQ(Plan(Config() + " --drafter-experts disk").rc, 2);
  EXPECT_EQ(Plan(Config() + " --instances-per-node -1").rc, 2);
  EXPECT_EQ(Plan(Config() + " --topology " + Path("4x192.json") + " --emit systemd").rc, 2);
  EXPECT_THAT(Plan(Config() + " --topology " + Path("4x192.json") + " --emit docker " + Path("x")).err,
              HasSubstr("--emit must be systemd or k8s"));
}

TEST_F(PlanCli, InstancesPerNode) {
  Result r = Plan(Config() + " --topology " + Path("2x768.json") + " --instances-per-node 4 --json");
  ASSERT_EQ(r.rc, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["workers"].size(), 8u);
  EXPECT_EQ(j["workers"][7]["nodes"], nlohmann::json::array({1}));
  EXPECT_EQ(j["workers"][7]["threads"], 12);
  Result too_many = Plan(Config() + " --topology " + Path("2x768.json") + " --instances-per-node 5");
  EXPECT_EQ(too_many.rc, 1);
  EXPECT_THAT(too_many.err, HasSubstr("node 0 holds only 4 workers"));
}

TEST_F(PlanCli, EmitSystemdAndKubernetes) {
  const std::string units = Path("units");
  Result r = Plan("--model " + std::string(NUMOE_TEST_DATA) + "/tiny-v4 --topology " + Path("4x192.json") +
                  " --emit systemd " + units);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("wrote 7 files to " + units));
  const std::string w3 = ReadFile(fs::path(units) / "numoe-worker-3.service");
  EXPECT_THAT(w3, HasSubstr("/usr/bin/numactl --cpunodebind=3 --membind=3 /usr/local/bin/numoe-worker --model "));
  EXPECT_THAT(w3, HasSubstr("tiny-v4 --numa-node 3 --threads 24"));
  EXPECT_THAT(w3, HasSubstr("CPUAffinity=72-95,168-191"));
  EXPECT_TRUE(fs::exists(fs::path(units) / "numoe-gpu.service"));
  EXPECT_TRUE(fs::exists(fs::path(units) / "numoe-router.service"));
  EXPECT_TRUE(fs::exists(fs::path(units) / "numoe.target"));

  Result again = Plan(Config() + " --topology " + Path("4x192.json") + " --emit systemd " + units);
  EXPECT_EQ(again.rc, 1);
  EXPECT_THAT(again.err, HasSubstr("exists"));
  Result forced = Plan(Config() + " --topology " + Path("4x192.json") + " --emit=systemd " + units +
                       " --force --bin-dir /opt/numoe/bin --gpu-node 2");
  EXPECT_EQ(forced.rc, 0) << forced.err;
  EXPECT_THAT(forced.err, HasSubstr("set --model in them"));
  EXPECT_THAT(ReadFile(fs::path(units) / "numoe-gpu.service"),
              HasSubstr("--cpunodebind=2 --preferred=2 /opt/numoe/bin/numoe-gpu --model /path/to/model"));
  EXPECT_EQ(
      Plan(Config() + " --topology " + Path("4x192.json") + " --emit systemd " + units + " --force --gpu-node 9").rc,
      2);

  Result k8s = Plan(Config() + " --topology " + Path("4x192.json") + " --emit k8s " + Path("k8s") +
                    " --hostname box7 --image registry/numoe:1");
  ASSERT_EQ(k8s.rc, 0) << k8s.err;
  const std::string y = ReadFile(fs::path(Path("k8s")) / "numoe.yaml");
  EXPECT_THAT(y, HasSubstr("kubernetes.io/hostname: \"box7\""));
  EXPECT_THAT(y, HasSubstr("image: \"registry/numoe:1\""));
  EXPECT_THAT(y, HasSubstr("- \"--membind=2\""));
  EXPECT_THAT(y, HasSubstr("kind: Service"));

  // Nothing is written when the machine cannot hold a copy.
  Result none = Plan(Config() + " --topology " + Path("small.json") + " --emit systemd " + Path("none"));
  EXPECT_EQ(none.rc, 3);
  EXPECT_FALSE(fs::exists(Path("none")));
}

// What `numoe serve` without --workers follows: the plan for this machine. The tiny model fits any
// machine that can build numoe (it needs about 1 GB, mostly activation buffers).
TEST_F(PlanCli, ThisMachineWithTinyModel) {
  Result r = Plan("--model " + std::string(NUMOE_TEST_DATA) + "/tiny-v4 --json");
  ASSERT_EQ(r.rc, 0) << r.out << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_GE(j["workers"].size(), 1u);
  EXPECT_THAT(j["topology"]["name"].get<std::string>(), HasSubstr("this machine"));
}

}  // namespace
