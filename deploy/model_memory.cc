#include "deploy/model_memory.h"

#include <filesystem>
#include <fstream>
#include <algorithm>
#include <sstream>

#include "absl/strings/numbers.h"
#include "common/checkpoint.h"
#include "nlohmann/json.hpp"

namespace numoe::deploy {
namespace {

namespace fs = std::filesystem;

std::string ExpertFormatName(const std::string& expert_dtype) {
  if (expert_dtype == "fp4") return "MXFP4";
  if (expert_dtype == "fp8") return "FP8";
  if (expert_dtype == "bf16") return "BF16";
  return expert_dtype;
}

}  // namespace

StatusOr<int64_t> CountDrafterStagesInIndex(const std::string& index_path) {
  std::ifstream in(index_path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(index_path, ": cannot open"));
  std::ostringstream ss;
  ss << in.rdbuf();
  nlohmann::json doc = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(index_path, ": not valid JSON"));
  if (!doc.is_object() || !doc.contains("weight_map") || !doc["weight_map"].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(index_path, ": weight_map must be an object"));
  }
  int64_t stages = 0;
  for (const auto& [name, shard] : doc["weight_map"].items()) {
    if (name.rfind("mtp.", 0) != 0) continue;
    size_t dot = name.find('.', 4);
    int64_t s = 0;
    if (dot == std::string::npos || !absl::SimpleAtoi(name.substr(4, dot - 4), &s) || s < 0 || s >= 1024) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": tensor \"", name, "\" has a bad MTP stage number"));
    }
    stages = std::max(stages, s + 1);
  }
  return stages;
}

ModelMemory ModelMemoryFromConfig(const ModelConfig& config, int64_t drafter_stages, const std::string& name) {
  const ModelFootprint fp = ComputeFootprint(config, drafter_stages);
  ModelMemory m;
  m.name = name;
  m.routed_expert_bytes = fp.routed_expert_bytes;
  m.drafter_expert_bytes = fp.mtp_routed_expert_bytes;
  m.routed_bytes_per_token = fp.routed_bytes_per_token;
  m.activation_bytes_per_token =
      WorkerActivationBytesPerToken(config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok);
  m.other_bytes = fp.other_bytes;
  m.num_layers = config.num_hidden_layers;
  m.num_experts = config.n_routed_experts;
  m.top_k = config.num_experts_per_tok;
  m.drafter_stages = drafter_stages;
  m.drafter_kind = config.dspark_block_size > 0 ? "DSpark" : "MTP";
  m.expert_format = ExpertFormatName(config.expert_dtype);
  return m;
}

StatusOr<ModelMemory> LoadModelMemory(const std::string& path) {
  std::error_code ec;
  const bool is_dir = fs::is_directory(path, ec);
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(path));
  int64_t stages = config.DefaultMtpStages();
  std::string name = fs::path(path).filename().string();
  if (name.empty()) name = fs::path(path).parent_path().filename().string();
  if (is_dir) {
    const std::string index = (fs::path(path) / "model.safetensors.index.json").string();
    if (fs::exists(index, ec)) {
      ASSIGN_OR_RETURN(stages, CountDrafterStagesInIndex(index));
    }
  }
  return ModelMemoryFromConfig(config, stages, name);
}

}  // namespace numoe::deploy
