// The deploy planner: how many numoe-workers a machine runs, and on which NUMA nodes.
//
// MakePlan(topology, model memory, options) works out what one worker needs and what each node offers,
// and leaves where the workers go to deploy/placement.h's PlaceWorkers(), the one placement rule;
// everything else (probing the machine, reading the model, printing, writing systemd units / k8s
// manifests) feeds it or formats its result. The launcher (`numoe serve`) calls PlanForThisMachine().
//
// The rules, and why:
//   * Decode speed is set by memory bandwidth, not capacity: every decoded token streams the chosen
//     experts' bytes (3.45 GB for V4-Flash) out of the DRAM the worker's copy lives in, so a worker is
//     bound to one node (threads and memory) and reads only that node's channels.
//   * One worker per node that can hold a copy (need + OS headroom <= node memory). Never two per node by
//     default: copies on one node split its bandwidth, and one worker batching several sequences reads
//     each expert once for all of them. PlanOptions::instances_per_node overrides, when they fit.
//   * Nodes too small for a copy are grouped (pairs first, the nearest by NUMA distance) into one worker
//     whose memory is interleaved over the group.
//   * Never a worker whose need exceeds the usable memory of its nodes; a machine that cannot hold one
//     copy gets a plan with no workers and Plan::shortfall_bytes saying how much is missing.
//
// Memory one worker needs (all bytes; GB in the output = 1e9 bytes), term by term:
//   routed experts           ModelMemory::routed_expert_bytes, as stored (MXFP4 nibbles + E8M0 scales)
//   drafter experts          ModelMemory::drafter_expert_bytes when the drafter's experts live on the CPU
//   repacking overhead       repack_overhead x (the two above): the kernel layout holds the same nibbles
//                            and scales reordered into tiles; the fraction covers tile padding, per-matrix
//                            alignment, huge-page rounding of the arena and the repack's staging buffers
//                            (the shards' page cache is reclaimable and not counted)
//   activations and buffers  micro_batches x max_batch_tokens x activation_bytes_per_token + fixed_buffer
//   OS headroom              per node, not per worker: kernel, page tables, daemons, a page-cache floor;
//                            8 GB, or 10% of nodes smaller than 80 GB
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/choices.h"
#include "common/status.h"
#include "common/topology.h"

namespace numoe::deploy {

// Defaults of PlanOptions, documented once.
inline constexpr double kDefaultRepackOverhead = 0.02;           // 2% of the expert bytes a worker holds
inline constexpr int64_t kDefaultMaxBatchTokens = 8192;          // tokens in flight per micro-batch (prefill chunk)
inline constexpr int kDefaultMicroBatches = 2;                   // the worker overlaps two micro-batches
inline constexpr int64_t kDefaultFixedBufferBytes = 1'000'000'000;  // process image, thread stacks and
                                                                    // per-thread scratch, shm rings, gRPC
inline constexpr int64_t kDefaultOsHeadroomBytes = 8'000'000'000;   // per node, at most...
inline constexpr double kDefaultOsHeadroomFraction = 0.10;          // ...and at most 10% of the node, so a
                                                                    // small dev box is not all headroom

// Worker-side bytes per token in flight: the MoE input row and the output row in fp32 (2 x hidden x 4),
// and per routed slot (top_k) the gate and up intermediates in fp32 (2 x intermediate x 4) plus the
// expert id and weight (8). V4-Flash: 2x4096x4 + 6x(2x2048x4 + 8) = 131,120 B.
int64_t WorkerActivationBytesPerToken(int64_t hidden, int64_t moe_intermediate, int64_t top_k);

// What the planner needs to know about the model: bytes only, so placement logic is testable without
// a checkpoint. deploy/model_memory.h fills it from a config or a checkpoint directory.
struct ModelMemory {
  std::string name;                         // shown in the output, e.g. "v4-flash-0731.config.json"
  int64_t routed_expert_bytes = 0;          // one copy of every main layer's routed experts, as stored
  int64_t drafter_expert_bytes = 0;         // routed experts of the DSpark/MTP stages; 0 = no drafter
  int64_t routed_bytes_per_token = 0;       // routed-expert bytes one decoded token reads (top-k per layer)
  int64_t activation_bytes_per_token = 0;   // see WorkerActivationBytesPerToken
  int64_t other_bytes = 0;                  // every other weight: numoe-gpu's share, not placed here
  // Shape facts for the explanation only; 0 / empty = unknown.
  int64_t num_layers = 0;
  int64_t num_experts = 0;                  // routed experts per layer
  int64_t top_k = 0;
  int64_t drafter_stages = 0;
  std::string drafter_kind;                 // "DSpark" or "MTP"; empty = "drafter"
  std::string expert_format;                // "MXFP4", "FP8", "BF16"
};

struct PlanOptions {
  // Where the drafter's routed experts live (common/choices.h): kWorker = in every worker, counted in its
  // need (the default: the GPU rarely has 10 GB to spare); kGpu = in numoe-gpu, not counted here.
  DrafterExperts drafter_experts = DrafterExperts::kWorker;
  int instances_per_node = 0;               // 0 = one worker per node that holds a copy; N = exactly N
  double repack_overhead = kDefaultRepackOverhead;  // fraction of the expert bytes, [0, 1]
  int64_t max_batch_tokens = kDefaultMaxBatchTokens;
  int micro_batches = kDefaultMicroBatches;
  int64_t fixed_buffer_bytes = kDefaultFixedBufferBytes;
  // OS headroom per node: min(os_headroom_bytes, os_headroom_fraction x node memory).
  int64_t os_headroom_bytes = kDefaultOsHeadroomBytes;
  double os_headroom_fraction = kDefaultOsHeadroomFraction;
  // Plan on the memory available now (free + reclaimable) instead of the node's memory: for a launcher
  // starting next to other memory users. Nodes with unknown availability use their memory.
  bool plan_on_available = false;
  // Kernel threads per worker (`numoe serve --threads-per-worker`); 0 = one per physical core of its CPUs.
  int threads_per_worker = 0;
};

// One line of the per-worker memory arithmetic.
struct MemoryTerm {
  std::string key;     // "routed_experts", "drafter_experts", "repack_overhead", "activations"
  std::string label;   // "routed experts"
  int64_t bytes = 0;
  std::string detail;  // the arithmetic and assumption behind it
};

// Per node: what it offers and what the plan does with it.
struct NodeUse {
  int id = 0;
  int64_t memory_bytes = 0;
  int64_t headroom_bytes = 0;  // OS headroom kept on this node
  int64_t usable_bytes = 0;    // memory (or available) minus OS headroom, >= 0
  int copies_fit = 0;          // floor(usable / need)
  std::vector<int> workers;    // indices of the workers using it
};

struct Plan {
  Topology topology;
  ModelMemory model;
  PlanOptions options;
  bool drafter_on_cpu = false;
  std::vector<MemoryTerm> terms;  // per worker, in print order
  int64_t worker_need_bytes = 0;  // sum of terms
  int64_t os_headroom_bytes = 0;  // per node (the cap; smaller nodes keep os_headroom_fraction)
  int64_t node_bytes_for_one_worker = 0;  // the smallest node memory that holds a worker plus headroom
  std::vector<WorkerPlacement> workers;
  std::vector<NodeUse> nodes;     // same order as topology.nodes
  std::vector<int> unused_nodes;  // ids of nodes no worker uses
  int64_t shortfall_bytes = 0;    // > 0 when not even one copy fits: how much is missing
  std::vector<std::string> explanation;  // why, in sentences
  std::vector<std::string> warnings;     // things to fix before starting (e.g. memory in use now)

  bool fits() const { return !workers.empty(); }
};

// Decides the placement. Errors (InvalidArgument) for an invalid topology, model or options, and for
// --instances-per-node values that do not fit a node; a machine too small for one copy is not an error:
// the plan has no workers and shortfall_bytes > 0.
StatusOr<Plan> MakePlan(const Topology& topology, const ModelMemory& model, const PlanOptions& options);

// The plan for the machine this runs on (ProbeTopology + MakePlan); ResourceExhausted, with the
// arithmetic in the message, when not one copy fits. What `numoe serve` follows without --workers.
StatusOr<Plan> PlanForThisMachine(const ModelMemory& model, const PlanOptions& options);

// Human output: the terms, the nodes, the workers with their numactl binding, and why.
std::string FormatPlanText(const Plan& plan);
// Machine output: {"workers": [{"nodes": [...], "need_gb": ..., "threads": ...}], "terms": [...], ...}.
std::string FormatPlanJson(const Plan& plan);

// OS headroom the planner keeps on a node of `memory_bytes`.
int64_t OsHeadroomBytes(int64_t memory_bytes, const PlanOptions& options);

// "147.17 GB" (bytes / 1e9, two decimals); below 1 GB "12.30 MB", below 1 MB "4.10 KB", below 1 KB "12 B".
std::string FormatBytes(int64_t bytes);

}  // namespace numoe::deploy
