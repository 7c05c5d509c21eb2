#include "gpu_service/gpu_flags.h"

#include "absl/strings/str_cat.h"

namespace numoe::gpu {

void AddGpuFlags(ArgParser& p, GpuAppConfig* c) {
  p.AddString("model", "DIR", "checkpoint directory (the same one the workers load)", &c->model_dir, true);
  p.AddEnum("backend", "model backend (auto = cuda when a CUDA device is present, else cpu)", &c->backend);
  p.AddString("host", "ADDR", "address to listen on", &c->host);
  p.AddInt("port", "N", "gRPC port (0 = any free port)", &c->port, 0, 65535);
  p.AddInt("heartbeat-ms", "MS", "heartbeat interval workers are told to use", &c->heartbeat_ms, 10, 60000);
  p.AddInt("lease-ms", "MS", "silence after which a worker is freed (0 = 4 x heartbeat)", &c->lease_ms, 0, 3600000);
  p.AddInt("max-workers", "N", "workers served at once", &c->max_workers, 1, 4096);
  p.AddInt("spin-us", "US", "busy-poll on the shared-memory doorbell before sleeping", &c->spin_us, 0, 100000);
  p.AddInt("max-sequences", "N", "sequences one worker may run at once (and the CUDA backend's total)",
           &c->max_sequences, 1, 65536);
  p.AddInt("threads", "N", "--backend cpu: threads for the model's matmuls (0 = every usable CPU)", &c->threads, 0,
           4096);
  p.AddInt("cuda-device", "N", "--backend cuda: first GPU", &c->cuda_device, 0, 1024);
  p.AddInt("tp", "N", "--backend cuda: tensor-parallel GPUs (--cuda-device onwards, or --gpus)", &c->tp, 1, 64);
  p.AddIntList("gpus", "LIST",
               "--backend cuda: the GPUs to use, in rank order (e.g. 0,1; sets --tp to their number)", &c->gpus);
  p.AddInt("lanes", "N",
           "--backend cuda: workers whose steps interleave, each on its own lane (CUDA stream, activation scratch, "
           "pinned staging, graphs: about 1.3 GiB of GPU memory per lane at V4-Flash width, taken when a worker "
           "first steps), so the GPU runs one worker's layers while others compute their experts; further workers "
           "take whole-step turns. 0 = every worker takes whole-step turns. Needs --tp 1 and no DSpark drafter",
           &c->lanes, 0, 64);
  p.AddEnum("drafter-experts",
            "--backend cuda, DSpark drafter: where its stages' routed experts run: worker (the CPU worker, like the "
            "main model's) or gpu (copied to this GPU: 3.3 GB per stage at V4-Flash width; no host round trip per "
            "stage; numoe-bench cuda --draft-experts measures the difference)",
            &c->drafter_experts);
  p.AddEnum("spec",
            "speculative decoding: the model drafter to load (auto = the checkpoint's: dspark with DSpark stages, "
            "mtp with MTP stages, else none; --backend cuda runs dspark with --tp 1 and no mtp). ngram and none load "
            "no drafter; the drafts of workers started with --spec ngram are verified whatever this says",
            &c->spec);
  p.AddFlag("no-prefix-cache",
            "turn the prefix cache off: every prompt is computed from its first token (by default prompts that share "
            "a prefix with earlier ones, from any worker, resume from its cached state)",
            &c->no_prefix_cache);
  p.AddDouble("prefix-cache-gb", "GB",
              "memory for the prefix cache's checkpoints (the backend's own: RAM on the CPU backend, GPU memory on "
              "CUDA); the least recently used go past it",
              &c->prefix_cache_gb, 0.0, 1e6);
  p.AddDouble("prefix-cache-host-gb", "GB",
              "host RAM for the prefix cache's second tier (pinned on CUDA): checkpoints the first tier evicts move "
              "there instead of being dropped, the compressed history of a shared prefix held once; the least "
              "recently used go past it (0 = no second tier)",
              &c->prefix_cache_host_gb, 0.0, 1e6);
  p.AddInt("prefix-checkpoint-tokens", "N",
           "prefix cache: a checkpoint every N tokens of a long prompt, besides the ones at each prompt's and "
           "answer's end (0 = only those)",
           &c->prefix_checkpoint_tokens, 0, int64_t{1} << 30);
  p.AddInt("gpu-prefill-threshold", "N",
           "--backend cuda: GPU prefill: a device pass of at least N rows (a long prompt's chunk) computes its routed "
           "experts on the GPU from the worker's shared expert arena, uploading one layer while the previous one "
           "computes (two layer buffers of GPU memory), instead of on the worker's CPUs. -1 = calibrate per worker at "
           "its registration: N = one layer's upload time (measured host-to-device bandwidth) / the worker's measured "
           "expert time per row and layer; 0 = never. Logged with its inputs; unused on the cpu backend",
           &c->gpu_prefill_threshold, -1, int64_t{1} << 30);
  p.AddInt("pass-rows", "N",
           "--backend cuda: rows per device pass (larger steps run as consecutive passes). GPU prefill uploads every "
           "layer's experts once per pass, so bigger passes pay less PCIe per prompt token, for activation scratch "
           "that grows with N (the backend logs its memory)",
           &c->pass_rows, 1, 65536);
  AddMergeLanesFlag(p, "", &c->merge_lanes);
}

void AddMergeLanesFlag(ArgParser& p, const std::string& what, MergeLanes* out) {
  p.AddEnum("merge-lanes",
            what + "merged passes: decode steps of several workers that wait for the model at the same time run as "
                   "one batched step (dense weights read once for all their rows), each worker computing its own "
                   "rows' experts at once. on / off; auto = off on both backends, where it was measured slower than "
                   "separate lanes (README \"Merged passes\")",
            out);
}

Status ResolveGpus(GpuAppConfig* c, int cuda_devices) {
  if (!c->gpus.empty()) {
    const int64_t n = static_cast<int64_t>(c->gpus.size());
    if (c->tp != 1 && c->tp != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tp ", c->tp, " disagrees with --gpus, which lists ", n, " GPU(s): give one of them"));
    }
    if (c->cuda_device != 0) {
      return absl::InvalidArgumentError("--cuda-device and --gpus both pick GPUs: give only --gpus");
    }
    for (size_t i = 0; i < c->gpus.size(); ++i) {
      for (size_t j = 0; j < i; ++j) {
        if (c->gpus[j] == c->gpus[i]) {
          return absl::InvalidArgumentError(absl::StrCat("--gpus lists GPU ", c->gpus[i], " twice"));
        }
      }
    }
    for (size_t i = 0; i < c->gpus.size(); ++i) {
      if (cuda_devices >= 0 && c->gpus[i] >= cuda_devices) {
        return absl::InvalidArgumentError(absl::StrCat("--gpus: GPU ", c->gpus[i], " requested but this machine has ",
                                                       cuda_devices, " CUDA device(s)"));
      }
    }
    c->tp = n;
  } else if (cuda_devices >= 0 && c->backend == Backend::kCuda && c->tp > 1 && c->cuda_device + c->tp > cuda_devices) {
    return absl::InvalidArgumentError(absl::StrCat("--tp ", c->tp, " from --cuda-device ", c->cuda_device,
                                                   " needs GPUs ", c->cuda_device, "..", c->cuda_device + c->tp - 1,
                                                   " but this machine has ", cuda_devices, " CUDA device(s)"));
  }
  if (c->backend != Backend::kCuda && (c->tp != 1 || !c->gpus.empty() || c->cuda_device != 0)) {
    return absl::InvalidArgumentError(absl::StrCat("--tp, --gpus and --cuda-device choose GPUs for --backend cuda; ",
                                                   "the backend is ", ChoiceName(c->backend)));
  }
  return absl::OkStatus();
}

std::vector<std::string> GpuArgv(const GpuAppConfig& c) { return ArgvOf(c, AddGpuFlags); }

}  // namespace numoe::gpu
