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
#include "bench/serve_harness.h"
#include "common/args.h"
#include "common/checkpoint.h"
#include "common/free_port.h"
#include "common/numa.h"
#include "common/thread_pool.h"
#include "common/topology.h"
#include "common/tokenizer/grammar.h"
#include "common/tokenizer/tokenizer.h"
#include "deploy/placement.h"
#include "nlohmann/json.hpp"
#include "gpu_service/gpu_flags.h"
#include "numoe/v1/gpu.grpc.pb.h"
#include "numoe/v1/worker.grpc.pb.h"
#include "worker/service/worker_flags.h"

namespace numoe::bench {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ---- the workers' expert time ---------------------------------------------------------------------------

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

StatusOr<RoundResult> RunRound(int port, int concurrency, int64_t prompt_len, int64_t max_tokens, int64_t vocab,
                               uint64_t round_seed, double timeout_s, const json& response_format = json()) {
  std::vector<StreamResult> results(concurrency);
  std::vector<std::thread> threads;
  std::atomic<bool> go{false};
  for (int i = 0; i < concurrency; ++i) {
    threads.emplace_back([&, i] {
      const std::vector<int32_t> prompt = RandomPrompt(prompt_len, round_seed * 64 + i, vocab);
      while (!go.load()) std::this_thread::yield();
      results[i] = StreamCompletion(port, prompt, max_tokens, timeout_s,
                                    response_format.is_null() ? std::string() : response_format.dump());
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
    rr.ids.push_back(r.token_ids);
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

}  // namespace

int RunDecodeBench(int argc, char** argv) {
  std::string model, concurrency_text = "1,4", backend = "cpu";
  int64_t workers = 1, threads = 0, prompt_len = 64, max_tokens = 32, read_mib = 0, passes = 5, lanes = -1,
          micro_batches = 0;
  double sim_gbps = 0;
  bool json_schema = false;
  ServeBenchFlags common;
  SpecChoice spec = SpecChoice::kAuto;
  MergeLanes merge_lanes = MergeLanes::kAuto;
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
  p.AddInt("micro-batches", "N", "numoe serve --micro-batches: micro-batches per worker (0 = the worker's default)",
           &micro_batches, 0, worker::kMaxMicroBatches);
  gpu::AddMergeLanesFlag(p, "numoe serve --merge-lanes: ", &merge_lanes);
  p.AddEnum("spec", "numoe serve --spec (auto: the checkpoint's drafter; none: one token per sequence per step)", &spec);
  p.AddInt("read-mib", "M", "read-bandwidth buffer in MiB (default: max(8 x LLC, 1 GiB))", &read_mib, 0, 1 << 20);
  p.AddInt("read-passes", "N", "timed read passes before and after serving", &passes, 1, 1000);
  worker::AddSimExpertGbpsFlag(
      p,
      "numoe serve --sim-expert-gbps: every worker simulates its routed experts at G GB/s (sleeps, returns zeros); "
      "the bound is then workers x G / routed bytes per token, and no read bandwidth is measured",
      &sim_gbps);
  p.AddFlag("json-schema",
            "run every concurrency a second time with a response_format json_schema (constrained sampling) and report "
            "both rates, their ratio and the token-mask time per step",
            &json_schema);
  AddServeBenchFlags(p, &common, "give up on a stream after this long");
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
  const auto fail = [&](const Status& st) { return BenchFail(argv[0], st); };
  auto say = [&](const std::string& line) { BenchSay(common.json_only, line); };

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
  const std::string& log_dir = common.MakeLogDir("decode");
  ServeSpec serve_spec{.model = model, .backend = backend, .spec = std::string(ChoiceName(spec)), .log_dir = log_dir,
                       .workers = workers, .threads = threads, .lanes = lanes, .sim_expert_gbps = sim_gbps};
  if (micro_batches > 0) serve_spec.extra = {"--micro-batches", std::to_string(micro_batches)};
  auto gpu_port = ReserveLocalPort();
  if (!gpu_port.ok()) return fail(gpu_port.status());
  serve_spec.extra.insert(serve_spec.extra.end(), {"--gpu-port", std::to_string(*gpu_port), "--merge-lanes",
                                                   std::string(ChoiceName(merge_lanes))});
  auto gpu_stub = v1::GpuService::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", *gpu_port), grpc::InsecureChannelCredentials()));
  // numoe-gpu's merged-pass counters (GpuStats merged_steps / merged_passes) now.
  auto merged_now = [&]() -> std::pair<uint64_t, uint64_t> {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::GpuStats s;
    if (!gpu_stub->Stats(&ctx, v1::GpuStatsRequest(), &s).ok()) return {0, 0};
    return {s.merged_steps(), s.merged_passes()};
  };
  auto endpoints = ServeCommand(serve_spec);
  if (!endpoints.ok()) return fail(endpoints.status());
  const int* port = &endpoints->port;
  const std::vector<std::string>& serve_argv = endpoints->argv;
  say("starting: " + absl::StrJoin(serve_argv, " "));
  ServeProcess serve;
  const auto t_start = Clock::now();
  if (Status st = serve.Start(serve_argv, log_dir + "/serve.log"); !st.ok()) return fail(st);
  auto ready = serve.WaitReady(common.startup_timeout);
  if (!ready.ok()) return fail(ready.status());
  say(absl::StrCat("ready in ", Fmt(Since(t_start, Clock::now()), 1), " s: ", *ready));
  auto worker_addrs = WorkerAddresses(*port);
  if (!worker_addrs.ok()) return fail(worker_addrs.status());
  ExpertTimePoller poller(*worker_addrs, std::chrono::milliseconds(50));
  if (Status st = poller.Start(); !st.ok()) return fail(st);

  // 4. Warm-up, then the rounds.
  const auto t_warm = Clock::now();
  auto warm = RunRound(*port, 1, prompt_len, 4, cfg.vocab_size, /*round_seed=*/999, common.request_timeout);
  if (!warm.ok()) return fail(Status(warm.status().code(), absl::StrCat("warm-up: ", warm.status().message())));
  say(absl::StrCat("warm-up: 1 stream, ", prompt_len, " prompt + ", warm->max_tokens, " tokens in ",
                   Fmt(Since(t_warm, Clock::now()), 1), " s"));
  std::vector<RoundResult> rounds;
  std::vector<double> constrained_tok_s;
  std::vector<std::vector<int32_t>> constrained_ids;
  std::vector<std::pair<uint64_t, uint64_t>> merged;  // per round: merged steps, merged passes
  for (size_t i = 0; i < levels->size(); ++i) {
    const auto merged_before = merged_now();
    auto r = RunRound(*port, static_cast<int>((*levels)[i]), prompt_len, max_tokens, cfg.vocab_size, i + 1,
                      common.request_timeout);
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
    const auto merged_after = merged_now();
    merged.push_back({merged_after.first - merged_before.first, merged_after.second - merged_before.second});
    say(absl::StrCat("  concurrency ", r->concurrency, ": ", Fmt(r->decode_tok_s, 3), " tok/s aggregate decode (",
                     Fmt(r->per_stream_tok_s, 3), " per stream), first token after ", Fmt(r->mean_ttft_s, 2),
                     " s on average, window ", Fmt(r->window_s, 1), " s; expert-busy per worker ",
                     absl::StrJoin(busy_text, " ")));
    if (json_schema) {
      auto c = RunRound(*port, static_cast<int>((*levels)[i]), prompt_len, max_tokens, cfg.vocab_size, i + 1,
                        common.request_timeout, BenchResponseFormat());
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
  {
    std::vector<std::string> per;
    json j_steps = json::array(), j_passes = json::array();
    for (size_t i = 0; i < rounds.size(); ++i) {
      per.push_back(absl::StrCat("concurrency ", rounds[i].concurrency, ": ", merged[i].first, " worker steps in ",
                                 merged[i].second, " passes"));
    }
    say(absl::StrCat("merged: --merge-lanes ", ChoiceName(merge_lanes), "; ", absl::StrJoin(per, ", ")));
  }
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
                    {"micro_batches", micro_batches > 0 ? micro_batches : worker::WorkerAppConfig{}.micro_batches},
                    {"threads", wc->threads}};
  json j_msteps = json::array(), j_mpasses = json::array();
  for (const auto& [steps, passes_merged] : merged) {
    j_msteps.push_back(steps);
    j_mpasses.push_back(passes_merged);
  }
  std::string constrained = absl::StrCat(", \"merge_lanes\": \"", ChoiceName(merge_lanes), "\", \"merged_steps\": ",
                                         j_msteps.dump(), ", \"merged_passes\": ", j_mpasses.dump());
  if (json_schema) {
    json ratio = json::array();
    for (size_t i = 0; i < rounds.size(); ++i) ratio.push_back(constrained_tok_s[i] / rounds[i].decode_tok_s);
    constrained += absl::StrCat(", \"constrained_tok_s\": ", json(constrained_tok_s).dump(),
                               ", \"constrained_ratio\": ", ratio.dump(), ", \"mask_us_per_step\": ",
                               json(masks.warm_us).dump(), ", \"mask_cold_us_per_step\": ", json(masks.cold_us).dump());
  }
  // Keys in the documented order first (nlohmann sorts objects, so print by hand).
  std::printf("{\"concurrency\": %s, \"tok_s\": %s, \"bound_tok_s\": %s, \"ratio\": %s, \"expert_busy\": %s, "
              "\"expert_busy_workers\": %s, \"read_gbps\": %s, \"sim_expert_gbps\": %s, "
              "\"routed_bytes_per_token\": %s, \"prompt_len\": %s, \"output_len\": %s, \"ttft_s\": %s, "
              "\"workers\": %s, \"micro_batches\": %s, \"threads\": %s, \"read_method\": %s%s}\n",
              out["concurrency"].dump().c_str(), out["tok_s"].dump().c_str(), out["bound_tok_s"].dump().c_str(),
              out["ratio"].dump().c_str(), out["expert_busy"].dump().c_str(), out["expert_busy_workers"].dump().c_str(),
              out["read_gbps"].dump().c_str(), out["sim_expert_gbps"].dump().c_str(),
              out["routed_bytes_per_token"].dump().c_str(), out["prompt_len"].dump().c_str(),
              out["output_len"].dump().c_str(), out["ttft_s"].dump().c_str(), out["workers"].dump().c_str(),
              out["micro_batches"].dump().c_str(), out["threads"].dump().c_str(), out["read_method"].dump().c_str(), constrained.c_str());
  return 0;
}

}  // namespace numoe::bench
