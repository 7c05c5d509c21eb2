// numoe-bench soak: `numoe serve` under a steady mixed REST load for --seconds, watching every process of the
// served tree for leaks and every request for errors.
//
//   1. `numoe serve` as a child (bench/serve_harness.h: own process group, free loopback ports, logs in
//      --log-dir), waiting for its ready line.
//   2. Warm-up: --concurrency clients for --warmup seconds; then the clients pause, the stack is let come to
//      rest (no request in flight or queued in the router, no active sequence on any worker) and every process
//      of serve's group is sampled: the baseline.
//   3. The soak: the clients for --seconds. Each client sends one request after another, the next kind of a
//      fixed rotation: streamed completion, unstreamed completion, streamed chat completion, unstreamed chat
//      completion, and a cancelled one (a streamed completion whose client closes the connection after the
//      first token event, or, every other time, right after sending). Prompts are text of a few to a few dozen
//      words, max_tokens varies from 4 to --max-tokens, EOS is ignored, sampling is greedy or at temperature 0.8.
//      RSS, open fds and threads of every process of the group (/proc/<pid>/status, /proc/<pid>/fd) are
//      sampled every --sample-interval seconds (the peaks).
//   4. The clients stop; once the stack is at rest again every process is sampled (the final sample) and
//      serve is stopped (SIGTERM; SIGKILL of its group after 30 s).
// It fails (exit 1) on any request error (a non-2xx status, an SSE error event, a stream that ends without
// [DONE] or a finish_reason, usage.completion_tokens other than max_tokens), on a process of the tree that
// exited or was replaced (a restart), on a stack that does not come to rest within 30 s of the load stopping
// (leaked sequences), and on growth from the baseline to the final sample past the bounds, per process:
// --max-rss-growth-mib, --max-fd-growth, --max-thread-growth. numoe-gpu's RSS growth is counted less the growth
// of its prefix cache, both tiers (numoe_prefix_cache_bytes in /metrics, tier "backend" and "host"): the
// soak's prompts are all new, so the cache fills with them up to its bounds, which is memory held by design.
// The host tier gets 32 MiB rather than its default of GBs (see RunSoakBench).
// The last line is one JSON object: {"ok", "seconds", "concurrency", "requests", "errors", "cancelled", ...}.
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench/commands.h"
#include "bench/serve_harness.h"
#include "common/args.h"
#include "common/choices.h"
#include "common/hash.h"
#include "nlohmann/json.hpp"

namespace numoe::bench {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

double SecondsSince(Clock::time_point t0) { return Since(t0, Clock::now()); }

// ---- the serve tree in /proc ----------------------------------------------------------------------------

struct ProcSample {
  pid_t pid = 0;
  std::string name;  // comm, and the worker id for workers ("numoe-worker worker-1")
  int64_t rss_kb = 0;
  int64_t fds = 0;
  int64_t threads = 0;
};

std::string Slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// Every live process of process group `pgid`, by name.
std::map<std::string, ProcSample> SampleGroup(pid_t pgid) {
  std::map<std::string, ProcSample> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const std::string dir = e.path().string(), base = e.path().filename().string();
    if (base.empty() || !std::isdigit(static_cast<unsigned char>(base[0]))) continue;
    // /proc/<pid>/stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces and parentheses.
    const std::string stat = Slurp(dir + "/stat");
    const size_t open_paren = stat.find('('), close_paren = stat.rfind(')');
    if (open_paren == std::string::npos || close_paren == std::string::npos) continue;
    std::istringstream rest(stat.substr(close_paren + 2));
    std::string state;
    long ppid = 0, pgrp = 0;
    rest >> state >> ppid >> pgrp;
    if (pgrp != pgid || state == "Z") continue;
    ProcSample s;
    s.pid = static_cast<pid_t>(std::stol(base));
    s.name = stat.substr(open_paren + 1, close_paren - open_paren - 1);
    const std::string cmd = Slurp(dir + "/cmdline");
    const std::string flag = std::string("--worker-id") + '\0';
    if (size_t at = cmd.find(flag); at != std::string::npos) s.name += " " + std::string(cmd.c_str() + at + flag.size());
    std::istringstream status(Slurp(dir + "/status"));
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("VmRSS:", 0) == 0) s.rss_kb = std::atoll(line.c_str() + 6);
      if (line.rfind("Threads:", 0) == 0) s.threads = std::atoll(line.c_str() + 8);
    }
    for (const auto& fd : fs::directory_iterator(dir + "/fd", ec)) {
      (void)fd;
      ++s.fds;
    }
    out[s.name] = s;
  }
  return out;
}

// ---- the load -----------------------------------------------------------------------------------------------

enum class Kind { kStreamCompletion, kCompletion, kStreamChat, kChat, kCancelled };
constexpr int kKinds = 5;
constexpr const char* kKindNames[kKinds] = {"completion_stream", "completion", "chat_stream", "chat", "cancelled"};

// The same requests on every run.
uint64_t Mix(uint64_t x) { return SplitMix64(x); }

std::string Words(uint64_t seed) {
  static const char* kWords[] = {"the", "river", "quiet", "machine", "counts", "every", "star", "over", "seven",
                                 "bridges", "while", "a", "cat", "sleeps", "near", "warm", "bread", "and", "tea"};
  const int n = 3 + static_cast<int>(Mix(seed) % 40);
  std::string s;
  for (int i = 0; i < n; ++i) {
    if (i > 0) s += ' ';
    s += kWords[Mix(seed * 131 + i) % (sizeof(kWords) / sizeof(kWords[0]))];
  }
  return s;
}

struct Totals {
  int64_t requests[kKinds] = {};
  int64_t errors = 0;
  int64_t tokens = 0;
  std::vector<std::string> first_errors;  // the first few, for the report
};

class Clients {
 public:
  Clients(int port, int concurrency, int64_t max_tokens, double request_timeout_s)
      : port_(port), concurrency_(concurrency), max_tokens_(max_tokens), request_timeout_s_(request_timeout_s) {}
  ~Clients() { Stop(); }

  void Start() {
    stop_ = false;
    for (int i = 0; i < concurrency_; ++i) {
      threads_.emplace_back([this, i] {
        while (!stop_.load()) {
          const uint64_t n = next_.fetch_add(1);
          One(static_cast<Kind>(n % kKinds), n * 7919 + static_cast<uint64_t>(i));
        }
      });
    }
  }
  // Each client finishes the request it is on.
  void Stop() {
    stop_ = true;
    for (auto& t : threads_) t.join();
    threads_.clear();
  }
  Totals totals() {
    std::lock_guard<std::mutex> lk(mu_);
    return totals_;
  }

 private:
  void Error(Kind kind, const std::string& what) {
    std::lock_guard<std::mutex> lk(mu_);
    ++totals_.errors;
    if (totals_.first_errors.size() < 10) totals_.first_errors.push_back(absl::StrCat(kKindNames[int(kind)], ": ", what));
  }

  void One(Kind kind, uint64_t seed) {
    const int64_t max_tokens = 4 + static_cast<int64_t>(Mix(seed ^ 0x5eed) % std::max<int64_t>(1, max_tokens_ - 3));
    const bool chat = kind == Kind::kStreamChat || kind == Kind::kChat;
    const bool stream = kind != Kind::kCompletion && kind != Kind::kChat;
    json body = {{"max_tokens", max_tokens}, {"ignore_eos", true}, {"stream", stream}};
    if (Mix(seed) % 2 == 0) {
      body["temperature"] = 0.0;
    } else {
      body["temperature"] = 0.8;
      body["seed"] = seed % 100000;
    }
    if (chat) {
      body["messages"] = json::array({{{"role", "user"}, {"content", Words(seed)}}});
    } else {
      body["prompt"] = Words(seed);
    }
    if (stream) body["stream_options"] = {{"include_usage", true}};
    const std::string path = chat ? "/v1/chat/completions" : "/v1/completions";
    const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(request_timeout_s_ * 1000));
    {
      std::lock_guard<std::mutex> lk(mu_);
      ++totals_.requests[int(kind)];
    }
    SseClient client;
    if (kind == Kind::kCancelled && seed % 2 == 0) {  // gone before any answer
      if (Status st = client.Send(port_, path, body.dump()); !st.ok()) Error(kind, std::string(st.message()));
      return;
    }
    if (Status st = client.Open(port_, path, body.dump(), deadline); !st.ok()) {
      Error(kind, std::string(st.message()));
      return;
    }
    if (!stream) {
      auto text = client.ReadAll(deadline);
      if (!text.ok()) return Error(kind, std::string(text.status().message()));
      const json j = json::parse(*text, nullptr, false);
      if (j.is_discarded() || !j.contains("choices") || j["choices"].empty()) {
        return Error(kind, "unparsable answer: " + text->substr(0, 200));
      }
      if (!j["choices"][0]["finish_reason"].is_string()) return Error(kind, "no finish_reason: " + text->substr(0, 200));
      return Usage(kind, j, max_tokens);
    }
    std::string finish;
    for (;;) {
      auto next = client.Next(deadline);
      if (!next.ok()) return Error(kind, std::string(next.status().message()));
      if (!next->has_value()) return Error(kind, "the stream ended without [DONE]");
      if (**next == "[DONE]") break;
      const json j = json::parse(**next, nullptr, false);
      if (j.is_discarded()) return Error(kind, "unparsable event: " + (*next)->substr(0, 200));
      if (j.contains("error")) return Error(kind, "error event: " + j["error"].dump());
      if (kind == Kind::kCancelled) {
        client.Close();  // the client gives up after the first event
        return;
      }
      if (j.contains("choices") && !j["choices"].empty() && j["choices"][0]["finish_reason"].is_string()) {
        finish = j["choices"][0]["finish_reason"];
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        if (finish.empty()) return Error(kind, "usage before any finish_reason");
        Usage(kind, j, max_tokens);
      }
    }
    if (finish.empty()) Error(kind, "[DONE] without a finish_reason");
  }

  void Usage(Kind kind, const json& j, int64_t max_tokens) {
    const int64_t got = j.contains("usage") && j["usage"].is_object() ? j["usage"].value("completion_tokens", -1) : -1;
    if (got != max_tokens) {
      return Error(kind, absl::StrCat("usage.completion_tokens ", got, ", expected max_tokens ", max_tokens));
    }
    std::lock_guard<std::mutex> lk(mu_);
    totals_.tokens += got;
  }

  const int port_;
  const int concurrency_;
  const int64_t max_tokens_;
  const double request_timeout_s_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> next_{0};
  std::vector<std::thread> threads_;
  std::mutex mu_;
  Totals totals_;
};

// ---- rest -----------------------------------------------------------------------------------------------------

// At rest: the router has nothing in flight or queued and no worker reports an active or queued sequence
// (numoe_worker_*_sequences in /metrics, from each worker's last Stats answer). Empty when it got there
// within `timeout_s`, else what is still busy.
std::string WaitForRest(int port, double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  std::string busy = "no answer";
  int quiet = 0;
  while (Clock::now() < deadline) {
    busy.clear();
    SseClient health, metrics;
    const auto call_deadline = Clock::now() + std::chrono::seconds(5);
    auto h = health.Open(port, "/health", "", call_deadline, "GET");
    auto hb = h.ok() ? health.ReadAll(call_deadline) : StatusOr<std::string>(h);
    auto m = metrics.Open(port, "/metrics", "", call_deadline, "GET");
    auto mb = m.ok() ? metrics.ReadAll(call_deadline) : StatusOr<std::string>(m);
    if (!hb.ok() || !mb.ok()) {
      busy = std::string((!hb.ok() ? hb.status() : mb.status()).message());
    } else {
      const json j = json::parse(*hb, nullptr, false);
      if (j.is_discarded()) {
        busy = "unparsable /health";
      } else {
        if (j.value("queued", 0) != 0) busy += absl::StrCat(" router queue ", j.value("queued", 0), ";");
        for (const json& w : j.value("worker_list", json::array())) {
          if (w.value("in_flight", 0) != 0) busy += absl::StrCat(" ", w.value("address", ""), " in flight ", w.value("in_flight", 0), ";");
        }
      }
      std::istringstream in(*mb);
      for (std::string line; std::getline(in, line);) {
        if ((line.rfind("numoe_worker_active_sequences{", 0) == 0 || line.rfind("numoe_worker_queued_sequences{", 0) == 0) &&
            std::atof(line.c_str() + line.rfind(' ') + 1) != 0) {
          busy += " " + line + ";";
        }
      }
    }
    // Two quiet looks a health interval apart: the worker gauges come from the last health check.
    quiet = busy.empty() ? quiet + 1 : 0;
    if (quiet >= 2) return "";
    std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  }
  return busy.empty() ? "still settling" : busy;
}

// The bytes numoe-gpu's prefix cache holds, per tier (numoe_prefix_cache_bytes{worker,tier} in /metrics:
// every worker of the one numoe-gpu reports the same cache, as of its last step, so the largest figure of any
// worker is the latest); 0 with the cache off, no host tier or no answer.
struct CacheBytes {
  int64_t backend = 0, host = 0;
  int64_t total() const { return backend + host; }
};

CacheBytes PrefixCacheBytes(int port) {
  SseClient metrics;
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  auto m = metrics.Open(port, "/metrics", "", deadline, "GET");
  auto body = m.ok() ? metrics.ReadAll(deadline) : StatusOr<std::string>(m);
  CacheBytes bytes;
  if (!body.ok()) return bytes;
  std::istringstream in(*body);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("numoe_prefix_cache_bytes{", 0) != 0) continue;
    const int64_t v = std::atoll(line.c_str() + line.rfind(' ') + 1);
    int64_t& tier = line.find("tier=\"host\"") != std::string::npos ? bytes.host : bytes.backend;
    tier = std::max(tier, v);
  }
  return bytes;
}

}  // namespace

int RunSoakBench(int argc, char** argv) {
  std::string model, backend = "cpu";
  double seconds = 60, warmup = 10, sample_interval = 1;
  int64_t concurrency = 64, workers = 2, threads = 0, max_seqs = 0, max_tokens = 16;
  double max_rss_growth_mib = 64;
  int64_t max_fd_growth = 16, max_thread_growth = 8;
  ServeBenchFlags common{.request_timeout = 600};
  ArgParser p(argv[0],
              "Soak `numoe serve`: a steady mixed REST load (streamed and unstreamed, completions and chat, cancelled\n"
              "requests) for --seconds, sampling RSS, open fds and threads of every process of the served tree.\n"
              "Fails (exit 1) on any request error, a restarted process, or growth past the bounds after warm-up.");
  p.AddString("model", "DIR", "checkpoint directory", &model, true);
  p.AddDouble("seconds", "S", "length of the soak after the warm-up", &seconds, 1, 7 * 86400);
  p.AddInt("concurrency", "C", "clients sending requests at once", &concurrency, 1, 4096);
  p.AddDouble("warmup", "S", "seconds of load before the baseline sample", &warmup, 0, 86400);
  p.AddInt("workers", "N", "numoe serve --workers", &workers, 1, 64);
  p.AddInt("threads", "N", "numoe serve --threads-per-worker (0 = the worker's CPUs)", &threads, 0, 4096);
  p.AddInt("max-seqs", "N", "numoe serve --max-seqs (0 = the workers' default)", &max_seqs, 0, 4096);
  p.AddInt("max-tokens", "T", "largest max_tokens of a request (each asks for 4 to T, EOS ignored)", &max_tokens, 4,
           1 << 20);
  p.AddString("backend", "cpu|cuda", "numoe serve --backend", &backend);
  p.AddDouble("sample-interval", "S", "seconds between samples of the processes during the soak", &sample_interval,
              0.05, 3600);
  p.AddDouble("max-rss-growth-mib", "M", "fail when a process's RSS at rest grew by more than M MiB after warm-up",
              &max_rss_growth_mib, 0, 1 << 30);
  p.AddInt("max-fd-growth", "N", "fail when a process's open fds at rest grew by more than N after warm-up",
           &max_fd_growth, 0, 1 << 20);
  p.AddInt("max-thread-growth", "N", "fail when a process's threads at rest grew by more than N after warm-up",
           &max_thread_growth, 0, 1 << 20);
  AddServeBenchFlags(p, &common, "a request that takes longer than this is an error");
  p.AddEpilog(
      "\nExample (the CI run on the tiny fixture):\n"
      "  numoe-bench soak --model tests/data/tiny-v4 --seconds 60 --concurrency 256 --max-seqs 64\n");
  int rc = 0;
  if (!p.ParseOrExit(argc, argv, &rc)) return rc;
  const auto fail = [&](const Status& st) { return BenchFail(argv[0], st); };
  auto say = [&](const std::string& line) { BenchSay(common.json_only, line); };
  if (!fs::exists(fs::path(model) / "config.json")) {
    return fail(absl::NotFoundError(absl::StrCat("--model: ", model, "/config.json does not exist")));
  }

  // 1. The served stack.
  const std::string& log_dir = common.MakeLogDir("soak");
  ServeSpec spec{.model = model, .backend = backend, .spec = "auto", .log_dir = log_dir, .workers = workers,
                 .threads = threads, .affinity_prefix_tokens = 64};  // the router's default affinity
  if (max_seqs > 0) spec.extra = {"--max-seqs", std::to_string(max_seqs)};
  // numoe-gpu's prefix cache fills up to its bounds, which is growth but no leak, and both tiers' bytes are
  // counted out of numoe-gpu's RSS growth. Its first tier reaches its checkpoint count during the warm-up.
  // The host tier keeps a bound of 32 MiB, which it reaches there too, instead of its default (8 GiB): with
  // every soak prompt new, the default tier would grow by GBs over the soak (on tiny-v4 a host checkpoint is
  // ~0.08 MiB, two a request at ~40 requests/s on 2 cores: ~400 MiB a minute), so the check would compare two
  // RSS figures GBs apart against a bound of tens of MiB and the run would take that much RAM from the
  // machine; at its bound the host tier's share of the growth is ~0, and the RSS check sees what numoe-gpu
  // gains besides the cache.
  spec.extra.insert(spec.extra.end(), {"--prefix-cache-host-gb", "0.03125"});
  auto cmd = ServeCommand(spec);
  if (!cmd.ok()) return fail(cmd.status());
  const std::vector<std::string>& serve_argv = cmd->argv;
  const int port = cmd->port;
  say("starting: " + absl::StrJoin(serve_argv, " "));
  ServeProcess serve;
  const auto t_start = Clock::now();
  if (Status st = serve.Start(serve_argv, log_dir + "/serve.log"); !st.ok()) return fail(st);
  auto ready = serve.WaitReady(common.startup_timeout);
  if (!ready.ok()) return fail(ready.status());
  say(absl::StrCat("ready in ", Fmt(SecondsSince(t_start), 1), " s: ", *ready));
  const pid_t pgid = serve.pid();

  std::vector<std::string> problems;  // what makes the run fail, besides request errors
  Clients clients(port, static_cast<int>(concurrency), max_tokens, common.request_timeout);

  // 2. Warm-up, rest, baseline.
  clients.Start();
  std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(warmup * 1000)));
  clients.Stop();
  const Totals warm = clients.totals();
  int64_t warm_requests = 0;
  for (int64_t n : warm.requests) warm_requests += n;
  say(absl::StrCat("warm-up: ", Fmt(warmup, 0), " s at ", concurrency, " clients, ", warm_requests, " requests, ",
                   warm.errors, " errors"));
  if (std::string busy = WaitForRest(port, 30); !busy.empty()) {
    problems.push_back("not at rest 30 s after the warm-up: " + busy);
  }
  const std::map<std::string, ProcSample> base = SampleGroup(pgid);
  const CacheBytes base_cache = PrefixCacheBytes(port);
  std::map<std::string, ProcSample> peak = base;

  // 3. The soak, sampling.
  const auto t_soak = Clock::now();
  clients.Start();
  auto next_report = t_soak + std::chrono::seconds(10);
  while (SecondsSince(t_soak) < seconds) {
    std::this_thread::sleep_for(std::chrono::milliseconds(
        static_cast<int64_t>(std::min(sample_interval, seconds - SecondsSince(t_soak)) * 1000) + 1));
    const auto now = SampleGroup(pgid);
    for (const auto& [name, b] : base) {
      auto it = now.find(name);
      if (it == now.end() || it->second.pid != b.pid) {
        const std::string what = it == now.end() ? absl::StrCat(name, " (pid ", b.pid, ") exited")
                                                 : absl::StrCat(name, " was restarted (pid ", b.pid, " -> ", it->second.pid, ")");
        if (std::find(problems.begin(), problems.end(), what) == problems.end()) problems.push_back(what);
        continue;
      }
      ProcSample& pk = peak[name];
      pk.rss_kb = std::max(pk.rss_kb, it->second.rss_kb);
      pk.fds = std::max(pk.fds, it->second.fds);
      pk.threads = std::max(pk.threads, it->second.threads);
    }
    if (Clock::now() >= next_report) {
      next_report += std::chrono::seconds(10);
      const Totals t = clients.totals();
      int64_t n = 0;
      for (int64_t k : t.requests) n += k;
      say(absl::StrCat("  ", Fmt(SecondsSince(t_soak), 0), " s: ", n - warm_requests, " requests, ", t.errors, " errors"));
    }
  }
  clients.Stop();
  const double soak_s = SecondsSince(t_soak);

  // 4. Rest, the final sample, stop.
  if (std::string busy = WaitForRest(port, 30); !busy.empty()) {
    problems.push_back("not at rest 30 s after the load stopped (leaked sequences?): " + busy);
  }
  const std::map<std::string, ProcSample> end = SampleGroup(pgid);
  const CacheBytes end_cache = PrefixCacheBytes(port);
  serve.Stop(30.0);
  // The prefix cache fills up to its bounds (--prefix-cache-gb, --prefix-cache-host-gb) as new prompts come:
  // numoe-gpu's growth of its stated bytes, both tiers, is memory it holds by design, not a leak, so it is
  // counted out of numoe-gpu's growth.
  const double cache_growth_mib = std::max<int64_t>(0, end_cache.total() - base_cache.total()) / (1024.0 * 1024.0);

  const Totals all = clients.totals();
  int64_t requests = 0;
  for (int k = 0; k < kKinds; ++k) requests += all.requests[k] - warm.requests[k];
  const int64_t tokens = all.tokens - warm.tokens;
  say("");
  say("process                     pid       rss MiB: rest -> rest (peak)   fds: rest -> rest (peak)   threads: rest -> rest (peak)");
  double rss_growth = 0;
  int64_t fd_growth = 0, thread_growth = 0;
  ordered_json procs = ordered_json::array();
  for (const auto& [name, b] : base) {
    auto it = end.find(name);
    if (it == end.end() || it->second.pid != b.pid) {
      const std::string what = absl::StrCat(name, " (pid ", b.pid, ") is not the same process at the end");
      if (std::find(problems.begin(), problems.end(), what) == problems.end()) problems.push_back(what);
      continue;
    }
    const ProcSample& e = it->second;
    const ProcSample& pk = peak[name];
    const bool is_gpu = name.rfind("numoe-gpu", 0) == 0;
    const double grow_mib = (e.rss_kb - b.rss_kb) / 1024.0 - (is_gpu ? cache_growth_mib : 0);
    rss_growth = std::max(rss_growth, grow_mib);
    fd_growth = std::max(fd_growth, e.fds - b.fds);
    thread_growth = std::max(thread_growth, e.threads - b.threads);
    if (grow_mib > max_rss_growth_mib) {
      problems.push_back(absl::StrCat(name, ": RSS grew by ", Fmt(grow_mib, 1), " MiB",
                                      is_gpu ? " besides its prefix cache" : "", " (bound ", max_rss_growth_mib, ")"));
    }
    if (e.fds - b.fds > max_fd_growth) {
      problems.push_back(absl::StrCat(name, ": open fds grew by ", e.fds - b.fds, " (bound ", max_fd_growth, ")"));
    }
    if (e.threads - b.threads > max_thread_growth) {
      problems.push_back(absl::StrCat(name, ": threads grew by ", e.threads - b.threads, " (bound ", max_thread_growth, ")"));
    }
    char line[256];
    std::snprintf(line, sizeof(line), "%-27s %-9d %8.1f -> %-8.1f (%.1f)       %5lld -> %-5lld (%lld)         %4lld -> %-4lld (%lld)",
                  name.c_str(), static_cast<int>(b.pid), b.rss_kb / 1024.0, e.rss_kb / 1024.0,
                  std::max(pk.rss_kb, e.rss_kb) / 1024.0, static_cast<long long>(b.fds), static_cast<long long>(e.fds),
                  static_cast<long long>(std::max(pk.fds, e.fds)), static_cast<long long>(b.threads),
                  static_cast<long long>(e.threads), static_cast<long long>(std::max(pk.threads, e.threads)));
    say(line);
    procs.push_back({{"name", name},
                     {"pid", b.pid},
                     {"rss_mib", {b.rss_kb / 1024.0, e.rss_kb / 1024.0, std::max(pk.rss_kb, e.rss_kb) / 1024.0}},
                     {"rss_growth_mib", grow_mib},  // what the bound is checked against
                     {"fds", {b.fds, e.fds, std::max(pk.fds, e.fds)}},
                     {"threads", {b.threads, e.threads, std::max(pk.threads, e.threads)}}});
  }
  const auto mib = [](int64_t bytes) { return bytes / (1024.0 * 1024.0); };
  say(absl::StrCat("numoe-gpu's prefix cache at rest: ", Fmt(mib(base_cache.total()), 1), " -> ",
                   Fmt(mib(end_cache.total()), 1), " MiB (backend ", Fmt(mib(base_cache.backend), 1), " -> ",
                   Fmt(mib(end_cache.backend), 1), ", host ", Fmt(mib(base_cache.host), 1), " -> ",
                   Fmt(mib(end_cache.host), 1), "; its growth is not counted in numoe-gpu's RSS growth)"));
  say(absl::StrCat("bounds per process, at rest after warm-up vs at rest after the soak: RSS +", max_rss_growth_mib,
                   " MiB, fds +", max_fd_growth, ", threads +", max_thread_growth, "; largest growth: RSS ",
                   Fmt(rss_growth, 1), " MiB, fds ", fd_growth, ", threads ", thread_growth));
  std::vector<std::string> by_kind;
  ordered_json j_kinds = ordered_json::object();
  for (int k = 0; k < kKinds; ++k) {
    by_kind.push_back(absl::StrCat(kKindNames[k], " ", all.requests[k] - warm.requests[k]));
    j_kinds[kKindNames[k]] = all.requests[k] - warm.requests[k];
  }
  say(absl::StrCat("soak: ", Fmt(soak_s, 1), " s at ", concurrency, " clients: ", requests, " requests (",
                   absl::StrJoin(by_kind, ", "), "), ", Fmt(requests / soak_s, 1), " requests/s, ", tokens,
                   " tokens (", Fmt(tokens / soak_s, 1), " tok/s); errors ", all.errors, " (warm-up included)"));
  for (const std::string& e : all.first_errors) say("  error: " + e);
  for (const std::string& pr : problems) say("  FAIL: " + pr);
  const bool ok = all.errors == 0 && problems.empty();
  say(ok ? "soak: OK" : "soak: FAILED");
  std::vector<std::string> reasons = problems;
  reasons.insert(reasons.end(), all.first_errors.begin(), all.first_errors.end());
  const ordered_json out = {{"ok", ok},
                            {"seconds", soak_s},
                            {"warmup_s", warmup},
                            {"concurrency", concurrency},
                            {"requests", requests},
                            {"errors", all.errors},
                            {"cancelled", j_kinds[kKindNames[int(Kind::kCancelled)]]},
                            {"requests_by_kind", j_kinds},
                            {"req_s", requests / soak_s},
                            {"tokens", tokens},
                            {"tok_s", tokens / soak_s},
                            {"rss_growth_mib", rss_growth},
                            {"prefix_cache_mib", {mib(base_cache.total()), mib(end_cache.total())}},  // both tiers
                            {"prefix_cache_host_mib", {mib(base_cache.host), mib(end_cache.host)}},
                            {"fd_growth", fd_growth},
                            {"thread_growth", thread_growth},
                            {"bounds", {{"rss_growth_mib", max_rss_growth_mib},
                                        {"fd_growth", max_fd_growth},
                                        {"thread_growth", max_thread_growth}}},
                            {"processes", procs},
                            {"problems", reasons}};
  std::printf("%s\n", out.dump().c_str());
  return ok ? 0 : 1;
}

}  // namespace numoe::bench
