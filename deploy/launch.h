// One launch plan for the whole stack on one host: the config of numoe-gpu, of every numoe-worker and of
// numoe-router, decided once from `numoe serve`'s or `numoe plan`'s options and a worker placement.
// `numoe serve` starts its children from it (deploy/supervisor.h) and `numoe plan --emit` renders it into
// systemd units or a Kubernetes manifest (deploy/emit.h); both write the command lines with the daemons'
// own flag definitions (GpuArgv, WorkerArgv, RouterArgv), so the launchers cannot drift from the daemons.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "common/args.h"
#include "common/choices.h"
#include "common/status.h"
#include "deploy/planner.h"
#include "gpu_service/gpu_app.h"
#include "router/router_app.h"
#include "worker/service/worker_app.h"

namespace numoe::deploy {

// What serve and plan decide the same way. AddLaunchFlags registers the user-facing part on both.
struct LaunchOptions {
  std::string model_dir;                // every daemon's --model
  Backend backend = Backend::kAuto;     // resolve kAuto (ResolveBackend) before MakeLaunchPlan
  SpecChoice spec = SpecChoice::kAuto;  // numoe-gpu and every worker (model/spec_policy.h)
  int64_t spec_depth = 0;               // 0 = the checkpoint's dspark_block_size, else 5
  bool spec_adaptive = false;
  DrafterExperts drafter_experts = DrafterExperts::kWorker;
  int64_t tp = 1;                       // numoe-gpu --tp (--backend cuda)
  std::vector<int> gpus;                // numoe-gpu --gpus (--backend cuda; sets tp)
  int64_t lanes = -1;                   // numoe-gpu --lanes (--backend cuda); -1 = its default
  int64_t max_seqs = 0;                 // numoe-worker --max-seqs; 0 = its default
  int64_t max_step_tokens = 0;          // numoe-worker --max-step-tokens; 0 = its default
  int64_t prefill_chunk = -1;           // numoe-worker --prefill-chunk; -1 = its default
  int64_t threads_per_worker = 0;       // 0 = the placement's
  bool no_numa_bind = false;            // workers get --no-numa-bind (and the launch files no numactl)
  double sim_expert_gbps = 0;           // numoe-worker --sim-expert-gbps (every worker); 0 = real experts
  int64_t micro_batches = 0;            // numoe-worker --micro-batches (every worker); 0 = its default
  int64_t prefill_lane_tokens = -1;     // numoe-worker --prefill-lane-tokens (every worker); -1 = its default
  int64_t prefill_lane_piece_rows = -1; // numoe-worker --prefill-lane-piece-rows; -1 = its default
  // Addresses. numoe-gpu and the workers listen on `host` and reach each other there.
  std::string host = "127.0.0.1";
  int gpu_port = 50051;
  int worker_base_port = 50061;         // worker i listens on worker_base_port + i...
  std::vector<int> worker_ports;        // ...unless this gives one port per worker
  std::string router_host = "127.0.0.1";
  int router_port = 8000;               // REST
  int router_grpc_port = 8001;
  int64_t affinity_prefix_tokens = -1;  // numoe-router --affinity-prefix-tokens; -1 = its default
  // numoe-gpu's prefix cache: --no-prefix-cache, --prefix-cache-gb and --prefix-cache-host-gb (< 0 = their
  // defaults), --prefix-checkpoint-tokens (-1 = its default).
  bool no_prefix_cache = false;
  double prefix_cache_gb = -1;
  double prefix_cache_host_gb = -1;
  int64_t prefix_checkpoint_tokens = -1;
  int64_t gpu_prefill_threshold = -1;   // numoe-gpu --gpu-prefill-threshold (-1 = calibrate, its default; 0 = never)
  int64_t pass_rows = 0;                // numoe-gpu --pass-rows (--backend cuda); 0 = its default
  MergeLanes merge_lanes = MergeLanes::kAuto;  // numoe-gpu --merge-lanes
  std::string api_key_file;             // numoe-router --api-key-file ("" = none)
  std::string tls_cert, tls_key;        // numoe-router --tls-cert / --tls-key ("" = no TLS)
};

// --backend, --spec, --spec-depth, --spec-adaptive, --drafter-experts, --tp, --gpus, --lanes, --max-seqs,
// --max-step-tokens, --prefill-chunk, --threads-per-worker, --no-numa-bind, --sim-expert-gbps, --micro-batches, --host, --port,
// --grpc-port, --affinity-prefix-tokens, --api-key-file, --tls-cert and --tls-key (the router's) and numoe-gpu's
// --no-prefix-cache, --prefix-cache-gb, --prefix-cache-host-gb, --prefix-checkpoint-tokens, --gpu-prefill-threshold, --pass-rows,
// --merge-lanes,
// bound to `o`: the flags `numoe serve` and `numoe plan` share.
void AddLaunchFlags(ArgParser& p, LaunchOptions* o);

// The checks numoe-gpu and the workers would fail on, made before any child starts or any file is
// written: --tp / --gpus (gpu::ResolveGpus; against `cuda_devices` when it is known, >= 0, as for serve),
// --spec against the checkpoint and the backend (ResolveSpec), --drafter-experts against the backend.
// Opens o.model_dir's checkpoint.
Status CheckLaunchOptions(const LaunchOptions& o, int cuda_devices = -1);

struct LaunchPlan {
  gpu::GpuAppConfig gpu;
  std::vector<worker::WorkerAppConfig> workers;  // workers[i] applies placements[i]
  router::RouterAppConfig router;                // balances over every worker, in order
};

// The plan for `placements` (deploy/planner.h: nodes, cpus, threads of each worker). Worker i is
// "worker-<i>", bound to its placement's nodes and CPUs unless o.no_numa_bind or the placement has no
// nodes. InvalidArgument when worker_ports is given but its size is not the number of placements.
StatusOr<LaunchPlan> MakeLaunchPlan(const LaunchOptions& o, std::span<const WorkerPlacement> placements);

}  // namespace numoe::deploy
