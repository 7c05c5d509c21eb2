#include "common/synthetic/presets.h"

#include <algorithm>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/synthetic/synthetic.h"

namespace numoe::synthetic {

// tests/data/v4-flash-0731.config.json, embedded by common/CMakeLists.txt (synthetic_data.cc).
extern const unsigned char kV4FlashConfigJson[];
extern const size_t kV4FlashConfigJsonSize;

namespace {

constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxExperts = 4096;

}  // namespace

ModelConfig V4FlashConfig() {
  const std::string text(reinterpret_cast<const char*>(kV4FlashConfigJson), kV4FlashConfigJsonSize);
  StatusOr<ModelConfig> c = ParseModelConfig(text, "v4-flash-0731.config.json");
  NCHECK(c.ok()) << c.status();
  return *std::move(c);
}

std::vector<AttnType> PresetSchedule(int64_t layers, int64_t sliding) {
  if (layers >= 3) sliding = std::min(sliding, layers - 2);
  std::vector<AttnType> out;
  for (int64_t i = 0; i < layers; ++i) {
    if (i < sliding) {
      out.push_back(AttnType::kSliding);
    } else {
      out.push_back((i - sliding) % 2 == 0 ? AttnType::kCSA : AttnType::kHCA);
    }
  }
  return out;
}

StatusOr<Preset> MakePreset(const PresetOptions& o) {
  Preset p;
  int64_t layers = o.layers, sliding = 0, hash = 0, stages = o.dspark_stages;
  if (o.preset == "tiny") {
    p.config = TinyConfig();
    if (layers == 0) layers = 5;
    sliding = 1;
    hash = 2;
    if (stages < 0) stages = 3;
  } else if (o.preset == "v4-flash") {
    p.config = V4FlashConfig();
    if (layers == 0) layers = 2;
    sliding = 2;
    hash = 3;
    if (stages < 0) stages = 0;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--preset must be tiny or v4-flash (got '", o.preset, "')"));
  }
  ModelConfig& c = p.config;
  if (layers < 1 || layers > kMaxLayers) {
    return absl::InvalidArgumentError(absl::StrCat("--layers must be in [1, ", kMaxLayers, "] (got ", layers, ")"));
  }
  if (o.experts != 0) {
    if (o.experts < c.num_experts_per_tok || o.experts > kMaxExperts) {
      return absl::InvalidArgumentError(absl::StrCat("--experts must be in [", c.num_experts_per_tok, ", ", kMaxExperts,
                                                     "] for ", o.preset, " (top-", c.num_experts_per_tok,
                                                     " routing) (got ", o.experts, ")"));
    }
    c.n_routed_experts = o.experts;
  }
  if (stages > 16) {
    return absl::InvalidArgumentError(absl::StrCat("--dspark-stages must be in [0, 16] (got ", stages, ")"));
  }
  bool mtp = false;
  if (o.drafter == "none" || o.drafter == "mtp") {
    if (o.dspark_stages > 0) {
      return absl::InvalidArgumentError(absl::StrCat("--dspark-stages ", o.dspark_stages, " needs --drafter dspark (got --drafter ",
                                                     o.drafter, ")"));
    }
    stages = 0;
    mtp = o.drafter == "mtp";
  } else if (o.drafter == "dspark") {
    if (o.dspark_stages < 0) stages = 3;
    if (stages == 0) return absl::InvalidArgumentError("--drafter dspark needs --dspark-stages >= 1 (got 0)");
  } else if (!o.drafter.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--drafter must be none, mtp or dspark (got '", o.drafter, "')"));
  }
  SetSchedule(&c, PresetSchedule(layers, sliding), std::min(hash, layers));
  c.extra_compress_ratios.assign(static_cast<size_t>(mtp ? 1 : stages), 0);
  if (stages > 0) {
    if (c.dspark_block_size <= 0) return absl::InternalError("preset without a DSpark config");
    c.num_nextn_predict_layers = 1;
    c.dspark_target_layer_ids.clear();
    for (int64_t l = std::max<int64_t>(0, layers - 3); l < layers; ++l) c.dspark_target_layer_ids.push_back(l);
  } else {
    c.num_nextn_predict_layers = mtp ? 1 : 0;
    c.dspark_block_size = 0;
    c.dspark_noise_token_id = -1;
    c.dspark_markov_rank = 0;
    c.dspark_target_layer_ids.clear();
  }
  p.mtp_stages = mtp ? 1 : stages;
  p.drafter = mtp ? "mtp" : stages > 0 ? "dspark" : "none";
  // Validate as a loaded config.json would be.
  ASSIGN_OR_RETURN(p.config, ParseModelConfig(ModelConfigToJson(c), absl::StrCat(o.preset, " preset config")));
  return p;
}

}  // namespace numoe::synthetic
