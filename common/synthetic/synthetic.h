// Synthetic DeepSeek-V4 checkpoints: random weights in the official on-disk layout, for any config of the
// family (other layer schedules, expert counts, widths, shard counts, tid2eid dtypes, with or without
// MTP/DSpark stages). Used by unit tests, model tests (forward passes on other family members) and
// `numoe mkmodel`.
//
//   ModelConfig cfg = numoe::synthetic::TinyConfig();                 // tiny-v4's shapes
//   numoe::synthetic::SetSchedule(&cfg, {AttnType::kCSA, AttnType::kHCA}, /*num_hash_layers=*/1);
//   cfg.n_routed_experts = 16;
//   numoe::synthetic::SyntheticOptions opt;
//   opt.seed = 7; opt.num_shards = 3; opt.tid2eid_dtype = DType::kI32;
//   RETURN_IF_ERROR(numoe::synthetic::MakeSyntheticCheckpoint(cfg, dir, opt));
//   auto ck = Checkpoint::Open(dir);                                  // validates cleanly
//
// What is written into `dir` (created if needed; existing files of the same names are replaced):
//   config.json                          ModelConfigToJson(config) (official keys)
//   model-0000k-of-0000N.safetensors     tensors of ExpectedTensors(config, stages), in that order, split
//                                        into N shards of roughly equal bytes (a shard may hold nothing but
//                                        a `__metadata__` when N exceeds the tensor count)
//   model.safetensors.index.json         {"metadata": {"total_size"}, "weight_map"}
// or, with write_index = false and num_shards = 1, a single `model.safetensors` and no index.
//
// Streaming: the shard headers are computed from the shapes first, then each shard is written front to
// back, a piece (about 1M elements of one tensor) at a time, encoded on `threads` threads; memory stays at a
// few MB per thread whatever the checkpoint's size (a 2-layer full-width V4-Flash is ~7.5 GB). Files are
// written under a `.tmp` name and renamed when complete. The bytes depend only on (config, seed,
// num_shards, tid2eid_dtype, mtp_stages, write_index, stds), never on `threads`.
//
// Storage follows the config exactly as the official checkpoint does: FP8 E4M3 + E8M0 (or F32) 128x128
// block scales for dense projections when quantization_config is set, MXFP4 (I8, low nibble first) +
// E8M0 per-32 scales for routed experts when expert_dtype is fp4 (FP8 + F32 scales for fp8, BF16 for
// bf16), BF16 embeddings/head/compressor/gate/norms, F32 mHC params/sinks/ape/gate bias.
//
// Values (before quantization; every tensor is drawn from its own stream seeded by (seed, name), so the
// weights do not depend on the shard count):
//   matrices           N(0, s^2) with s = min(dense_std, 1/sqrt(in)) — keeps activations O(1) at any width
//   embed.weight       N(0, embed_std^2)
//   norm weights       1 + N(0, 0.05^2)
//   hc_*_fn            N(0, 0.04^2); hc_*_base N(0, 0.4^2); hc_*_scale U(0.5, 1.5)   (as in tiny-v4)
//   attn_sink, ape     N(0, 0.5^2); ffn.gate.bias N(0, 0.05^2)
//   tid2eid            uniform expert ids in [0, n_routed_experts)
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/safetensors.h"
#include "common/status.h"

namespace numoe::synthetic {

struct SyntheticOptions {
  uint64_t seed = 1;
  int num_shards = 2;                 // >= 1
  DType tid2eid_dtype = DType::kI64;  // kI32 or kI64
  int64_t mtp_stages = -1;            // -1: config.DefaultMtpStages()
  bool write_index = true;            // false (with num_shards = 1): a single model.safetensors, no index
  float dense_std = 0.05f;
  float embed_std = 1.0f;
  int threads = 1;  // >= 1 encoding threads (the caller's thread writes)
  // Optional: called on the caller's thread after each piece, with the bytes written so far and the
  // bytes the whole checkpoint takes (config.json, shards with headers, index).
  std::function<void(int64_t written, int64_t total)> progress;
};

// The tiny-v4 fixture's config (5 layers sliding/CSA/HCA/CSA/HCA, hidden 128, 4 heads of 64, rope 16,
// 8 experts top-2 of width 64, 2 hash layers, FP8 dense + MXFP4 experts, 3 DSpark stages).
ModelConfig TinyConfig();

// Sets the layer schedule (num_hidden_layers = attn.size()) with the first `num_hash_layers` layers
// hash-routed, and keeps dspark_target_layer_ids inside the new layer range.
void SetSchedule(ModelConfig* config, const std::vector<AttnType>& attn, int64_t num_hash_layers);

// The bytes MakeSyntheticCheckpoint(config, dir, options) writes, from the shapes alone (no weights drawn):
// what to check free disk space against. Errors as MakeSyntheticCheckpoint's.
StatusOr<int64_t> SyntheticCheckpointBytes(const ModelConfig& config, const SyntheticOptions& options = {});

// Writes a random-weight checkpoint for `config` (validated first: an inconsistent config is an
// InvalidArgument naming the key, exactly as if config.json had been read).
Status MakeSyntheticCheckpoint(const ModelConfig& config, const std::string& dir, const SyntheticOptions& options = {});

}  // namespace numoe::synthetic
