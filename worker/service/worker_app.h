// numoe-worker as a program: bind to the NUMA node(s), load the routed experts (with a progress bar),
// register with numoe-gpu and attach its shared-memory channel, run the batching engine, serve
// worker.proto over gRPC; stop on SIGINT/SIGTERM, or exit with an error when numoe-gpu goes away (the
// launcher restarts the worker, which then registers afresh). worker/service/worker_flags.h turns the
// command line into a WorkerAppConfig and back.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/choices.h"

namespace numoe::worker {

// How the routed experts are held: packed MXFP4 for the CPU kernels (ISA-dispatched; NUMOE_ISA forces
// one) or dequantized to fp32 (exact; small models only).
enum class ExpertsImpl { kKernels, kReference };

struct WorkerAppConfig {
  std::string model_dir;
  std::string gpu_address = "127.0.0.1:50051";  // numoe-gpu's gRPC address
  std::string host = "127.0.0.1";               // this worker's gRPC listen address
  int64_t port = 50061;                         // 0 = any free port (logged, and sent to NUMOE_NOTIFY_FD)
  std::vector<int> numa_nodes;                  // empty = not bound
  bool no_numa_bind = false;
  int64_t threads = 0;                          // kernel threads; 0 = one per `cpus` entry, else per usable CPU
  std::vector<int> cpus;                        // kernel thread i's CPU is cpus[i] (empty: unpinned)
  int64_t max_seqs = 16;
  int64_t max_step_tokens = 512;
  int64_t prefill_chunk = 256;
  int64_t max_queue = 256;
  int64_t default_max_tokens = 256;
  std::string worker_id;                        // default "worker-<nodes>-<pid>"
  int64_t gpu_wait_ms = 60000;                  // how long to retry registering while numoe-gpu starts
  ExpertsImpl experts = ExpertsImpl::kKernels;
  // Speculative decoding. spec: auto (numoe-gpu's model drafter when it loaded one, else none), none,
  // dspark / mtp (numoe-gpu must draft with it), ngram (drafted here; numoe-gpu verifies).
  // spec_depth 0 = the checkpoint's dspark_block_size, else 5. Checked against numoe-gpu at start-up
  // (model/spec_policy.h).
  SpecChoice spec = SpecChoice::kAuto;
  int64_t spec_depth = 0;
  bool spec_adaptive = false;
  // Where numoe-gpu runs the model drafter's routed experts: worker (this process holds them) or gpu
  // (numoe-gpu --drafter-experts gpu: this worker skips them; checked against numoe-gpu at registration).
  DrafterExperts drafter_experts = DrafterExperts::kWorker;
  // > 0: simulated routed experts (worker/experts/sim_experts.h): nothing is loaded, each MoE call sleeps
  // for its distinct experts' bytes at this many GB/s and returns zeros. 0 = the real experts.
  double sim_expert_gbps = 0;
  // Micro-batches (1 or 2): with 2 the worker registers twice with numoe-gpu (two sessions, channels and
  // lanes) and splits its sequences between them, so numoe-gpu runs one micro-batch's layers while this
  // worker computes the other's experts (worker/engine/micro_batch_executor.h).
  int64_t micro_batches = 1;
  // The prefill lane: prompts of at least this many tokens prefill in one more numoe-gpu session that shares
  // this worker's sequences, beside the decode steps, so a long prompt does not slow the running streams
  // (worker/engine/engine.h); 0 = off. Its expert calls run in pieces of at most prefill_lane_piece_rows rows,
  // each after the decode steps' waiting calls (0 = whole calls).
  int64_t prefill_lane_tokens = 2048;
  int64_t prefill_lane_piece_rows = 256;

  bool operator==(const WorkerAppConfig&) const = default;
};

// Runs until a signal (exit code 0) or a fatal error (1, logged).
int RunWorkerApp(const WorkerAppConfig& config);

}  // namespace numoe::worker

namespace numoe {
template <>
struct ChoiceTable<worker::ExpertsImpl> {
  static constexpr Choice<worker::ExpertsImpl> kChoices[] = {{worker::ExpertsImpl::kKernels, "kernels"},
                                                             {worker::ExpertsImpl::kReference, "reference"}};
};
}  // namespace numoe
