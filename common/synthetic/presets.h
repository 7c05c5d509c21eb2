// Model presets of `numoe mkmodel`: the configs of synthetic checkpoints with real shapes.
//
//   ASSIGN_OR_RETURN(Preset p, MakePreset({.preset = "v4-flash", .layers = 2}));
//   SyntheticOptions o;  o.mtp_stages = p.mtp_stages;
//   RETURN_IF_ERROR(MakeSyntheticCheckpoint(p.config, dir, o));
//
// Presets:
//   tiny      tests/data/tiny-v4's config (hidden 128, 8 experts top-2 of 64, vocab 1024); default 5 layers
//             (sliding, CSA, HCA, CSA, HCA), 2 hash layers, 3 DSpark stages: the fixture's shapes exactly.
//   v4-flash  DeepSeek-V4-Flash-0731's config (tests/data/v4-flash-0731.config.json: hidden 4096, 64 heads of
//             512, q_lora 1024, 8 output groups of rank 1024, 256 experts top-6 of width 2048, indexer 64x128
//             top-512, vocab 129280, FP8 dense + MXFP4 experts) with fewer layers; default 2 layers (~7.5 GB:
//             6.9 GB of routed experts, 1.1 GB of embedding + head), no DSpark stages.
// Layer schedule (both presets): the preset's pattern truncated, i.e. `s` sliding layers (tiny 1, Flash 2)
// then CSA/HCA alternating, except that with 3 or more layers at most layers-2 are sliding so that at least
// one CSA and one HCA layer exist (3 Flash layers: sliding, CSA, HCA). The first min(preset's, layers) layers
// are hash-routed (tiny 2, Flash 3). DSpark stages (when > 0) target the last min(3, layers) layers.
// Drafter: the preset's (tiny: 3 DSpark stages, v4-flash: none), or `drafter` = "none", "dspark" (stages from
// `dspark_stages`, default 3) or "mtp" (the preview-Flash layout: one `mtp.0` block with e_proj/h_proj,
// enorm/hnorm/norm and hc_head_*, num_nextn_predict_layers 1, no dspark_* keys, compress_ratios entry 0).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/status.h"

namespace numoe::synthetic {

struct PresetOptions {
  std::string preset;          // "tiny" or "v4-flash"
  int64_t layers = 0;          // main layers, >= 1; 0 = the preset's default (tiny 5, v4-flash 2)
  int64_t experts = 0;         // routed experts per layer, >= top-k; 0 = the preset's (tiny 8, v4-flash 256)
  int64_t dspark_stages = -1;  // DSpark drafter stages; -1 = the preset's default (tiny 3, v4-flash 0)
  std::string drafter;         // "" = the preset's; "none", "mtp" or "dspark"
};

struct Preset {
  ModelConfig config;
  int64_t mtp_stages = 0;  // pass as SyntheticOptions::mtp_stages
  std::string drafter;     // what the checkpoint holds: "none", "mtp" or "dspark"
};

// InvalidArgument naming the option for an unknown preset or out-of-range numbers.
StatusOr<Preset> MakePreset(const PresetOptions& options);

// The released DeepSeek-V4-Flash-0731 config (43 layers), embedded from tests/data at build time.
ModelConfig V4FlashConfig();

// `layers` attention types: `sliding` sliding layers then CSA/HCA alternating, with at least one CSA and one
// HCA when layers >= 3 (see the header comment).
std::vector<AttnType> PresetSchedule(int64_t layers, int64_t sliding);

}  // namespace numoe::synthetic
