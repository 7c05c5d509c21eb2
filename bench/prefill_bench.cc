// numoe-bench prefill: time to first token and prefill tokens/s of long prompts through the served stack
// (`numoe serve`, REST /v1/completions, streaming), one prompt at a time, next to the compute bound of the
// routed experts on the worker that prefills it.
//
//   1. the routed-expert FLOPs per prompt token, from the checkpoint's config: 2 x 3 x hidden x moe_inter per
//      expert (gate, up, down), top-k experts per layer, every layer;
//   2. the multiply instruction's register-resident peak on worker-0's threads (the placement `numoe serve
//      --workers N` gives it), measured before the server starts: AMX bf16 tiles where the CPU has AMX, else
//      AVX-512 VNNI int8, else none (no bound is printed). One sequence is prefilled by one worker, so the
//      bound of one prompt is that worker's peak / FLOPs per token;
//   3. `numoe serve` as a child (bench/serve_harness.h), one warm-up request, then for every prompt length
//      (default 1K, 4K, 16K, 32K; lengths that do not fit the model's context are skipped and said so) --runs
//      prompts of random ordinary ids (different prompts: nothing is shared between them), each
//      `max_tokens` 1, greedy: TTFT is from the request's send to its first token, prefill tok/s = length / TTFT.
//   4. --backend cuda: the same with GPU prefill off and on (numoe-gpu --gpu-prefill-threshold 0, 1, or -1 =
//      calibrated: --gpu-prefill off,on,auto), next to the PCIe bound of GPU prefill: every device pass
//      uploads every layer's experts (packed bytes of the checkpoint's shapes), so a prompt of n tokens in
//      passes of p rows (min(n, --prefill-chunk, --max-step-tokens, --pass-rows)) costs
//      ceil(n / p) x expert bytes / the host-to-device bandwidth measured here (pinned memory, rank 0's GPU).
//   5. --decode-streams N: each length once more with N greedy decode streams (short prompts) running beside the
//      prompt: their aggregate tok/s over --decode-window seconds before it is sent and from its send to its first
//      token, i.e. what a long prompt costs the streams already running.
// The last line is one JSON object: {"prompt_len", "ttft_s", "prefill_tok_s", "bound_tok_s", "ratio",
// "peak_tflops", "peak_isa", "flops_per_token", "skipped"} (lists per prompt length; medians over --runs; those
// of the first --gpu-prefill mode), "gpu_prefill" (the modes) and "modes" ({mode: {"ttft_s", "prefill_tok_s"}}),
// ("beside_decode": [{"prompt_len", "ttft_s", "decode_tok_s_alone", "decode_tok_s_beside"}] with --decode-streams),
// "prefill_lane_tokens" (the --prefill-lane-tokens values; with some, every mode runs once per value and the
// modes are named "<mode>/lane<N>"),
// and with cuda "h2d_gbps", "expert_bytes_per_pass", "pass_rows" and "h2d_bound_tok_s" (per prompt length).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "backends/cuda/cuda_model.h"
#include "bench/commands.h"
#include "bench/read_bandwidth.h"
#include "bench/serve_harness.h"
#include "common/args.h"
#include "common/checkpoint.h"
#include "common/packed_layout.h"
#include "common/thread_pool.h"
#include "nlohmann/json.hpp"
#include "worker/experts/isa.h"
#include "worker/experts/kernel_ops.h"
#include "gpu_service/gpu_app.h"
#include "worker/service/worker_app.h"

namespace numoe::bench {
namespace {

namespace fs = std::filesystem;

struct Peak {
  const char* isa = "none";
  double flops = 0;  // FLOP/s on all of worker 0's threads
};

StatusOr<Peak> MeasurePeak(const WorkerPlacement& w) {
  Peak peak;
  const bool amx = IsaAvailable(Isa::kAmx), avx512 = IsaAvailable(Isa::kAvx512);
  if (!amx && !avx512) return peak;
  ASSIGN_OR_RETURN(auto pool, ThreadPool::Create({.num_threads = w.threads, .cpus = w.thread_cpus}));
  std::vector<double> per_thread(pool->size());
  pool->RunOnAll([&](int t) {
    per_thread[t] = amx ? experts::AmxBf16PeakFlops(0.5) : experts::Avx512VnniPeakFlops(0.5);
  });
  peak.isa = amx ? "amx-bf16" : "avx512-vnni-int8";
  for (double f : per_thread) peak.flops += f;
  return peak;
}

// One long prompt sent while `streams` greedy decode streams run: their aggregate tok/s over `window` seconds
// before the prompt is sent, and from its send to its first token.
struct BesideDecode {
  double ttft_s = 0, alone_tok_s = 0, beside_tok_s = 0;
};
StatusOr<BesideDecode> PrefillBesideDecode(int port, int64_t n, const std::vector<int32_t>& prompt, int64_t streams,
                                           double window, const ModelConfig& cfg, double timeout_s) {
  std::atomic<bool> stop{false};
  std::vector<StreamResult> results(static_cast<size_t>(streams));
  std::vector<std::thread> threads;
  const int64_t max_tokens = std::max<int64_t>(16, std::min<int64_t>(cfg.max_position_embeddings - 64, 1 << 20));
  for (int64_t i = 0; i < streams; ++i) {
    threads.emplace_back([&, i] {
      results[static_cast<size_t>(i)] =
          StreamCompletion(port, RandomPrompt(32, 50000 + static_cast<uint64_t>(i), cfg.vocab_size), max_tokens,
                           timeout_s, "", &stop);
    });
  }
  // Every stream must be decoding before the window opens: give their prompts time, then measure.
  std::this_thread::sleep_for(std::chrono::duration<double>(std::max(2.0, window / 2)));
  const auto a0 = Clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(window));
  const StreamResult r = StreamCompletion(port, prompt, 1, timeout_s);
  stop = true;
  for (auto& t : threads) t.join();
  if (!r.status.ok()) return Status(r.status.code(), absl::StrCat("prompt of ", n, " tokens beside decode: ", r.status.message()));
  if (r.events.empty()) return absl::DataLossError(absl::StrCat("prompt of ", n, " tokens beside decode: no token"));
  const auto first = r.events.front().first;
  BesideDecode out;
  out.ttft_s = Since(r.sent, first);
  int64_t alone = 0, beside = 0;
  for (const StreamResult& s : results) {
    if (!s.status.ok()) return Status(s.status.code(), absl::StrCat("decode stream: ", s.status.message()));
    for (const auto& [t, k] : s.events) {
      if (t >= a0 && t < r.sent) alone += k;
      if (t >= r.sent && t < first) beside += k;
    }
  }
  if (alone == 0) return absl::DeadlineExceededError("no decode stream produced a token in the window before the prompt");
  out.alone_tok_s = static_cast<double>(alone) / Since(a0, r.sent);
  out.beside_tok_s = static_cast<double>(beside) / out.ttft_s;
  return out;
}

}  // namespace

int RunPrefillBench(int argc, char** argv) {
  std::string model, lens_text = "1024,4096,16384,32768", backend = "cpu";
  int64_t workers = 1, threads = 0, runs = 1, lanes = -1, prefill_chunk = -1, max_step_tokens = 0, pass_rows_flag = 0;
  int64_t decode_streams = 0, piece_rows = -1;
  double decode_window = 3.0;
  std::string modes_text, lane_text;
  ServeBenchFlags common;
  ArgParser p(argv[0],
              "Time to first token and prefill tokens/s of long prompts through `numoe serve` (one prompt at a time),\n"
              "next to the routed experts' compute bound on the worker that prefills it (its threads' measured\n"
              "multiply peak / routed FLOPs per token).");
  p.AddString("model", "DIR", "checkpoint directory (e.g. from `numoe mkmodel --preset v4-flash --layers 6`)", &model,
              true);
  p.AddInt("workers", "N", "numoe serve --workers", &workers, 1, 64);
  p.AddInt("threads", "N", "numoe serve --threads-per-worker (0 = the worker's CPUs)", &threads, 0, 4096);
  p.AddString("prompt-lens", "1024,4096,16384,32768",
              "prompt lengths in tokens (those that do not fit the model's context are skipped)", &lens_text);
  p.AddInt("runs", "N", "prompts per length (medians are reported)", &runs, 1, 100);
  p.AddString("backend", "cpu|cuda", "numoe serve --backend", &backend);
  p.AddInt("lanes", "N", "numoe serve --lanes (--backend cuda; -1 = its default)", &lanes, -1, 64);
  p.AddInt("prefill-chunk", "N", "numoe serve --prefill-chunk (-1 = its default)", &prefill_chunk, -1, 65536);
  p.AddInt("max-step-tokens", "N", "numoe serve --max-step-tokens (0 = its default)", &max_step_tokens, 0, 16384);
  p.AddInt("pass-rows", "N", "numoe serve --pass-rows: numoe-gpu's rows per device pass (--backend cuda; 0 = its default)",
           &pass_rows_flag, 0, 65536);
  p.AddString("gpu-prefill", "LIST",
              "GPU prefill modes to run, in order: off (--gpu-prefill-threshold 0), on (1: every pass), auto (-1: "
              "calibrated); default off,on with --backend cuda, off with cpu",
              &modes_text);
  p.AddInt("decode-streams", "N",
           "after the prompts alone, prompt each length once more with N decode streams running beside it (short "
           "prompts, greedy): their tok/s in the --decode-window before the prompt and while it prefills "
           "(send to first token); 0 = off",
           &decode_streams, 0, 256);
  p.AddString("prefill-lane-tokens", "LIST",
              "numoe serve --prefill-lane-tokens values to run, in order, each with every --gpu-prefill mode (0 = "
              "no prefill lane: prompt chunks ride in the decode steps); default: the worker's default only",
              &lane_text);
  p.AddInt("prefill-lane-piece-rows", "N", "numoe serve --prefill-lane-piece-rows (-1 = the worker's default)",
           &piece_rows, -1, 65536);
  p.AddDouble("decode-window", "S", "--decode-streams: seconds of decode alone measured before the prompt is sent",
              &decode_window, 0.5, 600);
  AddServeBenchFlags(p, &common, "give up on a prompt after this long");
  p.AddEpilog(
      "\nExample (six full-width V4-Flash layers with all 256 experts, ~22 GB; each layer costs what a real one does):\n"
      "  numoe mkmodel --preset v4-flash --layers 6 --out /tmp/v4f-6l\n"
      "  numoe-bench prefill --model /tmp/v4f-6l --backend cuda --prompt-lens 1024,4096,16384 \\\n"
      "      --prefill-chunk 0 --max-step-tokens 16384 --pass-rows 16384\n"
      "Scale the 6-layer prefill tok/s by 6/43 for V4-Flash's 43 layers.\n");
  int rc = 0;
  if (!p.ParseOrExit(argc, argv, &rc)) return rc;
  const auto fail = [&](const Status& st) { return BenchFail(argv[0], st); };
  auto say = [&](const std::string& line) { BenchSay(common.json_only, line); };
  auto lens = ParseIntList(lens_text, "--prompt-lens");
  if (!lens.ok()) return fail(lens.status());
  if (lens->empty()) return fail(absl::InvalidArgumentError("--prompt-lens is empty"));
  for (int64_t n : *lens)
    if (n < 1 || n > (1 << 22)) return fail(absl::InvalidArgumentError("--prompt-lens values must be in [1, 4194304]"));

  if (modes_text.empty()) modes_text = backend == "cuda" ? "off,on" : "off";
  std::vector<std::string> modes = absl::StrSplit(modes_text, ',');
  for (const std::string& m : modes) {
    if (m != "off" && m != "on" && m != "auto") {
      return fail(absl::InvalidArgumentError(absl::StrCat("--gpu-prefill: '", m, "' is none of off, on, auto")));
    }
    if (m != "off" && backend != "cuda") {
      return fail(absl::InvalidArgumentError("--gpu-prefill on/auto needs --backend cuda"));
    }
  }

  std::vector<int64_t> lane_values;  // empty: the worker's default
  if (!lane_text.empty()) {
    auto l = ParseIntList(lane_text, "--prefill-lane-tokens");
    if (!l.ok()) return fail(l.status());
    for (int64_t v : *l) {
      if (v < 0) return fail(absl::InvalidArgumentError("--prefill-lane-tokens values must be >= 0"));
    }
    lane_values = *l;
  }
  // Every (GPU prefill mode, prefill lane) pair is one served stack, named "<mode>" or "<mode>/lane<N>".
  struct Config {
    std::string mode, name;
    int64_t lane = -1;  // -1: the worker's default
  };
  std::vector<Config> configs;
  for (const std::string& m : modes) {
    if (lane_values.empty()) configs.push_back({m, m, -1});
    for (int64_t v : lane_values) configs.push_back({m, absl::StrCat(m, "/lane", v), v});
  }

  // 1. FLOPs per prompt token in the routed experts.
  ModelConfig cfg;
  {
    auto ck = Checkpoint::Open(model);
    if (!ck.ok()) return fail(ck.status());
    cfg = (*ck)->config();
  }
  const double flops_per_token = 6.0 * static_cast<double>(cfg.hidden_size) * cfg.moe_intermediate_size *
                                 cfg.num_experts_per_tok * cfg.num_hidden_layers;
  std::vector<int64_t> fit, skipped;
  for (int64_t n : *lens) {
    // The prompt and its one generated token must fit the context.
    if (cfg.max_position_embeddings > 0 && n + 1 > cfg.max_position_embeddings) {
      skipped.push_back(n);
    } else {
      fit.push_back(n);
    }
  }
  say(absl::StrCat("model ", model, ": ", cfg.num_hidden_layers, " layers, hidden ", cfg.hidden_size, ", ",
                   cfg.n_routed_experts, " experts top-", cfg.num_experts_per_tok, " of ", cfg.moe_intermediate_size,
                   ", context ", cfg.max_position_embeddings, "; routed experts ", Fmt(flops_per_token / 1e9, 3),
                   " GFLOP per prompt token"));
  if (!skipped.empty()) {
    say(absl::StrCat("skipped (longer than the context of ", cfg.max_position_embeddings,
                     " positions): ", absl::StrJoin(skipped, ",")));
  }
  if (fit.empty()) return fail(absl::InvalidArgumentError("no --prompt-lens value fits the model's context"));

  // 2. The peak on worker 0's threads.
  auto wc = Worker0Placement(workers, threads);
  if (!wc.ok()) return fail(wc.status());
  auto peak = MeasurePeak(*wc);
  if (!peak.ok()) return fail(peak.status());
  const double bound = peak->flops > 0 ? peak->flops / flops_per_token : 0;
  if (peak->flops > 0) {
    say(absl::StrCat("peak on worker 0's ", wc->threads, " threads: ", Fmt(peak->flops / 1e12, 3), " TFLOP/s (",
                     peak->isa, ", register-resident): compute bound ", Fmt(bound, 1), " prompt tok/s"));
  } else {
    say("no AMX or AVX-512 on this CPU: no compute bound");
  }

  // 3. GPU prefill's PCIe bound: expert bytes per pass / the host-to-device bandwidth.
  const int64_t expert_bytes_per_pass =
      cfg.num_hidden_layers * cfg.n_routed_experts *
      experts::PackedExpertShape{cfg.hidden_size, cfg.moe_intermediate_size}.stride();
  double h2d_gbps = 0;
  std::vector<int64_t> pass_rows;
  std::vector<double> h2d_bound;
  if (backend == "cuda") {
    auto bw = MeasureHostToDeviceGBps(0, int64_t{1} << 30, 3);
    if (!bw.ok()) return fail(bw.status());
    h2d_gbps = *bw;
    const int64_t chunk = prefill_chunk >= 0 ? prefill_chunk : worker::WorkerAppConfig{}.prefill_chunk;
    const int64_t step = max_step_tokens > 0 ? max_step_tokens : worker::WorkerAppConfig{}.max_step_tokens;
    for (int64_t n : fit) {
      const int64_t rows = std::max<int64_t>(
          1, std::min({n, chunk > 0 ? chunk : n, step, pass_rows_flag > 0 ? pass_rows_flag : gpu::GpuAppConfig{}.pass_rows}));
      const double passes = static_cast<double>((n + rows - 1) / rows);
      pass_rows.push_back(rows);
      h2d_bound.push_back(static_cast<double>(n) / (passes * static_cast<double>(expert_bytes_per_pass) / (h2d_gbps * 1e9)));
    }
    say(absl::StrCat("host-to-device ", Fmt(h2d_gbps, 1), " GB/s (pinned, GPU 0); ",
                     Fmt(static_cast<double>(expert_bytes_per_pass) / 1e9, 2), " GB of experts per pass (",
                     Fmt(static_cast<double>(expert_bytes_per_pass) / (h2d_gbps * 1e9), 3), " s)"));
  }

  // 4. The served stack, once per GPU prefill mode.
  std::map<std::string, std::pair<std::vector<double>, std::vector<double>>> by_mode;  // mode -> (ttft, tok/s)
  std::vector<double> ttft_med, tok_s_med, ratios;
  std::map<std::string, nlohmann::json> out_beside;  // mode -> [{prompt_len, ttft_s, decode_tok_s_alone, ...}]
  for (const Config& config : configs) {
    const std::string& mode = config.name;
    const std::string& log_dir = common.MakeLogDir("prefill");
    ServeSpec spec{.model = model, .backend = backend, .spec = "none", .log_dir = log_dir, .workers = workers,
                   .threads = threads, .lanes = lanes};
    if (prefill_chunk >= 0) spec.extra = {"--prefill-chunk", std::to_string(prefill_chunk)};
    if (max_step_tokens > 0) {
      spec.extra.push_back("--max-step-tokens");
      spec.extra.push_back(std::to_string(max_step_tokens));
    }
    if (pass_rows_flag > 0) {
      spec.extra.push_back("--pass-rows");
      spec.extra.push_back(std::to_string(pass_rows_flag));
    }
    if (backend == "cuda") {
      spec.extra.push_back("--gpu-prefill-threshold");
      spec.extra.push_back(config.mode == "off" ? "0" : config.mode == "on" ? "1" : "-1");
    }
    if (config.lane >= 0) {
      spec.extra.push_back("--prefill-lane-tokens");
      spec.extra.push_back(std::to_string(config.lane));
    }
    if (piece_rows >= 0) {
      spec.extra.push_back("--prefill-lane-piece-rows");
      spec.extra.push_back(std::to_string(piece_rows));
    }
    auto endpoints = ServeCommand(spec);
    if (!endpoints.ok()) return fail(endpoints.status());
    say("GPU prefill " + mode + ": starting: " + absl::StrJoin(endpoints->argv, " "));
    ServeProcess serve;
    const auto t_start = Clock::now();
    std::string log_name = mode;
    std::replace(log_name.begin(), log_name.end(), '/', '-');
    if (Status st = serve.Start(endpoints->argv, log_dir + "/serve-" + log_name + ".log"); !st.ok()) return fail(st);
    auto ready = serve.WaitReady(common.startup_timeout);
    if (!ready.ok()) return fail(ready.status());
    say(absl::StrCat("ready in ", Fmt(Since(t_start, Clock::now()), 1), " s: ", *ready));
    const int port = endpoints->port;
    {
      StreamResult warm = StreamCompletion(port, RandomPrompt(16, 7777, cfg.vocab_size), 2, common.request_timeout);
      if (!warm.status.ok()) return fail(Status(warm.status.code(), absl::StrCat("warm-up: ", warm.status.message())));
    }

    auto& [mode_ttft, mode_rate] = by_mode[mode];
    for (size_t li = 0; li < fit.size(); ++li) {
      const int64_t n = fit[li];
      std::vector<double> ttft;
      for (int64_t run = 0; run < runs; ++run) {
        const StreamResult r = StreamCompletion(port, RandomPrompt(n, 1000 * (li + 1) + run, cfg.vocab_size), 1,
                                                common.request_timeout);
        if (!r.status.ok()) {
          return fail(Status(r.status.code(), absl::StrCat("prompt of ", n, " tokens: ", r.status.message())));
        }
        if (r.events.empty()) return fail(absl::DataLossError(absl::StrCat("prompt of ", n, " tokens: no token came back")));
        if (r.prompt_tokens >= 0 && r.prompt_tokens != n) {
          return fail(absl::DataLossError(absl::StrCat("prompt of ", n, " tokens: the server counted ", r.prompt_tokens)));
        }
        ttft.push_back(Since(r.sent, r.events.front().first));
      }
      const double t = Median(ttft), rate = n / t;
      mode_ttft.push_back(t);
      mode_rate.push_back(rate);
      if (&config == &configs.front()) {
        ttft_med.push_back(t);
        tok_s_med.push_back(rate);
        ratios.push_back(bound > 0 ? rate / bound : 0);
      }
      std::string bounds;
      if (bound > 0) bounds += absl::StrCat(", ", Fmt(rate / bound, 3), " of the CPU compute bound");
      if (!h2d_bound.empty()) {
        bounds += absl::StrCat(", ", Fmt(rate / h2d_bound[li], 3), " of the PCIe bound (", Fmt(h2d_bound[li], 1),
                               " tok/s in passes of ", pass_rows[li], " rows)");
      }
      say(absl::StrCat("  GPU prefill ", mode, ", prompt ", n, " tokens: first token after ", Fmt(t, 3), " s (median of ",
                       runs, "), ", Fmt(rate, 1), " prefill tok/s", bounds));
      if (decode_streams > 0) {
        auto beside = PrefillBesideDecode(port, n, RandomPrompt(n, 1000 * (li + 1) + 999, cfg.vocab_size),
                                          decode_streams, decode_window, cfg, common.request_timeout);
        if (!beside.ok()) return fail(beside.status());
        say(absl::StrCat("  GPU prefill ", mode, ", prompt ", n, " tokens beside ", decode_streams,
                         " decode streams: first token after ", Fmt(beside->ttft_s, 3), " s; decode ",
                         Fmt(beside->alone_tok_s, 1), " tok/s before it, ", Fmt(beside->beside_tok_s, 1),
                         " while it prefilled (", Fmt(100.0 * (1.0 - beside->beside_tok_s / beside->alone_tok_s), 1),
                         "% lost)"));
        out_beside[mode].push_back({{"prompt_len", n},
                                    {"ttft_s", beside->ttft_s},
                                    {"decode_tok_s_alone", beside->alone_tok_s},
                                    {"decode_tok_s_beside", beside->beside_tok_s}});
      }
    }
    serve.Stop(30.0);
  }

  nlohmann::json out = {{"prompt_len", fit},          {"ttft_s", ttft_med},         {"prefill_tok_s", tok_s_med},
                              {"bound_tok_s", bound},       {"ratio", ratios},            {"peak_tflops", peak->flops / 1e12},
                              {"peak_isa", peak->isa},      {"flops_per_token", flops_per_token},
                              {"skipped", skipped},         {"backend", backend}};
  out["gpu_prefill"] = modes;
  out["prefill_lane_tokens"] = lane_values;
  for (const auto& [mode, v] : by_mode) out["modes"][mode] = {{"ttft_s", v.first}, {"prefill_tok_s", v.second}};
  for (const auto& [mode, v] : out_beside) out["modes"][mode]["beside_decode"] = v;
  if (backend == "cuda") {
    out["h2d_gbps"] = h2d_gbps;
    out["expert_bytes_per_pass"] = expert_bytes_per_pass;
    out["pass_rows"] = pass_rows;
    out["h2d_bound_tok_s"] = h2d_bound;
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace numoe::bench
