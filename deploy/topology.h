// The machine the planner places workers on: NUMA nodes with their CPUs and memory.
//
// Two sources:
//   ProbeTopology()      this machine, through libnuma (nodes, memory, free memory, CPUs, distances) and
//                        hwloc (physical cores per node);
//   ParseTopologyJson()  a machine you do not have, described as
//       {"name": "4x8268-24dimm",
//        "nodes": [{"id": 0, "cpus": 24, "memory_gb": 192, "dimms": 6}, ...],
//        "distances": [[10, 21, ...], ...]}            (optional, row i = node i of "nodes")
//     per node: "id" (int >= 0, unique), "cpus" (a count, or a list of CPU ids such as [0, 1, 2] or the
//     string "0-23,96-119"), "memory_gb" (> 0, GB = 1e9 bytes: the node's memory as the OS reports it,
//     which `numactl -H` prints in MiB), optional "cores" (physical cores), "dimms" (DIMMs populated,
//     used only to explain the plan), "available_gb" (memory free now).
//   Every validation error names the field: "machine.json: nodes[2].memory_gb must be > 0 (got -1)".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace numoe::deploy {

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

// This machine, from libnuma (and hwloc for physical cores). A machine without NUMA support is reported
// as one node holding all CPUs and memory. Errors only when neither libnuma nor /proc can be read.
StatusOr<Topology> ProbeTopology();

// "0-23,48-71" for {0..23, 48..71}; ids need not be sorted. The inverse parses the same syntax and
// errors name `what`.
std::string FormatCpuList(const std::vector<int>& cpus);
StatusOr<std::vector<int>> ParseCpuList(std::string_view text, const std::string& what);

}  // namespace numoe::deploy
