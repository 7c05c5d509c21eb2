// numoe plan: how many workers this (or a described) machine runs, where, and why; optionally the
// systemd units or Kubernetes manifest that start them. The rules live in deploy/planner.h.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "common/args.h"
#include "backends/cuda/cuda_model.h"
#include "common/choices.h"
#include "common/topology.h"
#include "deploy/emit.h"
#include "deploy/launch.h"
#include "deploy/model_memory.h"
#include "deploy/planner.h"
#include "model/spec_policy.h"

namespace numoe::cli {
namespace {

// Exit codes (also in --help).
constexpr int kExitOk = 0;
constexpr int kExitError = 1;        // unreadable model/topology, bad values, emit failed
constexpr int kExitUsage = 2;        // ArgParser's code for bad flags
constexpr int kExitDoesNotFit = 3;   // the machine cannot hold one copy of the routed experts

int Fail(const char* prog, const Status& s, int code = kExitError) {
  std::fprintf(stderr, "%s: %s\n", prog, std::string(s.message()).c_str());
  return code;
}

// `--emit KIND DIR` takes two words, which ArgParser does not: take DIR out of argv here, leaving
// `--emit KIND` for the parser. Also accepts `--emit=KIND DIR`.
std::vector<char*> TakeEmitDir(int argc, char** argv, std::string* dir, bool* missing) {
  std::vector<char*> out;
  for (int i = 0; i < argc; ++i) {
    out.push_back(argv[i]);
    std::string a = argv[i];
    int kind_at = a == "--emit" ? i + 1 : (a.rfind("--emit=", 0) == 0 ? i : -1);
    if (kind_at < 0) continue;
    if (kind_at != i) {
      if (kind_at >= argc) break;
      out.push_back(argv[++i]);
    }
    if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
      *dir = argv[++i];
    } else {
      *missing = true;
    }
  }
  return out;
}

}  // namespace

int RunPlan(int argc, char** argv) {
  const char* prog = argv[0];
  std::string emit_dir;
  bool emit_dir_missing = false;
  std::vector<char*> args = TakeEmitDir(argc, argv, &emit_dir, &emit_dir_missing);

  std::string model_dir, config_file, topology_file, emit;
  deploy::EmitOptions eo;
  eo.launch.backend = Backend::kAuto;
  int64_t instances = 0, max_batch_tokens = deploy::kDefaultMaxBatchTokens;
  double headroom_gb = static_cast<double>(deploy::kDefaultOsHeadroomBytes) / kBytesPerGB;
  double headroom_pct = deploy::kDefaultOsHeadroomFraction * 100.0;
  double repack_pct = deploy::kDefaultRepackOverhead * 100.0;
  bool json = false, force = false, available = false;

  ArgParser p(prog,
              "Plan numoe-workers from the NUMA topology and the model's memory: one worker per NUMA node that\n"
              "holds a copy of the routed experts, small nodes paired into one interleaved worker. Prints each\n"
              "memory term, the placement with its numactl binding, and why; optionally writes launch files.");
  p.AddString("model", "DIR", "checkpoint directory (config.json; drafter stages from its tensor index)", &model_dir);
  p.AddString("config", "FILE", "a config.json instead of a checkpoint (shape-only planning)", &config_file);
  p.AddString("topology", "FILE.json",
              "describe a machine instead of probing this one: {\"name\": ..., \"nodes\": [{\"id\", \"cpus\" (count, "
              "list or \"0-23\"), \"memory_gb\", optional \"cores\", \"dimms\", \"available_gb\"}], optional "
              "\"distances\"}",
              &topology_file);
  p.AddInt("instances-per-node", "N",
           "workers on each node that holds a copy; 0 = one (more split the node's bandwidth, so each is slower)",
           &instances, 0, 256);
  p.AddFlag("json", "print the plan as JSON ({\"workers\": [{\"nodes\", \"need_gb\", \"threads\", ...}], "
                    "\"terms\": [...], ...})",
            &json);
  p.AddString("emit", "systemd|k8s DIR",
              "also write launch files into DIR: systemd units (numoe-gpu, numoe-worker-N, numoe-router, "
              "numoe.target) or a Kubernetes manifest (numoe.yaml)",
              &emit);
  p.AddFlag("force", "let --emit overwrite files that exist in DIR", &force);
  p.AddFlag("available-memory", "plan on memory available now (free + reclaimable) rather than installed", &available);
  p.AddDouble("os-headroom-gb", "GB", "memory kept free per node for the kernel, daemons and page cache",
              &headroom_gb, 0.0, 1e6);
  p.AddDouble("os-headroom-pct", "PCT", "...but at most this % of a node's memory (small machines)", &headroom_pct,
              0.0, 99.0);
  p.AddDouble("repack-overhead-pct", "PCT",
              "repacking overhead, % of the expert bytes (tile padding, alignment, huge pages, staging)",
              &repack_pct, 0.0, 100.0);
  p.AddInt("max-batch-tokens", "N", "tokens in flight per micro-batch (sizes the activation buffers)",
           &max_batch_tokens, 1, int64_t{1} << 24);
  // The daemons' options, shared with `numoe serve` (deploy/launch.h); --drafter-experts also decides
  // whether the drafter's experts count in each worker's memory.
  deploy::AddLaunchFlags(p, &eo.launch);
  p.AddString("bin-dir", "DIR", "--emit: where numoe-gpu, numoe-worker and numoe-router are installed",
              &eo.bin_dir);
  p.AddInt("gpu-node", "N", "--emit: NUMA node numoe-gpu runs on, nearest its GPU; -1 = the first node",
           &eo.gpu_numa_node, -1, 1 << 16);
  p.AddInt("gpu-port", "N", "--emit: numoe-gpu's gRPC port", &eo.launch.gpu_port, 1, 65535);
  p.AddInt("worker-port", "N", "--emit: worker i's gRPC port is N + i", &eo.launch.worker_base_port, 1, 65535);
  p.AddString("hostname", "NAME", "--emit k8s: kubernetes.io/hostname of the machine", &eo.k8s_hostname);
  p.AddString("image", "IMAGE", "--emit k8s: container image with the numoe binaries and numactl", &eo.image);
  p.AddEpilog(
      "Sizes are GB = 1e9 bytes. Exit status: 0 plan made; 1 error (unreadable model or topology, emit failed);\n"
      "2 bad flags; 3 the machine cannot hold one copy of the routed experts (the output says how much is\n"
      "missing).\n\n"
      "examples:\n"
      "  numoe plan --model /models/DeepSeek-V4-Flash-0731\n"
      "  numoe plan --config v4-flash-0731.config.json --topology 4x192gb.json --json\n"
      "  numoe plan --model /models/v4 --emit systemd ./units\n");
  int rc = 0;
  if (!p.ParseOrExit(static_cast<int>(args.size()), args.data(), &rc)) return rc;
  if (model_dir.empty() == config_file.empty()) {
    std::fprintf(stderr, "%s: give exactly one of --model DIR or --config FILE\n(run '%s --help' for usage)\n", prog,
                 prog);
    return kExitUsage;
  }
  if (!emit.empty() && emit != "systemd" && emit != "k8s") {
    std::fprintf(stderr, "%s: --emit must be systemd or k8s (got '%s')\n", prog, emit.c_str());
    return kExitUsage;
  }
  if (!emit.empty() && (emit_dir_missing || emit_dir.empty())) {
    std::fprintf(stderr, "%s: --emit %s needs a directory: --emit %s DIR\n", prog, emit.c_str(), emit.c_str());
    return kExitUsage;
  }

  deploy::PlanOptions options;
  options.drafter_experts = eo.launch.drafter_experts;
  options.instances_per_node = static_cast<int>(instances);
  options.os_headroom_bytes = static_cast<int64_t>(std::llround(headroom_gb * kBytesPerGB));
  options.os_headroom_fraction = headroom_pct / 100.0;
  options.repack_overhead = repack_pct / 100.0;
  options.max_batch_tokens = max_batch_tokens;
  options.plan_on_available = available;

  auto model = deploy::LoadModelMemory(model_dir.empty() ? config_file : model_dir);
  if (!model.ok()) return Fail(prog, model.status());
  auto topology = topology_file.empty() ? ProbeTopology() : LoadTopologyFile(topology_file);
  if (!topology.ok()) return Fail(prog, topology.status());
  auto plan = deploy::MakePlan(*topology, *model, options);
  if (!plan.ok()) return Fail(prog, plan.status());

  const std::string out = json ? deploy::FormatPlanJson(*plan) : deploy::FormatPlanText(*plan);
  std::fputs(out.c_str(), stdout);
  std::fflush(stdout);
  if (!plan->fits()) return kExitDoesNotFit;

  if (!emit.empty()) {
    std::error_code ec;
    eo.launch.model_dir = model_dir.empty() ? "/path/to/model" : std::filesystem::absolute(model_dir, ec).string();
    // auto: what this machine has (a described --topology does not say whether it has GPUs).
    eo.launch.backend = ResolveBackend(eo.launch.backend, CudaDeviceCount());
    if (eo.gpu_numa_node >= 0 && topology->IndexOf(eo.gpu_numa_node) < 0) {
      return Fail(prog, absl::InvalidArgumentError(absl::StrCat("--gpu-node ", eo.gpu_numa_node, " is not a node of ",
                                                                topology->name)),
                  kExitUsage);
    }
    // What numoe-gpu and the workers would refuse at start, refused before any file is written.
    if (Status st = model_dir.empty() ? CheckDrafterExperts(eo.launch.drafter_experts, eo.launch.backend)
                                      : deploy::CheckLaunchOptions(eo.launch);
        !st.ok()) {
      return Fail(prog, st);
    }
    auto files = emit == "systemd" ? deploy::RenderSystemd(*plan, eo) : deploy::RenderKubernetes(*plan, eo);
    if (!files.ok()) return Fail(prog, files.status());
    auto written = deploy::WriteEmittedFiles(*files, emit_dir, force);
    if (!written.ok()) return Fail(prog, written.status());
    std::fprintf(stderr, "%s: wrote %zu file%s to %s%s\n", prog, written->size(), written->size() == 1 ? "" : "s",
                 emit_dir.c_str(), model_dir.empty() ? " (set --model in them: planned from a config)" : "");
  }
  return kExitOk;
}

}  // namespace numoe::cli
