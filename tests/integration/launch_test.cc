// The launch files start the stack: `numoe plan --emit systemd` on tiny-v4 (a described two-node machine,
// --no-numa-bind, fixed free ports, --bin-dir this build), then every unit's ExecStart= line run as a
// child process exactly as written (no systemd), and greedy completions through the router equal the
// fixture's goldens. SIGTERM stops every process cleanly and leaves nothing behind.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "deploy/emit.h"
#include "tests/support/files.h"
#include "tests/support/fixtures.h"
#include "tests/support/http.h"
#include "tests/support/process.h"
#include "tests/support/status_matchers.h"

namespace numoe::test {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

const std::string kBin = NUMOE_BIN_DIR;

// The words of `unit`'s ExecStart= line.
std::vector<std::string> ExecStartOf(const std::string& unit_path) {
  const std::string unit = ReadFile(unit_path);
  const size_t at = unit.find("\nExecStart=");
  EXPECT_NE(at, std::string::npos) << unit_path << ":\n" << unit;
  if (at == std::string::npos) return {};
  const size_t begin = at + 11;
  auto words = deploy::SplitExecStart(unit.substr(begin, unit.find('\n', begin) - begin));
  EXPECT_TRUE(words.ok()) << words.status();
  return words.ok() ? *words : std::vector<std::string>{};
}

std::string Backend() {
  const char* b = std::getenv("NUMOE_E2E_BACKEND");
  return b != nullptr ? b : "cpu";
}

TEST(LaunchFiles, TheEmittedSystemdUnitsStartAStackThatServesTheGoldens) {
  ASSERT_OK_AND_ASSIGN(const Goldens goldens, Goldens::Load(TinyDir()));
  ASSERT_EQ(goldens.size(), 4u);
  const TempDir tmp("numoe-launch-");
  const std::string dir = tmp.str();
  {
    std::ofstream topo(dir + "/machine.json");
    topo << R"({"name": "two-node test machine", "nodes": [{"id": 0, "cpus": 1, "memory_gb": 16},)"
         << R"( {"id": 1, "cpus": 1, "memory_gb": 16}]})";
  }
  const int gpu_port = FreePort(), http = FreePort(), grpc_port = FreePort(), worker_base = ConsecutiveFreePorts(2);
  ASSERT_GT(worker_base, 0);
  Child plan = Child::Start({kBin + "/numoe", "plan", "--model", TinyDir(), "--topology", dir + "/machine.json",
                             "--emit", "systemd", dir + "/units", "--bin-dir", kBin, "--no-numa-bind", "--backend",
                             Backend(), "--gpu-port", std::to_string(gpu_port), "--worker-port",
                             std::to_string(worker_base), "--port", std::to_string(http), "--grpc-port",
                             std::to_string(grpc_port)},
                            {.log = dir + "/plan.log"});
  const int plan_status = plan.Wait(60s);
  ASSERT_TRUE(WIFEXITED(plan_status) && WEXITSTATUS(plan_status) == 0) << plan_status << ReadFile(dir + "/plan.log");

  // In the order numoe.target's After= lines give (the workers retry registering while numoe-gpu starts,
  // the router health-checks the workers until they answer).
  struct Unit {
    std::string name;
    Child child;
  };
  std::vector<Unit> units;
  for (const char* name : {"numoe-gpu", "numoe-worker-0", "numoe-worker-1", "numoe-router"}) {
    const std::vector<std::string> argv = ExecStartOf(dir + "/units/" + name + ".service");
    ASSERT_FALSE(argv.empty()) << name;
    EXPECT_EQ(argv[0], kBin + "/" + (std::string(name).rfind("numoe-worker", 0) == 0 ? "numoe-worker" : name));
    units.push_back({name, Child::Start(argv, {.log = dir + "/" + name + ".log", .new_group = true})});
  }
  auto logs = [&] {
    std::string all;
    for (const Unit& u : units) all += "--- " + u.name + ":\n" + ReadFile(dir + "/" + u.name + ".log");
    return all;
  };

  // Greedy token-id completions through the router equal the goldens (retried while the stack comes up).
  for (const GoldenPrompt& g : goldens) {
    const json req = {{"model", "tiny-v4"}, {"prompt", g.input_ids}, {"max_tokens", g.greedy.size()},
                      {"temperature", 0},   {"ignore_eos", true},    {"return_token_ids", true}};
    HttpResponse r;
    const auto deadline = std::chrono::steady_clock::now() + 180s;
    do {
      r = HttpCall(http, "POST", "/v1/completions", req.dump(), {}, 120s);
      if (r.status == 200) break;
      std::this_thread::sleep_for(200ms);
    } while (std::chrono::steady_clock::now() < deadline);
    ASSERT_EQ(r.status, 200) << g.name << ": " << r.body << r.error << "\n" << logs();
    const json j = json::parse(r.body);
    EXPECT_EQ(j["choices"][0]["token_ids"].get<std::vector<int32_t>>(), g.greedy) << g.name;
  }

  // SIGTERM, router first (as systemd stops numoe.target's units): every process exits 0, nothing is left.
  for (auto it = units.rbegin(); it != units.rend(); ++it) {
    const pid_t pgid = it->child.pid();
    it->child.Signal(SIGTERM);
    const int status = it->child.Wait(30s);
    EXPECT_TRUE(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << it->name << " status " << status << "\n" << logs();
    for (int i = 0; i < 50 && !ProcessGroupMembers(pgid).empty(); ++i) std::this_thread::sleep_for(100ms);
    EXPECT_TRUE(ProcessGroupMembers(pgid).empty()) << it->name;
  }
}

}  // namespace
}  // namespace numoe::test
