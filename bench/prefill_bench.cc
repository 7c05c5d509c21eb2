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
// The last line is one JSON object: {"prompt_len", "ttft_s", "prefill_tok_s", "bound_tok_s", "ratio",
// "peak_tflops", "peak_isa", "flops_per_token", "skipped"} (lists per prompt length; medians over --runs).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench/commands.h"
#include "bench/read_bandwidth.h"
#include "bench/serve_harness.h"
#include "common/args.h"
#include "common/checkpoint.h"
#include "common/thread_pool.h"
#include "nlohmann/json.hpp"
#include "worker/experts/isa.h"
#include "worker/experts/kernel_ops.h"

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

}  // namespace

int RunPrefillBench(int argc, char** argv) {
  std::string model, lens_text = "1024,4096,16384,32768", backend = "cpu";
  int64_t workers = 1, threads = 0, runs = 1, lanes = -1, prefill_chunk = -1;
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
  AddServeBenchFlags(p, &common, "give up on a prompt after this long");
  p.AddEpilog(
      "\nExample (six full-width V4-Flash layers with all 256 experts, ~22 GB; each layer costs what a real one does):\n"
      "  numoe mkmodel --preset v4-flash --layers 6 --out /tmp/v4f-6l\n"
      "  numoe-bench prefill --model /tmp/v4f-6l --backend cuda --prompt-lens 1024,4096,16384\n"
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

  // 3. The served stack.
  const std::string& log_dir = common.MakeLogDir("prefill");
  ServeSpec spec{.model = model, .backend = backend, .spec = "none", .log_dir = log_dir, .workers = workers,
                 .threads = threads, .lanes = lanes};
  if (prefill_chunk >= 0) spec.extra = {"--prefill-chunk", std::to_string(prefill_chunk)};
  auto endpoints = ServeCommand(spec);
  if (!endpoints.ok()) return fail(endpoints.status());
  say("starting: " + absl::StrJoin(endpoints->argv, " "));
  ServeProcess serve;
  const auto t_start = Clock::now();
  if (Status st = serve.Start(endpoints->argv, log_dir + "/serve.log"); !st.ok()) return fail(st);
  auto ready = serve.WaitReady(common.startup_timeout);
  if (!ready.ok()) return fail(ready.status());
  say(absl::StrCat("ready in ", Fmt(Since(t_start, Clock::now()), 1), " s: ", *ready));
  const int port = endpoints->port;
  {
    StreamResult warm = StreamCompletion(port, RandomPrompt(16, 7777, cfg.vocab_size), 2, common.request_timeout);
    if (!warm.status.ok()) return fail(Status(warm.status.code(), absl::StrCat("warm-up: ", warm.status.message())));
  }

  std::vector<double> ttft_med, tok_s_med, ratios;
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
    ttft_med.push_back(t);
    tok_s_med.push_back(rate);
    ratios.push_back(bound > 0 ? rate / bound : 0);
    say(absl::StrCat("  prompt ", n, " tokens: first token after ", Fmt(t, 3), " s (median of ", runs, "), ",
                     Fmt(rate, 1), " prefill tok/s", bound > 0 ? absl::StrCat(", ", Fmt(rate / bound, 3), " of the compute bound") : ""));
  }
  serve.Stop(30.0);

  const nlohmann::json out = {{"prompt_len", fit},          {"ttft_s", ttft_med},         {"prefill_tok_s", tok_s_med},
                              {"bound_tok_s", bound},       {"ratio", ratios},            {"peak_tflops", peak->flops / 1e12},
                              {"peak_isa", peak->isa},      {"flops_per_token", flops_per_token},
                              {"skipped", skipped},         {"backend", backend}};
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace numoe::bench
