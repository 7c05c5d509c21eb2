// numoe-gpu: one per host. Holds the non-expert model (attention, norms, gates, shared experts, caches,
// sampling) for every worker on the host; workers register over gRPC and exchange the per-layer MoE
// data over shared memory.
#include "common/args.h"
#include "gpu_service/gpu_app.h"
#include "gpu_service/gpu_flags.h"

int main(int argc, char** argv) {
  numoe::gpu::GpuAppConfig c;
  numoe::ArgParser p("numoe-gpu",
                     "one per host: attention, norms, gates, shared experts, caches and sampling for every worker.");
  numoe::gpu::AddGpuFlags(p, &c);
  int rc = 0;
  if (!p.ParseOrExit(argc, argv, &rc)) return rc;
  return numoe::gpu::RunGpuApp(c);
}
