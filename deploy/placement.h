// Where numoe-workers run: the one placement rule, a pure function of the machine and the request.
//
// `numoe plan` and `numoe serve` (through MakePlan in planner mode, directly in --workers N mode) and the
// benchmarks call PlaceWorkers(); numoe-worker applies its WorkerPlacement (common/topology.h) as given,
// through worker/service/numa_bind.h, and chooses nothing itself.
//
// The rule. Nodes are taken in the order of Topology::nodes ("position"); a worker's CPU ids are
// ascending.
//
//   Planner mode (request.workers == 0): memory decides how many workers a node runs.
//     * A node whose usable bytes hold one worker's need runs one worker (instances_per_node = N: exactly
//       N, an error when N copies or N CPUs do not fit it), bound to the node: memory MPOL_BIND to it,
//       CPUs its own.
//     * Nodes too small for a copy are grouped: start from the lowest remaining position, add the nearest
//       node (NUMA distance, then position) that completes a copy, else the nearest node, until the group
//       holds one. The group runs one worker, memory interleaved over its nodes, CPUs all of theirs. Small
//       nodes that cannot complete a copy together run nothing.
//     * Workers are numbered in the position order of their first node.
//   --workers N mode (request.workers = N > 0): the count is given; memory is not checked.
//     * Worker i runs on the node at position i % (number of nodes), bound to it; the workers of one node
//       are its slots 0, 1, ... in index order.
//
//   Both modes, workers sharing a node (S slots):
//     * The node's CPUs are split into S disjoint shares so SMT siblings stay together under Linux's
//       numbering (node 0 = 0-23 and 96-119): each contiguous run of ids is cut into S parts and slot k
//       takes part k of every run; plain chunks when a run is shorter than S. With more slots than CPUs
//       (--workers N only), slot k gets the one CPU at k % CPUs, shared.
//   Both modes, threads:
//     * threads = one per physical core of the worker's CPUs when the node's core count is known (the
//       expert kernels are bandwidth-bound; an SMT sibling adds contention, not bytes per second), else
//       one per logical CPU; threads_per_worker > 0 replaces it (an error above the worker's CPUs).
//     * Kernel thread t is pinned to the worker's t-th CPU (thread_cpus = the first `threads` of cpus):
//       Linux lists one hardware thread of every core before any sibling, so these are distinct cores.
//     * CPU ids unknown (a JSON description giving "cpus" as a count): cpus and thread_cpus stay empty and
//       the worker runs on all CPUs of its nodes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/topology.h"

namespace numoe::deploy {

struct PlacementRequest {
  // --workers N mode when > 0; 0 = planner mode (the fields below decide).
  int workers = 0;
  // Planner mode: one worker's need (> 0) and each node's usable bytes, in the order of Topology::nodes.
  int64_t need_bytes = 0;
  std::vector<int64_t> usable_bytes;
  int instances_per_node = 0;  // planner mode: 0 = one worker per node that holds a copy; N = exactly N
  // Both modes: kernel threads per worker; 0 = the rule's (one per physical core of its CPUs).
  int threads_per_worker = 0;
  // The flags the caller took `workers` and `threads_per_worker` from, for error messages.
  std::string workers_flag = "--workers";
  std::string threads_flag = "--threads-per-worker";
};

// The placement of every worker, by index. Errors (InvalidArgument, naming the flag) for an invalid
// topology or request, --instances-per-node values that do not fit a node, and a thread count above a
// worker's CPUs. A machine too small for one copy is not an error in planner mode: no workers.
StatusOr<std::vector<WorkerPlacement>> PlaceWorkers(const Topology& topology, const PlacementRequest& request);

}  // namespace numoe::deploy
