// `numoe serve` on tiny-v4: it starts numoe-gpu and the workers, prints one ready line on stdout, serves
// greedy tokens equal to the goldens, restarts a worker killed with SIGKILL on the same address (and the
// whole set after numoe-gpu is killed), and on SIGTERM leaves no process of its process group behind.
// With a real numoe-router built, the same runs through the router (REST /health and token-id
// completions equal to the goldens); without one that part is skipped.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "numoe/v1/worker.grpc.pb.h"
#include "tests/integration/process_util.h"
#include "tests/unit/engine/runtime_test_util.h"

namespace numoe::test {
namespace {

using Clock = std::chrono::steady_clock;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Processes whose process group is `pgid` (from /proc/<pid>/stat), with their command names.
std::vector<std::pair<pid_t, std::string>> GroupMembers(pid_t pgid) {
  std::vector<std::pair<pid_t, std::string>> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.empty() || !std::isdigit(static_cast<unsigned char>(name[0]))) continue;
    const std::string stat = ReadFile(e.path().string() + "/stat");
    const size_t open = stat.find('('), close = stat.rfind(')');
    if (open == std::string::npos || close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    std::string state;
    long ppid = 0, pgrp = 0;
    rest >> state >> ppid >> pgrp;
    if (pgrp == pgid) out.emplace_back(static_cast<pid_t>(std::stol(name)), stat.substr(open + 1, close - open - 1));
  }
  return out;
}

// Waits for the ready line on the serve process's stdout.
std::string WaitForReadyLine(const std::string& stdout_path, Child& serve, int timeout_s = 120) {
  const auto deadline = Clock::now() + std::chrono::seconds(timeout_s);
  while (Clock::now() < deadline && serve.running()) {
    const std::string out = ReadFile(stdout_path);
    if (out.find('\n') != std::string::npos) return out.substr(0, out.find('\n'));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return "";
}

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

// A minimal HTTP/1.1 exchange on loopback (Connection: close). Returns the status code (0 on failure).
int Http(int port, const std::string& method, const std::string& path, const std::string& body, std::string* out) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return 0;
  }
  const std::string req = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" +
                          "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
                          "\r\n\r\n" + body;
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return 0;
  }
  std::string resp;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) resp.append(buf, static_cast<size_t>(n));
  close(fd);
  int code = 0;
  std::sscanf(resp.c_str(), "HTTP/1.1 %d", &code);
  const size_t hdr_end = resp.find("\r\n\r\n");
  if (out != nullptr) *out = hdr_end == std::string::npos ? "" : resp.substr(hdr_end + 4);
  return code;
}

bool RealRouterBuilt() {
  const std::string path = std::string(NUMOE_BIN_DIR) + "/numoe-router";
  if (!std::filesystem::exists(path)) return false;
  std::string cmd = path + " --help 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return false;
  std::string help;
  char buf[512];
  while (fgets(buf, sizeof(buf), p) != nullptr) help += buf;
  pclose(p);
  return help.find("--workers") != std::string::npos && help.find("--ready-file") != std::string::npos;
}

TEST(Serve, StartsReportsReadyRestartsCrashedChildrenAndLeavesNothingOnSigterm) {
  const auto goldens = LoadGoldens(TinyDir());
  ASSERT_EQ(goldens.size(), 4u);
  const std::string out_path = TempPath("serve.out");
  Child serve("numoe",
              {"serve", "--model", TinyDir(), "--workers", "2", "--no-router", "--no-numa-bind",
               "--threads-per-worker", "1", "--max-step-tokens", "64"},
              TempPath("serve.log"), /*notify=*/false, /*new_group=*/true, out_path);
  const pid_t pgid = serve.pid();
  const std::string line = WaitForReadyLine(out_path, serve);
  ASSERT_FALSE(line.empty()) << ReadFile(TempPath("serve.log"));
  EXPECT_EQ(ReadFile(out_path), line + "\n");  // exactly one line on stdout
  std::smatch m;
  ASSERT_TRUE(std::regex_search(line, m, std::regex(R"(workers \(gRPC numoe\.v1\.Worker\) (\S+),(\S+), numoe-gpu)")))
      << line;
  const std::string w0 = m[1], w1 = m[2];

  // gpu + 2 workers + serve itself.
  auto members = GroupMembers(pgid);
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
  EXPECT_TRUE(st.ok()) << st.error_message();

  // SIGKILL a worker: serve logs it and brings it back on the same address.
  kill(worker0, SIGKILL);
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  std::vector<int32_t> got;
  while (Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    got = GreedyViaWorker(w0, goldens[3], &st);
    if (st.ok()) break;
  }
  EXPECT_TRUE(st.ok()) << st.error_message() << "\n" << ReadFile(TempPath("serve.log"));
  EXPECT_EQ(got, goldens[3].greedy);
  const std::string log = ReadFile(TempPath("serve.log"));
  EXPECT_NE(log.find("numoe-worker-0 (pid " + std::to_string(worker0) + ") was killed by signal 9"), std::string::npos)
      << log;
  EXPECT_NE(log.find("numoe-worker-0 is back"), std::string::npos) << log;

  // SIGKILL numoe-gpu: it comes back on its port, the workers notice, exit and come back registered
  // with the new one, and generation works again.
  pid_t gpu_pid = -1;
  for (auto& [pid, comm] : GroupMembers(pgid)) {
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
  EXPECT_TRUE(st.ok()) << st.error_message() << "\n" << ReadFile(TempPath("serve.log"));
  EXPECT_EQ(got, goldens[2].greedy);
  EXPECT_NE(ReadFile(TempPath("serve.log")).find("numoe-gpu is back"), std::string::npos);

  // SIGTERM: serve stops every child and exits 0; nothing of its group is left.
  const int status = serve.Signal(SIGTERM);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  std::vector<std::pair<pid_t, std::string>> left;
  for (int i = 0; i < 50; ++i) {  // children are reaped by serve; give /proc a moment
    left = GroupMembers(pgid);
    if (left.empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  for (auto& [pid, comm] : left) ADD_FAILURE() << "left behind: " << pid << " " << comm;
  EXPECT_EQ(kill(-pgid, 0), -1);
}

TEST(Serve, AStartupFailureStopsServeWithTheReason) {
  const std::string out_path = TempPath("serve_fail.out");
  Child serve("numoe", {"serve", "--model", TinyDir(), "--workers", "1", "--no-router", "--backend", "cuda"},
              TempPath("serve_fail.log"), /*notify=*/false, /*new_group=*/true, out_path);
  const pid_t pgid = serve.pid();
  const int status = serve.Reap(120000);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
  const std::string log = ReadFile(TempPath("serve_fail.log"));
  EXPECT_NE(log.find("numoe-gpu exited with status 1 before it was ready"), std::string::npos) << log;
  EXPECT_NE(log.find("--backend cuda"), std::string::npos) << log;
  EXPECT_EQ(ReadFile(out_path), "");
  EXPECT_TRUE(GroupMembers(pgid).empty());
}

TEST(Serve, EndToEndThroughTheRouter) {
  if (!RealRouterBuilt()) GTEST_SKIP() << "numoe-router is not built yet";
  const auto goldens = LoadGoldens(TinyDir());
  auto free_port = [] {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    close(fd);
    return static_cast<int>(ntohs(a.sin_port));
  };
  const int http = free_port(), grpc_port = free_port();
  const std::string out_path = TempPath("serve_router.out");
  Child serve("numoe",
              {"serve", "--model", TinyDir(), "--workers", "4", "--no-numa-bind", "--threads-per-worker", "1",
               "--port", std::to_string(http), "--grpc-port", std::to_string(grpc_port)},
              TempPath("serve_router.log"), /*notify=*/false, /*new_group=*/true, out_path);
  const pid_t pgid = serve.pid();
  const std::string line = WaitForReadyLine(out_path, serve);
  ASSERT_FALSE(line.empty()) << ReadFile(TempPath("serve_router.log"));
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
  const int status = serve.Signal(SIGTERM);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  for (int i = 0; i < 50 && !GroupMembers(pgid).empty(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_TRUE(GroupMembers(pgid).empty());
}

}  // namespace
}  // namespace numoe::test
