// The machine: NUMA nodes with their CPUs and memory, and where one numoe-worker runs on it.
//
// One type, Topology, from one of two sources:
//   ProbeTopology()      this machine, through libnuma (nodes, memory, free memory, CPUs, distances) and
//                        hwloc (physical cores per node), restricted to the CPUs this process may run on
//                        (sched_getaffinity), so a worker started under taskset or a cpuset cgroup sees
//                        the machine it can use;
//   ParseTopologyJson()  a machine you do not have, described as
//       {"name": "4x8268-24dimm",
//        "nodes": [{"id": 0, "cpus": 24, "memory_gb": 192, "dimms": 6}, ...],
//        "distances": [[10, 21, ...], ...]}            (optional, row i = node i of "nodes")
//     per node: "id" (int >= 0, unique), "cpus" (a count, or a list of CPU ids such as [0, 1, 2] or the
//     string "0-23,96-119"), "memory_gb" (> 0, GB = 1e9 bytes: the node's memory as the OS reports it,
//     which `numactl -H` prints in MiB), optional "cores" (physical cores), "dimms" (DIMMs populated,
//     used only to explain the plan), "available_gb" (memory free now).
//   Every validation error names the field: "machine.json: nodes[2].memory_gb must be > 0 (got -1)".
//
// WorkerPlacement is what deploy/placement.h's PlaceWorkers() decides for each worker and what
// numoe-worker applies (worker/service/numa_bind.h ApplyPlacement): it lives here, below both.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace numoe {

// Every size the planner prints is in GB = 1e9 bytes (the unit DIMMs and the model card use).
inline constexpr double kBytesPerGB = 1e9;

struct NumaNode {
  int id = 0;                    // OS node id (the number numactl takes)
  int num_cpus = 0;              // logical CPUs (hardware threads) on the node
  std::vector<int> cpu_ids;      // their ids, sorted; empty when only the count is known (JSON count)
  int cores = 0;                 // physical cores; 0 = unknown (then threads = logical CPUs)
  int64_t memory_bytes = 0;      // the node's memory as the OS reports it (MemTotal)
  int64_t available_bytes = -1;  // free + reclaimable page cache now; -1 = unknown
  int dimms = 0;                 // DIMMs populated on the node's channels; 0 = unknown
};

struct Topology {
  std::string name;                       // "this machine (hostname)" or the JSON's "name"
  std::vector<NumaNode> nodes;            // in the order given / probed (ascending id when probed)
  std::vector<std::vector<int>> distances;  // SLIT distances [i][j] by position in `nodes`; empty = unknown

  // Position in `nodes` of the node with OS id `id`, or -1.
  int IndexOf(int id) const;
  // Distance between the nodes at positions i and j: from `distances` when known, else 10 on the
  // diagonal and 20 + |i - j| elsewhere (so that neighbours by id pair first).
  int Distance(size_t i, size_t j) const;
};

// Checks what the planner relies on (non-empty, unique ids, memory > 0, CPUs > 0, square distances);
// `source` prefixes the messages.
Status ValidateTopology(const Topology& topology, const std::string& source);

// Parses and validates the JSON description above; `source` names the file in messages.
StatusOr<Topology> ParseTopologyJson(std::string_view text, const std::string& source);
StatusOr<Topology> LoadTopologyFile(const std::string& path);

// This machine, from libnuma (and hwloc for physical cores), restricted to the CPUs this process may run
// on; nodes without such CPUs (memory-only nodes, or CPUs outside the affinity mask) are left out. A
// machine without NUMA support is reported as one node holding every allowed CPU and all memory. Errors
// only when neither libnuma nor sysconf can be read.
StatusOr<Topology> ProbeTopology();

// "0-23,48-71" for {0..23, 48..71}; ids need not be sorted. The inverse parses the same syntax and
// errors name `what`.
std::string FormatCpuList(const std::vector<int>& cpus);
StatusOr<std::vector<int>> ParseCpuList(std::string_view text, const std::string& what);

// One numoe-worker process on the machine: its memory policy, the CPUs it runs on and its kernel threads.
// deploy/placement.h decides it (the rule is written there); the worker applies it as given.
struct WorkerPlacement {
  int index = 0;                 // numoe-worker-<index>
  // Memory: bound (MPOL_BIND) to the one node, or interleaved (MPOL_INTERLEAVE) over several, for a
  // worker spanning nodes too small for a copy each. Empty = not bound (--no-numa-bind).
  std::vector<int> nodes;
  // The CPUs the worker may run on, ascending; empty = every CPU of `nodes` (CPU ids unknown: a JSON
  // description that gives "cpus" as a count).
  std::vector<int> cpus;
  int threads = 0;               // expert kernel threads (--threads)
  // The CPU each kernel thread is pinned to, one per thread (size == threads), drawn from `cpus`; empty
  // when `cpus` is (the threads then run unpinned on the nodes' CPUs).
  std::vector<int> thread_cpus;
  int slot = 0;                  // this worker's slot among `slots` workers sharing one node
  int slots = 1;
  // Planner mode only (deploy/planner.h; zero in --workers N mode, which does not check memory):
  int64_t need_bytes = 0;        // what it needs (the same for every worker)
  int64_t usable_bytes = 0;      // usable memory of its nodes (its share when several share a node)

  bool interleaved() const { return nodes.size() > 1; }
  std::string NodeList() const;  // "2,3"
  // numactl arguments: "--cpunodebind=0 --membind=0", "--physcpubind=0-11,48-59 --membind=0",
  // "--cpunodebind=2,3 --interleave=2,3".
  std::string NumactlArgs() const;
};

}  // namespace numoe
