#include "tests/unit/deploy/full_size_model.h"

#include "deploy/model_memory.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/support/status_matchers.h"

namespace numoe::deploy::testing {

ModelMemory FullSizeModel() {
  // Loaded and checked once per test binary (the random-machine test plans hundreds of times).
  static const ModelMemory cached = [] {
  auto m = LoadModelMemory(std::string(NUMOE_TEST_DATA) + "/v4-flash-0731.config.json");
  EXPECT_OK(m);
  if (!m.ok()) return ModelMemory{};
  EXPECT_EQ(m->name, "v4-flash-0731.config.json");
  EXPECT_EQ(m->routed_expert_bytes, kRoutedBytes);
  EXPECT_EQ(m->drafter_expert_bytes, kDrafterBytes);
  EXPECT_EQ(m->routed_bytes_per_token, kBytesPerToken);
  EXPECT_EQ(m->activation_bytes_per_token, kActivationPerToken);
  EXPECT_EQ(m->num_layers, 43);
  EXPECT_EQ(m->num_experts, 256);
  EXPECT_EQ(m->top_k, 6);
  EXPECT_EQ(m->drafter_stages, 3);
  EXPECT_EQ(m->drafter_kind, "DSpark");
  EXPECT_EQ(m->expert_format, "MXFP4");
  EXPECT_GT(m->other_bytes, 0);
  return *m;
  }();
  return cached;
}

Topology Described(const std::string& name, const std::vector<NodeSpec>& nodes) {
  nlohmann::json j;
  j["name"] = name;
  j["nodes"] = nlohmann::json::array();
  for (size_t i = 0; i < nodes.size(); ++i) {
    nlohmann::json n = {{"id", i}, {"memory_gb", nodes[i].memory_gb}};
    if (nodes[i].dimms > 0) n["dimms"] = nodes[i].dimms;
    if (nodes[i].cpus > 0) {
      n["cpus"] = nodes[i].cpus;
    } else {
      // Linux numbering on a 24-core-per-node box with SMT: node i has i*24..i*24+23 and their siblings
      // 96+i*24.. (4 nodes x 24 cores).
      int base = static_cast<int>(i) * 24;
      n["cpus"] = std::to_string(base) + "-" + std::to_string(base + 23) + "," + std::to_string(96 + base) + "-" +
                  std::to_string(96 + base + 23);
      n["cores"] = 24;
    }
    j["nodes"].push_back(n);
  }
  auto t = ParseTopologyJson(j.dump(), name + ".json");
  EXPECT_OK(t);
  return t.ok() ? *t : Topology{};
}

}  // namespace numoe::deploy::testing
