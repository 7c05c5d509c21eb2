#include "deploy/planner.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <set>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace numoe::deploy {
namespace {

// Standard DIMM sizes (GB) for the "larger DIMMs would let each node hold a copy" hint.
constexpr int kDimmSizesGB[] = {8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512};

// One DDR4-2933 channel moves 2933e6 transfers x 8 bytes per second; six of them are the reference
// box's node (docs/design.md). Used only to give the bandwidth bound a concrete example.
constexpr double kExampleChannelBytesPerSecond = 2933e6 * 8;
constexpr int kExampleChannels = 6;

int64_t CeilTimes(int64_t bytes, double fraction) {
  return static_cast<int64_t>(std::ceil(static_cast<double>(bytes) * fraction));
}

Status OptionError(const std::string& what) { return absl::InvalidArgumentError(what); }

Status ValidateInputs(const ModelMemory& m, const PlanOptions& o) {
  if (m.routed_expert_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model ", m.name, ": routed expert bytes must be > 0 (got ", m.routed_expert_bytes,
                     "); the planner places routed experts, and this model has none"));
  }
  if (m.drafter_expert_bytes < 0 || m.routed_bytes_per_token < 0 || m.activation_bytes_per_token < 0 ||
      m.other_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("model ", m.name, ": byte counts must be >= 0"));
  }
  if (!(o.repack_overhead >= 0.0 && o.repack_overhead <= 1.0)) {
    return OptionError(absl::StrCat("repack overhead must be in [0, 1] (got ", o.repack_overhead, ")"));
  }
  if (o.instances_per_node < 0 || o.instances_per_node > 256) {
    return OptionError(absl::StrCat("--instances-per-node must be in [1, 256] (got ", o.instances_per_node, ")"));
  }
  if (o.max_batch_tokens < 1 || o.max_batch_tokens > (int64_t{1} << 24)) {
    return OptionError(absl::StrCat("--max-batch-tokens must be in [1, 16777216] (got ", o.max_batch_tokens, ")"));
  }
  if (o.micro_batches < 1 || o.micro_batches > 16) {
    return OptionError(absl::StrCat("micro-batches must be in [1, 16] (got ", o.micro_batches, ")"));
  }
  if (!(o.os_headroom_fraction >= 0.0 && o.os_headroom_fraction < 1.0)) {
    return OptionError(absl::StrCat("OS headroom fraction must be in [0, 1) (got ", o.os_headroom_fraction, ")"));
  }
  if (o.fixed_buffer_bytes < 0 || o.os_headroom_bytes < 0) {
    return OptionError("fixed buffer and OS headroom bytes must be >= 0");
  }
  // Keeps every sum below in int64 range: 1 PB per term is far above any machine.
  constexpr int64_t kPB = 1'000'000'000'000'000;
  if (m.routed_expert_bytes > kPB || m.drafter_expert_bytes > kPB || o.os_headroom_bytes > kPB ||
      o.fixed_buffer_bytes > kPB || m.activation_bytes_per_token > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError("model or option byte counts are implausibly large (> 1 PB)");
  }
  return absl::OkStatus();
}

// Splits a node's CPUs among `n` workers so that SMT siblings stay together under the usual Linux
// numbering (node 0 = 0-23 and 96-119): each contiguous run of ids is cut into n parts and worker k
// takes part k of every run. Falls back to plain chunks when a run is shorter than n.
std::vector<std::vector<int>> SplitCpus(const std::vector<int>& cpus, int n) {
  std::vector<std::vector<int>> out(n);
  if (cpus.empty()) return out;
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

// Threads for `cpus` logical CPUs of `node`: one per physical core when the core count is known (the
// expert kernels are bandwidth-bound; an SMT sibling adds contention, not bytes per second).
int ThreadsFor(const NumaNode& node, int cpus) {
  if (node.cores > 0 && node.cores < node.num_cpus) {
    return std::max(1, static_cast<int>(static_cast<int64_t>(cpus) * node.cores / node.num_cpus));
  }
  return std::max(1, cpus);
}

struct Placement {
  std::vector<WorkerPlacement> workers;
  std::vector<size_t> unused;  // positions in topology.nodes
};

// The placement rules of planner.h over usable bytes per node position.
StatusOr<Placement> Place(const Topology& t, const std::vector<int64_t>& usable, int64_t need, int instances) {
  Placement p;
  std::vector<size_t> small;
  for (size_t i = 0; i < t.nodes.size(); ++i) {
    const NumaNode& node = t.nodes[i];
    int64_t fit = usable[i] / need;
    if (fit < 1) {
      small.push_back(i);
      continue;
    }
    int n = instances > 0 ? instances : 1;
    if (n > fit) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--instances-per-node ", n, ": node ", node.id, " holds only ", fit, " worker", fit == 1 ? "" : "s", " (",
          FormatBytes(usable[i]), " usable, ", n, " x ", FormatBytes(need), " = ", FormatBytes(need * n), " needed)"));
    }
    if (n > node.num_cpus) {
      return absl::InvalidArgumentError(absl::StrCat("--instances-per-node ", n, ": node ", node.id, " has only ",
                                                     node.num_cpus, " CPUs"));
    }
    std::vector<std::vector<int>> shares = SplitCpus(node.cpu_ids, n);
    for (int k = 0; k < n; ++k) {
      WorkerPlacement w;
      w.nodes = {node.id};
      w.slot = k;
      w.slots = n;
      w.need_bytes = need;
      w.usable_bytes = usable[i] / n;
      int share_cpus = node.num_cpus / n + (k < node.num_cpus % n ? 1 : 0);
      if (n > 1 && !node.cpu_ids.empty()) {
        w.cpus = shares[k];
        share_cpus = static_cast<int>(w.cpus.size());
      } else if (n == 1) {
        w.cpus = node.cpu_ids;
      }
      w.threads = ThreadsFor(node, share_cpus);
      p.workers.push_back(std::move(w));
    }
  }
  // Group the small nodes: start from the lowest remaining position; add the nearest node that completes
  // a copy, or else the nearest node, until the group holds one.
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
    if (sum < need) {
      // Not even all remaining small nodes together hold a copy.
      p.unused.insert(p.unused.end(), remaining.begin(), remaining.end());
      break;
    }
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
    p.workers.push_back(std::move(w));
    std::vector<size_t> rest;
    for (size_t i : remaining) {
      if (std::find(group.begin(), group.end(), i) == group.end()) rest.push_back(i);
    }
    remaining = std::move(rest);
  }
  // Number workers in node order, so worker 0 is on the first node.
  std::stable_sort(p.workers.begin(), p.workers.end(), [&](const WorkerPlacement& a, const WorkerPlacement& b) {
    return t.IndexOf(a.nodes.front()) < t.IndexOf(b.nodes.front());
  });
  for (size_t i = 0; i < p.workers.size(); ++i) p.workers[i].index = static_cast<int>(i);
  std::sort(p.unused.begin(), p.unused.end());
  return p;
}

std::string NodesPhrase(const std::vector<int>& ids) {
  if (ids.size() == 1) return absl::StrCat("Node ", ids[0]);
  return absl::StrCat("Nodes ", absl::StrJoin(ids, ", "));
}

std::string Plural(int64_t n, const std::string& word) {
  return absl::StrCat(n, " ", word, n == 1 ? "" : "s");
}

std::string OneDecimal(double x) { return absl::StrFormat("%.1f", x); }

// "(192.00 GB, 6 DIMMs)" or "(192.00 GB)".
std::string NodeSizePhrase(const NumaNode& n, bool each) {
  std::string s = absl::StrCat("(", FormatBytes(n.memory_bytes));
  if (n.dimms > 0) absl::StrAppend(&s, ", ", Plural(n.dimms, "DIMM"), each ? " each" : "");
  return s + ")";
}

void Explain(Plan& plan) {
  const Topology& t = plan.topology;
  const int64_t need = plan.worker_need_bytes;
  std::vector<std::string>& out = plan.explanation;

  if (!plan.fits()) {
    int64_t total_usable = 0, total_memory = 0, total_headroom = 0;
    for (const NodeUse& n : plan.nodes) {
      total_usable += n.usable_bytes;
      total_memory += n.memory_bytes;
      total_headroom += n.headroom_bytes;
    }
    out.push_back(absl::StrCat(
        "This machine cannot hold one copy of the routed experts: a worker needs ", FormatBytes(need), ", and ",
        t.nodes.size() == 1 ? "its one node offers "
                            : absl::StrCat("all ", t.nodes.size(), " nodes together offer "),
        FormatBytes(total_usable),
        " usable (", FormatBytes(total_memory), " minus ", FormatBytes(total_headroom), " OS headroom",
        plan.options.plan_on_available ? ", limited to the memory available now" : "", "): ",
        FormatBytes(plan.shortfall_bytes), " missing."));
    if (plan.drafter_on_cpu && plan.model.drafter_expert_bytes > 0) {
      int64_t saved = plan.model.drafter_expert_bytes + CeilTimes(plan.model.drafter_expert_bytes, plan.options.repack_overhead);
      if (saved >= plan.shortfall_bytes) {
        out.push_back(absl::StrCat("Keeping the drafter's experts on the GPU (--drafter-experts gpu) saves ",
                                   FormatBytes(saved), " per worker, enough for one worker here if the GPU has room."));
      } else {
        out.push_back(absl::StrCat("Even with the drafter's experts on the GPU (--drafter-experts gpu, saves ",
                                   FormatBytes(saved), "), ", FormatBytes(plan.shortfall_bytes - saved), " would be missing."));
      }
    }
    out.push_back(absl::StrCat("Add at least ", FormatBytes(plan.shortfall_bytes),
                               " of memory (more or larger DIMMs), or serve a smaller model."));
    return;
  }

  // Node-local workers, grouped by node size so a uniform machine reads as one sentence.
  // memory, dimms, usable, copies, headroom
  std::map<std::tuple<int64_t, int, int64_t, int, int64_t>, std::vector<int>> local_classes;
  for (size_t i = 0; i < plan.nodes.size(); ++i) {
    const NodeUse& n = plan.nodes[i];
    if (n.copies_fit >= 1) {
      local_classes[{n.memory_bytes, t.nodes[i].dimms, n.usable_bytes, n.copies_fit, n.headroom_bytes}].push_back(n.id);
    }
  }
  const int per_node = plan.options.instances_per_node > 0 ? plan.options.instances_per_node : 1;
  for (const auto& [key, ids] : local_classes) {
    const auto& [memory, dimms, usable, fit, headroom] = key;
    const NumaNode& first = t.nodes[t.IndexOf(ids.front())];
    bool many = ids.size() > 1;
    std::string s = absl::StrCat(NodesPhrase(ids), " ", NodeSizePhrase(first, many), ": ", FormatBytes(usable),
                                 " usable after ", FormatBytes(headroom), " OS headroom >= ", FormatBytes(need), ". ",
                                 many ? "Each holds" : "It holds",
                                 per_node == 1 ? " a copy and " : absl::StrCat(" ", per_node, " copies and "));
    if (per_node == 1) {
      absl::StrAppend(&s, "runs one worker bound to it (threads and memory): every expert byte the worker "
                          "streams comes from its own node's DRAM.");
    } else {
      absl::StrAppend(&s, "runs ", per_node, " workers (--instances-per-node ", per_node,
                      "), each bound to its own share of the node's CPUs and to the node's memory. They share ",
                      many ? "each node's" : "the node's",
                      " memory bandwidth, so each decodes at roughly 1/", per_node,
                      " of the speed one worker per node would reach; they add independent streams, not speed.");
    }
    out.push_back(s);
    if (per_node == 1 && fit >= 2) {
      out.push_back(absl::StrCat(
          NodesPhrase(ids), many ? " could each hold " : " could hold ", fit, " copies (", FormatBytes(usable), " / ",
          FormatBytes(need), ") but ", many ? "run" : "runs",
          " one worker: decode streams every expert byte from DRAM, so copies on one node split its bandwidth "
          "instead of adding to it, and one worker batching several sequences reads each expert once for all "
          "of them. --instances-per-node N (up to ",
          fit, " here) runs more, for more independent streams at lower speed each."));
    }
  }

  // Interleaved workers; a group shaped like an earlier one (same node sizes) gets a short sentence.
  std::set<std::vector<std::pair<int64_t, int64_t>>> explained_shapes;
  for (const WorkerPlacement& w : plan.workers) {
    if (!w.interleaved()) continue;
    std::vector<std::pair<int64_t, int64_t>> shape;
    for (int id : w.nodes) {
      const NodeUse& n = plan.nodes[t.IndexOf(id)];
      shape.emplace_back(n.memory_bytes, n.usable_bytes);
    }
    if (!explained_shapes.insert(shape).second) {
      out.push_back(absl::StrCat(NodesPhrase(w.nodes), " likewise run worker ", w.index, ", interleaved over ",
                                 w.nodes.size() == 2 ? "both" : "all of them", " (", FormatBytes(w.usable_bytes),
                                 " usable)."));
      continue;
    }
    std::vector<std::string> sizes;
    int64_t worst_short = 0;
    for (int id : w.nodes) {
      const NodeUse& n = plan.nodes[t.IndexOf(id)];
      worst_short = std::max(worst_short, need - n.usable_bytes);
      sizes.push_back(FormatBytes(n.usable_bytes));
    }
    const NumaNode& first = t.nodes[t.IndexOf(w.nodes.front())];
    bool same_size = std::all_of(w.nodes.begin(), w.nodes.end(), [&](int id) {
      return t.nodes[t.IndexOf(id)].memory_bytes == first.memory_bytes && t.nodes[t.IndexOf(id)].dimms == first.dimms;
    });
    std::string size_phrase = same_size ? absl::StrCat(" ", NodeSizePhrase(first, true)) : "";
    std::string why_small =
        same_size ? absl::StrCat(sizes.front(), " usable each < ", FormatBytes(need), ": ", FormatBytes(worst_short), " short")
                  : absl::StrCat(absl::StrJoin(sizes, ", "), " usable, each < ", FormatBytes(need));
    out.push_back(absl::StrCat(
        NodesPhrase(w.nodes), size_phrase, " are too small alone (", why_small, "), so together they run worker ", w.index, " with its memory interleaved over ",
        w.nodes.size() == 2 ? "both" : "all of them", " (", FormatBytes(w.usable_bytes), " usable) and threads on ",
        w.nodes.size() == 2 ? "both" : "each", ". Part of what it streams crosses the inter-socket link, so "
        "expect it to decode slower per stream than a node-local worker; it adds an instance the nodes could "
        "not run alone."));
  }
  if (!plan.unused_nodes.empty()) {
    out.push_back(absl::StrCat(NodesPhrase(plan.unused_nodes), plan.unused_nodes.size() == 1 ? " stays" : " stay",
                               " unused: too small for a copy, and no node is left to pair with."));
  }

  if (plan.model.other_bytes > 0) {
    out.push_back(absl::StrCat(
        "numoe-gpu (one per host) holds the other ", FormatBytes(plan.model.other_bytes),
        " of weights (attention, embeddings, head, shared experts, gates)",
        !plan.drafter_on_cpu && plan.model.drafter_expert_bytes > 0
            ? absl::StrCat(" plus the drafter's experts (", FormatBytes(plan.model.drafter_expert_bytes), ")")
            : "",
        " and the KV caches, in GPU memory: not counted above."));
  }

  // Speed follows bandwidth.
  if (plan.model.routed_bytes_per_token > 0) {
    double per_token_gb = static_cast<double>(plan.model.routed_bytes_per_token) / kBytesPerGB;
    double example_bw = kExampleChannels * kExampleChannelBytesPerSecond;
    std::string shape;
    if (plan.model.top_k > 0 && plan.model.num_experts > 0 && plan.model.num_layers > 0) {
      shape = absl::StrCat(" (top-", plan.model.top_k, " of ", plan.model.num_experts, " experts in each of ",
                           plan.model.num_layers, " layers)");
    }
    out.push_back(absl::StrCat(
        "Speed: each decoded token reads ", FormatBytes(plan.model.routed_bytes_per_token), " of routed experts", shape,
        " from the worker's DRAM, so one stream decodes at most (memory bandwidth) / ",
        FormatBytes(plan.model.routed_bytes_per_token), " tokens per second (e.g. ", kExampleChannels,
        " channels of DDR4-2933 = ", OneDecimal(example_bw / kBytesPerGB), " GB/s: ",
        OneDecimal(example_bw / kBytesPerGB / per_token_gb),
        " tok/s before speculative decoding). Bandwidth comes from the memory channels the DIMMs populate, "
        "capacity from their size: memory beyond one copy per node adds instances (concurrent streams), "
        "not per-stream speed."));
  }

  // DIMM population, when the description gives it for every node.
  bool all_dimms = std::all_of(t.nodes.begin(), t.nodes.end(), [](const NumaNode& n) { return n.dimms > 0; });
  if (!all_dimms) return;
  int total = 0, most = 0;
  std::vector<std::string> per;
  for (const NumaNode& n : t.nodes) {
    total += n.dimms;
    most = std::max(most, n.dimms);
    per.push_back(std::to_string(n.dimms));
  }
  bool uniform = std::all_of(t.nodes.begin(), t.nodes.end(), [&](const NumaNode& n) { return n.dimms == most; });
  const int full_total = most * static_cast<int>(t.nodes.size());
  if (!uniform) {
    // The same machine with every node populated like the fullest one (same DIMM size per node).
    std::vector<int64_t> usable_full;
    for (size_t i = 0; i < t.nodes.size(); ++i) {
      const NumaNode& n = t.nodes[i];
      int64_t memory = n.memory_bytes / n.dimms * most;
      usable_full.push_back(std::max<int64_t>(0, memory - OsHeadroomBytes(memory, plan.options)));
    }
    auto full = Place(t, usable_full, need, plan.options.instances_per_node);
    std::vector<int> fullest_local;
    for (const WorkerPlacement& w : plan.workers) {
      if (!w.interleaved() && t.nodes[t.IndexOf(w.nodes.front())].dimms == most &&
          (fullest_local.empty() || fullest_local.back() != w.nodes.front())) {
        fullest_local.push_back(w.nodes.front());
      }
    }
    std::string s = absl::StrCat("DIMMs: ", total, " (", absl::StrJoin(per, "/"), " per node). ");
    if (!fullest_local.empty()) {
      absl::StrAppend(&s, "The worker", fullest_local.size() == 1 ? " on node " : "s on nodes ",
                      absl::StrJoin(fullest_local, ", "), " stream", fullest_local.size() == 1 ? "s" : "",
                      " from ", fullest_local.size() == 1 ? "a node" : "nodes", " populated like every node of a ",
                      full_total, "-DIMM machine (", most, " per node), so a stream there decodes as fast as on ",
                      full_total, " DIMMs. ");
    }
    if (full.ok()) {
      size_t here = plan.workers.size(), there = full->workers.size();
      if (there > here) {
        absl::StrAppend(&s, "The ", full_total - total, " missing DIMM", full_total - total == 1 ? "" : "s",
                        " cost instances, not per-stream speed: ", Plural(static_cast<int64_t>(here), "worker"),
                        " here, ", there, " with ", most, " DIMMs on every node.");
      } else {
        absl::StrAppend(&s, "The ", full_total - total, " missing DIMM", full_total - total == 1 ? "" : "s",
                        " cost nothing here: ", Plural(static_cast<int64_t>(there), "worker"),
                        " either way.");
      }
    }
    out.push_back(s);
  } else {
    bool any_group = std::any_of(plan.workers.begin(), plan.workers.end(),
                                 [](const WorkerPlacement& w) { return w.interleaved(); });
    std::string s = absl::StrCat("DIMMs: ", total, " (", most, " per node).");
    if (any_group || !plan.unused_nodes.empty()) {
      int64_t node_needs = plan.node_bytes_for_one_worker;
      double per_dimm_gb = static_cast<double>(node_needs) / most / kBytesPerGB;
      int suggest = 0;
      for (int size : kDimmSizesGB) {
        if (size >= per_dimm_gb) {
          suggest = size;
          break;
        }
      }
      absl::StrAppend(&s, " A node needs ", FormatBytes(node_needs), " to hold its own copy: with ", most,
                      " DIMMs per node, at least ", absl::StrFormat("%.2f", per_dimm_gb), " GB each");
      if (suggest > 0) absl::StrAppend(&s, " (e.g. ", most, " x ", suggest, " GB)");
      absl::StrAppend(&s, ", which would run ", Plural(static_cast<int64_t>(t.nodes.size()), "node-local worker"),
                      " instead of ", plan.workers.size(), ".");
    }
    out.push_back(s);
  }
}

void Warn(Plan& plan) {
  const Topology& t = plan.topology;
  for (const WorkerPlacement& w : plan.workers) {
    int64_t available = 0;
    bool known = true;
    for (int id : w.nodes) {
      const NumaNode& n = t.nodes[t.IndexOf(id)];
      if (n.available_bytes < 0) known = false;
      available += n.available_bytes;
    }
    if (!known || plan.options.plan_on_available) continue;
    int64_t wanted = w.need_bytes * (w.slots > 1 ? w.slots : 1);
    if (w.slot == 0 && available < wanted) {
      plan.warnings.push_back(absl::StrCat(
          w.interleaved() ? "nodes " : "node ", w.NodeList(), ": only ", FormatBytes(available),
          " available now, but its worker", w.slots > 1 ? "s need " : " needs ", FormatBytes(wanted),
          "; other processes (or page cache that cannot be dropped) hold the rest. Free it before starting, "
          "or plan on what is available (--available-memory)."));
    }
  }
  for (const NumaNode& n : t.nodes) {
    if (n.cpu_ids.empty() && plan.options.instances_per_node > 1) {
      plan.warnings.push_back(absl::StrCat(
          "node ", n.id, ": its CPU ids are unknown (\"cpus\" given as a count), so its ",
          plan.options.instances_per_node,
          " workers share all of the node's CPUs; list the ids to pin each to its own CPUs."));
    }
  }
}

}  // namespace

int64_t WorkerActivationBytesPerToken(int64_t hidden, int64_t moe_intermediate, int64_t top_k) {
  return 2 * hidden * 4 + top_k * (2 * moe_intermediate * 4 + 8);
}

std::string FormatBytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  const double mag = std::fabs(b);
  if (mag >= 1e9 || bytes == 0) return absl::StrFormat("%.2f GB", b / 1e9);
  if (mag >= 1e6) return absl::StrFormat("%.2f MB", b / 1e6);
  if (mag >= 1e3) return absl::StrFormat("%.2f KB", b / 1e3);
  return absl::StrFormat("%d B", bytes);
}

int64_t OsHeadroomBytes(int64_t memory_bytes, const PlanOptions& options) {
  return std::min(options.os_headroom_bytes, CeilTimes(memory_bytes, options.os_headroom_fraction));
}

std::string WorkerPlacement::NodeList() const { return absl::StrJoin(nodes, ","); }

std::string WorkerPlacement::NumactlArgs() const {
  const std::string list = NodeList();
  if (interleaved()) return absl::StrCat("--cpunodebind=", list, " --interleave=", list);
  if (slots > 1 && !cpus.empty()) return absl::StrCat("--physcpubind=", FormatCpuList(cpus), " --membind=", list);
  return absl::StrCat("--cpunodebind=", list, " --membind=", list);
}

StatusOr<Plan> MakePlan(const Topology& topology, const ModelMemory& model, const PlanOptions& options) {
  RETURN_IF_ERROR(ValidateTopology(topology, topology.name.empty() ? "topology" : topology.name));
  RETURN_IF_ERROR(ValidateInputs(model, options));
  Plan plan;
  plan.topology = topology;
  plan.model = model;
  plan.options = options;
  plan.os_headroom_bytes = options.os_headroom_bytes;
  plan.drafter_on_cpu = options.drafter_experts == DrafterExperts::kWorker && model.drafter_expert_bytes > 0;

  // The per-worker terms.
  const std::string fmt = model.expert_format.empty() ? "as stored" : absl::StrCat(model.expert_format, ", as stored");
  std::string routed_detail = fmt;
  if (model.num_layers > 0 && model.num_experts > 0) {
    int64_t per_expert = model.routed_expert_bytes / (model.num_layers * model.num_experts);
    routed_detail = absl::StrCat(model.num_layers, " layers x ", model.num_experts, " experts x ",
                                 FormatBytes(per_expert), " (", fmt, ")");
  }
  plan.terms.push_back({"routed_experts", "routed experts", model.routed_expert_bytes, routed_detail});

  const int64_t drafter = plan.drafter_on_cpu ? model.drafter_expert_bytes : 0;
  std::string drafter_detail;
  if (model.drafter_expert_bytes == 0) {
    drafter_detail = "the model has no drafter experts";
  } else if (plan.drafter_on_cpu) {
    drafter_detail = absl::StrCat(model.drafter_stages > 0 ? absl::StrCat(Plural(model.drafter_stages, "stage"), " x ") : "",
                                  model.num_experts > 0 ? absl::StrCat(model.num_experts, " experts, ") : "",
                                  "in every worker (--drafter-experts worker)");
  } else {
    drafter_detail = absl::StrCat("on the GPU (--drafter-experts gpu): ", FormatBytes(model.drafter_expert_bytes),
                                  " in numoe-gpu instead");
  }
  plan.terms.push_back({"drafter_experts",
                        model.drafter_kind.empty() ? "drafter experts" : absl::StrCat(model.drafter_kind, " drafter experts"),
                        drafter, drafter_detail});

  const int64_t expert_bytes = model.routed_expert_bytes + drafter;
  const int64_t repack = CeilTimes(expert_bytes, options.repack_overhead);
  plan.terms.push_back(
      {"repack_overhead", "repacking overhead", repack,
       absl::StrCat(absl::StrFormat("%g", options.repack_overhead * 100), "% of ", FormatBytes(expert_bytes),
                    ": same bytes in the kernel's tile layout, plus padding, alignment, huge-page rounding and "
                    "staging")});

  const int64_t activations =
      options.micro_batches * options.max_batch_tokens * model.activation_bytes_per_token + options.fixed_buffer_bytes;
  plan.terms.push_back({"activations", "activations and buffers", activations,
                        absl::StrCat(options.micro_batches, " micro-batches x ", options.max_batch_tokens,
                                     " tokens x ", model.activation_bytes_per_token, " B + ",
                                     FormatBytes(options.fixed_buffer_bytes),
                                     " fixed (threads, scratch, shm rings)")});
  int64_t need = 0;
  for (const MemoryTerm& term : plan.terms) need += term.bytes;
  plan.worker_need_bytes = need;

  // What each node offers.
  std::vector<int64_t> usable;
  for (const NumaNode& n : topology.nodes) {
    const int64_t headroom = OsHeadroomBytes(n.memory_bytes, options);
    int64_t u = n.memory_bytes - headroom;
    if (options.plan_on_available && n.available_bytes >= 0) u = std::min(u, n.available_bytes);
    u = std::max<int64_t>(0, u);
    usable.push_back(u);
    plan.nodes.push_back(
        {n.id, n.memory_bytes, headroom, u, static_cast<int>(std::min<int64_t>(u / need, 1 << 20)), {}});
  }
  // The smallest node that holds a worker: with the full headroom cap, or with the fractional headroom
  // when the node is small enough for the fraction to be the smaller of the two.
  plan.node_bytes_for_one_worker = need + options.os_headroom_bytes;
  if (CeilTimes(plan.node_bytes_for_one_worker, options.os_headroom_fraction) < options.os_headroom_bytes) {
    plan.node_bytes_for_one_worker =
        static_cast<int64_t>(std::ceil(static_cast<double>(need) / (1.0 - options.os_headroom_fraction)));
  }
  if (options.plan_on_available) {
    for (const NumaNode& n : topology.nodes) {
      if (n.available_bytes < 0) {
        plan.warnings.push_back(absl::StrCat("node ", n.id, ": available memory unknown; planned on its total memory"));
      }
    }
  }

  ASSIGN_OR_RETURN(Placement placement, Place(topology, usable, need, options.instances_per_node));
  plan.workers = std::move(placement.workers);
  for (const WorkerPlacement& w : plan.workers) {
    for (int id : w.nodes) plan.nodes[topology.IndexOf(id)].workers.push_back(w.index);
  }
  for (size_t i : placement.unused) plan.unused_nodes.push_back(topology.nodes[i].id);
  if (plan.workers.empty()) {
    plan.shortfall_bytes = need - std::accumulate(usable.begin(), usable.end(), int64_t{0});
  }
  Explain(plan);
  Warn(plan);
  return plan;
}

StatusOr<Plan> PlanForThisMachine(const ModelMemory& model, const PlanOptions& options) {
  ASSIGN_OR_RETURN(Topology topology, ProbeTopology());
  ASSIGN_OR_RETURN(Plan plan, MakePlan(topology, model, options));
  if (!plan.fits()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "not one copy of ", model.name, "'s routed experts fits ", topology.name, ": ",
        plan.explanation.empty() ? FormatBytes(plan.shortfall_bytes) + " missing" : plan.explanation.front()));
  }
  return plan;
}

}  // namespace numoe::deploy
