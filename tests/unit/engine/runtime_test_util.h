// Shared by the runtime's unit and integration tests: the tiny-v4 goldens (prompt ids and the greedy
// continuation transformers produced, EOS ignored).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "common/quant.h"
#include "common/safetensors.h"

namespace numoe::test {

struct GoldenPrompt {
  std::string name;              // "p0".."p3"
  std::vector<int32_t> input_ids;
  std::vector<int32_t> greedy;   // greedy continuation (32 tokens for tiny-v4)
};

inline std::vector<int32_t> GoldenIds(const TensorStore& s, const std::string& name) {
  std::vector<int32_t> out;
  auto v = s.Get(name);
  EXPECT_TRUE(v.ok()) << v.status();
  if (!v.ok()) return out;
  auto t = ToF32(**v);
  EXPECT_TRUE(t.ok()) << t.status();
  if (!t.ok()) return out;
  for (float f : t->data) out.push_back(static_cast<int32_t>(f));
  return out;
}

// p0..p3 of DIR/golden.safetensors.
inline std::vector<GoldenPrompt> LoadGoldens(const std::string& dir) {
  std::vector<GoldenPrompt> out;
  auto g = TensorStore::Open(dir + "/golden.safetensors");
  EXPECT_TRUE(g.ok()) << g.status();
  if (!g.ok()) return out;
  for (const char* p : {"p0", "p1", "p2", "p3"}) {
    out.push_back(GoldenPrompt{p, GoldenIds(**g, std::string(p) + ".input_ids"),
                               GoldenIds(**g, std::string(p) + ".greedy_tokens")});
  }
  return out;
}

inline std::string TinyDir() { return std::string(NUMOE_TEST_DATA) + "/tiny-v4"; }

}  // namespace numoe::test
