// numoe-gpu as a program: load the model on the chosen backend, serve GpuService over gRPC, stop on
// SIGINT/SIGTERM. gpu_service/gpu_flags.h turns the command line into a GpuAppConfig and back.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/choices.h"
#include "common/status.h"

namespace numoe::gpu {

struct GpuAppConfig {
  std::string model_dir;
  Backend backend = Backend::kCpu;    // kAuto: cuda when a CUDA device is present, else cpu
  std::string host = "127.0.0.1";
  int64_t port = 50051;               // 0 = any free port (logged and sent to NUMOE_NOTIFY_FD)
  int64_t heartbeat_ms = 500;
  int64_t lease_ms = 0;               // 0 = 4 x heartbeat_ms
  int64_t max_workers = 64;
  int64_t spin_us = 50;               // channel busy-poll before sleeping
  int64_t threads = 0;                // CPU backend threads (0 = every usable CPU)
  int64_t max_sequences = 256;        // per worker channel, and live sequences of the CUDA backend
  int64_t cuda_device = 0;            // --backend cuda: first GPU
  int64_t tp = 1;                     // --backend cuda: tensor-parallel GPUs
  std::vector<int> gpus;              // --backend cuda: the GPUs, in rank order (empty: cuda_device onwards)
  int64_t lanes = 4;                  // --backend cuda: workers whose steps interleave (CudaOptions::lanes)
  // --backend cuda: where the DSpark stages' routed experts run.
  DrafterExperts drafter_experts = DrafterExperts::kWorker;
  // Speculative decoding (model/spec_policy.h): auto (the checkpoint's drafter when the backend runs it:
  // the CPU backend runs DSpark and MTP, the CUDA backend DSpark with tp 1), dspark / mtp (load that
  // drafter; refused before loading when the checkpoint lacks it or the backend cannot run it), ngram /
  // none (no drafter loaded; n-gram drafts come from the workers). Verification needs a backend that
  // rolls back (both do).
  SpecChoice spec = SpecChoice::kAuto;
  // The prefix cache (model/prefix_cache.h): off with --no-prefix-cache; its checkpoints' memory in GiB
  // (the backend's own: RAM on the CPU backend, GPU memory on CUDA), then its host-RAM tier's (0 = none); a
  // checkpoint every N tokens of a long prompt.
  bool no_prefix_cache = false;
  double prefix_cache_gb = 4.0;
  double prefix_cache_host_gb = 8.0;
  int64_t prefix_checkpoint_tokens = 2048;
  // GPU prefill (--backend cuda): device passes of at least this many rows compute their routed experts on the
  // GPU from the worker's expert arena, streamed over PCIe layer by layer. -1 = calibrated per worker from the
  // measured host-to-device bandwidth and the worker's expert speed; 0 = never.
  int64_t gpu_prefill_threshold = -1;
  // --backend cuda: rows per device pass (CudaOptions::max_step_tokens; larger steps run as several passes).
  // GPU prefill uploads every layer once per pass, so bigger passes cost less PCIe per prompt token, for
  // activation scratch that grows with the rows (logged by the backend's description).
  int64_t pass_rows = 2048;
  MergeLanes merge_lanes = MergeLanes::kAuto;  // --merge-lanes (gpu_service/merged_step.h)

  bool operator==(const GpuAppConfig&) const = default;
};

// Runs until SIGINT/SIGTERM; returns the process exit code (errors are logged).
int RunGpuApp(const GpuAppConfig& config);

}  // namespace numoe::gpu
