#include "gpu_service/gpu_flags.h"

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
  p.AddInt("tp", "N", "--backend cuda: tensor-parallel GPUs", &c->tp, 1, 64);
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
}

std::vector<std::string> GpuArgv(const GpuAppConfig& c) { return ArgvOf(c, AddGpuFlags); }

}  // namespace numoe::gpu
