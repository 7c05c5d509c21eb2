// The speculative start-up matrix: `numoe serve` (numoe-gpu on the CPU backend, 1 numoe-worker, numoe-router) on
// tiny-v4 over --max-seqs x --spec-depth x --max-step-tokens, with --spec dspark (the checkpoint's random
// DSpark stages: acceptance near zero, so rollback runs all the time) and --spec ngram. The seed system
// crashed at start-up whenever max sequences x (depth + 1) > 32; here every cell
//   - starts and prints its ready line,
//   - serves min(max-seqs, 8) concurrent greedy token-id completions equal to the goldens (transformers'
//     greedy tokens, tests/data/tiny-v4/golden.safetensors),
//   - shows drafted > 0 for its drafter in /metrics,
//   - stops on SIGTERM with nothing of its process group left.
// And the combinations that cannot run are refused before anything loads, with what to change:
// a drafter the checkpoint lacks (demo-v4 has no DSpark stages), MTP on the CUDA backend, a
// bad --spec or --spec-depth, and a worker whose --spec disagrees with numoe-gpu's.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
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

struct Cell {
  int64_t max_seqs, depth, budget;  // budget 0: the worker's default --max-step-tokens
  const char* spec;
  bool adaptive = false;
};

std::string Describe(const Cell& c) {
  return absl::StrCat("--spec ", c.spec, " --max-seqs ", c.max_seqs, " --spec-depth ", c.depth,
                      " --max-step-tokens ", c.budget, c.adaptive ? " --spec-adaptive" : "");
}

// `model`: the served name (the checkpoint directory's name).
std::vector<int32_t> Complete(int port, const test::GoldenPrompt& g, std::string* err,
                              const std::string& model = "tiny-v4") {
  json req = {{"model", model}, {"prompt", g.input_ids},   {"max_tokens", g.greedy.size()},
              {"temperature", 0},   {"ignore_eos", true},      {"return_token_ids", true}};
  HttpResponse r = HttpCall(port, "POST", "/v1/completions", req.dump(), {}, 120s);
  if (r.status != 200) {
    *err = "HTTP " + std::to_string(r.status) + ": " + r.body + r.error;
    return {};
  }
  json j = json::parse(r.body, nullptr, false);
  if (j.is_discarded()) {
    *err = "bad JSON: " + r.body;
    return {};
  }
  return j["choices"][0]["token_ids"].get<std::vector<int32_t>>();
}

// NUMOE_E2E_BACKEND=cuda runs the matrix with numoe-gpu on the CUDA backend (on a GPU machine; its
// DSpark drafter runs on the device; it has no MTP drafter). With it, NUMOE_E2E_DRAFTER_EXPERTS=gpu also
// runs the drafter's routed experts on the GPU (numoe serve --drafter-experts gpu: the worker skips them).
std::string Backend() {
  const char* b = std::getenv("NUMOE_E2E_BACKEND");
  return b != nullptr ? b : "cpu";
}
std::string DrafterExperts() {
  const char* d = std::getenv("NUMOE_E2E_DRAFTER_EXPERTS");
  return d != nullptr ? d : "worker";
}

// Runs one cell on `model`: every request's tokens must equal goldens[..].greedy, and /metrics must show
// drafted > 0 for `drafter` (the cell's --spec, or what auto resolves to; "none": no check).
void RunCell(const Cell& c, const std::vector<test::GoldenPrompt>& goldens, const std::string& model = test::TinyDir(),
             std::string drafter = "") {
  if (drafter.empty()) drafter = c.spec;
  SCOPED_TRACE(Describe(c) + " --backend " + Backend() + " --drafter-experts " + DrafterExperts() + " --model " + model);
  const TempDir dir_tmp("numoe-spec-serve");
  const std::string dir = dir_tmp.str();
  const int http = FreePort(), grpc_port = FreePort();
  std::vector<std::string> argv = {kBin + "/numoe", "serve", "--model", model, "--workers", "1",
                                   "--no-numa-bind", "--threads-per-worker", "1", "--port", std::to_string(http),
                                   "--grpc-port", std::to_string(grpc_port), "--max-seqs", std::to_string(c.max_seqs),
                                   "--spec", c.spec, "--spec-depth", std::to_string(c.depth), "--startup-timeout",
                                   "120", "--backend", Backend()};
  if (c.budget > 0) argv.insert(argv.end(), {"--max-step-tokens", std::to_string(c.budget)});
  if (c.adaptive) argv.push_back("--spec-adaptive");
  if (DrafterExperts() != "worker") argv.insert(argv.end(), {"--drafter-experts", DrafterExperts()});
  Child serve = Child::Start(
      argv, {.log = dir + "/serve.log", .append_log = true, .stdout_file = dir + "/serve.out", .new_group = true});
  const pid_t pgid = serve.pid();
  std::string ready;
  for (int i = 0; i < 2400 && ready.find('\n') == std::string::npos && serve.running(); ++i) {
    std::this_thread::sleep_for(50ms);
    ready = ReadFile(dir + "/serve.out");
  }
  ASSERT_NE(ready.find("http://127.0.0.1:" + std::to_string(http)), std::string::npos)
      << "numoe serve did not print its ready line; log:\n" << ReadFile(dir + "/serve.log");

  // As many concurrent requests as the worker runs at once, at most 8. p1 (250 tokens) and p3 (150)
  // first: a long history gives the n-gram drafter matches even when only one request runs.
  const std::vector<size_t> order = {1, 3, 0, 2};
  const size_t n = static_cast<size_t>(std::min<int64_t>(c.max_seqs, 8));
  std::vector<std::vector<int32_t>> got(n);
  std::vector<std::string> errs(n);
  std::vector<std::thread> threads;
  for (size_t k = 0; k < n; ++k) {
    threads.emplace_back([&, k] { got[k] = Complete(http, goldens[order[k % 4]], &errs[k], std::filesystem::path(model).filename().string()); });
  }
  for (auto& t : threads) t.join();
  for (size_t k = 0; k < n; ++k) {
    const test::GoldenPrompt& g = goldens[order[k % 4]];
    EXPECT_EQ(errs[k], "") << g.name;
    EXPECT_EQ(got[k], g.greedy) << g.name << "\n" << ReadFile(dir + "/serve.log");
  }

  // The router refreshes worker figures on its health checks (every second): poll a little.
  double drafted = drafter == "none" ? 1 : -1;
  std::string page;
  for (int i = 0; i < 60 && drafted <= 0; ++i) {
    HttpResponse r = HttpCall(http, "GET", "/metrics", "", {}, 10s);
    page = r.body;
    drafted = MetricSum(page, "numoe_spec_drafted_tokens_total", {"drafter=\"" + drafter + "\""});
    if (drafted <= 0) std::this_thread::sleep_for(100ms);
  }
  EXPECT_GT(drafted, 0) << "/metrics:\n" << page;

  serve.Signal(SIGTERM);
  const int status = serve.Wait(60s);
  ASSERT_NE(status, -1) << "numoe serve did not exit after SIGTERM";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  std::vector<std::pair<pid_t, std::string>> left;
  for (int i = 0; i < 50; ++i) {
    left = ProcessGroupMembers(pgid);
    if (left.empty()) break;
    std::this_thread::sleep_for(100ms);
  }
  for (const auto& [pid, name] : left) ADD_FAILURE() << "left behind: " << pid << " " << name;
  const auto ready_file = std::filesystem::temp_directory_path() / ("numoe-serve-" + std::to_string(pgid) + "-router.ready");
  EXPECT_FALSE(std::filesystem::exists(ready_file)) << ready_file << " left behind";
}

// The corners (32 x 7 on a budget of 32 is what crashed the seed system; 8 x 16 on a budget of 8 leaves
// drafts only the rows decode does not take; 64 x 5 on 64; 300 x 2 beyond numoe-gpu's default of 256
// sequences per worker) and the smallest, for both drafters, some with adaptive depth.
TEST(SpecServe, StartupMatrixRunsEveryCombinationWithGreedyGoldens) {
  ASSERT_OK_AND_ASSIGN(const test::Goldens loaded, test::Goldens::Load(test::TinyDir()));
  const std::vector<test::GoldenPrompt>& goldens = loaded.prompts();
  ASSERT_EQ(goldens.size(), 4u);
  const std::vector<Cell> cells = {
      {32, 7, 32, "dspark"},        {1, 1, 0, "dspark"},  {8, 16, 8, "dspark"}, {64, 5, 64, "dspark"},
      {4, 3, 2, "dspark", true},    {300, 2, 512, "dspark"},
      {32, 7, 32, "ngram"},         {1, 1, 0, "ngram"},   {8, 16, 8, "ngram"},  {64, 5, 64, "ngram", true},
  };
  for (const Cell& c : cells) {
    RunCell(c, goldens);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// A checkpoint with an MTP drafter (numoe mkmodel --drafter mtp: random weights, tiny-v4's shapes): no
// goldens, so the plain run's (--spec none) greedy tokens are the reference for --spec mtp and auto.
TEST(SpecServe, MtpDrafterServesThePlainGreedyTokens) {
  if (Backend() == "cuda") GTEST_SKIP() << "the CUDA backend has no MTP drafter";
  const TempDir dir_tmp("numoe-spec-mtp");
  const std::string dir = dir_tmp.str();
  const std::string model = dir + "/tiny-mtp";
  Child mk =
      Child::Start({kBin + "/numoe", "mkmodel", "--preset", "tiny", "--drafter", "mtp", "--out", model, "--quiet"},
                   {.log = dir + "/mkmodel.log", .append_log = true});
  const int st = mk.Wait(60s);
  ASSERT_TRUE(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0) << ReadFile(dir + "/mkmodel.log");
  // Reference: the goldens' prompts, greedy without speculation on this checkpoint (one request at a time
  // through a 1-sequence cell, so batching plays no part).
  ASSERT_OK_AND_ASSIGN(const test::Goldens goldens, test::Goldens::Load(test::TinyDir()));
  std::vector<test::GoldenPrompt> prompts = goldens.prompts();  // greedy replaced below
  ASSERT_EQ(prompts.size(), 4u);
  {
    const TempDir ref_dir_tmp("numoe-spec-mtp-ref");
    const std::string ref_dir = ref_dir_tmp.str();
    const int http = FreePort(), grpc_port = FreePort();
    Child serve = Child::Start(
        {kBin + "/numoe", "serve", "--model", model, "--workers", "1", "--no-numa-bind", "--threads-per-worker", "1",
         "--port", std::to_string(http), "--grpc-port", std::to_string(grpc_port), "--spec", "none", "--backend", Backend()},
        {.log = ref_dir + "/serve.log", .append_log = true, .stdout_file = ref_dir + "/serve.out", .new_group = true});
    std::string ready;
    for (int i = 0; i < 2400 && ready.find('\n') == std::string::npos && serve.running(); ++i) {
      std::this_thread::sleep_for(50ms);
      ready = ReadFile(ref_dir + "/serve.out");
    }
    ASSERT_NE(ready.find("ready"), std::string::npos) << ReadFile(ref_dir + "/serve.log");
    for (auto& p : prompts) {
      std::string err;
      p.greedy = Complete(http, p, &err, "tiny-mtp");
      ASSERT_EQ(err, "") << p.name;
      ASSERT_EQ(p.greedy.size(), 32u);
    }
    serve.Signal(SIGTERM);
    ASSERT_NE(serve.Wait(60s), -1);
    std::filesystem::remove_all(ref_dir);
  }
  RunCell({32, 7, 32, "mtp"}, prompts, model);
  RunCell({8, 3, 8, "mtp", true}, prompts, model);
  RunCell({4, 5, 0, "auto"}, prompts, model, "mtp");  // the default resolves to the checkpoint's MTP drafter
  if (!::testing::Test::HasFailure()) std::filesystem::remove_all(dir);
}

// A `numoe serve` that must refuse: exits 1 (2 for a bad flag value, the parser's usage error) without
// starting a child, the log says what to change.
void ExpectRefused(const std::vector<std::string>& args, const std::vector<std::string>& needles, int code = 1) {
  const TempDir dir_tmp("numoe-spec-refuse");
  const std::string dir = dir_tmp.str();
  std::vector<std::string> argv = {kBin + "/numoe", "serve"};
  argv.insert(argv.end(), args.begin(), args.end());
  Child serve = Child::Start(
      argv, {.log = dir + "/serve.log", .append_log = true, .stdout_file = dir + "/serve.out", .new_group = true});
  const int status = serve.Wait(30s);
  const std::string log = ReadFile(dir + "/serve.log");
  ASSERT_NE(status, -1) << "not refused within 30 s:\n" << log;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == code) << status << "\n" << log;
  for (const std::string& s : needles) EXPECT_NE(log.find(s), std::string::npos) << "'" << s << "' not in:\n" << log;
  EXPECT_EQ(log.find("started numoe-gpu"), std::string::npos) << log;
  EXPECT_EQ(ReadFile(dir + "/serve.out"), "");
  std::filesystem::remove_all(dir);
}

TEST(SpecServe, CombinationsThatCannotRunAreRefusedBeforeLoading) {
  ExpectRefused({"--model", DemoDir(), "--workers", "1", "--no-numa-bind", "--spec", "dspark"},
                {"--spec dspark", "no drafter stages", "use --spec ngram or none"});
  // --backend cpu pinned: on a GPU machine --backend auto picks cuda, whose refusal is the next case's.
  ExpectRefused({"--model", test::TinyDir(), "--workers", "1", "--no-numa-bind", "--backend", "cpu", "--spec", "mtp"},
                {"--spec mtp", "a dspark drafter", "use --spec dspark, ngram or none"});
  ExpectRefused({"--model", test::TinyDir(), "--workers", "1", "--no-numa-bind", "--backend", "cuda", "--spec",
                 "mtp"},
                {"--spec mtp", "CUDA backend has no MTP drafter", "--backend cpu"});
  ExpectRefused({"--model", test::TinyDir(), "--workers", "1", "--no-numa-bind", "--spec", "eagle"},
                {"--spec must be auto, none, dspark, mtp or ngram", "eagle"}, 2);
  // Out of range depth: the flag parser's usage error (exit 2) names the flag and its range.
  ExpectRefused({"--model", test::TinyDir(), "--workers", "1", "--no-numa-bind", "--spec-depth", "17"},
                {"--spec-depth: 17 is out of range [0, 16]"}, 2);
  // Drafter experts on the GPU need the CUDA backend; an unknown place is named.
  ExpectRefused({"--model", test::TinyDir(), "--workers", "1", "--no-numa-bind", "--backend", "cpu",
                 "--drafter-experts", "gpu"},
                {"--drafter-experts gpu needs --backend cuda"});
  ExpectRefused({"--model", test::TinyDir(), "--workers", "1", "--no-numa-bind", "--drafter-experts", "disk"},
                {"--drafter-experts must be worker or gpu", "disk"}, 2);
}

// numoe-gpu and a numoe-worker started by hand with different drafters: the worker exits at start-up
// saying which flag to change; numoe-gpu refuses a drafter the checkpoint lacks before loading.
TEST(SpecServe, WorkerAndGpuDisagreeingOnTheDrafterIsAClearStartupError) {
  const TempDir dir_tmp("numoe-spec-mismatch");
  const std::string dir = dir_tmp.str();
  const int gpu_port = FreePort();
  Child gpu = Child::Start({kBin + "/numoe-gpu", "--model", test::TinyDir(), "--port", std::to_string(gpu_port),
                            "--threads", "1", "--spec", "none"},
                           {.log = dir + "/gpu.log", .append_log = true, .new_group = true});
  Child worker = Child::Start(
      {kBin + "/numoe-worker", "--model", test::TinyDir(), "--gpu", "127.0.0.1:" + std::to_string(gpu_port), "--port",
       "0", "--no-numa-bind", "--threads", "1", "--experts", "reference", "--spec", "dspark"},
      {.log = dir + "/worker.log", .append_log = true, .new_group = true});
  const int status = worker.Wait(60s);
  const std::string log = ReadFile(dir + "/worker.log");
  ASSERT_NE(status, -1) << log;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status << "\n" << log;
  EXPECT_NE(log.find("--spec dspark: numoe-gpu drafts with none; start numoe-gpu with --spec dspark"),
            std::string::npos)
      << log;
  gpu.Signal(SIGTERM);
  EXPECT_NE(gpu.Wait(30s), -1);

  // A worker that leaves the drafter's experts to numoe-gpu, whose CPU backend runs them on the workers:
  // refused at registration, naming both ways out.
  const int gpu2_port = FreePort();
  Child gpu2 = Child::Start({kBin + "/numoe-gpu", "--model", test::TinyDir(), "--port", std::to_string(gpu2_port),
                             "--threads", "1", "--spec", "dspark"},
                            {.log = dir + "/gpu2.log", .append_log = true, .new_group = true});
  Child worker2 = Child::Start({kBin + "/numoe-worker", "--model", test::TinyDir(), "--gpu",
                                "127.0.0.1:" + std::to_string(gpu2_port), "--port", "0", "--no-numa-bind", "--threads",
                                "1", "--experts", "reference", "--spec", "dspark", "--drafter-experts", "gpu"},
                               {.log = dir + "/worker2.log", .append_log = true, .new_group = true});
  const int status2 = worker2.Wait(60s);
  const std::string log2 = ReadFile(dir + "/worker2.log");
  ASSERT_NE(status2, -1) << log2;
  EXPECT_TRUE(WIFEXITED(status2) && WEXITSTATUS(status2) == 1) << status2 << "\n" << log2;
  EXPECT_NE(log2.find("--drafter-experts gpu: numoe-gpu runs the drafter's routed experts on the workers"),
            std::string::npos)
      << log2;
  gpu2.Signal(SIGTERM);
  EXPECT_NE(gpu2.Wait(30s), -1);

  Child bad_gpu = Child::Start({kBin + "/numoe-gpu", "--model", DemoDir(), "--port", "0", "--spec", "dspark"},
                               {.log = dir + "/bad_gpu.log", .append_log = true, .new_group = true});
  const int bad = bad_gpu.Wait(30s);
  const std::string bad_log = ReadFile(dir + "/bad_gpu.log");
  EXPECT_TRUE(bad != -1 && WIFEXITED(bad) && WEXITSTATUS(bad) == 1) << bad << "\n" << bad_log;
  EXPECT_NE(bad_log.find("no drafter stages"), std::string::npos) << bad_log;
  EXPECT_EQ(bad_log.find("loaded"), std::string::npos) << bad_log;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace numoe::test
