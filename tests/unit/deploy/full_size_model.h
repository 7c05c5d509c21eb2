// Shared by the deploy tests: the full-size DeepSeek-V4-Flash-0731 model's memory terms and described
// machines.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "deploy/planner.h"
#include "common/topology.h"

namespace numoe::deploy::testing {

// Byte terms of tests/data/v4-flash-0731.config.json, worked out by hand from tests/data/README.md
// ("43 x 256 x 3 x 4096 x 2048 params at 4.25 bits = 147.2 GB per full copy; 3.45 GB read per decoded
// token"): one expert = 3 x 4096 x 2048 x 4.25 / 8 = 13,369,344 B (MXFP4 nibbles + one E8M0 scale per 32).
inline constexpr int64_t kExpertBytes = 13'369'344;
inline constexpr int64_t kRoutedBytes = 43 * 256 * kExpertBytes;      // 147,169,738,752
inline constexpr int64_t kDrafterBytes = 3 * 256 * kExpertBytes;      //  10,267,656,192 (3 DSpark stages)
inline constexpr int64_t kBytesPerToken = 43 * 6 * kExpertBytes;      //   3,449,290,752
inline constexpr int64_t kActivationPerToken = 2 * 4096 * 4 + 6 * (2 * 2048 * 4 + 8);  // 131,120

// The model the tests plan for: LoadModelMemory (LoadModelConfig + ComputeFootprint) on the config file,
// checked against the hand-worked constants above, so a changed fixture or footprint fails loudly instead
// of silently moving the goldens.
ModelMemory FullSizeModel();

struct NodeSpec {
  double memory_gb;
  int dimms;
  int cpus;  // count; 0 = give an explicit list instead (24 CPUs + 24 SMT siblings, 24 cores)
};
// Builds the JSON description and parses it with ParseTopologyJson (so the tests also cover the format).
Topology Described(const std::string& name, const std::vector<NodeSpec>& nodes);

}  // namespace numoe::deploy::testing
