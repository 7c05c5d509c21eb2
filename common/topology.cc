#include "common/topology.h"

#include <hwloc.h>
#include <numa.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include "absl/strings/str_join.h"
#include "common/log.h"
#include "nlohmann/json.hpp"

namespace numoe {
namespace {

using json = nlohmann::json;

// Bounds that keep the byte arithmetic far from overflow and catch unit mix-ups (bytes given as GB).
constexpr double kMaxNodeMemoryGB = 1e6;  // 1 PB per node
constexpr int kMaxNodes = 1024;
constexpr int kMaxCpuId = 1 << 20;
constexpr int kMaxNodeId = 1 << 16;

std::string JsonTypeName(const json& v) { return v.type_name(); }

Status FieldError(const std::string& source, const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": ", field, " ", what));
}

// An integer field: JSON integer (not bool, not 1.5) within [min, max].
StatusOr<int64_t> GetInt(const json& v, const std::string& source, const std::string& field, int64_t min,
                         int64_t max) {
  if (!v.is_number_integer()) {
    if (v.is_number_float()) {
      double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && d >= static_cast<double>(min) &&
          d <= static_cast<double>(max)) {
        return static_cast<int64_t>(d);
      }
      return FieldError(source, field, absl::StrCat("must be an integer (got ", v.dump(), ")"));
    }
    return FieldError(source, field, absl::StrCat("must be an integer (got ", JsonTypeName(v), ")"));
  }
  int64_t x = v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)
                  ? INT64_MAX
                  : v.get<int64_t>();
  if (x < min) {
    return FieldError(source, field, absl::StrCat("must be >= ", min, " (got ", x, ")"));
  }
  if (x > max) {
    return FieldError(source, field, absl::StrCat("must be <= ", max, " (got ", x, ")"));
  }
  return x;
}

// A size in GB: a finite number > 0 (or >= 0 when `allow_zero`), converted to bytes.
StatusOr<int64_t> GetGB(const json& v, const std::string& source, const std::string& field, bool allow_zero) {
  if (!v.is_number() || v.is_boolean()) {
    return FieldError(source, field, absl::StrCat("must be a number of GB (got ", JsonTypeName(v), ")"));
  }
  double gb = v.get<double>();
  if (!std::isfinite(gb) || (allow_zero ? gb < 0 : gb <= 0)) {
    return FieldError(source, field, absl::StrCat(allow_zero ? "must be >= 0" : "must be > 0", " (got ", v.dump(), ")"));
  }
  if (gb > kMaxNodeMemoryGB) {
    return FieldError(source, field,
                      absl::StrCat("must be <= ", kMaxNodeMemoryGB, " GB (got ", v.dump(),
                                   "; sizes are in GB = 1e9 bytes, not bytes)"));
  }
  return static_cast<int64_t>(std::llround(gb * kBytesPerGB));
}

StatusOr<std::vector<int>> GetCpus(const json& v, const std::string& source, const std::string& field) {
  std::vector<int> ids;
  if (v.is_string()) {
    return ParseCpuList(v.get<std::string>(), absl::StrCat(source, ": ", field));
  }
  if (!v.is_array()) {
    return FieldError(source, field,
                      absl::StrCat("must be a CPU count, a list of CPU ids or a string like \"0-23\" (got ",
                                   JsonTypeName(v), ")"));
  }
  if (v.empty()) return FieldError(source, field, "must list at least one CPU");
  for (size_t i = 0; i < v.size(); ++i) {
    ASSIGN_OR_RETURN(int64_t id, GetInt(v[i], source, absl::StrCat(field, "[", i, "]"), 0, kMaxCpuId));
    ids.push_back(static_cast<int>(id));
  }
  std::vector<int> sorted = ids;
  std::sort(sorted.begin(), sorted.end());
  auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end()) {
    return FieldError(source, field, absl::StrCat("lists CPU ", *dup, " twice"));
  }
  return sorted;
}

StatusOr<NumaNode> ParseNode(const json& v, const std::string& source, size_t index) {
  const std::string prefix = absl::StrCat("nodes[", index, "]");
  if (!v.is_object()) return FieldError(source, prefix, absl::StrCat("must be an object (got ", JsonTypeName(v), ")"));
  static const std::set<std::string> kKnown = {"id", "cpus", "cores", "memory_gb", "available_gb", "dimms"};
  for (const auto& [key, value] : v.items()) {
    if (!kKnown.contains(key)) {
      return FieldError(source, absl::StrCat(prefix, ".", key),
                        "is not a known key (known: id, cpus, cores, memory_gb, available_gb, dimms)");
    }
  }
  for (const char* required : {"id", "cpus", "memory_gb"}) {
    if (!v.contains(required)) return FieldError(source, absl::StrCat(prefix, ".", required), "is missing");
  }
  NumaNode node;
  ASSIGN_OR_RETURN(int64_t id, GetInt(v["id"], source, prefix + ".id", 0, kMaxNodeId));
  node.id = static_cast<int>(id);
  const json& cpus = v["cpus"];
  if (cpus.is_number()) {
    ASSIGN_OR_RETURN(int64_t n, GetInt(cpus, source, prefix + ".cpus", 1, kMaxCpuId));
    node.num_cpus = static_cast<int>(n);
  } else {
    ASSIGN_OR_RETURN(node.cpu_ids, GetCpus(cpus, source, prefix + ".cpus"));
    node.num_cpus = static_cast<int>(node.cpu_ids.size());
  }
  ASSIGN_OR_RETURN(node.memory_bytes, GetGB(v["memory_gb"], source, prefix + ".memory_gb", false));
  if (v.contains("available_gb")) {
    ASSIGN_OR_RETURN(node.available_bytes, GetGB(v["available_gb"], source, prefix + ".available_gb", true));
    if (node.available_bytes > node.memory_bytes) {
      return FieldError(source, prefix + ".available_gb",
                        absl::StrCat("must be <= memory_gb (got ", v["available_gb"].dump(), " > ",
                                     v["memory_gb"].dump(), ")"));
    }
  }
  if (v.contains("cores")) {
    ASSIGN_OR_RETURN(int64_t cores, GetInt(v["cores"], source, prefix + ".cores", 1, node.num_cpus));
    node.cores = static_cast<int>(cores);
  }
  if (v.contains("dimms")) {
    ASSIGN_OR_RETURN(int64_t dimms, GetInt(v["dimms"], source, prefix + ".dimms", 1, 1024));
    node.dimms = static_cast<int>(dimms);
  }
  return node;
}

// Reads "Node N <Key>: <value> kB" lines of /sys/devices/system/node/nodeN/meminfo.
std::map<std::string, int64_t> ReadNodeMeminfo(int node) {
  std::map<std::string, int64_t> out;
  std::ifstream in(absl::StrCat("/sys/devices/system/node/node", node, "/meminfo"));
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string word_node, id, key;
    int64_t value = 0;
    if (!(ls >> word_node >> id >> key >> value)) continue;
    if (!key.empty() && key.back() == ':') key.pop_back();
    out[key] = value * 1024;
  }
  return out;
}

// Free memory plus what the kernel can reclaim without swapping (clean page cache, reclaimable slab);
// /dev/shm (Shmem) is not reclaimable. Falls back to libnuma's MemFree.
int64_t NodeAvailableBytes(int node, int64_t numa_free) {
  auto info = ReadNodeMeminfo(node);
  if (!info.contains("MemFree") || !info.contains("FilePages")) return numa_free;
  int64_t avail = info["MemFree"] + info["FilePages"] - info["Shmem"] + info["SReclaimable"];
  return std::max<int64_t>(avail, info["MemFree"]);
}

struct HwlocDeleter {
  void operator()(hwloc_topology* t) const { hwloc_topology_destroy(t); }
};

// Physical cores per NUMA node (by OS index); empty when hwloc cannot load the topology.
std::map<int, int> CoresPerNode() {
  std::map<int, int> out;
  hwloc_topology_t raw = nullptr;
  if (hwloc_topology_init(&raw) != 0) return out;
  std::unique_ptr<hwloc_topology, HwlocDeleter> topo(raw);
  if (hwloc_topology_load(topo.get()) != 0) return out;
  int n = hwloc_get_nbobjs_by_type(topo.get(), HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < n; ++i) {
    hwloc_obj_t obj = hwloc_get_obj_by_type(topo.get(), HWLOC_OBJ_NUMANODE, i);
    if (obj == nullptr || obj->cpuset == nullptr || hwloc_bitmap_iszero(obj->cpuset)) continue;
    out[static_cast<int>(obj->os_index)] =
        hwloc_get_nbobjs_inside_cpuset_by_type(topo.get(), obj->cpuset, HWLOC_OBJ_CORE);
  }
  return out;
}

// The CPUs this process may run on (sched_getaffinity: a cpuset cgroup, taskset or numactl narrows it).
StatusOr<cpu_set_t> AllowedCpus() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) {
    return absl::InternalError(absl::StrCat("topology: sched_getaffinity: ", std::strerror(errno)));
  }
  return allowed;
}

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

// A machine without libnuma support: one node with every CPU this process may run on, and all memory.
StatusOr<Topology> ProbeWithoutNuma(const cpu_set_t& allowed) {
  long pages = sysconf(_SC_PHYS_PAGES);
  long avail_pages = sysconf(_SC_AVPHYS_PAGES);
  long page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) {
    return absl::UnavailableError("cannot read the machine's topology: libnuma is unavailable and sysconf failed");
  }
  Topology t;
  t.name = absl::StrCat("this machine (", HostName(), ", no NUMA support)");
  NumaNode node;
  node.id = 0;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &allowed)) node.cpu_ids.push_back(c);
  }
  node.num_cpus = static_cast<int>(node.cpu_ids.size());
  node.memory_bytes = static_cast<int64_t>(pages) * page;
  node.available_bytes = avail_pages > 0 ? static_cast<int64_t>(avail_pages) * page : -1;
  t.nodes.push_back(std::move(node));
  RETURN_IF_ERROR(ValidateTopology(t, t.name));
  return t;
}

}  // namespace

int Topology::IndexOf(int id) const {
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i].id == id) return static_cast<int>(i);
  }
  return -1;
}

int Topology::Distance(size_t i, size_t j) const {
  if (i < distances.size() && j < distances[i].size()) return distances[i][j];
  if (i == j) return 10;
  return 20 + static_cast<int>(i > j ? i - j : j - i);
}

Status ValidateTopology(const Topology& t, const std::string& source) {
  if (t.nodes.empty()) return FieldError(source, "nodes", "must list at least one NUMA node");
  if (t.nodes.size() > static_cast<size_t>(kMaxNodes)) {
    return FieldError(source, "nodes", absl::StrCat("has ", t.nodes.size(), " entries (at most ", kMaxNodes, ")"));
  }
  std::map<int, size_t> seen_id;
  std::map<int, size_t> seen_cpu;
  for (size_t i = 0; i < t.nodes.size(); ++i) {
    const NumaNode& n = t.nodes[i];
    const std::string prefix = absl::StrCat("nodes[", i, "]");
    if (n.id < 0) return FieldError(source, prefix + ".id", absl::StrCat("must be >= 0 (got ", n.id, ")"));
    if (auto [it, fresh] = seen_id.emplace(n.id, i); !fresh) {
      return FieldError(source, prefix + ".id", absl::StrCat("repeats node id ", n.id, " of nodes[", it->second, "]"));
    }
    if (n.num_cpus <= 0) return FieldError(source, prefix + ".cpus", absl::StrCat("must be > 0 (got ", n.num_cpus, ")"));
    if (!n.cpu_ids.empty() && n.cpu_ids.size() != static_cast<size_t>(n.num_cpus)) {
      return FieldError(source, prefix + ".cpus", "count and list disagree");
    }
    for (int c : n.cpu_ids) {
      if (auto [it, fresh] = seen_cpu.emplace(c, i); !fresh) {
        return FieldError(source, prefix + ".cpus",
                          absl::StrCat("lists CPU ", c, ", which nodes[", it->second, "] also lists"));
      }
    }
    if (n.memory_bytes <= 0) {
      return FieldError(source, prefix + ".memory_gb",
                        absl::StrCat("must be > 0 (got ", static_cast<double>(n.memory_bytes) / kBytesPerGB, ")"));
    }
    if (n.cores < 0 || n.cores > n.num_cpus) {
      return FieldError(source, prefix + ".cores", absl::StrCat("must be in [1, cpus] (got ", n.cores, ")"));
    }
  }
  if (!t.distances.empty()) {
    if (t.distances.size() != t.nodes.size()) {
      return FieldError(source, "distances",
                        absl::StrCat("must have one row per node (", t.nodes.size(), " rows, got ", t.distances.size(), ")"));
    }
    for (size_t i = 0; i < t.distances.size(); ++i) {
      if (t.distances[i].size() != t.nodes.size()) {
        return FieldError(source, absl::StrCat("distances[", i, "]"),
                          absl::StrCat("must have ", t.nodes.size(), " entries (got ", t.distances[i].size(), ")"));
      }
      for (size_t j = 0; j < t.distances[i].size(); ++j) {
        if (t.distances[i][j] <= 0) {
          return FieldError(source, absl::StrCat("distances[", i, "][", j, "]"),
                            absl::StrCat("must be > 0 (got ", t.distances[i][j], ")"));
        }
      }
    }
  }
  return absl::OkStatus();
}

StatusOr<Topology> ParseTopologyJson(std::string_view text, const std::string& source) {
  json doc;
  try {
    doc = json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not valid JSON: ", e.what()));
  }
  if (!doc.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": must be a JSON object with \"nodes\" (got ", doc.type_name(), ")"));
  }
  for (const auto& [key, value] : doc.items()) {
    if (key != "name" && key != "nodes" && key != "distances" && key != "comment") {
      return FieldError(source, key, "is not a known key (known: name, nodes, distances, comment)");
    }
  }
  Topology t;
  if (doc.contains("name")) {
    if (!doc["name"].is_string()) return FieldError(source, "name", absl::StrCat("must be a string (got ", doc["name"].type_name(), ")"));
    t.name = doc["name"].get<std::string>();
  } else {
    t.name = source;
  }
  if (!doc.contains("nodes")) return FieldError(source, "nodes", "is missing");
  const json& nodes = doc["nodes"];
  if (!nodes.is_array()) return FieldError(source, "nodes", absl::StrCat("must be an array (got ", nodes.type_name(), ")"));
  if (nodes.size() > static_cast<size_t>(kMaxNodes)) {
    return FieldError(source, "nodes", absl::StrCat("has ", nodes.size(), " entries (at most ", kMaxNodes, ")"));
  }
  for (size_t i = 0; i < nodes.size(); ++i) {
    ASSIGN_OR_RETURN(NumaNode node, ParseNode(nodes[i], source, i));
    t.nodes.push_back(std::move(node));
  }
  if (doc.contains("distances")) {
    const json& d = doc["distances"];
    if (!d.is_array()) return FieldError(source, "distances", absl::StrCat("must be an array of rows (got ", d.type_name(), ")"));
    for (size_t i = 0; i < d.size(); ++i) {
      if (!d[i].is_array()) {
        return FieldError(source, absl::StrCat("distances[", i, "]"), absl::StrCat("must be an array (got ", d[i].type_name(), ")"));
      }
      std::vector<int> row;
      for (size_t j = 0; j < d[i].size(); ++j) {
        ASSIGN_OR_RETURN(int64_t x, GetInt(d[i][j], source, absl::StrCat("distances[", i, "][", j, "]"), 1, 255));
        row.push_back(static_cast<int>(x));
      }
      t.distances.push_back(std::move(row));
    }
  }
  RETURN_IF_ERROR(ValidateTopology(t, source));
  return t;
}

StatusOr<Topology> LoadTopologyFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open topology file"));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read error"));
  return ParseTopologyJson(ss.str(), path);
}

StatusOr<Topology> ProbeTopology() {
  ASSIGN_OR_RETURN(cpu_set_t allowed, AllowedCpus());
  if (numa_available() < 0) return ProbeWithoutNuma(allowed);
  Topology t;
  t.name = absl::StrCat("this machine (", HostName(), ")");
  std::map<int, int> cores = CoresPerNode();
  const int max_node = numa_max_node();
  const int possible_cpus = numa_num_possible_cpus();
  std::unique_ptr<bitmask, decltype(&numa_free_cpumask)> mask(numa_allocate_cpumask(), &numa_free_cpumask);
  for (int id = 0; id <= max_node; ++id) {
    long long free_bytes = 0;
    long long size = numa_node_size64(id, &free_bytes);
    if (size <= 0) continue;  // no such node, or a CPU-only node
    NumaNode node;
    node.id = id;
    numa_bitmask_clearall(mask.get());
    if (numa_node_to_cpus(id, mask.get()) != 0) continue;
    for (int c = 0; c < possible_cpus && c < CPU_SETSIZE; ++c) {
      if (numa_bitmask_isbitset(mask.get(), c) && CPU_ISSET(c, &allowed)) node.cpu_ids.push_back(c);
    }
    if (node.cpu_ids.empty()) {
      // Memory-only nodes (CXL, HBM in flat mode), and nodes whose CPUs this process may not use, cannot
      // run a worker's threads; plan without them.
      NLOG(INFO) << "node " << id << " has memory but no CPUs this process may run on; the planner leaves it out";
      continue;
    }
    node.num_cpus = static_cast<int>(node.cpu_ids.size());
    if (auto it = cores.find(id); it != cores.end() && it->second > 0 && it->second <= node.num_cpus) {
      node.cores = it->second;
    }
    node.memory_bytes = size;
    node.available_bytes = NodeAvailableBytes(id, free_bytes);
    t.nodes.push_back(std::move(node));
  }
  if (t.nodes.empty()) return ProbeWithoutNuma(allowed);
  bool have_distances = true;
  for (size_t i = 0; i < t.nodes.size() && have_distances; ++i) {
    std::vector<int> row;
    for (size_t j = 0; j < t.nodes.size(); ++j) {
      int d = numa_distance(t.nodes[i].id, t.nodes[j].id);
      if (d <= 0) {
        have_distances = false;
        break;
      }
      row.push_back(d);
    }
    t.distances.push_back(std::move(row));
  }
  if (!have_distances) t.distances.clear();
  RETURN_IF_ERROR(ValidateTopology(t, t.name));
  return t;
}

std::string WorkerPlacement::NodeList() const { return absl::StrJoin(nodes, ","); }

std::string WorkerPlacement::NumactlArgs() const {
  const std::string list = NodeList();
  if (interleaved()) return absl::StrCat("--cpunodebind=", list, " --interleave=", list);
  if (slots > 1 && !cpus.empty()) return absl::StrCat("--physcpubind=", FormatCpuList(cpus), " --membind=", list);
  return absl::StrCat("--cpunodebind=", list, " --membind=", list);
}

std::string FormatCpuList(const std::vector<int>& cpus) {
  std::vector<int> s = cpus;
  std::sort(s.begin(), s.end());
  s.erase(std::unique(s.begin(), s.end()), s.end());
  std::string out;
  for (size_t i = 0; i < s.size();) {
    size_t j = i;
    while (j + 1 < s.size() && s[j + 1] == s[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(s[i]);
    if (j > i) absl::StrAppend(&out, "-", s[j]);
    i = j + 1;
  }
  return out;
}

StatusOr<std::vector<int>> ParseCpuList(std::string_view text_view, const std::string& what) {
  // Debian's absl::StrCat takes absl::string_view, which is not std::string_view there.
  const std::string text(text_view);
  std::vector<int> out;
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(what, " must look like \"0-23,48-71\": ", why, " (got \"", text, "\")"));
  };
  if (text.empty()) return bad("empty");
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    std::string part = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    size_t dash = part.find('-');
    auto parse = [&](std::string_view s, int* v) -> bool {
      if (s.empty() || s.size() > 7) return false;
      int x = 0;
      for (char c : s) {
        if (c < '0' || c > '9') return false;
        x = x * 10 + (c - '0');
      }
      *v = x;
      return x <= kMaxCpuId;
    };
    int lo = 0, hi = 0;
    if (dash == std::string::npos) {
      if (!parse(part, &lo)) return bad(absl::StrCat("\"", part, "\" is not a CPU id"));
      hi = lo;
    } else if (!parse(part.substr(0, dash), &lo) || !parse(part.substr(dash + 1), &hi) || hi < lo) {
      return bad(absl::StrCat("\"", part, "\" is not a range lo-hi"));
    }
    for (int c = lo; c <= hi; ++c) out.push_back(c);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  std::sort(out.begin(), out.end());
  auto dup = std::adjacent_find(out.begin(), out.end());
  if (dup != out.end()) return bad(absl::StrCat("CPU ", *dup, " appears twice"));
  return out;
}

}  // namespace numoe
