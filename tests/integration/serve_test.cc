// `numoe serve` on tiny-v4: it starts numoe-gpu and the workers, prints one ready line on stdout, serves
// greedy tokens equal to the goldens, restarts a worker killed with SIGKILL on the same address (and the
// whole set after numoe-gpu is killed), and on SIGTERM leaves no process of its process group behind.
// With a real numoe-router built, the same runs through the router (REST /health and token-id
// completions equal to the goldens, and numoe-gpu's prefix cache tiers in its /metrics); without one that
// part is skipped.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "numoe/v1/worker.grpc.pb.h"
#include "tests/support/files.h"
#include "tests/support/fixtures.h"
#include "tests/support/http.h"
#include "tests/support/process.h"
#include "tests/support/status_matchers.h"

namespace numoe::test {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<int32_t> GreedyViaWorker(const std::string& addr, const GoldenPrompt& g, grpc::Status* status) {
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
  v1::WorkerGenerateRequest req;
  for (int32_t t : g.input_ids) req.add_prompt_ids(t);
  req.set_max_new_tokens(static_cast<uint32_t>(g.greedy.size()));
  req.set_ignore_eos(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = stub->Generate(&ctx, req);
  v1::WorkerGenerateResponse resp;
  std::vector<int32_t> tokens;
  while (reader->Read(&resp)) tokens.insert(tokens.end(), resp.token_ids().begin(), resp.token_ids().end());
  *status = reader->Finish();
  return tokens;
}

// An HTTP/1.1 exchange on loopback: the status code (0 on failure), the body in *out.
int Http(int port, const std::string& method, const std::string& path, const std::string& body, std::string* out) {
  const HttpResponse r = HttpCall(port, method, path, body);
  if (out != nullptr) *out = r.body;
  return r.status;
}

bool RealRouterBuilt() {
  const std::string path = std::string(NUMOE_BIN_DIR) + "/numoe-router";
  if (!std::filesystem::exists(path)) return false;
  const std::string help = RunCommand({path, "--help"}, {.merge_stderr = true}).out;
  return help.find("--workers") != std::string::npos && help.find("--ready-file") != std::string::npos;
}

TEST(Serve, StartsReportsReadyRestartsCrashedChildrenAndLeavesNothingOnSigterm) {
  ASSERT_OK_AND_ASSIGN(const Goldens goldens, Goldens::Load(TinyDir()));
  ASSERT_EQ(goldens.size(), 4u);
  const TempDir tmp("numoe-serve-it");
  const std::string out_path = tmp / "serve.out", log_path = tmp / "serve.log";
  Child serve = Child::Start({BinPath("numoe"), "serve", "--model", TinyDir(), "--workers", "2", "--no-router",
                              "--no-numa-bind", "--backend", "cpu", "--threads-per-worker", "1", "--max-step-tokens", "64"},
                             {.log = log_path, .stdout_file = out_path, .new_group = true});
  const pid_t pgid = serve.pid();
  const std::string line = serve.WaitForLine();
  ASSERT_FALSE(line.empty()) << ReadFile(log_path);
  EXPECT_EQ(ReadFile(out_path), line + "\n");  // exactly one line on stdout
  std::smatch m;
  ASSERT_TRUE(std::regex_search(line, m, std::regex(R"(workers \(gRPC numoe\.v1\.Worker\) (\S+),(\S+), numoe-gpu)")))
      << line;
  const std::string w0 = m[1], w1 = m[2];

  // gpu + 2 workers + serve itself.
  auto members = ProcessGroupMembers(pgid);
  int workers = 0, gpus = 0;
  pid_t worker0 = -1;
  for (auto& [pid, comm] : members) {
    if (comm == "numoe-worker") {
      ++workers;
      const std::string port_arg = std::string("--port") + '\0' + w0.substr(w0.find(':') + 1) + '\0';
      if (ReadFile("/proc/" + std::to_string(pid) + "/cmdline").find(port_arg) != std::string::npos) {
        worker0 = pid;
      }
    }
    if (comm == "numoe-gpu") ++gpus;
  }
  EXPECT_EQ(workers, 2);
  EXPECT_EQ(gpus, 1);
  ASSERT_GT(worker0, 0);

  grpc::Status st;
  EXPECT_EQ(GreedyViaWorker(w1, goldens[0], &st), goldens[0].greedy);
  EXPECT_OK(st) << st.error_message();

  // SIGKILL a worker: serve logs it and brings it back on the same address.
  kill(worker0, SIGKILL);
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  std::vector<int32_t> got;
  while (Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    got = GreedyViaWorker(w0, goldens[3], &st);
    if (st.ok()) break;
  }
  EXPECT_OK(st) << st.error_message() << "\n" << ReadFile(log_path);
  EXPECT_EQ(got, goldens[3].greedy);
  const std::string log = ReadFile(log_path);
  EXPECT_NE(log.find("numoe-worker-0 (pid " + std::to_string(worker0) + ") was killed by signal 9"), std::string::npos)
      << log;
  EXPECT_NE(log.find("numoe-worker-0 is back"), std::string::npos) << log;

  // SIGKILL numoe-gpu: it comes back on its port, the workers notice, exit and come back registered
  // with the new one, and generation works again.
  pid_t gpu_pid = -1;
  for (auto& [pid, comm] : ProcessGroupMembers(pgid)) {
    if (comm == "numoe-gpu") gpu_pid = pid;
  }
  ASSERT_GT(gpu_pid, 0);
  kill(gpu_pid, SIGKILL);
  const auto gpu_deadline = Clock::now() + std::chrono::seconds(90);
  got.clear();
  do {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    got = GreedyViaWorker(w1, goldens[2], &st);
  } while (!(st.ok() && got == goldens[2].greedy) && Clock::now() < gpu_deadline);
  EXPECT_OK(st) << st.error_message() << "\n" << ReadFile(log_path);
  EXPECT_EQ(got, goldens[2].greedy);
  EXPECT_NE(ReadFile(log_path).find("numoe-gpu is back"), std::string::npos);

  // SIGTERM: serve stops every child and exits 0; nothing of its group is left.
  const int status = serve.Terminate();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  std::vector<std::pair<pid_t, std::string>> left;
  for (int i = 0; i < 50; ++i) {  // children are reaped by serve; give /proc a moment
    left = ProcessGroupMembers(pgid);
    if (left.empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  for (auto& [pid, comm] : left) ADD_FAILURE() << "left behind: " << pid << " " << comm;
  EXPECT_EQ(kill(-pgid, 0), -1);
}

TEST(Serve, AStartupFailureStopsServeWithTheReason) {
  const TempDir tmp("numoe-serve-fail");
  const std::string out_path = tmp / "serve.out";
  Child serve = Child::Start(
      {BinPath("numoe"), "serve", "--model", TinyDir(), "--workers", "1", "--no-router", "--backend", "cuda"},
      {.log = tmp / "serve.log", .stdout_file = out_path, .new_group = true});
  const pid_t pgid = serve.pid();
  const int status = serve.Wait(std::chrono::seconds(120));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
  const std::string log = serve.Log();
  EXPECT_NE(log.find("numoe-gpu exited with status 1 before it was ready"), std::string::npos) << log;
  EXPECT_NE(log.find("--backend cuda"), std::string::npos) << log;
  EXPECT_EQ(ReadFile(out_path), "");
  EXPECT_TRUE(ProcessGroupMembers(pgid).empty());
}

// --tp and --gpus are checked (gpu::ResolveGpus) before any child starts.
TEST(Serve, GpuChoicesThatCannotRunAreRefusedBeforeStarting) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--backend", "cpu", "--tp", "2"}, "--tp, --gpus and --cuda-device choose GPUs for --backend cuda"},
      {{"--backend", "cuda", "--gpus", "0,0"}, "--gpus lists GPU 0 twice"},
      {{"--backend", "cuda", "--gpus", "0,1", "--tp", "4"}, "--tp 4 disagrees with --gpus"},
  };
  for (const auto& [flags, needle] : cases) {
    const TempDir tmp("numoe-serve-gpus");
    std::vector<std::string> argv = {BinPath("numoe"), "serve", "--model", TinyDir(), "--workers", "1", "--no-router"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    Child serve = Child::Start(argv, {.log = tmp / "serve.log", .stdout_file = tmp / "serve.out", .new_group = true});
    const int status = serve.Wait(std::chrono::seconds(30));
    const std::string log = serve.Log();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status << "\n" << log;
    EXPECT_NE(log.find(needle), std::string::npos) << log;
    EXPECT_EQ(log.find("started numoe-gpu"), std::string::npos) << log;
  }
}

TEST(Serve, EndToEndThroughTheRouter) {
  if (!RealRouterBuilt()) GTEST_SKIP() << "numoe-router is not built yet";
  ASSERT_OK_AND_ASSIGN(const Goldens goldens, Goldens::Load(TinyDir()));
  const int http = FreePort(), grpc_port = FreePort();
  const TempDir tmp("numoe-serve-router");
  Child serve = Child::Start(
      {BinPath("numoe"), "serve", "--model", TinyDir(), "--workers", "4", "--no-numa-bind", "--backend", "cpu",
        "--threads-per-worker", "1",
       "--port", std::to_string(http), "--grpc-port", std::to_string(grpc_port)},
      {.log = tmp / "serve.log", .stdout_file = tmp / "serve.out", .new_group = true});
  const pid_t pgid = serve.pid();
  const std::string line = serve.WaitForLine();
  ASSERT_FALSE(line.empty()) << serve.Log();
  EXPECT_NE(line.find("http://127.0.0.1:" + std::to_string(http) + "/v1"), std::string::npos) << line;
  std::string body;
  EXPECT_EQ(Http(http, "GET", "/health", "", &body), 200) << body;
  // Every golden prompt twice, all at once, over the 4 workers.
  std::vector<std::string> bodies(goldens.size() * 2);
  std::vector<int> codes(bodies.size());
  std::vector<std::thread> threads;
  for (size_t k = 0; k < bodies.size(); ++k) {
    threads.emplace_back([&, k] {
      const GoldenPrompt& g = goldens[k % goldens.size()];
      std::string prompt;
      for (int32_t t : g.input_ids) prompt += (prompt.empty() ? "" : ",") + std::to_string(t);
      const std::string req = R"({"model":"tiny-v4","prompt":[)" + prompt +
                              R"(],"max_tokens":32,"temperature":0,"ignore_eos":true,"return_token_ids":true})";
      codes[k] = Http(http, "POST", "/v1/completions", req, &bodies[k]);
    });
  }
  for (auto& t : threads) t.join();
  for (size_t k = 0; k < bodies.size(); ++k) {
    const GoldenPrompt& g = goldens[k % goldens.size()];
    ASSERT_EQ(codes[k], 200) << bodies[k];
    std::string want;
    for (int32_t t : g.greedy) want += (want.empty() ? "" : ",") + std::to_string(t);
    std::string compact;
    for (char ch : bodies[k]) {
      if (ch != ' ' && ch != '\n') compact += ch;
    }
    EXPECT_NE(compact.find("\"token_ids\":[" + want + "]"), std::string::npos) << g.name << ": " << bodies[k];
  }
  const int status = serve.Terminate();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  for (int i = 0; i < 50 && !ProcessGroupMembers(pgid).empty(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_TRUE(ProcessGroupMembers(pgid).empty());
}

// numoe-gpu's prefix cache by tier in the router's /metrics: a first tier of 0 bytes moves every checkpoint
// to a 4 MiB host tier as it is stored, so after the same prompt twice (the second time restored from the
// host tier) the router shows tier="host" bytes within that bound, none in the first tier, and the first
// tier's evictions.
TEST(Serve, PrefixCacheHostTierInTheRoutersMetrics) {
  if (!RealRouterBuilt()) GTEST_SKIP() << "numoe-router is not built yet";
  ASSERT_OK_AND_ASSIGN(const Goldens goldens, Goldens::Load(TinyDir()));
  const int http = FreePort(), grpc_port = FreePort();
  const TempDir tmp("numoe-serve-prefix-metrics");
  constexpr double kHostGb = 4.0 / 1024;  // 4 MiB
  Child serve = Child::Start(
      {BinPath("numoe"), "serve", "--model", TinyDir(), "--workers", "1", "--no-numa-bind", "--backend", "cpu",
       "--threads-per-worker", "1", "--prefix-cache-gb", "0", "--prefix-cache-host-gb", std::to_string(kHostGb),
       "--port", std::to_string(http), "--grpc-port", std::to_string(grpc_port)},
      {.log = tmp / "serve.log", .stdout_file = tmp / "serve.out", .new_group = true});
  const pid_t pgid = serve.pid();
  ASSERT_FALSE(serve.WaitForLine().empty()) << serve.Log();
  std::string prompt;
  for (int32_t t : goldens[0].input_ids) prompt += (prompt.empty() ? "" : ",") + std::to_string(t);
  const std::string req = R"({"model":"tiny-v4","prompt":[)" + prompt +
                          R"(],"max_tokens":4,"temperature":0,"ignore_eos":true})";
  for (int i = 0; i < 2; ++i) {
    std::string body;
    ASSERT_EQ(Http(http, "POST", "/v1/completions", req, &body), 200) << body;
  }
  // The worker gauges come from the router's health checks: wait for one after the second request.
  std::string page;
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (Clock::now() < deadline) {
    ASSERT_EQ(Http(http, "GET", "/metrics", "", &page), 200) << page;
    if (MetricSum(page, "numoe_prefix_cache_hit_tokens_total") > 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_GT(MetricSum(page, "numoe_prefix_cache_hit_tokens_total"), 0) << page;
  const double host = MetricSum(page, "numoe_prefix_cache_bytes", {"tier=\"host\""});
  EXPECT_GT(host, 0) << page;
  EXPECT_LE(host, kHostGb * double(int64_t{1} << 30)) << page;
  EXPECT_EQ(MetricSum(page, "numoe_prefix_cache_bytes", {"tier=\"backend\""}), 0) << page;
  EXPECT_GT(MetricSum(page, "numoe_prefix_cache_evictions_total", {"tier=\"backend\""}), 0) << page;
  EXPECT_GE(MetricSum(page, "numoe_prefix_cache_evictions_total", {"tier=\"host\""}), 0) << page;
  EXPECT_NE(page.find("# TYPE numoe_prefix_cache_evictions_total counter\n"), std::string::npos) << page;
  const int status = serve.Terminate();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  for (int i = 0; i < 50 && !ProcessGroupMembers(pgid).empty(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_TRUE(ProcessGroupMembers(pgid).empty());
}

}  // namespace
}  // namespace numoe::test
