// numoe-bench decode: end-to-end decode tokens/s through the served stack (`numoe serve`: numoe-gpu, workers,
// router; REST /v1/completions with streaming), next to the bound that this machine's memory bandwidth sets.
//
//   1. the model's routed-expert bytes read per decoded token (ComputeFootprint: top-k experts per layer);
//   2. streaming-read bandwidth on worker-0's CPUs and thread count (the placement `numoe serve --workers N`
//      gives it), over a buffer far larger than the LLC, before the server starts, with the fastest of the
//      yardstick's read loops (read_bandwidth.h; named in the output and as "read_method");
//   3. `numoe serve` as a child process (own process group, free loopback ports, logs in --log-dir, --spec
//      passed through, the router's prefix affinity off: the prompts share no prefix, so C streams spread
//      evenly over the workers by outstanding work), waiting for its ready line; one warm-up request;
//   4. for each concurrency C: C streams at once, each a different random prompt of --prompt-len token ids,
//      `ignore_eos`, `max_tokens` = --max-tokens, greedy. Every SSE event is timestamped on arrival, so
//      prefill (up to each stream's first token) is excluded: the decode rate is the tokens that arrived while
//      every stream was past its first token and none had finished, divided by that window (for C = 1: tokens
//      after the first over the time since the first);
//   5. the server is stopped (SIGTERM, then SIGKILL of its group) and the bandwidth measured again.
//   bound_tok_s = read bandwidth (median of both measurements' passes) / routed bytes per token; ratio =
//   tok_s / bound_tok_s. Batching lets C streams share expert reads, so an aggregate ratio may exceed 1.
// Expert-busy: while serving, every worker's Stats (worker.proto: expert_seconds, the time inside its MoE
// calls) is polled over gRPC (the addresses from the router's /health); a worker's expert-busy fraction in a
// round is its expert seconds over the decode window (the counter interpolated at the window's ends) divided
// by the window. The JSON's "expert_busy" is the least busy worker's, per concurrency.
// --sim-expert-gbps G: every worker simulates its experts at G GB/s (numoe-worker --sim-expert-gbps); no read
// bandwidth is measured and the bound is workers x G / routed bytes per token ("read_gbps" = workers x G).
// --json-schema: every round runs a second time with a response_format json_schema (constrained sampling,
// common/tokenizer/grammar.h; an array of short strings too long to close within --max-tokens, so every
// stream decodes --max-tokens tokens either way), and the JSON adds "constrained_tok_s" and
// "constrained_ratio" (constrained / unconstrained tok/s, per concurrency). The mask time per step is
// measured here on the same code and vocabulary: the constrained streams' tokens are replayed through the
// grammar (GrammarState::Mask and the masking of one logits row, as numoe-gpu's sampler does per step):
// "mask_us_per_step" with the mask cache as served (warm), "mask_cold_us_per_step" for masks computed afresh.
// The last line is one JSON object: {"concurrency", "tok_s", "bound_tok_s", "ratio", "expert_busy", ...}.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench/commands.h"
#include "bench/read_bandwidth.h"
#include "common/args.h"
#include "common/checkpoint.h"
#include "common/numa.h"
#include "common/thread_pool.h"
#include "common/topology.h"
#include "deploy/placement.h"
#include "common/tokenizer/grammar.h"
#include "common/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"
#include "numoe/v1/worker.grpc.pb.h"
#include "worker/service/worker_flags.h"

namespace numoe::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

double Since(Clock::time_point t0, Clock::time_point t1) { return std::chrono::duration<double>(t1 - t0).count(); }

// ---- a minimal HTTP/1.1 client for one streaming POST on loopback ----------------------------------------

class SseClient {
 public:
  ~SseClient() {
    if (fd_ >= 0) ::close(fd_);
  }

  // Connects, sends the request (POST `body`, or GET when `method` says so) and reads the response head.
  // Non-2xx: the body is in the error.
  Status Open(int port, const std::string& path, const std::string& body, Clock::time_point deadline,
              const std::string& method = "POST") {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) return absl::InternalError("socket() failed");
    const int one = 1;
    ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0)
      return absl::UnavailableError(absl::StrCat("connect to 127.0.0.1:", port, ": ", std::strerror(errno)));
    const std::string req = absl::StrCat(method, " ", path, " HTTP/1.1\r\nHost: 127.0.0.1:", port,
                                         "\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n"
                                         "Connection: close\r\nContent-Length: ",
                                         body.size(), "\r\n\r\n", body);
    for (size_t off = 0; off < req.size();) {
      const ssize_t n = ::send(fd_, req.data() + off, req.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return absl::UnavailableError(absl::StrCat("send: ", std::strerror(errno)));
      off += static_cast<size_t>(n);
    }
    size_t end;
    while ((end = raw_.find("\r\n\r\n")) == std::string::npos) RETURN_IF_ERROR(Fill(deadline));
    const std::string head = raw_.substr(0, end);
    raw_.erase(0, end + 4);
    int status = 0;
    if (std::sscanf(head.c_str(), "HTTP/1.%*d %d", &status) != 1)
      return absl::DataLossError("bad HTTP status line: " + head.substr(0, head.find('\r')));
    std::string lower = head;
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    chunked_ = lower.find("transfer-encoding: chunked") != std::string::npos;
    if (status < 200 || status >= 300) {
      while (!eof_ && Fill(deadline).ok()) {
      }
      Decode();
      return absl::FailedPreconditionError(absl::StrCat("HTTP ", status, ": ", body_.substr(0, 500)));
    }
    return absl::OkStatus();
  }

  // The whole (rest of the) body, to the end of the response.
  StatusOr<std::string> ReadAll(Clock::time_point deadline) {
    while (!eof_) RETURN_IF_ERROR(Fill(deadline));
    Decode();
    return std::move(body_);
  }

  // The next SSE "data:" payload, or nullopt at the end of the stream.
  StatusOr<std::optional<std::string>> Next(Clock::time_point deadline) {
    for (;;) {
      Decode();
      const size_t end = body_.find("\n\n");
      if (end != std::string::npos) {
        std::string event = body_.substr(0, end);
        body_.erase(0, end + 2);
        std::string data;
        for (size_t pos = 0; pos <= event.size();) {
          size_t nl = event.find('\n', pos);
          if (nl == std::string::npos) nl = event.size();
          if (event.compare(pos, 5, "data:") == 0) {
            size_t from = pos + 5;
            if (from < nl && event[from] == ' ') ++from;
            data.append(event, from, nl - from);
          }
          pos = nl + 1;
        }
        if (data.empty()) continue;  // comments, keep-alives
        return std::optional<std::string>(std::move(data));
      }
      if (eof_) return std::optional<std::string>();
      RETURN_IF_ERROR(Fill(deadline));
    }
  }

 private:
  Status Fill(Clock::time_point deadline) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return absl::DeadlineExceededError("no response within the request timeout");
    pollfd p{fd_, POLLIN, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
    if (r < 0 && errno != EINTR) return absl::InternalError("poll failed");
    if (r <= 0) return absl::OkStatus();
    char buf[16384];
    const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
    if (n < 0) return absl::UnavailableError(absl::StrCat("recv: ", std::strerror(errno)));
    if (n == 0) {
      eof_ = true;
      return absl::OkStatus();
    }
    raw_.append(buf, static_cast<size_t>(n));
    return absl::OkStatus();
  }
  // Moves complete chunks (or everything, without chunked encoding) from raw_ to body_.
  void Decode() {
    if (!chunked_) {
      body_ += raw_;
      raw_.clear();
      return;
    }
    for (;;) {
      const size_t eol = raw_.find("\r\n");
      if (eol == std::string::npos) return;
      const size_t size = std::strtoul(raw_.substr(0, eol).c_str(), nullptr, 16);
      if (size == 0) {
        eof_ = true;
        raw_.clear();
        return;
      }
      if (raw_.size() < eol + 2 + size + 2) return;
      body_.append(raw_, eol + 2, size);
      raw_.erase(0, eol + 2 + size + 2);
    }
  }

  int fd_ = -1;
  bool chunked_ = false, eof_ = false;
  std::string raw_, body_;
};

// ---- one streamed completion ------------------------------------------------------------------------------

struct StreamResult {
  Status status;
  Clock::time_point sent;
  std::vector<std::pair<Clock::time_point, int>> events;  // arrival time, tokens in the event
  int64_t tokens = 0;
  std::vector<int32_t> ids;
  std::string finish_reason;
};

StreamResult StreamCompletion(int port, const std::vector<int32_t>& prompt, int64_t max_tokens, double timeout_s,
                              const json& response_format) {
  StreamResult r;
  json body = {{"prompt", prompt},         {"max_tokens", max_tokens},  {"ignore_eos", true},
               {"temperature", 0.0},       {"stream", true},            {"return_token_ids", true},
               {"stream_options", {{"include_usage", true}}}};
  if (!response_format.is_null()) body["response_format"] = response_format;
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  SseClient client;
  r.sent = Clock::now();
  r.status = client.Open(port, "/v1/completions", body.dump(), deadline);
  if (!r.status.ok()) return r;
  for (;;) {
    auto next = client.Next(deadline);
    if (!next.ok()) {
      r.status = next.status();
      return r;
    }
    const auto now = Clock::now();
    if (!next->has_value() || **next == "[DONE]") break;
    const json chunk = json::parse(**next, nullptr, /*allow_exceptions=*/false);
    if (chunk.is_discarded()) {
      r.status = absl::DataLossError("unparsable SSE event: " + (*next)->substr(0, 200));
      return r;
    }
    if (chunk.contains("error")) {
      r.status = absl::InternalError("error event: " + chunk["error"].dump());
      return r;
    }
    if (!chunk.contains("choices") || chunk["choices"].empty()) continue;  // the usage chunk
    const json& c = chunk["choices"][0];
    int n = 0;
    if (c.contains("token_ids") && c["token_ids"].is_array()) {
      n = static_cast<int>(c["token_ids"].size());
      for (const json& id : c["token_ids"]) r.ids.push_back(id.get<int32_t>());
    }
    if (c.contains("finish_reason") && c["finish_reason"].is_string()) r.finish_reason = c["finish_reason"];
    if (n > 0) {
      r.events.push_back({now, n});
      r.tokens += n;
    }
  }
  return r;
}

// ---- the workers' expert time ---------------------------------------------------------------------------

// The router's workers (GET /health: worker_list[].address).
StatusOr<std::vector<std::string>> WorkerAddresses(int port) {
  SseClient client;
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  RETURN_IF_ERROR(client.Open(port, "/health", "", deadline, "GET"));
  ASSIGN_OR_RETURN(std::string body, client.ReadAll(deadline));
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.contains("worker_list") || !j["worker_list"].is_array()) {
    return absl::DataLossError("the router's /health has no worker_list: " + body.substr(0, 200));
  }
  std::vector<std::string> out;
  for (const json& w : j["worker_list"]) {
    if (w.contains("address") && w["address"].is_string()) out.push_back(w["address"]);
  }
  if (out.empty()) return absl::DataLossError("the router's /health lists no worker");
  return out;
}

// Polls every worker's Stats (expert_seconds) from its own thread, every `interval`, and keeps the samples,
// so that a round can read each worker's expert time at any instant of it (ExpertSecondsAt).
class ExpertTimePoller {
 public:
  ExpertTimePoller(const std::vector<std::string>& addresses, std::chrono::milliseconds interval)
      : interval_(interval), samples_(addresses.size()) {
    for (const std::string& a : addresses) {
      stubs_.push_back(v1::Worker::NewStub(grpc::CreateChannel(a, grpc::InsecureChannelCredentials())));
    }
  }
  ~ExpertTimePoller() { Stop(); }

  // One poll of every worker now (the first one fails on a worker that does not answer), then the thread.
  Status Start() {
    for (size_t w = 0; w < stubs_.size(); ++w) RETURN_IF_ERROR(Poll(w));
    thread_ = std::thread([this] {
      std::unique_lock<std::mutex> lk(mu_);
      while (!stop_) {
        lk.unlock();
        for (size_t w = 0; w < stubs_.size(); ++w) (void)Poll(w);
        lk.lock();
        cv_.wait_for(lk, interval_, [&] { return stop_; });
      }
    });
    return absl::OkStatus();
  }
  void Stop() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  // Takes one more sample of every worker now (the end of a round).
  void PollNow() {
    for (size_t w = 0; w < stubs_.size(); ++w) (void)Poll(w);
  }
  size_t workers() const { return stubs_.size(); }

  // Worker w's expert seconds at `t`, interpolated between the samples around it (the nearest one outside
  // them).
  double ExpertSecondsAt(size_t w, Clock::time_point t) const {
    std::lock_guard<std::mutex> lk(mu_);
    const std::vector<Sample>& v = samples_[w];
    if (v.empty()) return 0;
    if (t <= v.front().t) return v.front().seconds;
    if (t >= v.back().t) return v.back().seconds;
    auto hi = std::lower_bound(v.begin(), v.end(), t, [](const Sample& s, Clock::time_point x) { return s.t < x; });
    auto lo = hi - 1;
    const double span = Since(lo->t, hi->t);
    return span <= 0 ? hi->seconds : lo->seconds + (hi->seconds - lo->seconds) * Since(lo->t, t) / span;
  }

 private:
  struct Sample {
    Clock::time_point t;  // the middle of the call
    double seconds = 0;
  };
  Status Poll(size_t w) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::WorkerStats stats;
    const auto t0 = Clock::now();
    const grpc::Status st = stubs_[w]->Stats(&ctx, v1::WorkerStatsRequest(), &stats);
    const auto t1 = Clock::now();
    if (!st.ok()) {
      return absl::UnavailableError(absl::StrCat("worker ", w, " Stats: ", st.error_message()));
    }
    const Sample sample{t0 + (t1 - t0) / 2, stats.expert_seconds()};
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<Sample>& v = samples_[w];  // in time order (PollNow and the thread may overlap)
    v.insert(std::upper_bound(v.begin(), v.end(), sample.t, [](Clock::time_point x, const Sample& s) { return x < s.t; }),
             sample);
    return absl::OkStatus();
  }

  std::chrono::milliseconds interval_;
  std::vector<std::unique_ptr<v1::Worker::Stub>> stubs_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<std::vector<Sample>> samples_;  // per worker, in time order
  std::thread thread_;
};

struct RoundResult {
  int concurrency = 0;
  double decode_tok_s = 0;    // aggregate, prefill excluded
  double mean_ttft_s = 0;     // time to first token
  double per_stream_tok_s = 0;  // mean of each stream's own decode rate
  int64_t min_tokens = 0, max_tokens = 0;
  double window_s = 0;
  Clock::time_point window_start, window_end;
  std::vector<double> expert_busy;  // per worker: expert seconds in the window / window
  std::vector<std::vector<int32_t>> ids;  // per stream: the tokens it generated
};

// splitmix64, for prompts that are the same on every run.
uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

std::vector<int32_t> Prompt(int64_t len, uint64_t stream, int64_t vocab) {
  // Ordinary (non-special) ids: DeepSeek's BPE range [3, 128000) where the vocabulary is that large.
  const int64_t hi = std::min<int64_t>(vocab, 128000), lo = std::min<int64_t>(3, hi - 1);
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < len; ++i)
    ids.push_back(static_cast<int32_t>(lo + static_cast<int64_t>(Mix(stream * 1000003 + i) % (hi - lo))));
  return ids;
}

StatusOr<RoundResult> RunRound(int port, int concurrency, int64_t prompt_len, int64_t max_tokens, int64_t vocab,
                               uint64_t round_seed, double timeout_s, const json& response_format = json()) {
  std::vector<StreamResult> results(concurrency);
  std::vector<std::thread> threads;
  std::atomic<bool> go{false};
  for (int i = 0; i < concurrency; ++i) {
    threads.emplace_back([&, i] {
      const std::vector<int32_t> prompt = Prompt(prompt_len, round_seed * 64 + i, vocab);
      while (!go.load()) std::this_thread::yield();
      results[i] = StreamCompletion(port, prompt, max_tokens, timeout_s, response_format);
    });
  }
  go = true;
  for (auto& t : threads) t.join();

  RoundResult rr;
  rr.concurrency = concurrency;
  rr.min_tokens = INT64_MAX;
  Clock::time_point window_start{}, window_end = Clock::time_point::max();
  for (int i = 0; i < concurrency; ++i) {
    const StreamResult& r = results[i];
    if (!r.status.ok()) return Status(r.status.code(), absl::StrCat("stream ", i, ": ", r.status.message()));
    if (r.events.empty()) return absl::DataLossError(absl::StrCat("stream ", i, " returned no tokens"));
    rr.min_tokens = std::min(rr.min_tokens, r.tokens);
    rr.max_tokens = std::max(rr.max_tokens, r.tokens);
    rr.mean_ttft_s += Since(r.sent, r.events.front().first) / concurrency;
    window_start = std::max(window_start, r.events.front().first);
    window_end = std::min(window_end, r.events.back().first);
    rr.ids.push_back(r.ids);
    const double own = Since(r.events.front().first, r.events.back().first);
    if (own > 0) rr.per_stream_tok_s += (r.tokens - r.events.front().second) / own / concurrency;
  }
  rr.window_s = Since(window_start, window_end);
  rr.window_start = window_start;
  rr.window_end = window_end;
  if (rr.window_s <= 0) {
    return absl::FailedPreconditionError(
        "no time when every stream was decoding (streams too short or too staggered); raise --max-tokens");
  }
  int64_t in_window = 0;
  for (const StreamResult& r : results) {
    for (const auto& [t, n] : r.events)
      if (t > window_start && t <= window_end) in_window += n;
  }
  rr.decode_tok_s = static_cast<double>(in_window) / rr.window_s;
  return rr;
}

// ---- constrained sampling --------------------------------------------------------------------------------

// The --json-schema rounds' schema: 4096 strings of at most 16 characters never close within a benchmark's
// --max-tokens, so constrained streams decode exactly as many tokens as unconstrained ones.
json BenchResponseFormat() {
  const json schema = {{"type", "object"},
                       {"properties",
                        {{"items", {{"type", "array"},
                                    {"items", {{"type", "string"}, {"maxLength", 16}}},
                                    {"minItems", 4096},
                                    {"maxItems", 4096}}}}},
                       {"required", {"items"}}};
  return {{"type", "json_schema"}, {"json_schema", {{"name", "bench"}, {"schema", schema}, {"strict", true}}}};
}

struct MaskTiming {
  double warm_us = 0, cold_us = 0;
  int64_t steps = 0;
};

// Replays the streams' tokens through the grammar the server compiled (same spec, same vocabulary): per
// step GrammarState::Mask and the masking of one logits row (model/sampling.cc), once with a fresh grammar
// (every distinct state computed) and once more on it (the cache warm, as served).
StatusOr<MaskTiming> TimeMasks(const std::string& model_dir, int64_t vocab, const std::vector<std::vector<int32_t>>& streams) {
  ASSIGN_OR_RETURN(auto tok, tokenizer::Tokenizer::Load(model_dir));
  auto gv = tokenizer::GrammarVocab::FromTokenizer(*tok, vocab);
  const json rf = BenchResponseFormat();
  json spec = {{"type", "json_schema"}, {"schema", rf["json_schema"]["schema"]}, {"end", {tok->special_ids().eos}}};
  ASSIGN_OR_RETURN(auto grammar, tokenizer::Grammar::Compile(spec.dump(), gv));
  std::vector<float> row(static_cast<size_t>(vocab), 0.5f);
  MaskTiming t;
  for (int pass = 0; pass < 2; ++pass) {
    double seconds = 0;
    int64_t steps = 0;
    for (const auto& ids : streams) {
      tokenizer::GrammarState st(grammar);
      for (int32_t id : ids) {
        const auto t0 = Clock::now();
        const auto mask = st.Mask();
        for (int64_t i = 0; i < vocab; ++i) {
          if (!tokenizer::MaskAllows(*mask, static_cast<int32_t>(i))) row[static_cast<size_t>(i)] = -INFINITY;
        }
        seconds += Since(t0, Clock::now());
        ++steps;
        st.Accept(id);
      }
    }
    (pass == 0 ? t.cold_us : t.warm_us) = steps > 0 ? seconds / static_cast<double>(steps) * 1e6 : 0;
    t.steps = steps;
  }
  return t;
}

// ---- the bandwidth ----------------------------------------------------------------------------------------

// Worker-0's placement as `numoe serve --workers N [--threads-per-worker T]` gives it: the one rule of
// deploy/placement.h on this machine.
StatusOr<WorkerPlacement> Worker0Placement(int64_t workers, int64_t threads) {
  ASSIGN_OR_RETURN(Topology topology, ProbeTopology());
  ASSIGN_OR_RETURN(std::vector<WorkerPlacement> placed,
                   deploy::PlaceWorkers(topology, {.workers = static_cast<int>(workers),
                                                   .threads_per_worker = static_cast<int>(threads),
                                                   .threads_flag = "--threads"}));
  return placed.front();
}

struct ReadResult {
  const ReadMethod* method = nullptr;
  std::string methods;  // every read loop's median GB/s, when this measurement chose the loop
  std::vector<double> gbps;
};

// Streaming-read GB/s of each of `passes` passes over a node-0 buffer of `bytes`, read with `method` or, when
// null, with the fastest read loop (ChooseReadMethod, `passes` trials of each; that also faults it in).
StatusOr<ReadResult> MeasureRead(const WorkerPlacement& w, size_t bytes, int passes, const ReadMethod* method) {
  ASSIGN_OR_RETURN(auto pool, ThreadPool::Create({.num_threads = w.threads, .cpus = w.thread_cpus}));
  ASSIGN_OR_RETURN(NodeBuffer buf, AllocateOnNode(bytes, {.node = w.nodes.front()}));
  std::memset(buf.data(), 1, buf.size());
  const std::vector<ReadSpan> spans = {{buf.data(), buf.size()}};
  uint64_t sink = 0;
  ReadResult r;
  if (method == nullptr) {
    const ReadChoice choice = ChooseReadMethod(*pool, spans, passes, &sink);
    method = choice.best;
    r.methods = choice.Summary();
  } else {
    ReadPass(*pool, *method, spans, &sink);
  }
  r.method = method;
  for (int i = 0; i < passes; ++i) r.gbps.push_back(SpanBytes(spans) / ReadPass(*pool, *method, spans, &sink) / 1e9);
  if (sink == 42) std::fprintf(stderr, " ");  // keeps the sums alive
  return r;
}

// ---- numoe serve as a child ---------------------------------------------------------------------------------

StatusOr<int> FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError("socket() failed");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  if (!ok) return absl::InternalError("no free loopback port");
  return static_cast<int>(ntohs(a.sin_port));
}

std::string TailOf(const std::string& path, size_t bytes) {
  std::ifstream f(path, std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return s.size() > bytes ? "..." + s.substr(s.size() - bytes) : s;
}

class ServeProcess {
 public:
  ~ServeProcess() { Stop(5.0); }

  Status Start(const std::vector<std::string>& argv, const std::string& log_path) {
    log_path_ = log_path;
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError("pipe2 failed");
    const int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (log < 0) return absl::PermissionDeniedError(absl::StrCat(log_path, ": cannot create"));
    pid_ = ::fork();
    if (pid_ < 0) return absl::InternalError("fork failed");
    if (pid_ == 0) {
      ::setpgid(0, 0);  // serve and its children form one group: stopped together, never orphaned
      ::dup2(fds[1], 1);
      ::dup2(log, 2);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      std::fprintf(stderr, "cannot run %s: %s\n", args[0], std::strerror(errno));
      ::_exit(127);
    }
    ::setpgid(pid_, pid_);
    ::close(fds[1]);
    ::close(log);
    out_fd_ = fds[0];
    return absl::OkStatus();
  }

  // The ready line from serve's stdout.
  StatusOr<std::string> WaitReady(double timeout_s) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    std::string out;
    while (Clock::now() < deadline) {
      pollfd p{out_fd_, POLLIN, 0};
      if (::poll(&p, 1, 500) > 0) {
        char buf[1024];
        const ssize_t n = ::read(out_fd_, buf, sizeof(buf));
        if (n > 0) out.append(buf, static_cast<size_t>(n));
        const size_t nl = out.find('\n');
        if (nl != std::string::npos) return out.substr(0, nl);
        if (n == 0) break;  // stdout closed: serve exited
      }
      int status;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return absl::UnavailableError(absl::StrCat("numoe serve exited before it was ready; its log (", log_path_,
                                                   ") ends with:\n", TailOf(log_path_, 3000)));
      }
    }
    return absl::DeadlineExceededError(absl::StrCat("numoe serve was not ready within ", timeout_s, " s; log: ",
                                                    log_path_, "\n", TailOf(log_path_, 2000)));
  }

  // SIGTERM to serve (it stops its children), SIGKILL to the whole group after `timeout_s`.
  void Stop(double timeout_s) {
    if (out_fd_ >= 0) ::close(out_fd_);
    out_fd_ = -1;
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    while (Clock::now() < deadline) {
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
        ::kill(-pid_, SIGKILL);  // anything of the group left behind
        pid_ = -1;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ::kill(-pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1;
  std::string log_path_;
};

std::string BinDir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}

std::string Fmt(double v, int digits) {
  char b[64];
  std::snprintf(b, sizeof(b), "%.*f", digits, v);
  return b;
}

}  // namespace

int RunDecodeBench(int argc, char** argv) {
  std::string model, concurrency_text = "1,4", log_dir, backend = "cpu";
  int64_t workers = 1, threads = 0, prompt_len = 64, max_tokens = 32, read_mib = 0, passes = 5, lanes = -1;
  double startup_timeout = 1800, request_timeout = 3600, sim_gbps = 0;
  bool json_only = false, json_schema = false;
  SpecChoice spec = SpecChoice::kAuto;
  ArgParser p(argv[0],
              "End-to-end decode tokens/s through `numoe serve` (REST, streaming, prefill excluded) for one stream\n"
              "and each concurrency, next to the bound of this machine: streaming-read bandwidth on the worker's\n"
              "CPUs / routed-expert bytes read per token.");
  p.AddString("model", "DIR", "checkpoint directory (e.g. from `numoe mkmodel --preset v4-flash`)", &model, true);
  p.AddInt("workers", "N", "numoe serve --workers", &workers, 1, 64);
  p.AddInt("threads", "N", "numoe serve --threads-per-worker (0 = the worker's CPUs)", &threads, 0, 4096);
  p.AddString("concurrency", "1,4", "concurrent streams per round (aggregate tokens/s)", &concurrency_text);
  p.AddInt("prompt-len", "P", "prompt tokens per stream (random ordinary ids, different per stream)", &prompt_len, 1,
           1 << 20);
  p.AddInt("max-tokens", "T", "tokens generated per stream (EOS ignored)", &max_tokens, 2, 1 << 20);
  p.AddString("backend", "cpu|cuda", "numoe serve --backend", &backend);
  p.AddInt("lanes", "N", "numoe serve --lanes (--backend cuda; -1 = its default)", &lanes, -1, 64);
  p.AddEnum("spec", "numoe serve --spec (auto: the checkpoint's drafter; none: one token per sequence per step)", &spec);
  p.AddString("log-dir", "DIR", "where serve and its children log (default: a new directory under /tmp)", &log_dir);
  p.AddInt("read-mib", "M", "read-bandwidth buffer in MiB (default: max(8 x LLC, 1 GiB))", &read_mib, 0, 1 << 20);
  p.AddInt("read-passes", "N", "timed read passes before and after serving", &passes, 1, 1000);
  p.AddDouble("startup-timeout", "S", "give up when serve is not ready after this long", &startup_timeout, 1, 86400);
  p.AddDouble("request-timeout", "S", "give up on a stream after this long", &request_timeout, 1, 86400);
  worker::AddSimExpertGbpsFlag(
      p,
      "numoe serve --sim-expert-gbps: every worker simulates its routed experts at G GB/s (sleeps, returns zeros); "
      "the bound is then workers x G / routed bytes per token, and no read bandwidth is measured",
      &sim_gbps);
  p.AddFlag("json-schema",
            "run every concurrency a second time with a response_format json_schema (constrained sampling) and report "
            "both rates, their ratio and the token-mask time per step",
            &json_schema);
  p.AddFlag("json", "print only the JSON line (the last line is JSON either way)", &json_only);
  p.AddEpilog(
      "\nExample (a full-width 2-layer V4-Flash, ~7.5 GB):\n"
      "  numoe mkmodel --preset v4-flash --layers 2 --out /tmp/v4f-2l\n"
      "  numoe-bench decode --model /tmp/v4f-2l --workers 1 --concurrency 1,4 --prompt-len 64 --max-tokens 32\n"
      "Four simulated 100 GB/s workers in front of this machine's numoe-gpu:\n"
      "  numoe-bench decode --model /tmp/v4f-2l --workers 4 --sim-expert-gbps 100 --concurrency 1,4,8,16\n"
      "Each round also reports every worker's expert-busy fraction (time inside its MoE calls over the decode\n"
      "window; the JSON's \"expert_busy\" is the least busy worker's).\n"
      "The cost of constrained output (response_format json_schema) at 16 streams on the demo model:\n"
      "  numoe-bench decode --model tests/data/demo-v4 --workers 1 --concurrency 16 --max-tokens 64 --json-schema\n");
  int rc = 0;
  if (!p.ParseOrExit(argc, argv, &rc)) return rc;
  const auto fail = [&](const Status& st) {
    std::fprintf(stderr, "%s: %s\n", argv[0], std::string(st.message()).c_str());
    return 1;
  };
  auto say = [&](const std::string& line) {
    if (!json_only) std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  };

  auto levels = ParseIntList(concurrency_text, "--concurrency");
  if (!levels.ok()) return fail(levels.status());
  for (int64_t c : *levels)
    if (c < 1 || c > 1024) return fail(absl::InvalidArgumentError("--concurrency values must be in [1, 1024]"));
  if (levels->empty()) return fail(absl::InvalidArgumentError("--concurrency is empty"));

  // 1. Bytes per token, from the checkpoint's config (closed again before the server maps it).
  ModelConfig cfg;
  ModelFootprint fp;
  {
    auto ck = Checkpoint::Open(model);
    if (!ck.ok()) return fail(ck.status());
    cfg = (*ck)->config();
    fp = ComputeFootprint(cfg, (*ck)->mtp_stages());
  }
  std::string schedule;
  for (AttnType t : cfg.layer_types) schedule += t == AttnType::kSliding ? 'S' : t == AttnType::kCSA ? 'C' : 'H';
  say(absl::StrCat("model ", model, ": ", cfg.num_hidden_layers, " layers (", schedule, "), hidden ", cfg.hidden_size,
                   ", ", cfg.n_routed_experts, " experts top-", cfg.num_experts_per_tok, " of ",
                   cfg.moe_intermediate_size, ", vocab ", cfg.vocab_size, "; routed experts ",
                   Fmt(fp.routed_expert_bytes / 1e9, 2), " GB, read per token ",
                   Fmt(fp.routed_bytes_per_token / 1e6, 1), " MB"));

  // 2. Read bandwidth on worker-0's CPUs.
  auto wc = Worker0Placement(workers, threads);
  if (!wc.ok()) return fail(wc.status());
  const size_t read_bytes = read_mib > 0 ? static_cast<size_t>(read_mib) << 20
                                         : static_cast<size_t>(std::max<int64_t>(8 * LastLevelCacheBytes(), int64_t{1} << 30));
  const bool sim = sim_gbps > 0;
  StatusOr<ReadResult> before = ReadResult{};
  if (sim) {
    say(absl::StrCat("simulated experts: every worker sleeps for its MoE calls' expert bytes at ", sim_gbps,
                     " GB/s (no read bandwidth measured)"));
  } else {
    before = MeasureRead(*wc, read_bytes, static_cast<int>(passes), nullptr);
    if (!before.ok()) return fail(before.status());
    say(absl::StrCat("read loops (median of ", passes, " passes each): ", before->methods));
    say(absl::StrCat("read bandwidth before serving: ", Fmt(Median(before->gbps), 2), " GB/s with ",
                     before->method->name, " (", wc->threads, " threads on CPUs ", absl::StrJoin(wc->thread_cpus, ","),
                     ", ", Fmt(read_bytes / 1e9, 2), " GB buffer, median of ", passes, " passes)"));
  }

  // 3. The served stack.
  if (log_dir.empty()) {
    log_dir = (fs::temp_directory_path() / absl::StrCat("numoe-bench-decode-", ::getpid())).string();
  }
  std::error_code ec;
  fs::create_directories(log_dir, ec);
  auto port = FreePort(), grpc_port = FreePort();
  if (!port.ok() || !grpc_port.ok()) return fail(absl::UnavailableError("no free loopback ports"));
  std::vector<std::string> serve_argv = {BinDir() + "/numoe", "serve", "--model", model, "--workers",
                                         std::to_string(workers), "--backend", backend, "--port",
                                         std::to_string(*port), "--grpc-port", std::to_string(*grpc_port),
                                         "--log-dir", log_dir, "--spec", std::string(ChoiceName(spec)),
                                         // The streams' prompts share no prefix: balance by outstanding work
                                         // alone, so C streams spread evenly over the workers.
                                         "--affinity-prefix-tokens", "0"};
  if (threads > 0) serve_argv.insert(serve_argv.end(), {"--threads-per-worker", std::to_string(threads)});
  if (lanes >= 0) serve_argv.insert(serve_argv.end(), {"--lanes", std::to_string(lanes)});
  if (sim) serve_argv.insert(serve_argv.end(), {"--sim-expert-gbps", absl::StrCat(sim_gbps)});
  say("starting: " + absl::StrJoin(serve_argv, " "));
  ServeProcess serve;
  const auto t_start = Clock::now();
  if (Status st = serve.Start(serve_argv, log_dir + "/serve.log"); !st.ok()) return fail(st);
  auto ready = serve.WaitReady(startup_timeout);
  if (!ready.ok()) return fail(ready.status());
  say(absl::StrCat("ready in ", Fmt(Since(t_start, Clock::now()), 1), " s: ", *ready));
  auto worker_addrs = WorkerAddresses(*port);
  if (!worker_addrs.ok()) return fail(worker_addrs.status());
  ExpertTimePoller poller(*worker_addrs, std::chrono::milliseconds(50));
  if (Status st = poller.Start(); !st.ok()) return fail(st);

  // 4. Warm-up, then the rounds.
  const auto t_warm = Clock::now();
  auto warm = RunRound(*port, 1, prompt_len, 4, cfg.vocab_size, /*round_seed=*/999, request_timeout);
  if (!warm.ok()) return fail(Status(warm.status().code(), absl::StrCat("warm-up: ", warm.status().message())));
  say(absl::StrCat("warm-up: 1 stream, ", prompt_len, " prompt + ", warm->max_tokens, " tokens in ",
                   Fmt(Since(t_warm, Clock::now()), 1), " s"));
  std::vector<RoundResult> rounds;
  std::vector<double> constrained_tok_s;
  std::vector<std::vector<int32_t>> constrained_ids;
  for (size_t i = 0; i < levels->size(); ++i) {
    auto r = RunRound(*port, static_cast<int>((*levels)[i]), prompt_len, max_tokens, cfg.vocab_size, i + 1,
                      request_timeout);
    if (!r.ok()) return fail(Status(r.status().code(), absl::StrCat("concurrency ", (*levels)[i], ": ", r.status().message())));
    poller.PollNow();  // a sample after the window's end
    std::vector<std::string> busy_text;
    for (size_t w = 0; w < poller.workers(); ++w) {
      const double busy =
          (poller.ExpertSecondsAt(w, r->window_end) - poller.ExpertSecondsAt(w, r->window_start)) / r->window_s;
      r->expert_busy.push_back(busy);
      busy_text.push_back(Fmt(busy, 2));
    }
    rounds.push_back(*r);
    say(absl::StrCat("  concurrency ", r->concurrency, ": ", Fmt(r->decode_tok_s, 3), " tok/s aggregate decode (",
                     Fmt(r->per_stream_tok_s, 3), " per stream), first token after ", Fmt(r->mean_ttft_s, 2),
                     " s on average, window ", Fmt(r->window_s, 1), " s; expert-busy per worker ",
                     absl::StrJoin(busy_text, " ")));
    if (json_schema) {
      auto c = RunRound(*port, static_cast<int>((*levels)[i]), prompt_len, max_tokens, cfg.vocab_size, i + 1,
                        request_timeout, BenchResponseFormat());
      if (!c.ok()) {
        return fail(Status(c.status().code(), absl::StrCat("concurrency ", (*levels)[i], " with json_schema: ",
                                                           c.status().message())));
      }
      constrained_tok_s.push_back(c->decode_tok_s);
      for (auto& ids : c->ids) constrained_ids.push_back(std::move(ids));
      say(absl::StrCat("  concurrency ", c->concurrency, " with json_schema: ", Fmt(c->decode_tok_s, 3),
                       " tok/s aggregate decode (", Fmt(c->decode_tok_s / r->decode_tok_s, 3), " x unconstrained)"));
    }
  }
  poller.Stop();

  // 5. Stop, and the bandwidth again.
  serve.Stop(30.0);
  MaskTiming masks;
  if (json_schema) {
    auto m = TimeMasks(model, cfg.vocab_size, constrained_ids);
    if (!m.ok()) return fail(m.status());
    masks = *m;
    say(absl::StrCat("token mask per step (", masks.steps, " steps of the constrained streams replayed, vocab ",
                     cfg.vocab_size, "): ", Fmt(masks.warm_us, 2), " us with the mask cache as served, ",
                     Fmt(masks.cold_us, 2), " us computed afresh"));
  }
  double read_gbps = 0;
  std::string read_method;
  if (sim) {
    read_gbps = sim_gbps * static_cast<double>(workers);
    read_method = "sim-expert-gbps";
    say(absl::StrCat("bound bandwidth: ", workers, " simulated worker(s) x ", sim_gbps, " GB/s = ", read_gbps,
                     " GB/s"));
  } else {
    auto after = MeasureRead(*wc, read_bytes, static_cast<int>(passes), before->method);
    if (!after.ok()) return fail(after.status());
    std::vector<double> all = before->gbps;
    all.insert(all.end(), after->gbps.begin(), after->gbps.end());
    read_gbps = Median(all);
    read_method = before->method->name;
    say(absl::StrCat("read bandwidth after serving: ", Fmt(Median(after->gbps), 2), " GB/s; used: ",
                     Fmt(read_gbps, 2), " GB/s (median of all ", all.size(), " passes)"));
  }
  const double bound = read_gbps * 1e9 / static_cast<double>(fp.routed_bytes_per_token);
  say(absl::StrCat("bound: ", sim ? absl::StrCat(read_gbps) : Fmt(read_gbps, 2), " GB/s / ",
                   Fmt(fp.routed_bytes_per_token / 1e6, 3), " MB routed-expert bytes per token = ", Fmt(bound, 2),
                   " tok/s"));
  say("");
  say("concurrency  prompt_len  output_len  ttft_s    decode_tok_s  bound_tok_s  ratio   expert_busy (min)");
  json j_conc = json::array(), j_tok = json::array(), j_ratio = json::array(), j_out = json::array(),
       j_ttft = json::array(), j_busy = json::array(), j_busy_workers = json::array();
  for (const RoundResult& r : rounds) {
    const std::string out_len = r.min_tokens == r.max_tokens ? std::to_string(r.min_tokens)
                                                             : absl::StrCat(r.min_tokens, "-", r.max_tokens);
    const double busy = r.expert_busy.empty() ? 0 : *std::min_element(r.expert_busy.begin(), r.expert_busy.end());
    char line[256];
    std::snprintf(line, sizeof(line), "%-12d %-11lld %-11s %-9.2f %-13.3f %-12.2f %-7.4f %.3f", r.concurrency,
                  static_cast<long long>(prompt_len), out_len.c_str(), r.mean_ttft_s, r.decode_tok_s, bound,
                  r.decode_tok_s / bound, busy);
    say(line);
    j_busy.push_back(busy);
    j_busy_workers.push_back(r.expert_busy);
    j_conc.push_back(r.concurrency);
    j_tok.push_back(r.decode_tok_s);
    j_ratio.push_back(r.decode_tok_s / bound);
    j_out.push_back(r.max_tokens);
    j_ttft.push_back(r.mean_ttft_s);
  }
  const json out = {{"concurrency", j_conc},
                    {"tok_s", j_tok},
                    {"bound_tok_s", bound},
                    {"ratio", j_ratio},
                    {"read_gbps", read_gbps},
                    {"read_method", read_method},
                    {"expert_busy", j_busy},
                    {"expert_busy_workers", j_busy_workers},
                    {"sim_expert_gbps", sim_gbps},
                    {"routed_bytes_per_token", fp.routed_bytes_per_token},
                    {"prompt_len", prompt_len},
                    {"output_len", j_out},
                    {"ttft_s", j_ttft},
                    {"workers", workers},
                    {"threads", wc->threads}};
  std::string constrained;
  if (json_schema) {
    json ratio = json::array();
    for (size_t i = 0; i < rounds.size(); ++i) ratio.push_back(constrained_tok_s[i] / rounds[i].decode_tok_s);
    constrained = absl::StrCat(", \"constrained_tok_s\": ", json(constrained_tok_s).dump(),
                               ", \"constrained_ratio\": ", ratio.dump(), ", \"mask_us_per_step\": ",
                               json(masks.warm_us).dump(), ", \"mask_cold_us_per_step\": ", json(masks.cold_us).dump());
  }
  // Keys in the documented order first (nlohmann sorts objects, so print by hand).
  std::printf("{\"concurrency\": %s, \"tok_s\": %s, \"bound_tok_s\": %s, \"ratio\": %s, \"expert_busy\": %s, "
              "\"expert_busy_workers\": %s, \"read_gbps\": %s, \"sim_expert_gbps\": %s, "
              "\"routed_bytes_per_token\": %s, \"prompt_len\": %s, \"output_len\": %s, \"ttft_s\": %s, "
              "\"workers\": %s, \"threads\": %s, \"read_method\": %s%s}\n",
              out["concurrency"].dump().c_str(), out["tok_s"].dump().c_str(), out["bound_tok_s"].dump().c_str(),
              out["ratio"].dump().c_str(), out["expert_busy"].dump().c_str(), out["expert_busy_workers"].dump().c_str(),
              out["read_gbps"].dump().c_str(), out["sim_expert_gbps"].dump().c_str(),
              out["routed_bytes_per_token"].dump().c_str(), out["prompt_len"].dump().c_str(),
              out["output_len"].dump().c_str(), out["ttft_s"].dump().c_str(), out["workers"].dump().c_str(),
              out["threads"].dump().c_str(), out["read_method"].dump().c_str(), constrained.c_str());
  return 0;
}

}  // namespace numoe::bench
