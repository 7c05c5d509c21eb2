// Chaos under load: `numoe serve` on tiny-v4 (CPU backend, 2 workers) with 128 concurrent streamed
// completions, then one fault per test:
//   KilledGpu          kill -9 numoe-gpu: every request in flight ends within 10 s with a clear error (an SSE
//                      error event, or 503/429 with Retry-After) or its finished answer; requests sent meanwhile
//                      (honouring Retry-After) succeed once serve has restarted it; the goldens match after.
//   StoppedWorker      SIGSTOP one worker for 5 s: the other keeps finishing requests meanwhile; every request
//                      ends (fails over, finishes, or ends with a clear error) within 10 s of the SIGCONT.
//   KilledRouter       kill -9 numoe-router: serve restarts it, new connections succeed, and the workers have
//                      freed the dead router's sequences (active sequences 0 in /metrics).
//   ClientsDisconnect  128 clients close their connections mid-stream: active sequences back to 0 in /metrics
//                      and in numoe-gpu's Stats.
// Each test ends with SIGTERM to serve: exit 0, and no process of its group, nor any child pid seen during
// the test (restarted ones included), is left.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "nlohmann/json.hpp"
#include "numoe/v1/gpu.grpc.pb.h"
#include "tests/support/files.h"
#include "tests/support/fixtures.h"
#include "tests/support/http.h"
#include "tests/support/process.h"
#include "tests/support/status_matchers.h"

namespace numoe::test {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;
using namespace std::chrono_literals;

constexpr int kStreams = 128;
constexpr auto kErrorBound = 10s;  // a request in flight at a fault ends within this

double Secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// ---- the served stack ----------------------------------------------------------------------------------------

class Stack {
 public:
  explicit Stack(const TempDir& tmp) : tmp_(tmp) {}

  // numoe serve on tiny-v4: 2 workers of 64 sequences each (so all 128 streams run at once), CPU backend.
  void Start() {
    http_ = FreePort();
    const int grpc_port = FreePort();
    serve_ = Child::Start({BinPath("numoe"), "serve", "--model", TinyDir(), "--workers", "2", "--no-numa-bind",
                           "--backend", "cpu", "--threads-per-worker", "1", "--max-seqs", "64", "--spec", "none",
                           "--port", std::to_string(http_), "--grpc-port", std::to_string(grpc_port), "--log-dir",
                           tmp_ / "logs", "--stop-timeout", "10"},
                          {.log = tmp_ / "serve.log", .stdout_file = tmp_ / "serve.out", .new_group = true});
    pgid_ = serve_.pid();
    const std::string line = serve_.WaitForLine(120s);
    ASSERT_FALSE(line.empty()) << serve_.Log();
    Remember();
  }

  int http() const { return http_; }
  std::string Logs() const {
    std::string all = "--- serve.log\n" + serve_.Log();
    for (const char* name : {"numoe-gpu", "numoe-worker-0", "numoe-worker-1", "numoe-router"}) {
      std::string log = ReadFile(tmp_.path() / "logs" / (std::string(name) + ".log"));
      if (log.size() > 6000) log = "..." + log.substr(log.size() - 6000);
      all += std::string("--- ") + name + ".log\n" + log;
    }
    return all;
  }

  // The group's processes named `comm`, and every child pid seen so far.
  std::vector<pid_t> Find(const std::string& comm) {
    std::vector<pid_t> out;
    for (auto& [pid, name] : ProcessGroupMembers(pgid_)) {
      if (pid != pgid_) seen_.insert(pid);
      if (name == comm) out.push_back(pid);
    }
    std::sort(out.begin(), out.end());
    return out;
  }
  void Remember() { (void)Find(""); }

  // The first `--port N` of a process's command line.
  static int PortOf(pid_t pid) {
    const std::string cmd = ReadFile("/proc/" + std::to_string(pid) + "/cmdline");
    const std::string flag = std::string("--port") + '\0';
    const size_t at = cmd.find(flag);
    return at == std::string::npos ? 0 : std::atoi(cmd.c_str() + at + flag.size());
  }

  // SIGTERM: serve exits 0 and nothing of its group, nor any child it ever had, is left.
  void StopAndExpectNothingLeft() {
    Remember();
    const int status = serve_.Terminate(30s);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << "\n" << Logs();
    std::vector<std::pair<pid_t, std::string>> left;
    for (int i = 0; i < 50; ++i) {
      left = ProcessGroupMembers(pgid_);
      if (left.empty()) break;
      std::this_thread::sleep_for(100ms);
    }
    for (auto& [pid, comm] : left) ADD_FAILURE() << "left behind in the group: " << pid << " " << comm;
    for (pid_t pid : seen_) {
      const std::string stat = ReadFile("/proc/" + std::to_string(pid) + "/stat");
      const size_t close_paren = stat.rfind(')');
      const bool alive = close_paren != std::string::npos && stat.size() > close_paren + 2 && stat[close_paren + 2] != 'Z';
      EXPECT_FALSE(alive) << "child " << pid << " is still running: " << stat;
    }
  }

 private:
  const TempDir& tmp_;
  Child serve_;
  pid_t pgid_ = -1;
  int http_ = 0;
  std::set<pid_t> seen_;
};

// ---- requests --------------------------------------------------------------------------------------------------

std::string Ids(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t t : ids) s += (s.empty() ? "" : ",") + std::to_string(t);
  return s;
}

std::string CompletionBody(const GoldenPrompt& g, int max_tokens, bool stream) {
  return R"({"model":"tiny-v4","prompt":[)" + Ids(g.input_ids) + R"(],"max_tokens":)" + std::to_string(max_tokens) +
         R"(,"temperature":0,"ignore_eos":true,"return_token_ids":true,"stream":)" + (stream ? "true" : "false") + "}";
}

// How one request ended.
enum class End {
  kOk,          // [DONE] after a finish_reason (or a 200 JSON answer)
  kErrorEvent,  // an SSE error event
  kRefused,     // 503 or 429 with Retry-After
  kBadStatus,   // any other status, or 503/429 without Retry-After
  kCut,         // the connection ended without [DONE] or an error event
  kNoConnect,   // no connection (or no response head)
  kHung,        // nothing ended it before its deadline
  kClosed,      // the client closed it on purpose
};

const char* EndName(End e) {
  switch (e) {
    case End::kOk: return "ok";
    case End::kErrorEvent: return "error event";
    case End::kRefused: return "refused with Retry-After";
    case End::kBadStatus: return "bad status";
    case End::kCut: return "cut";
    case End::kNoConnect: return "no connection";
    case End::kHung: return "hung";
    case End::kClosed: return "closed by the client";
  }
  return "?";
}

struct Outcome {
  End end = End::kHung;
  int status = 0;
  Clock::time_point start, finish;
  bool got_token = false;
  std::vector<int32_t> tokens;
  int retry_after = 0;
  bool wrong_tokens = false;  // finished, but not with the golden tokens
  std::string detail;
};

// One streamed completion. `close_after` > 0: the client closes the connection after that many token events.
Outcome Stream(int port, const std::string& body, Clock::duration limit, int close_after = 0) {
  Outcome o;
  o.start = Clock::now();
  const auto deadline = o.start + limit;
  SseStream s;
  const bool opened = s.Open(port, "/v1/completions", body);
  auto done = [&](End e, std::string detail = "") {
    o.end = e;
    o.detail = std::move(detail);
    o.finish = Clock::now();
    return o;
  };
  if (!opened) return done(End::kNoConnect);
  o.status = s.status();
  if (o.status != 200) {
    o.retry_after = std::atoi(s.header("retry-after").c_str());
    const std::string text = s.ReadBody(5s);
    const bool refusal = (o.status == 503 || o.status == 429) && o.retry_after > 0;
    return done(refusal ? End::kRefused : End::kBadStatus, text.substr(0, 300));
  }
  int events = 0;
  std::string finish_reason;
  while (Clock::now() < deadline) {
    const std::string ev = s.NextEvent(200ms);
    if (ev.empty()) {
      if (s.eof()) return done(End::kCut, "after " + std::to_string(events) + " events");
      continue;
    }
    if (ev == "[DONE]") {
      return finish_reason.empty() ? done(End::kCut, "[DONE] without a finish_reason") : done(End::kOk);
    }
    const json j = json::parse(ev, nullptr, false);
    if (j.is_discarded()) return done(End::kCut, "unparsable event: " + ev.substr(0, 200));
    if (j.contains("error")) return done(End::kErrorEvent, j["error"].dump().substr(0, 300));
    if (!j.contains("choices") || j["choices"].empty()) continue;
    const json& c = j["choices"][0];
    if (c.contains("token_ids") && c["token_ids"].is_array()) {
      for (const json& t : c["token_ids"]) o.tokens.push_back(t.get<int32_t>());
      if (!c["token_ids"].empty()) {
        o.got_token = true;
        ++events;
      }
    }
    if (c.contains("finish_reason") && c["finish_reason"].is_string()) finish_reason = c["finish_reason"];
    if (close_after > 0 && events >= close_after) {
      s.Close();
      return done(End::kClosed);
    }
  }
  return done(End::kHung);
}

// 128 clients, each sending streamed completions of the golden prompts one after another until told to stop.
class Load {
 public:
  Load(int port, const Goldens& goldens, int max_tokens) : port_(port), goldens_(goldens), max_tokens_(max_tokens) {}
  ~Load() { Stop(); }

  void Start() {
    for (int i = 0; i < kStreams; ++i) {
      threads_.emplace_back([this, i] {
        for (int k = 0; !stop_.load(); ++k) {
          in_flight_.fetch_add(1);
          const GoldenPrompt& g = goldens_[(i + k) % goldens_.size()];
          Outcome o = Stream(port_, CompletionBody(g, max_tokens_, true), 60s);
          in_flight_.fetch_sub(1);
          // Greedy: a finished answer is the golden continuation, whatever happened around it.
          if (o.end == End::kOk && o.tokens != std::vector<int32_t>(g.greedy.begin(), g.greedy.begin() + max_tokens_)) {
            o.wrong_tokens = true;
          }
          std::lock_guard<std::mutex> lk(mu_);
          if (o.end == End::kOk) ++ok_;
          outcomes_.push_back(std::move(o));
        }
      });
    }
  }
  // Clients finish the request they are on, then stop.
  void Stop() {
    stop_ = true;
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

  int ok() {
    std::lock_guard<std::mutex> lk(mu_);
    return ok_;
  }
  int in_flight() const { return in_flight_.load(); }
  std::vector<Outcome> outcomes() {
    std::lock_guard<std::mutex> lk(mu_);
    return outcomes_;
  }

 private:
  const int port_;
  const Goldens& goldens_;
  const int max_tokens_;
  std::atomic<bool> stop_{false};
  std::atomic<int> in_flight_{0};
  std::vector<std::thread> threads_;
  std::mutex mu_;
  int ok_ = 0;
  std::vector<Outcome> outcomes_;
};

// Every finished request of a load answered the golden tokens.
void ExpectGoldenAnswers(const std::vector<Outcome>& outcomes) {
  int ok = 0, wrong = 0;
  for (const Outcome& o : outcomes) {
    ok += o.end == End::kOk;
    wrong += o.wrong_tokens;
  }
  EXPECT_EQ(wrong, 0) << "of " << ok << " finished requests";
}

// Waits until `done` holds, checking every 100 ms, up to `timeout`.
template <typename F>
bool WaitUntil(F done, Clock::duration timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(100ms);
  }
  return done();
}

// The load runs: at least `min_ok` requests finished and most clients are mid-request.
void WarmUp(Load& load, const Stack& stack, int min_ok = 2 * kStreams) {
  ASSERT_TRUE(WaitUntil([&] { return load.ok() >= min_ok && load.in_flight() >= kStreams * 3 / 4; }, 90s))
      << "ok " << load.ok() << ", in flight " << load.in_flight() << "\n"
      << stack.Logs();
}

// /health answers 200 with both workers up.
bool BothWorkersUp(int port) {
  const HttpResponse r = HttpCall(port, "GET", "/health", "", {}, 2s);
  if (r.status != 200) return false;
  const json j = json::parse(r.body, nullptr, false);
  return !j.is_discarded() && j.value("workers_up", 0) == 2;
}

// The sum of numoe_worker_active_sequences over the workers in /metrics (-1 when /metrics does not answer).
int64_t ActiveSequences(int port) {
  const HttpResponse r = HttpCall(port, "GET", "/metrics", "", {}, 2s);
  if (r.status != 200) return -1;
  // No worker line at all counts as none active.
  return std::max<int64_t>(0, std::llround(MetricSum(r.body, "numoe_worker_active_sequences")));
}

// Every golden prompt, once streamed and once not, greedy, 32 tokens: the goldens' continuations.
void ExpectGoldens(int port, const Goldens& goldens) {
  for (const GoldenPrompt& g : goldens) {
    const Outcome o = Stream(port, CompletionBody(g, static_cast<int>(g.greedy.size()), true), 60s);
    EXPECT_EQ(o.end, End::kOk) << g.name << ": " << EndName(o.end) << " " << o.detail;
    EXPECT_EQ(o.tokens, g.greedy) << g.name << " streamed";
    const HttpResponse r =
        HttpCall(port, "POST", "/v1/completions", CompletionBody(g, static_cast<int>(g.greedy.size()), false));
    ASSERT_EQ(r.status, 200) << r.body;
    const json j = json::parse(r.body, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << r.body;
    EXPECT_EQ(j["choices"][0]["token_ids"].get<std::vector<int32_t>>(), g.greedy) << g.name << " unstreamed";
  }
}

// The requests in flight at `t` (started before, not finished): each ended within kErrorBound of `t`, either
// with its answer or with a clear error. Returns how many ended with an error.
int ExpectClearEnds(const std::vector<Outcome>& outcomes, Clock::time_point t, const std::string& what,
                    const std::string& logs) {
  int errors = 0, in_flight = 0, shown = 0;
  for (const Outcome& o : outcomes) {
    if (o.start >= t || o.finish < t) continue;
    ++in_flight;
    const bool clear = o.end == End::kOk || o.end == End::kErrorEvent || o.end == End::kRefused;
    const bool prompt = o.finish - t <= kErrorBound;
    if (o.end != End::kOk) ++errors;
    if ((!clear || !prompt) && shown++ < 10) {
      ADD_FAILURE() << what << ": a request in flight ended " << EndName(o.end) << " (status " << o.status << ", "
                    << o.detail << ") " << Secs(o.finish - t) << " s after it";
    }
  }
  double latest = 0;
  for (const Outcome& o : outcomes) {
    if (o.start < t && o.finish >= t) latest = std::max(latest, Secs(o.finish - t));
  }
  std::map<std::string, int> ends;
  for (const Outcome& o : outcomes) {
    if (o.start < t && o.finish >= t) ++ends[EndName(o.end)];
  }
  std::string how;
  for (const auto& [name, n] : ends) how += (how.empty() ? "" : ", ") + std::to_string(n) + " " + name;
  std::printf("%s: %d requests in flight (%s), the last ended %.2f s after it\n", what.c_str(), in_flight, how.c_str(),
              latest);
  EXPECT_GT(in_flight, kStreams / 2) << what << ": too few requests were in flight";
  if (shown > 0) ADD_FAILURE() << shown << " requests did not end well; the logs:\n" << logs;
  return errors;
}

// Requests that had not started at a fault: sent now, each retried after Retry-After (or a second, when
// there was no connection) until it succeeds; all succeed within `timeout`.
void ExpectPatientClientsSucceed(int port, const Goldens& goldens, Clock::duration timeout, const std::string& logs) {
  std::vector<Outcome> last(kStreams);
  std::vector<int> tries(kStreams, 0);
  std::vector<std::thread> threads;
  const auto deadline = Clock::now() + timeout;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      const GoldenPrompt& g = goldens[i % goldens.size()];
      while (Clock::now() < deadline) {
        ++tries[i];
        last[i] = Stream(port, CompletionBody(g, 16, true), 30s);
        if (last[i].end == End::kOk) return;
        std::this_thread::sleep_for(last[i].retry_after > 0 ? std::chrono::seconds(last[i].retry_after) : 1s);
      }
    });
  }
  for (auto& t : threads) t.join();
  int failed = 0;
  for (int i = 0; i < kStreams; ++i) {
    if (last[i].end == End::kOk) {
      const GoldenPrompt& g = goldens[i % goldens.size()];
      EXPECT_EQ(last[i].tokens, std::vector<int32_t>(g.greedy.begin(), g.greedy.begin() + 16)) << g.name;
      continue;
    }
    if (failed++ < 5) {
      ADD_FAILURE() << "client " << i << " did not succeed in " << tries[i] << " tries: " << EndName(last[i].end)
                    << " (status " << last[i].status << ", " << last[i].detail << ")";
    }
  }
  int most = 0;
  for (int t : tries) most = std::max(most, t);
  std::printf("%d patient clients: %d failed, at most %d tries\n", kStreams, failed, most);
  if (failed > 0) ADD_FAILURE() << failed << " of " << kStreams << " clients failed; the logs:\n" << logs;
}

// ---- the faults ---------------------------------------------------------------------------------------------

class Chaos : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(goldens_, Goldens::Load(TinyDir()));
    ASSERT_EQ(goldens_.size(), 4u);
  }

  // serve started (logs in a temporary directory named after `name`); with `load`, kStreams clients busy
  // and warmed up.
  void StartStack(const std::string& name, bool load) {
    tmp_.emplace(name);
    stack_.emplace(*tmp_);
    ASSERT_NO_FATAL_FAILURE(stack_->Start());
    if (!load) return;
    load_.emplace(stack_->http(), goldens_, 32);
    load_->Start();
    ASSERT_NO_FATAL_FAILURE(WarmUp(*load_, *stack_));
  }

  // The processes named `name` (there must be `count`); the first gets `sig`.
  std::vector<pid_t> Signal(const std::string& name, size_t count, int sig) {
    std::vector<pid_t> pids = stack_->Find(name);
    EXPECT_EQ(pids.size(), count) << name;
    if (pids.size() != count) return {};
    EXPECT_EQ(kill(pids[0], sig), 0) << name;
    return pids;
  }

  // After a fault: both workers up again, the goldens, and SIGTERM to serve leaves nothing behind.
  void ExpectRecovered() {
    ASSERT_TRUE(WaitUntil([&] { return BothWorkersUp(stack_->http()); }, 60s)) << stack_->Logs();
    ExpectGoldens(stack_->http(), goldens_);
    stack_->StopAndExpectNothingLeft();
  }

  Goldens goldens_;
  // In this order: the load stops before the stack, the stack before its directory goes.
  std::optional<TempDir> tmp_;
  std::optional<Stack> stack_;
  std::optional<Load> load_;
};

TEST_F(Chaos, KilledGpu) {
  ASSERT_NO_FATAL_FAILURE(StartStack("numoe-chaos-gpu", true));
  const std::vector<pid_t> gpu = Signal("numoe-gpu", 1, SIGKILL);
  ASSERT_FALSE(gpu.empty());
  const auto t0 = Clock::now();
  load_->Stop();
  ExpectGoldenAnswers(load_->outcomes());
  const int errors = ExpectClearEnds(load_->outcomes(), t0, "kill -9 numoe-gpu", stack_->Logs());
  EXPECT_GT(errors, 0) << "no request noticed numoe-gpu's death";
  ExpectPatientClientsSucceed(stack_->http(), goldens_, 90s, stack_->Logs());
  ASSERT_TRUE(WaitUntil([&] { return BothWorkersUp(stack_->http()); }, 60s)) << stack_->Logs();
  stack_->Remember();
  EXPECT_NE(stack_->Find("numoe-gpu"), gpu);
  ExpectRecovered();
}

TEST_F(Chaos, StoppedWorker) {
  ASSERT_NO_FATAL_FAILURE(StartStack("numoe-chaos-stop", true));
  const std::vector<pid_t> workers = Signal("numoe-worker", 2, SIGSTOP);
  ASSERT_FALSE(workers.empty());
  const auto t_stop = Clock::now();
  std::this_thread::sleep_for(5s);
  ASSERT_EQ(kill(workers[0], SIGCONT), 0);
  const auto t_cont = Clock::now();
  // The load goes on through the recovery, then stops.
  std::this_thread::sleep_for(3s);
  load_->Stop();
  const std::vector<Outcome> outcomes = load_->outcomes();
  ExpectGoldenAnswers(outcomes);
  // The other worker kept serving: requests finished during the stop, from its second second on.
  int served = 0;
  for (const Outcome& o : outcomes) served += o.end == End::kOk && o.finish > t_stop + 1s && o.finish < t_cont;
  int errors = 0;
  double latest = 0;
  for (const Outcome& o : outcomes) {
    if (o.finish < t_stop) continue;
    errors += o.end != End::kOk;
    latest = std::max(latest, Secs(o.finish - t_cont));
  }
  std::printf("SIGSTOP: %d requests finished during the stop, %d ended with an error, the last %.2f s after the "
              "SIGCONT\n", served, errors, latest);
  EXPECT_GT(served, kStreams / 4) << "requests finished while worker " << workers[0] << " was stopped\n"
                                  << stack_->Logs();
  // No request hung: those in flight at the stop, and all sent after it, ended well within 10 s of the SIGCONT.
  int shown = 0;
  for (const Outcome& o : outcomes) {
    if (o.finish < t_stop) continue;
    const bool clear = o.end == End::kOk || o.end == End::kErrorEvent || o.end == End::kRefused;
    if ((!clear || o.finish > t_cont + kErrorBound) && shown++ < 10) {
      ADD_FAILURE() << "a request ended " << EndName(o.end) << " (status " << o.status << ", " << o.detail << ") "
                    << Secs(o.finish - t_cont) << " s after the SIGCONT";
    }
  }
  if (shown > 0) ADD_FAILURE() << "the logs:\n" << stack_->Logs();
  ExpectRecovered();
}

TEST_F(Chaos, KilledRouter) {
  ASSERT_NO_FATAL_FAILURE(StartStack("numoe-chaos-router", true));
  const std::vector<pid_t> router = Signal("numoe-router", 1, SIGKILL);
  ASSERT_FALSE(router.empty());
  const auto t0 = Clock::now();
  load_->Stop();
  ExpectGoldenAnswers(load_->outcomes());
  // The router's own connections die with it; none may hang.
  for (const Outcome& o : load_->outcomes()) {
    if (o.finish >= t0) {
      EXPECT_LE(o.finish - t0, kErrorBound) << EndName(o.end) << " " << o.detail;
    }
  }
  // serve brings it back on its port: new connections succeed.
  ASSERT_TRUE(WaitUntil([&] { return BothWorkersUp(stack_->http()); }, 60s)) << stack_->Logs();
  stack_->Remember();
  EXPECT_NE(stack_->Find("numoe-router"), router);
  // The workers freed the sequences of the dead router's calls.
  EXPECT_TRUE(WaitUntil([&] { return ActiveSequences(stack_->http()) == 0; }, 15s))
      << "active sequences " << ActiveSequences(stack_->http()) << "\n" << stack_->Logs();
  ExpectPatientClientsSucceed(stack_->http(), goldens_, 60s, stack_->Logs());
  ExpectRecovered();
}

TEST_F(Chaos, ClientsDisconnect) {
  ASSERT_NO_FATAL_FAILURE(StartStack("numoe-chaos-disconnect", false));
  Stack& stack = *stack_;
  // Long requests, each abandoned by its client: a quarter right after sending, the others after two token
  // events, once the gauge has seen them running.
  std::vector<std::string> failures(kStreams);
  std::vector<std::thread> threads;
  std::atomic<bool> release{false};
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      const std::string body = CompletionBody(goldens_[i % goldens_.size()], 600, true);
      if (i % 4 == 0) {
        (void)HttpCall(stack.http(), "POST", "/v1/completions", body, {}, 0ms);  // sends and closes at once
        return;
      }
      SseStream s;
      if (!s.Open(stack.http(), "/v1/completions", body) || s.status() != 200) {
        failures[i] = "status " + std::to_string(s.status());
        return;
      }
      for (int events = 0; events < 2;) {
        const std::string ev = s.NextEvent(60s);
        if (ev.empty() || ev == "[DONE]" || ev.find("\"error\"") != std::string::npos) {
          failures[i] = "the stream ended early: " + ev;
          return;
        }
        ++events;
      }
      while (!release.load()) std::this_thread::sleep_for(10ms);
      s.Close();
    });
  }
  // While the streams run the gauge counts them (it lags by a health interval).
  EXPECT_TRUE(WaitUntil([&] { return ActiveSequences(stack.http()) >= kStreams / 2; }, 60s))
      << ActiveSequences(stack.http()) << "\n" << stack.Logs();
  release = true;
  for (auto& t : threads) t.join();
  for (const std::string& f : failures) EXPECT_EQ(f, "");
  EXPECT_TRUE(WaitUntil([&] { return ActiveSequences(stack.http()) == 0; }, 15s))
      << "active sequences " << ActiveSequences(stack.http()) << "\n" << stack.Logs();
  // numoe-gpu freed them too.
  const std::vector<pid_t> gpu = stack.Find("numoe-gpu");
  ASSERT_EQ(gpu.size(), 1u);
  auto stub = v1::GpuService::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(Stack::PortOf(gpu[0])),
                                                          grpc::InsecureChannelCredentials()));
  v1::GpuStats stats;
  EXPECT_TRUE(WaitUntil(
      [&] {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
        return stub->Stats(&ctx, v1::GpuStatsRequest(), &stats).ok() && stats.sequences() == 0;
      },
      15s))
      << stats.DebugString();
  ExpectRecovered();
}

}  // namespace
}  // namespace numoe::test
