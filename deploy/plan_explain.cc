#include "deploy/plan_explain.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "deploy/placement.h"

namespace numoe::deploy {
namespace {

// Standard DIMM sizes (GB) for the "larger DIMMs would let each node hold a copy" hint.
constexpr int kDimmSizesGB[] = {8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512};

// One DDR4-2933 channel moves 2933e6 transfers x 8 bytes per second; six of them are the reference
// box's node (docs/design.md). Used only to give the bandwidth bound a concrete example.
constexpr double kExampleChannelBytesPerSecond = 2933e6 * 8;
constexpr int kExampleChannels = 6;

std::string NodesPhrase(const std::vector<int>& ids) {
  if (ids.size() == 1) return absl::StrCat("Node ", ids[0]);
  return absl::StrCat("Nodes ", absl::StrJoin(ids, ", "));
}

std::string OneDecimal(double x) { return absl::StrFormat("%.1f", x); }

// "(192.00 GB, 6 DIMMs)" or "(192.00 GB)".
std::string NodeSizePhrase(const NumaNode& n, bool each) {
  std::string s = absl::StrCat("(", FormatBytes(n.memory_bytes));
  if (n.dimms > 0) absl::StrAppend(&s, ", ", Plural(n.dimms, "DIMM"), each ? " each" : "");
  return s + ")";
}

}  // namespace

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
    auto full = PlaceWorkers(t, {.need_bytes = need,
                                 .usable_bytes = usable_full,
                                 .instances_per_node = plan.options.instances_per_node,
                                 .threads_per_worker = plan.options.threads_per_worker});
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
      size_t here = plan.workers.size(), there = full->size();
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

}  // namespace numoe::deploy
