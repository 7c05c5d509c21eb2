// numoe-bench prefix: the prefix cache over a multi-turn conversation through `numoe serve` (REST
// /v1/completions, streaming, token-id prompts).
//
// The conversation: a system prompt of --system-tokens random ordinary ids, then --turns turns; turn t sends
// the whole history (system prompt, every earlier user message and answer) plus a new user message of
// --user-tokens ids, and its answer (--max-tokens tokens, greedy, EOS ignored) joins the history. Each turn
// is sent twice:
//   cold: the same length, but its first token changed, so nothing of it is cached (what a server without
//         the cache computes);
//   warm: the real history, which the cache holds from the turns before (numoe-gpu checkpoints each prompt
//         one token before its end and each answer at its end).
// Per turn: time to first token cold and warm, their ratio, the tokens restored (the usage chunk's
// prompt_tokens_details.cached_tokens) and recomputed (prompt - restored). The hit rate is the restored
// tokens over the resent ones (each turn's prompt less its new user message), over turns 2 onwards.
// The last line is one JSON object: {"turns": [{"prompt", "resent", "cached", "recomputed", "ttft_cold_s",
// "ttft_warm_s", "ratio"}...], "hit_rate", "warm_over_cold" (the last turn's ratio), "last_cached", ...}.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/str_join.h"
#include "bench/commands.h"
#include "bench/serve_harness.h"
#include "common/args.h"
#include "common/checkpoint.h"
#include "nlohmann/json.hpp"

namespace numoe::bench {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

double Ttft(const StreamResult& r) { return r.events.empty() ? 0.0 : Since(r.sent, r.events.front().first); }

}  // namespace

int RunPrefixBench(int argc, char** argv) {
  std::string model, backend = "cpu";
  int64_t workers = 1, threads = 0, system_tokens = 2048, turns = 8, user_tokens = 256, max_tokens = 32;
  int64_t checkpoint_tokens = -1;
  double cache_gb = -1, host_gb = -1;
  ServeBenchFlags common;
  ArgParser p(argv[0],
              "The prefix cache over a multi-turn conversation through `numoe serve`: per turn, time to first token\n"
              "of the whole history with nothing cached (cold) and as the cache holds it (warm), tokens restored\n"
              "and recomputed; the hit rate over the resent tokens.");
  p.AddString("model", "DIR", "checkpoint directory (e.g. tests/data/demo-v4)", &model, true);
  p.AddInt("workers", "N", "numoe serve --workers", &workers, 1, 64);
  p.AddInt("threads", "N", "numoe serve --threads-per-worker (0 = the worker's CPUs)", &threads, 0, 4096);
  p.AddString("backend", "cpu|cuda", "numoe serve --backend", &backend);
  p.AddInt("system-tokens", "N", "tokens of the system prompt every turn starts with", &system_tokens, 1, 1 << 20);
  p.AddInt("turns", "N", "turns of the conversation", &turns, 1, 1000);
  p.AddInt("user-tokens", "N", "tokens of each turn's new user message", &user_tokens, 1, 1 << 20);
  p.AddInt("max-tokens", "T", "tokens of each answer (greedy, EOS ignored)", &max_tokens, 1, 1 << 16);
  p.AddDouble("prefix-cache-gb", "GB", "numoe serve --prefix-cache-gb (-1 = its default)", &cache_gb, -1, 1e6);
  p.AddDouble("prefix-cache-host-gb", "GB", "numoe serve --prefix-cache-host-gb (-1 = its default)", &host_gb, -1,
              1e6);
  p.AddInt("prefix-checkpoint-tokens", "N", "numoe serve --prefix-checkpoint-tokens (-1 = its default)",
           &checkpoint_tokens, -1, int64_t{1} << 30);
  AddServeBenchFlags(p, &common, "give up on a request after this long");
  p.AddEpilog(
      "\nExample (the small trained fixture on the CPU backend, context 4096: the last turn resends a ~3.8K-token\n"
      "prefix):\n"
      "  numoe-bench prefix --model tests/data/demo-v4 --system-tokens 2048 --turns 8 --user-tokens 220\n");
  int rc = 0;
  if (!p.ParseOrExit(argc, argv, &rc)) return rc;
  const auto fail = [&](const Status& st) { return BenchFail(argv[0], st); };
  auto say = [&](const std::string& line) { BenchSay(common.json_only, line); };
  int64_t vocab = 0;
  {
    auto ck = Checkpoint::Open(model);
    if (!ck.ok()) return fail(ck.status());
    vocab = (*ck)->config().vocab_size;
  }
  if (vocab <= 32) return fail(absl::InvalidArgumentError("--model: the vocabulary is too small for random prompts"));

  const std::string& log_dir = common.MakeLogDir("prefix");
  // The router's prefix affinity stays at serve's default: a conversation's turns share their prefix.
  ServeSpec serve_spec{.model = model, .backend = backend, .spec = "none", .log_dir = log_dir, .workers = workers,
                       .threads = threads, .affinity_prefix_tokens = -1};
  if (cache_gb >= 0) serve_spec.extra.insert(serve_spec.extra.end(), {"--prefix-cache-gb", absl::StrCat(cache_gb)});
  if (host_gb >= 0) serve_spec.extra.insert(serve_spec.extra.end(), {"--prefix-cache-host-gb", absl::StrCat(host_gb)});
  if (checkpoint_tokens >= 0) {
    serve_spec.extra.insert(serve_spec.extra.end(), {"--prefix-checkpoint-tokens", std::to_string(checkpoint_tokens)});
  }
  auto endpoints = ServeCommand(serve_spec);
  if (!endpoints.ok()) return fail(endpoints.status());
  const int* port = &endpoints->port;
  const std::vector<std::string>& serve_argv = endpoints->argv;
  say("starting: " + absl::StrJoin(serve_argv, " "));
  ServeProcess serve;
  if (Status st = serve.Start(serve_argv, log_dir + "/serve.log"); !st.ok()) return fail(st);
  auto ready = serve.WaitReady(common.startup_timeout);
  if (!ready.ok()) return fail(ready.status());
  say("ready: " + *ready);

  // Warm-up: one short request, so the first cold turn pays no first-call costs.
  {
    StreamResult w = StreamCompletion(*port, RandomPrompt(16, 7777, vocab), 2, common.request_timeout);
    if (!w.status.ok()) return fail(w.status);
  }
  std::vector<int32_t> history = RandomPrompt(system_tokens, 1, vocab);
  say("turn  prompt  resent  cached  recomputed  ttft_cold_s  ttft_warm_s  warm/cold");
  json jturns = json::array();
  int64_t resent_total = 0, hit_total = 0;
  double last_ratio = 0;
  int64_t last_cached = 0;
  for (int64_t t = 0; t < turns; ++t) {
    const int64_t resent = t == 0 ? 0 : static_cast<int64_t>(history.size());
    std::vector<int32_t> user = RandomPrompt(user_tokens, 100 + static_cast<uint64_t>(t), vocab);
    std::vector<int32_t> prompt = history;
    prompt.insert(prompt.end(), user.begin(), user.end());
    std::vector<int32_t> cold_prompt = prompt;
    cold_prompt[0] = static_cast<int32_t>(16 + (cold_prompt[0] - 16 + 1 + t) % (vocab - 16));  // shares nothing
    StreamResult cold = StreamCompletion(*port, cold_prompt, max_tokens, common.request_timeout);
    if (!cold.status.ok()) return fail(cold.status);
    StreamResult warm = StreamCompletion(*port, prompt, max_tokens, common.request_timeout);
    if (!warm.status.ok()) return fail(warm.status);
    if (warm.cached_tokens < 0) return fail(absl::DataLossError("the usage chunk carried no cached_tokens"));
    const int64_t cached = warm.cached_tokens;
    const double ttft_cold = Ttft(cold), ttft_warm = Ttft(warm);
    const double ratio = ttft_cold > 0 ? ttft_warm / ttft_cold : 0;
    if (t > 0) {
      resent_total += resent;
      hit_total += std::min(cached, resent);
    }
    last_ratio = ratio;
    last_cached = cached;
    char line[256];
    std::snprintf(line, sizeof(line), "%-5lld %-7zu %-7lld %-7lld %-11lld %-12.4f %-12.4f %.3f",
                  static_cast<long long>(t + 1), prompt.size(), static_cast<long long>(resent),
                  static_cast<long long>(cached), static_cast<long long>(prompt.size()) - static_cast<long long>(cached),
                  ttft_cold, ttft_warm, ratio);
    say(line);
    jturns.push_back({{"prompt", prompt.size()},
                      {"resent", resent},
                      {"cached", cached},
                      {"recomputed", static_cast<int64_t>(prompt.size()) - cached},
                      {"ttft_cold_s", ttft_cold},
                      {"ttft_warm_s", ttft_warm},
                      {"ratio", ratio}});
    history = std::move(prompt);
    history.insert(history.end(), warm.token_ids.begin(), warm.token_ids.end());
  }
  const double hit_rate = resent_total > 0 ? static_cast<double>(hit_total) / static_cast<double>(resent_total) : 0;
  say(absl::StrCat("hit rate ", Fmt(100 * hit_rate, 1), "% of ", resent_total, " resent tokens; last turn: ", last_cached,
                   " tokens restored, warm TTFT ", Fmt(100 * last_ratio, 1), "% of cold"));
  serve.Stop(30);
  std::printf("{\"turns\": %s, \"hit_rate\": %s, \"warm_over_cold\": %s, \"last_cached\": %lld, \"system_tokens\": %lld, "
              "\"user_tokens\": %lld, \"max_tokens\": %lld, \"workers\": %lld, \"backend\": %s}\n",
              jturns.dump().c_str(), json(hit_rate).dump().c_str(), json(last_ratio).dump().c_str(),
              static_cast<long long>(last_cached), static_cast<long long>(system_tokens),
              static_cast<long long>(user_tokens), static_cast<long long>(max_tokens), static_cast<long long>(workers),
              json(backend).dump().c_str());
  return 0;
}

}  // namespace numoe::bench
