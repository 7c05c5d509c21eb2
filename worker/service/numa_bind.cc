#include "worker/service/numa_bind.h"

#include <numa.h>
#include <numaif.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include "common/numa.h"

namespace numoe::worker {

namespace {

std::string NodeList(const std::vector<int>& nodes) {
  std::string s;
  for (int n : nodes) s += (s.empty() ? "" : ",") + std::to_string(n);
  return s;
}

}  // namespace

NumaBinding Unbound(int threads, const std::vector<int>& cpus) {
  NumaBinding b;
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  int n = threads;
  if (n <= 0) n = !cpus.empty() ? static_cast<int>(cpus.size())
                                : (sched_getaffinity(0, sizeof(allowed), &allowed) == 0 ? CPU_COUNT(&allowed) : 1);
  b.threads = std::max(n, 1);
  b.cpus = cpus;
  b.description = absl::StrCat("not NUMA-bound (--no-numa-bind or no --numa-node); ", b.threads, " kernel threads",
                               cpus.empty() ? " (unpinned)" : " pinned to --cpus");
  return b;
}

StatusOr<NumaBinding> BindToNumaNodes(const std::vector<int>& nodes, int max_threads, const std::vector<int>& cpus) {
  const std::string hint = " (run with --no-numa-bind where the process may not bind, e.g. some containers)";
  if (nodes.empty()) return absl::InvalidArgumentError("--numa-node: no node given");
  if (numa_available() < 0) {
    return absl::FailedPreconditionError("NUMA bind: libnuma reports NUMA is not available on this system" + hint);
  }
  ASSIGN_OR_RETURN(NumaTopology topo, GetNumaTopology());
  NumaBinding b;
  std::unique_ptr<bitmask, void (*)(bitmask*)> mask(numa_allocate_nodemask(), numa_free_nodemask);
  for (int node : nodes) {
    if (node < 0 || node >= topo.num_nodes()) {
      return absl::InvalidArgumentError(absl::StrCat("--numa-node: node ", node, " does not exist (this machine has ",
                                                     topo.num_nodes(), " node(s): 0..", topo.num_nodes() - 1, ")"));
    }
    if (std::find(b.nodes.begin(), b.nodes.end(), node) != b.nodes.end()) {
      return absl::InvalidArgumentError(absl::StrCat("--numa-node: node ", node, " is listed twice"));
    }
    if (topo.cpus[node].empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("NUMA bind: node ", node, " has no CPUs this process may run on" + hint));
    }
    b.nodes.push_back(node);
    numa_bitmask_setbit(mask.get(), static_cast<unsigned>(node));
  }
  // CPUs: every allowed CPU of the nodes for the process; the first max_threads for the kernel pool.
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> all;
  for (int node : b.nodes) {
    for (int c : topo.cpus[node]) {
      CPU_SET(c, &set);
      all.push_back(c);
    }
  }
  for (int c : cpus) {  // validated before anything is bound
    if (std::find(all.begin(), all.end(), c) == all.end()) {
      return absl::InvalidArgumentError(absl::StrCat("--cpus: CPU ", c, " is not a usable CPU of node(s) ",
                                                     NodeList(b.nodes)));
    }
  }
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("NUMA bind: sched_setaffinity to the CPUs of node(s) ", NodeList(b.nodes), " failed: ",
                     std::strerror(errno), hint));
  }
  const int mode = b.nodes.size() == 1 ? MPOL_BIND : MPOL_INTERLEAVE;
  if (set_mempolicy(mode, mask->maskp, mask->size + 1) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("NUMA bind: set_mempolicy(", b.nodes.size() == 1 ? "MPOL_BIND" : "MPOL_INTERLEAVE", ", node(s) ",
                     NodeList(b.nodes), ") failed: ", std::strerror(errno), hint));
  }
  b.cpus = cpus.empty() ? all : cpus;
  if (max_threads > 0 && static_cast<int>(b.cpus.size()) > max_threads) b.cpus.resize(static_cast<size_t>(max_threads));
  b.threads = static_cast<int>(b.cpus.size());
  b.memory_node = b.nodes.size() == 1 ? b.nodes[0] : -1;
  b.description = absl::StrCat("bound to NUMA node(s) ", NodeList(b.nodes), " (memory ",
                               b.nodes.size() == 1 ? "bound" : "interleaved", ", ", all.size(), " CPUs; ",
                               b.cpus.size(), " kernel threads pinned)");
  return b;
}

}  // namespace numoe::worker
