#include "deploy/planner.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_format.h"
#include "deploy/placement.h"
#include "deploy/plan_explain.h"

namespace numoe::deploy {
namespace {

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

int64_t CeilTimes(int64_t bytes, double fraction) {
  return static_cast<int64_t>(std::ceil(static_cast<double>(bytes) * fraction));
}

std::string Plural(int64_t n, const std::string& word) { return absl::StrCat(n, " ", word, n == 1 ? "" : "s"); }

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

  ASSIGN_OR_RETURN(plan.workers, PlaceWorkers(topology, {.need_bytes = need,
                                                         .usable_bytes = usable,
                                                         .instances_per_node = options.instances_per_node,
                                                         .threads_per_worker = options.threads_per_worker}));
  for (const WorkerPlacement& w : plan.workers) {
    for (int id : w.nodes) plan.nodes[topology.IndexOf(id)].workers.push_back(w.index);
  }
  for (size_t i = 0; i < topology.nodes.size(); ++i) {
    if (plan.nodes[i].workers.empty()) plan.unused_nodes.push_back(topology.nodes[i].id);
  }
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
