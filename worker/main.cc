// numoe-worker: one per NUMA node. Holds the routed experts in node-local memory, computes them on the
// CPU for numoe-gpu's per-layer requests, and runs the continuous-batching engine behind worker.proto.
#include <cstdio>

#include "common/args.h"
#include "common/topology.h"
#include "worker/service/worker_app.h"

int main(int argc, char** argv) {
  numoe::worker::WorkerAppConfig c;
  std::string numa_nodes, cpus;
  numoe::ArgParser p("numoe-worker", "one per NUMA node: holds the routed experts, computes them on the CPU and "
                                     "batches sequences for numoe-gpu.");
  p.AddString("model", "DIR", "checkpoint directory (the same one numoe-gpu loads)", &c.model_dir, true);
  p.AddString("gpu", "HOST:PORT", "numoe-gpu's gRPC address", &c.gpu_address);
  p.AddString("host", "ADDR", "address to listen on", &c.host);
  p.AddInt("port", "N", "gRPC port of the Worker service (0 = any free port)", &c.port, 0, 65535);
  p.AddString("numa-node", "N[,N...]", "bind threads and memory to these NUMA node(s) (several: interleaved)",
              &numa_nodes);
  p.AddFlag("no-numa-bind", "do not bind (machines or containers without NUMA rights)", &c.no_numa_bind);
  p.AddInt("threads", "N", "expert kernel threads (0 = one per --cpus CPU, else one per CPU of the bound nodes)",
           &c.threads, 0, 4096);
  p.AddString("cpus", "LIST", "pin kernel thread i to the i-th of these CPUs, e.g. 0-11,96-107 (one per thread; "
              "without it the threads run unpinned on the nodes' CPUs)", &cpus);
  p.AddInt("max-seqs", "N", "sequences running at once", &c.max_seqs, 1, 4096);
  p.AddInt("max-step-tokens", "N", "token budget of one step (decode tokens + prefill chunks)", &c.max_step_tokens, 1,
           65536);
  p.AddInt("prefill-chunk", "N", "prompt tokens of one sequence per step (0 = up to the budget)", &c.prefill_chunk, 0,
           65536);
  p.AddInt("max-queue", "N", "requests waiting beyond the running ones (then RESOURCE_EXHAUSTED)", &c.max_queue, 0,
           1000000);
  p.AddInt("default-max-tokens", "N", "max_new_tokens of requests that leave it 0", &c.default_max_tokens, 1,
           10000000);
  p.AddString("worker-id", "ID", "name reported to numoe-gpu and in stats (default worker-n<node>-<pid>)",
              &c.worker_id);
  p.AddInt("gpu-wait-ms", "MS", "keep retrying registration this long while numoe-gpu starts", &c.gpu_wait_ms, 0,
           3600000);
  p.AddString("experts", "kernels|reference",
              "routed experts: packed for the CPU kernels (NUMOE_ISA forces an ISA), or fp32 reference (small models)",
              &c.experts);
  p.AddString("spec", "auto|none|dspark|mtp|ngram",
              "speculative decoding: auto = numoe-gpu's model drafter when it loaded one (this worker then also "
              "holds the drafter stages' routed experts), else none; dspark/mtp must match numoe-gpu's --spec; "
              "ngram drafts here from prompt + generated text and numoe-gpu verifies",
              &c.spec);
  p.AddInt("spec-depth", "K", "draft tokens per step (0 = the checkpoint's dspark_block_size, else 5)", &c.spec_depth,
           0, 16);
  p.AddString("drafter-experts", "worker|gpu",
              "where numoe-gpu runs the model drafter's routed experts: worker (this process loads them) or gpu "
              "(numoe-gpu --drafter-experts gpu: not loaded here; must match numoe-gpu, checked at registration)",
              &c.drafter_experts);
  p.AddFlag("spec-adaptive", "adapt each sequence's depth from its recent acceptance (up to --spec-depth)",
            &c.spec_adaptive);
  int rc = 0;
  if (!p.ParseOrExit(argc, argv, &rc)) return rc;
  if (!numa_nodes.empty() && !c.no_numa_bind) {
    auto nodes = numoe::ParseIntList(numa_nodes, "--numa-node");
    if (!nodes.ok()) {
      std::fprintf(stderr, "numoe-worker: %s\n", std::string(nodes.status().message()).c_str());
      return 2;
    }
    for (int64_t n : *nodes) c.numa_nodes.push_back(static_cast<int>(n));
  }
  if (!cpus.empty()) {
    auto list = numoe::ParseCpuList(cpus, "--cpus");
    if (!list.ok()) {
      std::fprintf(stderr, "numoe-worker: %s\n", std::string(list.status().message()).c_str());
      return 2;
    }
    c.cpus = std::move(*list);
  }
  return numoe::worker::RunWorkerApp(c);
}
