#include "deploy/placement.h"

#include <algorithm>

#include "deploy/planner.h"  // FormatBytes

namespace numoe::deploy {
namespace {

// Upper bound on --workers: far above any machine, low enough to keep the loops trivial.
constexpr int kMaxWorkers = 4096;

// Slot k's share of `cpus` among `n` slots (the split of placement.h). Empty when `cpus` is.
std::vector<std::vector<int>> SplitCpus(const std::vector<int>& cpus, int n) {
  std::vector<std::vector<int>> out(n);
  if (cpus.empty()) return out;
  if (static_cast<size_t>(n) > cpus.size()) {
    for (int k = 0; k < n; ++k) out[k] = {cpus[static_cast<size_t>(k) % cpus.size()]};
    return out;
  }
  std::vector<std::vector<int>> runs;
  for (int c : cpus) {
    if (runs.empty() || runs.back().back() + 1 != c) runs.emplace_back();
    runs.back().push_back(c);
  }
  bool runs_ok = std::all_of(runs.begin(), runs.end(), [n](const auto& r) { return r.size() >= static_cast<size_t>(n); });
  if (!runs_ok) runs = {cpus};
  for (const auto& run : runs) {
    size_t base = run.size() / n, extra = run.size() % n, pos = 0;
    for (int k = 0; k < n; ++k) {
      size_t len = base + (static_cast<size_t>(k) < extra ? 1 : 0);
      out[k].insert(out[k].end(), run.begin() + pos, run.begin() + pos + len);
      pos += len;
    }
  }
  return out;
}

// Threads for `cpus` logical CPUs of `node`: one per physical core when the core count is known.
int ThreadsFor(const NumaNode& node, int cpus) {
  if (node.cores > 0 && node.cores < node.num_cpus) {
    return std::max(1, static_cast<int>(static_cast<int64_t>(cpus) * node.cores / node.num_cpus));
  }
  return std::max(1, cpus);
}

// The workers of one node with `slots` slots, slots first..first+slots-1 of the node.
std::vector<WorkerPlacement> NodeWorkers(const NumaNode& node, int slots) {
  std::vector<std::vector<int>> shares = SplitCpus(node.cpu_ids, slots);
  std::vector<WorkerPlacement> out;
  for (int k = 0; k < slots; ++k) {
    WorkerPlacement w;
    w.nodes = {node.id};
    w.slot = k;
    w.slots = slots;
    w.cpus = shares[k];
    int share_cpus = static_cast<int>(w.cpus.size());
    if (w.cpus.empty()) share_cpus = std::max(1, node.num_cpus / slots + (k < node.num_cpus % slots ? 1 : 0));
    w.threads = ThreadsFor(node, share_cpus);
    out.push_back(std::move(w));
  }
  return out;
}

// threads_per_worker and the threads' CPUs, the same for every worker of both modes.
Status SetThreads(WorkerPlacement& w, const PlacementRequest& r) {
  if (r.threads_per_worker > 0) {
    if (!w.cpus.empty() && static_cast<size_t>(r.threads_per_worker) > w.cpus.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          r.threads_flag, " ", r.threads_per_worker, ": worker ", w.index, " (node", w.interleaved() ? "s " : " ",
          w.NodeList(), w.slots > 1 ? absl::StrCat(", slot ", w.slot + 1, " of ", w.slots) : "", ") has only ",
          w.cpus.size(), " CPUs (", FormatCpuList(w.cpus), "); give at most ", w.cpus.size(), " or fewer workers"));
    }
    w.threads = r.threads_per_worker;
  }
  w.thread_cpus.assign(w.cpus.begin(), w.cpus.begin() + std::min<size_t>(w.cpus.size(), w.threads));
  return absl::OkStatus();
}

// Planner mode: memory decides (the first two rules of placement.h).
StatusOr<std::vector<WorkerPlacement>> PlaceByMemory(const Topology& t, const PlacementRequest& r) {
  const std::vector<int64_t>& usable = r.usable_bytes;
  const int64_t need = r.need_bytes;
  std::vector<WorkerPlacement> workers;
  std::vector<size_t> small;
  for (size_t i = 0; i < t.nodes.size(); ++i) {
    const NumaNode& node = t.nodes[i];
    int64_t fit = usable[i] / need;
    if (fit < 1) {
      small.push_back(i);
      continue;
    }
    int n = r.instances_per_node > 0 ? r.instances_per_node : 1;
    if (n > fit) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--instances-per-node ", n, ": node ", node.id, " holds only ", fit, " worker", fit == 1 ? "" : "s", " (",
          FormatBytes(usable[i]), " usable, ", n, " x ", FormatBytes(need), " = ", FormatBytes(need * n), " needed)"));
    }
    if (n > node.num_cpus) {
      return absl::InvalidArgumentError(absl::StrCat("--instances-per-node ", n, ": node ", node.id, " has only ",
                                                     node.num_cpus, " CPUs"));
    }
    for (WorkerPlacement& w : NodeWorkers(node, n)) {
      w.need_bytes = need;
      w.usable_bytes = usable[i] / n;
      workers.push_back(std::move(w));
    }
  }
  std::vector<size_t> remaining = small;
  while (!remaining.empty()) {
    size_t first = remaining.front();
    std::vector<size_t> group = {first};
    std::vector<size_t> candidates(remaining.begin() + 1, remaining.end());
    int64_t sum = usable[first];
    while (sum < need && !candidates.empty()) {
      auto nearer = [&](size_t a, size_t b) {
        int da = t.Distance(first, a), db = t.Distance(first, b);
        return da != db ? da < db : a < b;
      };
      std::sort(candidates.begin(), candidates.end(), nearer);
      auto completes = std::find_if(candidates.begin(), candidates.end(),
                                    [&](size_t c) { return sum + usable[c] >= need; });
      auto pick = completes != candidates.end() ? completes : candidates.begin();
      sum += usable[*pick];
      group.push_back(*pick);
      candidates.erase(pick);
    }
    if (sum < need) break;  // not even all remaining small nodes together hold a copy
    std::sort(group.begin(), group.end());
    WorkerPlacement w;
    w.need_bytes = need;
    w.usable_bytes = sum;
    for (size_t i : group) {
      const NumaNode& node = t.nodes[i];
      w.nodes.push_back(node.id);
      w.cpus.insert(w.cpus.end(), node.cpu_ids.begin(), node.cpu_ids.end());
      w.threads += ThreadsFor(node, node.num_cpus);
    }
    bool all_ids_known = std::all_of(group.begin(), group.end(), [&](size_t i) { return !t.nodes[i].cpu_ids.empty(); });
    if (!all_ids_known) w.cpus.clear();
    std::sort(w.cpus.begin(), w.cpus.end());
    workers.push_back(std::move(w));
    std::vector<size_t> rest;
    for (size_t i : remaining) {
      if (std::find(group.begin(), group.end(), i) == group.end()) rest.push_back(i);
    }
    remaining = std::move(rest);
  }
  std::stable_sort(workers.begin(), workers.end(), [&](const WorkerPlacement& a, const WorkerPlacement& b) {
    return t.IndexOf(a.nodes.front()) < t.IndexOf(b.nodes.front());
  });
  return workers;
}

// --workers N mode: round-robin over the nodes.
std::vector<WorkerPlacement> PlaceByCount(const Topology& t, int count) {
  const size_t nodes = t.nodes.size();
  std::vector<std::vector<WorkerPlacement>> per_node(nodes);
  for (size_t p = 0; p < nodes; ++p) {
    const int slots = static_cast<int>(count / nodes + (p < count % nodes ? 1 : 0));
    if (slots > 0) per_node[p] = NodeWorkers(t.nodes[p], slots);
  }
  std::vector<WorkerPlacement> workers;
  for (int i = 0; i < count; ++i) workers.push_back(std::move(per_node[i % nodes][i / nodes]));
  return workers;
}

Status ValidateRequest(const Topology& t, const PlacementRequest& r) {
  if (r.workers < 0 || r.workers > kMaxWorkers) {
    return absl::InvalidArgumentError(
        absl::StrCat(r.workers_flag, " must be in [0, ", kMaxWorkers, "] (got ", r.workers, ")"));
  }
  if (r.threads_per_worker < 0) {
    return absl::InvalidArgumentError(absl::StrCat(r.threads_flag, " must be >= 0 (got ", r.threads_per_worker, ")"));
  }
  if (r.workers > 0) return absl::OkStatus();
  if (r.need_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("placement: a worker's need must be > 0 bytes (got ", r.need_bytes, ")"));
  }
  if (r.usable_bytes.size() != t.nodes.size()) {
    return absl::InvalidArgumentError(absl::StrCat("placement: ", r.usable_bytes.size(), " usable sizes for ",
                                                   t.nodes.size(), " nodes (one per node)"));
  }
  return absl::OkStatus();
}

}  // namespace

StatusOr<std::vector<WorkerPlacement>> PlaceWorkers(const Topology& topology, const PlacementRequest& request) {
  RETURN_IF_ERROR(ValidateTopology(topology, topology.name.empty() ? "topology" : topology.name));
  RETURN_IF_ERROR(ValidateRequest(topology, request));
  std::vector<WorkerPlacement> workers;
  if (request.workers > 0) {
    workers = PlaceByCount(topology, request.workers);
  } else {
    ASSIGN_OR_RETURN(workers, PlaceByMemory(topology, request));
  }
  for (size_t i = 0; i < workers.size(); ++i) {
    workers[i].index = static_cast<int>(i);
    RETURN_IF_ERROR(SetThreads(workers[i], request));
  }
  return workers;
}

}  // namespace numoe::deploy
