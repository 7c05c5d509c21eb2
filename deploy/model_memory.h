// The planner's ModelMemory from a DeepSeek-V4 config or checkpoint directory. Shape-only: the byte
// terms come from common/checkpoint.h's ComputeFootprint; no weight is read.
#pragma once

#include <cstdint>
#include <string>

#include "common/config.h"
#include "common/status.h"
#include "deploy/planner.h"

namespace numoe::deploy {

// Drafter (MTP/DSpark) stages a checkpoint ships, from the tensor names of its
// model.safetensors.index.json: the highest N of the "mtp.N." prefixes + 1, as Checkpoint::Open counts
// them. NotFound when the file cannot be opened.
StatusOr<int64_t> CountDrafterStagesInIndex(const std::string& index_path);

// Fills every ModelMemory field from the config and ComputeFootprint(config, drafter_stages).
ModelMemory ModelMemoryFromConfig(const ModelConfig& config, int64_t drafter_stages, const std::string& name);

// `path` is a checkpoint directory (DIR/config.json; drafter stages from the index when there is one,
// since what ships is what the worker loads) or a config .json file (drafter stages from
// ModelConfig::DefaultMtpStages: 3 for V4-Flash-0731).
StatusOr<ModelMemory> LoadModelMemory(const std::string& path);

}  // namespace numoe::deploy
