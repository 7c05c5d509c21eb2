#include "tests/support/fixtures.h"

#include <algorithm>

#include "common/quant.h"
#include "common/safetensors.h"
#include "common/status.h"

namespace numoe::test {
namespace {

StatusOr<std::vector<float>> ReadFloats(const TensorStore& store, std::string_view name) {
  ASSIGN_OR_RETURN(const TensorView* view, store.Get(name));
  ASSIGN_OR_RETURN(auto t, ToF32(*view));
  return std::move(t.data);
}

StatusOr<std::vector<int32_t>> ReadIds(const TensorStore& store, std::string_view name) {
  ASSIGN_OR_RETURN(std::vector<float> f, ReadFloats(store, name));
  return std::vector<int32_t>(f.begin(), f.end());
}

}  // namespace

std::string SafetensorsBytes(const std::string& header, const std::string& data, uint64_t header_len) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header_len >> (8 * i)) & 0xFF);
  return out + header + data;
}

std::string TestDataDir() { return NUMOE_TEST_DATA; }
std::string TinyDir() { return TestDataDir() + "/tiny-v4"; }
std::string DemoDir() { return TestDataDir() + "/demo-v4"; }

StatusOr<Goldens> Goldens::Load(const std::string& dir) {
  Goldens g;
  g.path_ = dir + "/golden.safetensors";
  ASSIGN_OR_RETURN(std::unique_ptr<TensorStore> store, TensorStore::Open(g.path_));
  g.store_ = std::move(store);
  // The prompts are what the file holds: every pK.input_ids, ordered by K.
  std::vector<std::pair<int, std::string>> names;
  constexpr std::string_view kIds = ".input_ids";
  for (const std::string& t : g.store_->Names()) {
    if (t.size() > kIds.size() + 1 && t[0] == 'p' && t.ends_with(kIds)) {
      const std::string name = t.substr(0, t.size() - kIds.size());
      names.emplace_back(std::stoi(name.substr(1)), name);
    }
  }
  std::sort(names.begin(), names.end());
  if (names.empty()) return absl::NotFoundError(g.path_ + " holds no golden prompt (pK.input_ids)");
  for (const auto& [k, name] : names) {
    GoldenPrompt p;
    p.name = name;
    ASSIGN_OR_RETURN(p.input_ids, ReadIds(*g.store_, name + ".input_ids"));
    ASSIGN_OR_RETURN(p.greedy, ReadIds(*g.store_, name + ".greedy_tokens"));
    ASSIGN_OR_RETURN(p.prefill_logits, ReadFloats(*g.store_, name + ".prefill_logits"));
    ASSIGN_OR_RETURN(p.step_logits, ReadFloats(*g.store_, name + ".greedy_step_logits"));
    g.prompts_.push_back(std::move(p));
  }
  return g;
}

StatusOr<const GoldenPrompt*> Goldens::Find(std::string_view name) const {
  for (const GoldenPrompt& p : prompts_) {
    if (p.name == name) return &p;
  }
  return absl::NotFoundError(path_ + " has no golden prompt " + std::string(name));
}

StatusOr<std::vector<float>> Goldens::Floats(std::string_view tensor) const { return ReadFloats(*store_, tensor); }

}  // namespace numoe::test
