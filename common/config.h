// The DeepSeek-V4 model config: official config.json keys and the transformers keys, validated.
//
// Accepted spellings (docs/dsv4-architecture.md §1):
//   official:     compress_ratios (may be longer than num_hidden_layers: truncated; extra entries are the
//                 MTP/DSpark stages), num_hash_layers, qk_rope_head_dim, rope_scaling, compress_rope_theta,
//                 quantization_config, expert_dtype, dspark_*;
//   transformers: layer_types, compress_rates, mlp_layer_types, partial_rotary_factor, nested
//                 rope_parameters {"main": {...}, "compress": {...}}.
// Every validation error names the key, e.g. "config.json: num_key_value_heads must be 1 (got 2)".
//
// Required keys (they fix tensor shapes; no silent defaults): vocab_size, hidden_size, num_hidden_layers,
// num_attention_heads, head_dim, q_lora_rank, o_groups, o_lora_rank, n_routed_experts (or
// num_local_experts), num_experts_per_tok, moe_intermediate_size (or intermediate_size), index_n_heads,
// index_head_dim, index_topk. Everything else defaults as transformers' DeepseekV4Config does
// (sliding_window 128, rope_theta 1e4, compress_rope_theta 1.6e5, hc_mult 4, hc_sinkhorn_iters 20,
// hc_eps 1e-6, rms_norm_eps 1e-6, scoring_func sqrtsoftplus, routed_scaling_factor 1.5, swiglu_limit 10,
// compress_rates {CSA 4, HCA 128}, 3 hash layers, rope dim = head_dim/8, layer schedule = V4-Pro's
// 2xHCA then HCA/CSA alternating), except that no quantization_config means unquantized BF16 weights.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace numoe {

enum class AttnType { kSliding, kCSA, kHCA };
enum class MoeType { kHash, kScored };
enum class ScoringFunc { kSqrtSoftplus, kSoftmax, kSigmoid };

// Speculative-decoding drafters: the checkpoint's own (kDspark: 0731 DSpark stages, kMtp: a preview MTP
// block), a weightless prompt-lookup drafter (kNgram), or none. The numeric values travel in the
// shared-memory channel's Geometry::drafter (common/shm_channel.h): do not renumber.
enum class SpecMethod : uint32_t { kNone = 0, kDspark = 1, kMtp = 2, kNgram = 3 };
// "none", "dspark", "mtp", "ngram". The --spec flag parses through SpecChoice (common/choices.h).
const char* SpecMethodName(SpecMethod m);

const char* AttnTypeName(AttnType t);  // "sliding" / "csa" / "hca"
const char* MoeTypeName(MoeType t);    // "hash" / "scored"

// One rotary table. Without YaRN, inv_freq[i] = 1/theta^(2i/rope_dim).
struct RopeConfig {
  double theta = 10000.0;
  bool yarn = false;
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  // transformers forces 1.0 for DeepSeek-V4 (no mscale); kept for completeness.
  double attention_factor = 1.0;
};

struct ModelConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;          // D
  int64_t num_hidden_layers = 0;    // main layers only
  int64_t num_attention_heads = 0;  // H
  int64_t head_dim = 0;             // q/k/v head width
  int64_t rope_dim = 0;             // trailing rotary channels (qk_rope_head_dim or head_dim*partial_rotary_factor)
  int64_t q_lora_rank = 0;
  int64_t o_groups = 0;
  int64_t o_lora_rank = 0;
  int64_t sliding_window = 0;

  std::vector<AttnType> layer_types;  // size num_hidden_layers
  int64_t csa_rate = 4;               // compress rate of CSA layers
  int64_t hca_rate = 128;             // compress rate of HCA layers
  std::vector<MoeType> mlp_layer_types;  // size num_hidden_layers
  // compress ratios of the entries past num_hidden_layers (the MTP/DSpark stages), as given
  std::vector<int64_t> extra_compress_ratios;

  int64_t index_n_heads = 0;
  int64_t index_head_dim = 0;
  int64_t index_topk = 0;

  int64_t n_routed_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t n_shared_experts = 1;
  int64_t moe_intermediate_size = 0;  // I (routed and shared expert width)
  ScoringFunc scoring_func = ScoringFunc::kSqrtSoftplus;
  double routed_scaling_factor = 1.0;
  double swiglu_limit = 0.0;  // 0 = no clamp

  int64_t hc_mult = 4;
  int64_t hc_sinkhorn_iters = 20;
  double hc_eps = 1e-6;
  double rms_norm_eps = 1e-6;

  RopeConfig rope_main;      // sliding-only layers and MTP/DSpark stages
  RopeConfig rope_compress;  // CSA/HCA layers (attention, compressors, indexer)
  int64_t max_position_embeddings = 0;

  bool tie_word_embeddings = false;
  int64_t bos_token_id = 0;
  int64_t eos_token_id = 1;

  // Dense weights: FP8 E4M3 with block scales when fp8_dense.
  bool fp8_dense = false;
  int64_t fp8_block_out = 128;
  int64_t fp8_block_in = 128;
  // "ue8m0" (E8M0 block scales, the official FP8+FP4 release) or "fp32" (F32 scales).
  std::string fp8_scale_fmt = "ue8m0";
  // "fp4" (MXFP4), "fp8" (FP8 blocks, F32 scales) or "bf16". When the key is absent: "fp8" if the dense
  // weights are FP8 (quantization_config present), else "bf16".
  std::string expert_dtype = "bf16";

  int64_t num_nextn_predict_layers = 0;
  int64_t dspark_block_size = 0;  // 0 = no DSpark config
  int64_t dspark_noise_token_id = -1;
  int64_t dspark_markov_rank = 0;
  std::vector<int64_t> dspark_target_layer_ids;

  // Compress rate of a main layer: 0 (sliding), csa_rate or hca_rate.
  int64_t CompressRate(int64_t layer) const;
  // MTP/DSpark stages implied by the config alone (when no tensors are at hand): DSpark configs
  // (dspark_block_size > 0) have one stage per extra compress_ratios entry (3 for V4-Flash-0731; 1 when the
  // list has no extras); otherwise num_nextn_predict_layers.
  int64_t DefaultMtpStages() const;
  int64_t NumLayersOf(AttnType t) const;
  int64_t NumLayersOf(MoeType t) const;
};

// Parses and validates config JSON text; `source` names the file in messages.
StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text, const std::string& source = "config.json");
// Reads DIR/config.json or a path to a .json file.
StatusOr<ModelConfig> LoadModelConfig(const std::string& path);

// Writes `config` as an official-layout config.json text (compress_ratios incl. the extra MTP/DSpark
// entries, num_hash_layers or mlp_layer_types, qk_rope_head_dim, rope_scaling, quantization_config,
// expert_dtype, dspark_*), which ParseModelConfig reads back to an equal config. Rates other than 4/128
// also get a `compress_rates` dict.
std::string ModelConfigToJson(const ModelConfig& config);

// inv_freq of a rope table for `rope_dim` channels (rope_dim/2 values), computed as transformers does
// (YaRN ramp with low/high from beta_fast/beta_slow, no mscale).
std::vector<float> RopeInvFreq(const RopeConfig& rope, int64_t rope_dim);

}  // namespace numoe
