#include "worker/service/numa_bind.h"

#include <numa.h>
#include <numaif.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <set>

#include "absl/strings/str_join.h"

namespace numoe::worker {
namespace {

constexpr char kOptOut[] = " (run with --no-numa-bind where the process may not bind, e.g. some containers)";

// The CPUs the placement may use: those of its nodes, or every CPU of `topology` when it binds none.
std::set<int> DomainCpus(const WorkerPlacement& p, const Topology& topology) {
  std::set<int> out;
  for (const NumaNode& n : topology.nodes) {
    if (p.nodes.empty() || std::find(p.nodes.begin(), p.nodes.end(), n.id) != p.nodes.end()) {
      out.insert(n.cpu_ids.begin(), n.cpu_ids.end());
    }
  }
  return out;
}

std::string Where(const WorkerPlacement& p) {
  return p.nodes.empty() ? std::string("this process") : absl::StrCat("node(s) ", p.NodeList());
}

}  // namespace

Status ValidatePlacement(const WorkerPlacement& p, const Topology& topology) {
  std::vector<int> usable;
  for (const NumaNode& n : topology.nodes) usable.push_back(n.id);
  for (size_t i = 0; i < p.nodes.size(); ++i) {
    const int node = p.nodes[i];
    if (topology.IndexOf(node) < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--numa-node: node ", node, " does not exist or has no CPUs this process may run on (usable nodes: ",
          absl::StrJoin(usable, ","), ")"));
    }
    if (std::find(p.nodes.begin(), p.nodes.begin() + i, node) != p.nodes.begin() + i) {
      return absl::InvalidArgumentError(absl::StrCat("--numa-node: node ", node, " is listed twice"));
    }
  }
  const std::set<int> domain = DomainCpus(p, topology);
  for (int c : p.cpus) {
    if (!domain.contains(c)) {
      return absl::InvalidArgumentError(absl::StrCat("placement: CPU ", c, " is not a CPU of ", Where(p),
                                                     " that this process may run on"));
    }
  }
  const std::set<int> for_threads = p.cpus.empty() ? domain : std::set<int>(p.cpus.begin(), p.cpus.end());
  std::set<int> seen;
  for (int c : p.thread_cpus) {
    if (!for_threads.contains(c)) {
      return absl::InvalidArgumentError(absl::StrCat("--cpus: CPU ", c, " is not a usable CPU of ", Where(p),
                                                     " (usable: ", FormatCpuList({for_threads.begin(), for_threads.end()}),
                                                     ")"));
    }
    if (!seen.insert(c).second) {
      return absl::InvalidArgumentError(absl::StrCat("--cpus: CPU ", c, " is listed twice (one kernel thread each)"));
    }
  }
  if (p.threads < 1) return absl::InvalidArgumentError(absl::StrCat("--threads must be >= 1 (got ", p.threads, ")"));
  if (!p.thread_cpus.empty() && static_cast<size_t>(p.threads) != p.thread_cpus.size()) {
    return absl::InvalidArgumentError(absl::StrCat("--threads ", p.threads, " disagrees with --cpus (",
                                                   p.thread_cpus.size(), p.thread_cpus.size() == 1 ? " CPU" : " CPUs",
                                                   ", one per kernel thread): list ", p.threads,
                                                   " CPUs, or drop --threads"));
  }
  return absl::OkStatus();
}

StatusOr<NumaBinding> ApplyPlacement(const WorkerPlacement& placement) {
  ASSIGN_OR_RETURN(Topology topology, ProbeTopology());
  WorkerPlacement p = placement;
  if (p.threads <= 0) {
    p.threads = !p.thread_cpus.empty() ? static_cast<int>(p.thread_cpus.size())
                : !p.cpus.empty()      ? static_cast<int>(p.cpus.size())
                                       : static_cast<int>(DomainCpus(p, topology).size());
  }
  RETURN_IF_ERROR(ValidatePlacement(p, topology));
  NumaBinding b;
  b.threads = p.threads;
  b.cpus = p.thread_cpus;
  const std::string pinned = p.thread_cpus.empty() ? " (unpinned)" : absl::StrCat(" pinned to ", FormatCpuList(p.thread_cpus));
  if (p.nodes.empty()) {
    b.description = absl::StrCat("not NUMA-bound (--no-numa-bind or no --numa-node); ", b.threads, " kernel threads",
                                 pinned);
    return b;
  }
  if (numa_available() < 0) {
    return absl::FailedPreconditionError(absl::StrCat("NUMA bind: libnuma reports NUMA is not available on this system",
                                                      kOptOut));
  }
  const std::set<int> domain = DomainCpus(p, topology);
  const std::vector<int> process_cpus = p.cpus.empty() ? std::vector<int>(domain.begin(), domain.end()) : p.cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : process_cpus) CPU_SET(c, &set);
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("NUMA bind: sched_setaffinity to CPUs ",
                                                      FormatCpuList(process_cpus), " of node(s) ", p.NodeList(),
                                                      " failed: ", std::strerror(errno), kOptOut));
  }
  std::unique_ptr<bitmask, void (*)(bitmask*)> mask(numa_allocate_nodemask(), numa_free_nodemask);
  for (int node : p.nodes) numa_bitmask_setbit(mask.get(), static_cast<unsigned>(node));
  const int mode = p.interleaved() ? MPOL_INTERLEAVE : MPOL_BIND;
  if (set_mempolicy(mode, mask->maskp, mask->size + 1) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("NUMA bind: set_mempolicy(",
                                                      p.interleaved() ? "MPOL_INTERLEAVE" : "MPOL_BIND", ", node(s) ",
                                                      p.NodeList(), ") failed: ", std::strerror(errno), kOptOut));
  }
  b.nodes = p.nodes;
  b.memory_node = p.interleaved() ? -1 : p.nodes[0];
  b.description = absl::StrCat("bound to NUMA node(s) ", p.NodeList(), " (memory ",
                               p.interleaved() ? "interleaved" : "bound", ", CPUs ", FormatCpuList(process_cpus), "; ",
                               b.threads, " kernel threads", pinned, ")");
  return b;
}

}  // namespace numoe::worker
