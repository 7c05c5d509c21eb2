// numoe-bench hop: the round trip of one layer hop over the shared-memory data plane, between two
// processes. The gpu side is numoe-gpu's own ShmExpertBackend::RunRouted (copy the MoE rows, expert ids
// and weights into the channel, ring, wait, copy the sum out); the worker side answers each MoeRequest the
// way RemoteExecutor does, minus the expert compute. So the figure is the transport cost a decode step
// pays twice per layer on top of the real work.
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/commands.h"
#include "common/args.h"
#include "common/shm_channel.h"
#include "gpu_service/shm_experts.h"
#include "nlohmann/json.hpp"

namespace numoe::bench {
namespace {

Status Pin(int cpu) {
  if (cpu < 0) return absl::OkStatus();
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--cpus: cannot pin to CPU ", cpu));
  }
  return absl::OkStatus();
}

// The worker side: answer every MoeRequest at once until the gpu side closes the channel.
[[noreturn]] void Responder(shm::Channel* ch) {
  for (;;) {
    auto t = ch->Receive(-1);
    if (!t.ok()) _exit(0);  // closed by the parent
    if (*t != shm::MsgType::kMoeRequest) _exit(3);
    shm::MsgHeader& out = ch->outgoing();
    out.layer = ch->incoming().layer;
    out.rows = ch->incoming().rows;
    out.compute_ns = 0;
    if (!ch->Send(shm::MsgType::kMoeResponse).ok()) _exit(4);
  }
}

double Pct(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  size_t k = std::min(v.size() - 1, static_cast<size_t>(p / 100.0 * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<long>(k), v.end());
  return v[k];
}

}  // namespace

int RunHopBench(int argc, char** argv) {
  int64_t iters = 20000, warmup = 2000, rows = 1, hidden = 4096, top_k = 6, spin_us = 50;
  std::string cpus;
  bool json_only = false;
  ArgParser p(argv[0], "Layer-hop round trip over the shared-memory channel between two processes (no compute).");
  p.AddInt("iters", "N", "timed hops", &iters, 1, 100000000);
  p.AddInt("warmup", "N", "untimed hops first", &warmup, 0, 100000000);
  p.AddInt("rows", "R", "MoE rows per hop (tokens in the step)", &rows, 1, 65536);
  p.AddInt("hidden", "D", "row width (V4-Flash: 4096)", &hidden, 1, 65536);
  p.AddInt("top-k", "K", "routed experts per row (V4-Flash: 6)", &top_k, 1, 64);
  p.AddInt("spin-us", "US", "doorbell busy-poll before sleeping on the futex (numoe-gpu's default: 50)", &spin_us, 0,
           1000000);
  p.AddString("cpus", "A,B", "pin the gpu side to CPU A and the worker side to CPU B", &cpus);
  p.AddFlag("json", "print only the JSON line", &json_only);
  int rc = 0;
  if (!p.ParseOrExit(argc, argv, &rc)) return rc;
  int cpu_gpu = -1, cpu_worker = -1;
  if (!cpus.empty()) {
    auto list = ParseIntList(cpus, "--cpus");
    if (!list.ok() || list->size() != 2) {
      std::fprintf(stderr, "%s: --cpus takes two CPU numbers, e.g. 0,1\n", argv[0]);
      return 2;
    }
    cpu_gpu = static_cast<int>((*list)[0]);
    cpu_worker = static_cast<int>((*list)[1]);
  }

  shm::Geometry g{.hidden = static_cast<uint32_t>(hidden),
                  .top_k = static_cast<uint32_t>(top_k),
                  .max_rows = static_cast<uint32_t>(rows),
                  .max_seqs = 1,
                  .vocab = 1,
                  .logits_rows = 0};
  auto ch = shm::Channel::CreateAnonymous(g, {.spin_us = static_cast<int>(spin_us), .poll_ms = 20});
  if (!ch.ok()) {
    std::fprintf(stderr, "%s: %s\n", argv[0], ch.status().ToString().c_str());
    return 1;
  }
  const pid_t parent = getpid();
  const pid_t child = fork();
  if (child < 0) {
    std::perror("fork");
    return 1;
  }
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(0);
    (*ch)->BindAfterFork(shm::Side::kWorker);
    if (!Pin(cpu_worker).ok()) _exit(5);
    Responder(ch->get());
  }
  if (Status st = Pin(cpu_gpu); !st.ok()) {
    std::fprintf(stderr, "%s: %s\n", argv[0], st.ToString().c_str());
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    return 2;
  }

  // The gpu side, through the production ExpertBackend.
  gpu::ShmExpertBackend backend(ch->get(), nullptr);
  std::vector<float> x(static_cast<size_t>(rows * hidden), 0.5f), out(x.size());
  std::vector<int32_t> ids(static_cast<size_t>(rows * top_k));
  std::vector<float> weights(ids.size(), 1.0f / static_cast<float>(top_k));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i % 256);
  MoeRequest req{.layer = 0, .rows = rows, .top_k = top_k, .x = x.data(), .expert_ids = ids.data(),
                 .expert_weights = weights.data(), .out = out.data()};
  std::vector<double> us;
  us.reserve(static_cast<size_t>(iters));
  Status st;
  for (int64_t i = 0; i < warmup + iters && st.ok(); ++i) {
    req.layer = i % 43;
    const auto t0 = std::chrono::steady_clock::now();
    st = backend.RunRouted(req);
    const auto t1 = std::chrono::steady_clock::now();
    if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  (*ch)->Close();
  int wstatus = 0;
  waitpid(child, &wstatus, 0);
  if (!st.ok()) {
    std::fprintf(stderr, "%s: %s\n", argv[0], st.ToString().c_str());
    return 1;
  }
  double sum = 0;
  for (double v : us) sum += v;
  const double p50 = Pct(us, 50), p90 = Pct(us, 90), p99 = Pct(us, 99), p999 = Pct(us, 99.9);
  const double mx = *std::max_element(us.begin(), us.end());
  const double mean = sum / static_cast<double>(us.size());
  const double bytes = static_cast<double>(rows) * (2.0 * hidden * 4 + top_k * 8);
  if (!json_only) {
    std::printf("layer hop over shm (2 processes%s): %lld hops of %lld row(s) x %lld floats (+%lld routes), "
                "%.1f KiB moved per hop\n",
                cpus.empty() ? ", unpinned" : (", pinned " + cpus).c_str(), static_cast<long long>(iters),
                static_cast<long long>(rows), static_cast<long long>(hidden), static_cast<long long>(top_k),
                bytes / 1024.0);
    std::printf("  p50 %.2f us   p90 %.2f us   p99 %.2f us   p99.9 %.2f us   max %.1f us   mean %.2f us\n", p50, p90,
                p99, p999, mx, mean);
    std::printf("  targets: p50 <= 10 us (%s), p99 <= 50 us (%s); a V4-Flash decode step makes 43 hops\n",
                p50 <= 10 ? "met" : "missed", p99 <= 50 ? "met" : "missed");
  }
  nlohmann::json j = {{"bench", "hop"},        {"iters", iters},    {"rows", rows},   {"hidden", hidden},
                      {"top_k", top_k},        {"spin_us", spin_us}, {"pinned", !cpus.empty()},
                      {"p50_us", p50},         {"p90_us", p90},      {"p99_us", p99}, {"p999_us", p999},
                      {"max_us", mx},          {"mean_us", mean},    {"bytes_per_hop", bytes}};
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace numoe::bench
