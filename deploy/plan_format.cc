// Text and JSON renderings of a Plan (deploy/planner.h).
#include <cmath>
#include <sstream>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "deploy/planner.h"
#include "nlohmann/json.hpp"

namespace numoe::deploy {
namespace {

using json = nlohmann::json;

constexpr size_t kWrapColumns = 100;

// Word-wraps `text` to kWrapColumns, the first line after `first`, the others indented by `indent`.
std::string Wrap(const std::string& first, const std::string& text, size_t indent) {
  std::string out = first;
  size_t col = first.size();
  std::istringstream words(text);
  std::string word;
  bool line_start = true;
  while (words >> word) {
    if (!line_start && col + 1 + word.size() > kWrapColumns) {
      out += "\n" + std::string(indent, ' ');
      col = indent;
      line_start = true;
    }
    if (!line_start) {
      out += ' ';
      ++col;
    }
    out += word;
    col += word.size();
    line_start = false;
  }
  return out + "\n";
}

double RoundGB(int64_t bytes) { return std::round(static_cast<double>(bytes) / kBytesPerGB * 100.0) / 100.0; }

std::string WorkerWhere(const WorkerPlacement& w) {
  if (w.interleaved()) return absl::StrCat("nodes ", w.NodeList(), " interleaved");
  if (w.slots > 1) return absl::StrCat("node ", w.NodeList(), " (", w.slot + 1, "/", w.slots, ")");
  return absl::StrCat("node ", w.NodeList());
}

}  // namespace

std::string FormatPlanText(const Plan& plan) {
  const Topology& t = plan.topology;
  std::ostringstream os;
  int64_t memory = 0;
  int cpus = 0, dimms = 0;
  bool all_dimms = true;
  for (const NumaNode& n : t.nodes) {
    memory += n.memory_bytes;
    cpus += n.num_cpus;
    dimms += n.dimms;
    all_dimms = all_dimms && n.dimms > 0;
  }
  os << "numoe plan: " << (plan.model.name.empty() ? "model" : plan.model.name) << " on " << t.name << "\n";
  os << "  " << t.nodes.size() << " NUMA node" << (t.nodes.size() == 1 ? "" : "s") << ", " << FormatBytes(memory)
     << ", " << cpus << " CPUs";
  if (all_dimms) os << ", " << dimms << " DIMMs";
  os << "\n\nMemory one worker needs (GB = 1e9 bytes):\n";
  constexpr int kLabel = 26;
  auto term_line = [&](const std::string& label, int64_t bytes, const std::string& detail) {
    std::string head = absl::StrFormat("  %-*s %10s", kLabel, label, FormatBytes(bytes));
    os << (detail.empty() ? head + "\n" : Wrap(head + "  ", detail, head.size() + 2));
  };
  for (const MemoryTerm& term : plan.terms) term_line(term.label, term.bytes, term.detail);
  os << "  " << std::string(kLabel + 11, '-') << "\n";
  term_line("= one worker", plan.worker_need_bytes, "");
  term_line("OS headroom per node", plan.os_headroom_bytes,
            absl::StrCat("kernel, page tables, daemons, a page-cache floor; ",
                         absl::StrFormat("%g", plan.options.os_headroom_fraction * 100),
                         "% on smaller nodes (--os-headroom-gb, --os-headroom-pct)"));
  term_line("= a node holds a copy with", plan.node_bytes_for_one_worker,
            plan.options.plan_on_available ? "of memory available now (--available-memory)" : "of memory");

  os << "\nNodes:\n";
  os << absl::StrFormat("  %4s %11s %11s %6s %5s %7s  %s\n", "node", "memory", "usable", "DIMMs", "CPUs", "copies",
                        "used by");
  for (size_t i = 0; i < plan.nodes.size(); ++i) {
    const NodeUse& u = plan.nodes[i];
    const NumaNode& n = t.nodes[i];
    std::string used;
    if (u.workers.empty()) {
      used = "-";
    } else {
      std::vector<std::string> names;
      for (int w : u.workers) {
        names.push_back(absl::StrCat("worker ", w, plan.workers[w].interleaved() ? " (interleaved)" : ""));
      }
      used = absl::StrJoin(names, ", ");
    }
    os << absl::StrFormat("  %4d %11s %11s %6s %5d %7d  %s\n", n.id, FormatBytes(u.memory_bytes),
                          FormatBytes(u.usable_bytes), n.dimms > 0 ? std::to_string(n.dimms) : "?", n.num_cpus,
                          u.copies_fit, used);
  }

  os << "\n";
  if (plan.fits()) {
    os << "Plan: " << plan.workers.size() << " worker" << (plan.workers.size() == 1 ? "" : "s") << "\n";
    for (const WorkerPlacement& w : plan.workers) {
      os << absl::StrFormat("  worker %-3d %-22s %4d threads  %s of %s usable  numactl %s\n", w.index,
                            WorkerWhere(w), w.threads, FormatBytes(w.need_bytes), FormatBytes(w.usable_bytes),
                            w.NumactlArgs());
    }
  } else {
    os << "Plan: no worker fits (" << FormatBytes(plan.shortfall_bytes) << " missing)\n";
  }
  os << "\nWhy:\n";
  for (const std::string& s : plan.explanation) os << Wrap("  - ", s, 4);
  if (!plan.warnings.empty()) {
    os << "\nWarnings:\n";
    for (const std::string& s : plan.warnings) os << Wrap("  - ", s, 4);
  }
  return os.str();
}

std::string FormatPlanJson(const Plan& plan) {
  json j;
  const ModelMemory& m = plan.model;
  j["model"] = {{"name", m.name},
                {"routed_expert_gb", RoundGB(m.routed_expert_bytes)},
                {"drafter_expert_gb", RoundGB(m.drafter_expert_bytes)},
                {"routed_gb_per_token", RoundGB(m.routed_bytes_per_token)},
                {"other_gb", RoundGB(m.other_bytes)}};
  j["drafter_experts"] = plan.drafter_on_cpu ? "cpu" : (m.drafter_expert_bytes > 0 ? "gpu" : "none");
  json terms = json::array();
  for (const MemoryTerm& t : plan.terms) {
    terms.push_back({{"key", t.key}, {"label", t.label}, {"bytes", t.bytes}, {"gb", RoundGB(t.bytes)}, {"detail", t.detail}});
  }
  j["terms"] = terms;
  j["need_bytes"] = plan.worker_need_bytes;
  j["need_gb"] = RoundGB(plan.worker_need_bytes);
  j["os_headroom_gb_per_node"] = RoundGB(plan.os_headroom_bytes);
  j["node_gb_for_one_worker"] = RoundGB(plan.node_bytes_for_one_worker);
  json nodes = json::array();
  for (size_t i = 0; i < plan.nodes.size(); ++i) {
    const NodeUse& u = plan.nodes[i];
    const NumaNode& n = plan.topology.nodes[i];
    json node = {{"id", n.id},
                 {"memory_gb", RoundGB(u.memory_bytes)},
                 {"headroom_gb", RoundGB(u.headroom_bytes)},
                 {"usable_gb", RoundGB(u.usable_bytes)},
                 {"cpus", n.num_cpus},
                 {"copies_fit", u.copies_fit},
                 {"workers", u.workers}};
    if (!n.cpu_ids.empty()) node["cpu_list"] = FormatCpuList(n.cpu_ids);
    if (n.cores > 0) node["cores"] = n.cores;
    if (n.dimms > 0) node["dimms"] = n.dimms;
    if (n.available_bytes >= 0) node["available_gb"] = RoundGB(n.available_bytes);
    nodes.push_back(std::move(node));
  }
  j["topology"] = {{"name", plan.topology.name}, {"nodes", nodes}};
  json workers = json::array();
  for (const WorkerPlacement& w : plan.workers) {
    json wj = {{"name", absl::StrCat("numoe-worker-", w.index)},
               {"nodes", w.nodes},
               {"interleaved", w.interleaved()},
               {"need_gb", RoundGB(w.need_bytes)},
               {"usable_gb", RoundGB(w.usable_bytes)},
               {"threads", w.threads},
               {"numactl", w.NumactlArgs()}};
    if (!w.cpus.empty()) wj["cpus"] = FormatCpuList(w.cpus);
    if (!w.thread_cpus.empty()) wj["thread_cpus"] = FormatCpuList(w.thread_cpus);  // numoe-worker --cpus
    if (w.slots > 1) {
      wj["slot"] = w.slot;
      wj["slots"] = w.slots;
    }
    workers.push_back(std::move(wj));
  }
  j["workers"] = workers;
  j["fits"] = plan.fits();
  j["missing_gb"] = RoundGB(plan.shortfall_bytes);
  j["unused_nodes"] = plan.unused_nodes;
  j["explanation"] = plan.explanation;
  j["warnings"] = plan.warnings;
  // Names come from files and hostnames: replace invalid UTF-8 instead of throwing.
  return j.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
}

}  // namespace numoe::deploy
