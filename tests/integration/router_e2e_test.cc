// The serving stack end to end on real processes: `numoe serve` with 4 workers on tiny-v4 (numoe-gpu on
// the CPU backend, 4 numoe-workers, numoe-router), then
//   - greedy token ids over REST (token-id prompts, ignore_eos, return_token_ids) equal the goldens for every
//     prompt while 16 mixed streaming / non-streaming / gRPC requests run at once;
//   - the same through gRPC;
//   - each bad input gets its 4xx and service continues;
//   - after kill -9 of one worker, new requests still succeed (and still match the goldens);
//   - SIGTERM stops serve and leaves no process of its group behind.
// Goldens: tests/data/tiny-v4/golden.safetensors (pK.input_ids, pK.greedy_tokens: 32 tokens, EOS ignored).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <filesystem>
#include <future>
#include <nlohmann/json.hpp>
#include <thread>

#include "numoe/v1/inference.grpc.pb.h"
#include "numoe/v1/worker.grpc.pb.h"
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

// One golden request over REST; returns the token ids ("" error text in *err).
std::vector<int32_t> RestGolden(int port, const test::GoldenPrompt& g, bool stream, std::string* err) {
  json req = {{"model", "tiny-v4"},     {"prompt", g.input_ids},     {"max_tokens", g.greedy.size()},
              {"temperature", 0},       {"ignore_eos", true},        {"return_token_ids", true},
              {"stream", stream}};
  HttpResponse r = HttpCall(port, "POST", "/v1/completions", req.dump(), {}, 300s);
  std::vector<int32_t> ids;
  if (r.status != 200) {
    *err = "HTTP " + std::to_string(r.status) + ": " + r.body + r.error;
    return ids;
  }
  if (!stream) {
    json j = json::parse(r.body, nullptr, false);
    if (j.is_discarded()) {
      *err = "bad JSON: " + r.body;
      return ids;
    }
    if (j["choices"][0]["finish_reason"] != "length") *err = "finish_reason " + j["choices"][0]["finish_reason"].dump();
    return j["choices"][0]["token_ids"].get<std::vector<int32_t>>();
  }
  auto events = SseEvents(r.body);
  if (events.empty() || events.back() != "[DONE]") *err = "stream did not end with [DONE]: " + r.body;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    json e = json::parse(events[i], nullptr, false);
    if (e.is_discarded() || e.contains("error")) {
      *err = "error event: " + events[i];
      continue;
    }
    for (int32_t id : e["choices"][0]["token_ids"]) ids.push_back(id);
  }
  return ids;
}

std::vector<int32_t> GrpcGolden(v1::Inference::Stub& stub, const test::GoldenPrompt& g, std::string* err) {
  v1::GenerateRequest req;
  req.set_model("tiny-v4");
  for (int32_t id : g.input_ids) req.mutable_token_ids()->add_ids(id);
  req.set_max_tokens(static_cast<uint32_t>(g.greedy.size()));
  req.mutable_sampling()->set_temperature(0);
  req.set_ignore_eos(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 300s);
  auto reader = stub.Generate(&ctx, req);
  v1::GenerateResponse resp;
  std::vector<int32_t> ids;
  while (reader->Read(&resp)) ids.insert(ids.end(), resp.token_ids().begin(), resp.token_ids().end());
  grpc::Status s = reader->Finish();
  if (!s.ok()) *err = "gRPC " + std::to_string(s.error_code()) + ": " + s.error_message();
  return ids;
}

TEST(RouterEndToEnd, ServeFourWorkersGoldensErrorsFailoverSigterm) {
  ASSERT_OK_AND_ASSIGN(const test::Goldens goldens, test::Goldens::Load(test::TinyDir()));
  ASSERT_EQ(goldens.size(), 4u);
  const TempDir dir_tmp("numoe-e2e");
  const std::string dir = dir_tmp.str();
  const int http = FreePort(), grpc_port = FreePort();
  // NUMOE_E2E_BACKEND=cuda runs the same test with numoe-gpu on the CUDA backend (on a GPU machine).
  const char* backend_env = std::getenv("NUMOE_E2E_BACKEND");
  const std::string backend = backend_env != nullptr ? backend_env : "cpu";
  std::vector<std::string> argv = {kBin + "/numoe", "serve", "--model", test::TinyDir(), "--workers", "4", "--backend",
                                   backend, "--no-numa-bind", "--threads-per-worker", "1", "--port", std::to_string(http),
                                   "--grpc-port", std::to_string(grpc_port), "--stop-timeout", "10"};
  // NUMOE_E2E_GPU_PREFILL_THRESHOLD=N passes numoe-gpu --gpu-prefill-threshold N (with cuda: 1 = every step's
  // routed experts on the GPU, from the workers' shared arenas).
  if (const char* t = std::getenv("NUMOE_E2E_GPU_PREFILL_THRESHOLD"); t != nullptr && *t != '\0') {
    argv.push_back("--gpu-prefill-threshold");
    argv.push_back(t);
  }
  Child serve = Child::Start(
      argv,
      {.log = dir + "/serve.log", .append_log = true, .stdout_file = dir + "/serve.out", .new_group = true});
  const pid_t pgid = serve.pid();
  std::string ready;
  for (int i = 0; i < 1800 && ready.find('\n') == std::string::npos && serve.running(); ++i) {
    std::this_thread::sleep_for(100ms);
    ready = ReadFile(dir + "/serve.out");
  }
  ASSERT_NE(ready.find("http://127.0.0.1:" + std::to_string(http)), std::string::npos)
      << "numoe serve did not print its ready line; log:\n" << ReadFile(dir + "/serve.log");
  HttpResponse health = HttpCall(http, "GET", "/health");
  ASSERT_EQ(health.status, 200) << health.body;
  EXPECT_EQ(json::parse(health.body)["workers_up"], 4);

  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(grpc_port), grpc::InsecureChannelCredentials());
  auto stub = v1::Inference::NewStub(channel);

  // 16 mixed requests at once: REST whole, REST streamed and gRPC streamed, over the 4 golden prompts.
  {
    std::vector<std::future<std::pair<std::string, std::string>>> futures;
    for (int i = 0; i < 16; ++i) {
      futures.push_back(std::async(std::launch::async, [&, i] {
        const auto& g = goldens[i % 4];
        std::string err;
        std::vector<int32_t> ids;
        const char* kind = "";
        switch ((i / 4) % 4) {
          case 0:
            kind = "REST";
            ids = RestGolden(http, g, false, &err);
            break;
          case 1:
            kind = "REST stream";
            ids = RestGolden(http, g, true, &err);
            break;
          case 2:
            kind = "gRPC";
            ids = GrpcGolden(*stub, g, &err);
            break;
          default:
            kind = "REST stream";
            ids = RestGolden(http, g, true, &err);
        }
        if (err.empty() && ids != g.greedy) err = "token ids differ from the golden";
        return std::make_pair(std::string(kind) + " " + g.name, err);
      }));
    }
    // Bad inputs while those run: each gets its 4xx at once.
    struct Bad {
      std::string body;
      int status;
      std::string param;
    };
    const std::vector<Bad> bad = {
        {"{not json", 400, ""},
        {R"({"model": "tiny-v4", "prompt": [5, 1024]})", 400, "prompt"},
        {R"({"model": "tiny-v4", "prompt": "x", "temperature": -1})", 400, "temperature"},
        {R"({"model": "tiny-v4", "prompt": "x", "max_tokens": "many"})", 400, "max_tokens"},
        {R"({"model": "nope", "prompt": "x"})", 404, "model"},
    };
    for (const Bad& b : bad) {
      HttpResponse r = HttpCall(http, "POST", "/v1/completions", b.body);
      EXPECT_EQ(r.status, b.status) << b.body << " -> " << r.body;
      json e = json::parse(r.body, nullptr, false);
      ASSERT_FALSE(e.is_discarded()) << r.body;
      EXPECT_EQ(e["error"]["param"], b.param.empty() ? json(nullptr) : json(b.param)) << r.body;
    }
    for (auto& f : futures) {
      auto [what, err] = f.get();
      EXPECT_TRUE(err.empty()) << what << ": " << err;
    }
  }

  // kill -9 the worker that generated the most (prefix affinity sends golden prompts back to it, so the
  // next requests meet the dead worker first): new requests still succeed.
  pid_t victim = -1;
  uint64_t most = 0;
  for (const auto& [pid, name] : ProcessGroupMembers(pgid)) {
    if (name != "numoe-worker") continue;
    std::string cmdline = ReadFile("/proc/" + std::to_string(pid) + "/cmdline");
    std::vector<std::string> args;
    for (size_t b = 0, e; b < cmdline.size(); b = e + 1) {
      e = cmdline.find('\0', b);
      if (e == std::string::npos) e = cmdline.size();
      args.push_back(cmdline.substr(b, e - b));
    }
    auto it = std::find(args.begin(), args.end(), "--port");
    if (it == args.end() || it + 1 == args.end()) continue;
    auto wstub = v1::Worker::NewStub(
        grpc::CreateChannel("127.0.0.1:" + *(it + 1), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 5s);
    v1::WorkerStats stats;
    if (!wstub->Stats(&ctx, v1::WorkerStatsRequest(), &stats).ok()) continue;
    if (victim < 0 || stats.tokens_generated() > most) {
      victim = pid;
      most = stats.tokens_generated();
    }
  }
  ASSERT_GT(victim, 0) << "no numoe-worker in serve's process group";
  EXPECT_GT(most, 0u);
  kill(victim, SIGKILL);
  for (int i = 0; i < 8; ++i) {
    std::string err;
    const auto& g = goldens[i % 4];
    std::vector<int32_t> ids = (i % 2) ? GrpcGolden(*stub, g, &err) : RestGolden(http, g, i % 4 == 2, &err);
    EXPECT_TRUE(err.empty()) << "after kill -9, request " << i << ": " << err;
    EXPECT_EQ(ids, g.greedy) << "after kill -9, request " << i;
  }
  HttpResponse still = HttpCall(http, "GET", "/health");
  EXPECT_EQ(still.status, 200);

  // SIGTERM: serve stops everything and exits 0; nothing of its group is left.
  serve.Signal(SIGTERM);
  int status = serve.Wait(60s);
  ASSERT_NE(status, -1) << "numoe serve did not exit after SIGTERM";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  std::vector<std::pair<pid_t, std::string>> left;
  for (int i = 0; i < 100; ++i) {
    left = ProcessGroupMembers(pgid);
    if (left.empty()) break;
    std::this_thread::sleep_for(100ms);
  }
  for (const auto& [pid, name] : left) ADD_FAILURE() << "left behind: " << pid << " " << name;
  if (!::testing::Test::HasFailure() && std::getenv("NUMOE_KEEP_TEST_LOGS") == nullptr) {
    std::filesystem::remove_all(dir);
  }
}

}  // namespace
}  // namespace numoe::test
