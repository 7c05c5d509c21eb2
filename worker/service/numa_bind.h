// Binding a numoe-worker to its NUMA node(s): the process's CPUs (every thread created afterwards
// inherits them) and its memory policy (MPOL_BIND to one node; MPOL_INTERLEAVE over several, for a
// worker spanning nodes too small for a copy each). Every failure is an error that says what failed and
// how to opt out (--no-numa-bind): a worker that silently runs unbound streams its experts from remote
// memory at a fraction of the bandwidth.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace numoe::worker {

struct NumaBinding {
  std::vector<int> nodes;    // bound nodes (empty: not bound)
  int threads = 1;           // kernel threads
  std::vector<int> cpus;     // the CPU each kernel thread is pinned to (empty: unpinned)
  int memory_node = -1;      // the node for node-local allocations (-1: several nodes, or unbound)
  std::string description;   // one line for the log
};

// Binds this process to `nodes` and picks the kernel CPUs: `cpus` when given (each must be an allowed
// CPU of those nodes: several workers sharing a node get disjoint slices from the launcher), else the
// nodes' allowed CPUs in node order; the first `max_threads` of them (all when max_threads <= 0).
StatusOr<NumaBinding> BindToNumaNodes(const std::vector<int>& nodes, int max_threads, const std::vector<int>& cpus = {});

// No NUMA binding: `threads` kernel threads (<= 0: one per usable CPU), pinned to `cpus` when given.
NumaBinding Unbound(int threads, const std::vector<int>& cpus = {});

}  // namespace numoe::worker
