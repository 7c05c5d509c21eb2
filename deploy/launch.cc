#include "deploy/launch.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/checkpoint.h"
#include "gpu_service/gpu_flags.h"
#include "model/spec_policy.h"
#include "worker/service/worker_flags.h"

namespace numoe::deploy {

void AddLaunchFlags(ArgParser& p, LaunchOptions* o) {
  p.AddEnum("backend", "numoe-gpu's model backend; auto = cuda when this machine has a CUDA device, else cpu",
            &o->backend);
  p.AddEnum("spec",
            "speculative decoding (numoe-gpu and every worker): auto = the checkpoint's drafter (dspark with DSpark "
            "stages, mtp with MTP stages, else none; --backend cuda has no mtp); ngram drafts from the prompt and "
            "generated text (no weights); none turns it off",
            &o->spec);
  p.AddInt("spec-depth", "K",
           "draft tokens per step (0 = the checkpoint's dspark_block_size, else 5); any --max-seqs x --spec-depth "
           "runs, drafts share --max-step-tokens",
           &o->spec_depth, 0, 16);
  p.AddFlag("spec-adaptive", "adapt each sequence's draft depth from its recent acceptance (up to --spec-depth)",
            &o->spec_adaptive);
  p.AddEnum("drafter-experts",
            "where the model drafter's routed experts run: worker (in every numoe-worker, counted in its memory) or "
            "gpu (numoe-gpu --drafter-experts gpu: copied to the GPU, 9.6 GiB at V4-Flash width; needs --backend "
            "cuda)",
            &o->drafter_experts);
  p.AddInt("tp", "N", "numoe-gpu --tp: tensor-parallel GPUs (--backend cuda)", &o->tp, 1, 64);
  p.AddIntList("gpus", "LIST", "numoe-gpu --gpus: the GPUs to use, in rank order (--backend cuda; sets --tp)",
               &o->gpus);
  p.AddInt("lanes", "N", "numoe-gpu --lanes: workers whose steps interleave on the GPU (--backend cuda; -1 = its default)",
           &o->lanes, -1, 64);
  p.AddFlag("no-prefix-cache", "numoe-gpu --no-prefix-cache: compute every prompt from its first token",
            &o->no_prefix_cache);
  p.AddDouble("prefix-cache-gb", "GB", "numoe-gpu --prefix-cache-gb: the prefix cache's memory (-1 = its default)",
              &o->prefix_cache_gb, -1, 1e6);
  p.AddDouble("prefix-cache-host-gb", "GB",
              "numoe-gpu --prefix-cache-host-gb: the prefix cache's host-RAM tier (0 = none, -1 = its default)",
              &o->prefix_cache_host_gb, -1, 1e6);
  p.AddInt("prefix-checkpoint-tokens", "N",
           "numoe-gpu --prefix-checkpoint-tokens: a prefix-cache checkpoint every N tokens of a long prompt (-1 = its "
           "default)",
           &o->prefix_checkpoint_tokens, -1, int64_t{1} << 30);
  p.AddInt("gpu-prefill-threshold", "N",
           "numoe-gpu --gpu-prefill-threshold: device passes of at least N rows compute their routed experts on the GPU "
           "from the workers' shared expert arenas (--backend cuda; -1 = calibrated at each worker's registration, its "
           "default; 0 = never)",
           &o->gpu_prefill_threshold, -1, int64_t{1} << 30);
  p.AddInt("pass-rows", "N",
           "numoe-gpu --pass-rows: rows per device pass (--backend cuda; 0 = its default): GPU prefill pays one "
           "upload of every layer per pass",
           &o->pass_rows, 0, 65536);
  gpu::AddMergeLanesFlag(p, "numoe-gpu --merge-lanes: ", &o->merge_lanes);
  p.AddInt("max-seqs", "N", "numoe-worker --max-seqs (0 = its default)", &o->max_seqs, 0, 4096);
  // 16384: the most numoe-gpu accepts per worker step (GpuServerOptions::max_step_tokens).
  p.AddInt("max-step-tokens", "N", "numoe-worker --max-step-tokens (0 = its default)", &o->max_step_tokens, 0,
           16384);
  p.AddInt("prefill-chunk", "N", "numoe-worker --prefill-chunk (-1 = its default)", &o->prefill_chunk, -1, 65536);
  p.AddInt("threads-per-worker", "N", "expert kernel threads per worker (0 = its CPUs)", &o->threads_per_worker, 0,
           4096);
  p.AddFlag("no-numa-bind", "start workers with --no-numa-bind (no NUMA rights, e.g. containers)", &o->no_numa_bind);
  worker::AddSimExpertGbpsFlag(p, absl::StrCat("numoe-worker --sim-expert-gbps for every worker: ", worker::kSimExpertGbpsHelp),
                               &o->sim_expert_gbps);
  p.AddInt("micro-batches", "N",
           "numoe-worker --micro-batches for every worker (0 = its default): N sessions per worker in numoe-gpu, so "
           "the GPU runs one micro-batch's layers while the worker computes another's experts; with --backend cuda "
           "and --lanes left at its default, numoe-gpu gets a lane for every session",
           &o->micro_batches, 0, worker::kMaxMicroBatches);
  p.AddInt("prefill-lane-tokens", "N",
           "numoe-worker --prefill-lane-tokens for every worker (-1 = its default; 0 = off): prompts of at least N "
           "tokens prefill in a lane of their own beside the decode steps (one more session per worker in "
           "numoe-gpu)",
           &o->prefill_lane_tokens, -1, int64_t{1} << 30);
  p.AddInt("prefill-lane-piece-rows", "N",
           "numoe-worker --prefill-lane-piece-rows for every worker (-1 = its default; 0 = whole calls)",
           &o->prefill_lane_piece_rows, -1, 65536);
  p.AddString("host", "ADDR", "address the router binds (REST and gRPC)", &o->router_host);
  p.AddInt("port", "N", "the router's REST port", &o->router_port, 0, 65535);
  p.AddInt("grpc-port", "N", "the router's gRPC port", &o->router_grpc_port, 0, 65535);
  p.AddInt("affinity-prefix-tokens", "N",
           "numoe-router --affinity-prefix-tokens: leading prompt tokens hashed for prefix affinity (-1 = the "
           "router's default; 0 = off, least outstanding work only)",
           &o->affinity_prefix_tokens, -1, 1 << 20);
  p.AddString("api-key-file", "PATH",
              "numoe-router --api-key-file: accept the keys in PATH, one per line ('#' comments); with "
              "$NUMOE_API_KEY too, either is accepted",
              &o->api_key_file);
  p.AddString("tls-cert", "PATH", "numoe-router --tls-cert: serve REST and gRPC over TLS with this PEM certificate",
              &o->tls_cert);
  p.AddString("tls-key", "PATH", "numoe-router --tls-key: the PEM private key of --tls-cert", &o->tls_key);
}

Status CheckLaunchOptions(const LaunchOptions& o, int cuda_devices) {
  RETURN_IF_ERROR(CheckDrafterExperts(o.drafter_experts, o.backend));
  gpu::GpuAppConfig g{.backend = o.backend, .tp = o.tp, .gpus = o.gpus};
  RETURN_IF_ERROR(gpu::ResolveGpus(&g, cuda_devices));
  ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(o.model_dir));
  return ResolveSpec(SpecFlags{.spec = o.spec, .depth = o.spec_depth, .adaptive = o.spec_adaptive},
                     DrafterOf(*ckpt, o.model_dir), KnownDrafterSupport(o.backend, g.tp))
      .status();
}

StatusOr<LaunchPlan> MakeLaunchPlan(const LaunchOptions& o, std::span<const WorkerPlacement> placements) {
  if (!o.worker_ports.empty() && o.worker_ports.size() != placements.size()) {
    return absl::InvalidArgumentError(absl::StrCat("worker_ports: ", o.worker_ports.size(), " ports for ",
                                                   placements.size(), " workers"));
  }
  LaunchPlan plan;
  gpu::GpuAppConfig& g = plan.gpu;
  g.model_dir = o.model_dir;
  g.backend = o.backend;
  g.host = o.host;
  g.port = o.gpu_port;
  g.spec = o.spec;
  g.drafter_experts = o.drafter_experts;
  g.tp = o.tp;
  g.gpus = o.gpus;
  // Sessions per worker in numoe-gpu: its micro-batches and its prefill lane.
  const int64_t lane_tokens =
      o.prefill_lane_tokens >= 0 ? o.prefill_lane_tokens : worker::WorkerAppConfig{}.prefill_lane_tokens;
  const int64_t sessions = std::max<int64_t>(o.micro_batches, 1) + (lane_tokens > 0 ? 1 : 0);
  if (o.lanes >= 0) {
    g.lanes = o.lanes;
  } else if (sessions > 1) {
    // Every micro-batch and prefill lane is a session of its own in numoe-gpu: one lane each, so none takes
    // whole-step turns. (64: the most numoe-gpu --lanes accepts.)
    g.lanes = std::clamp<int64_t>(sessions * static_cast<int64_t>(placements.size()), g.lanes, 64);
  }
  g.no_prefix_cache = o.no_prefix_cache;
  if (o.prefix_cache_gb >= 0) g.prefix_cache_gb = o.prefix_cache_gb;
  if (o.prefix_cache_host_gb >= 0) g.prefix_cache_host_gb = o.prefix_cache_host_gb;
  if (o.prefix_checkpoint_tokens >= 0) g.prefix_checkpoint_tokens = o.prefix_checkpoint_tokens;
  g.gpu_prefill_threshold = o.gpu_prefill_threshold;
  if (o.pass_rows > 0) g.pass_rows = o.pass_rows;
  g.merge_lanes = o.merge_lanes;
  // numoe-gpu's per-worker sequence bound must admit the workers' --max-seqs.
  g.max_sequences = std::max(g.max_sequences, o.max_seqs);

  router::RouterConfig& r = plan.router.router;
  r.model_dir = o.model_dir;
  r.host = o.router_host;
  r.http_port = o.router_port;
  r.grpc_port = o.router_grpc_port;
  if (o.affinity_prefix_tokens >= 0) r.balancer.policy.prefix_tokens = static_cast<int>(o.affinity_prefix_tokens);
  r.api_key_file = o.api_key_file;
  r.tls_cert = o.tls_cert;
  r.tls_key = o.tls_key;

  const std::string gpu_address = absl::StrCat(o.host, ":", o.gpu_port);
  for (size_t i = 0; i < placements.size(); ++i) {
    const WorkerPlacement& place = placements[i];
    worker::WorkerAppConfig w;
    w.model_dir = o.model_dir;
    w.gpu_address = gpu_address;
    w.host = o.host;
    w.port = o.worker_ports.empty() ? o.worker_base_port + static_cast<int64_t>(i) : o.worker_ports[i];
    w.worker_id = absl::StrCat("worker-", i);
    w.no_numa_bind = o.no_numa_bind || place.nodes.empty();
    if (!w.no_numa_bind) w.numa_nodes = place.nodes;
    // The placement already applied --threads-per-worker (PlaceWorkers / MakePlan): one pinned CPU per thread.
    w.cpus = place.thread_cpus;
    w.threads = place.threads;
    if (o.max_seqs > 0) w.max_seqs = o.max_seqs;
    if (o.max_step_tokens > 0) w.max_step_tokens = o.max_step_tokens;
    if (o.prefill_chunk >= 0) w.prefill_chunk = o.prefill_chunk;
    w.spec = o.spec;
    w.spec_depth = o.spec_depth;
    w.spec_adaptive = o.spec_adaptive;
    w.drafter_experts = o.drafter_experts;
    w.sim_expert_gbps = o.sim_expert_gbps;
    if (o.micro_batches > 0) w.micro_batches = o.micro_batches;
    if (o.prefill_lane_tokens >= 0) w.prefill_lane_tokens = o.prefill_lane_tokens;
    if (o.prefill_lane_piece_rows >= 0) w.prefill_lane_piece_rows = o.prefill_lane_piece_rows;
    r.balancer.workers.push_back(absl::StrCat(o.host, ":", w.port));
    plan.workers.push_back(std::move(w));
  }
  return plan;
}

}  // namespace numoe::deploy
