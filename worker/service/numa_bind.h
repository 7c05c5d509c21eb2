// Applying a numoe-worker's placement: the process's CPUs (every thread created afterwards inherits
// them), its memory policy (MPOL_BIND to one node; MPOL_INTERLEAVE over several, for a worker spanning
// nodes too small for a copy each) and the CPU each kernel thread is pinned to. The placement is decided
// elsewhere (deploy/placement.h PlaceWorkers, reaching the worker as --numa-node / --cpus / --threads);
// this only checks and applies it, and chooses no CPU. Every failure is an error that says what failed
// and how to opt out (--no-numa-bind): a worker that silently runs unbound streams its experts from
// remote memory at a fraction of the bandwidth.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "common/topology.h"

namespace numoe::worker {

struct NumaBinding {
  std::vector<int> nodes;    // bound nodes (empty: not bound)
  int threads = 1;           // kernel threads
  std::vector<int> cpus;     // the CPU each kernel thread is pinned to (empty: unpinned)
  int memory_node = -1;      // the node for node-local allocations (-1: several nodes, or unbound)
  std::string description;   // one line for the log
};

// Checks `placement` against `topology` (the CPUs this process may run on) without binding anything.
// Errors name the worker flag the field comes from:
//   --numa-node  every node exists in `topology` (has CPUs this process may use) and is listed once;
//   --cpus       thread_cpus are distinct CPUs of the placement's CPU set (its `cpus`, else the CPUs of
//                its nodes, else any allowed CPU when it binds no node);
//   --threads    >= 1, and equal to the number of thread_cpus when those are given (one thread each).
// The placement's `cpus`, when given, must be allowed CPUs of its nodes.
Status ValidatePlacement(const WorkerPlacement& placement, const Topology& topology);

// Probes this machine (ProbeTopology), validates, then binds: with nodes, the process's CPUs to
// placement.cpus (empty: all CPUs of the nodes) and its memory to the nodes; without nodes
// (--no-numa-bind) nothing is bound and only the kernel threads are pinned. threads <= 0 means one per
// thread_cpus entry, else one per CPU the worker may run on. The returned binding's `cpus` are
// placement.thread_cpus, for the kernels' ThreadPool.
StatusOr<NumaBinding> ApplyPlacement(const WorkerPlacement& placement);

}  // namespace numoe::worker
