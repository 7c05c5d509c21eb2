// numoe-worker: one per NUMA node. Holds the routed experts in node-local memory, computes them on the
// CPU for numoe-gpu's per-layer requests, and runs the continuous-batching engine behind worker.proto.
#include "common/args.h"
#include "worker/service/worker_app.h"
#include "worker/service/worker_flags.h"

int main(int argc, char** argv) {
  numoe::worker::WorkerAppConfig c;
  numoe::ArgParser p("numoe-worker", "one per NUMA node: holds the routed experts, computes them on the CPU and "
                                     "batches sequences for numoe-gpu.");
  numoe::worker::AddWorkerFlags(p, &c);
  int rc = 0;
  if (!p.ParseOrExit(argc, argv, &rc)) return rc;
  return numoe::worker::RunWorkerApp(c);
}
