// Per-sequence decode state of the V4 attention caches (docs/dsv4-architecture.md §3), in values
// (multiply by the element size of the backend: 4 for fp32, 2 for bf16).
//
//   every layer: the sliding window ring, sliding_window x head_dim (fixed);
//   HCA layer:   one head_dim entry per hca_rate tokens (growing) + a pending window of kv and gate;
//   CSA layer:   one head_dim entry per csa_rate tokens, plus the indexer's index_head_dim key per
//                csa_rate tokens (growing) + pending windows and the overlap (Ca) state of both.
// For V4-Flash: 21·(512+128)/4 + 20·512/128 = 3440 growing values per token.
#pragma once

#include <cstdint>

#include "common/config.h"

namespace numoe {

struct StateSize {
  double growing_values_per_token = 0;  // compressed entries, averaged per token
  int64_t fixed_values = 0;             // windows, pending buffers, overlap state
  // Exact growing values after `tokens` tokens (only closed windows emit entries).
  int64_t GrowingValuesAt(const ModelConfig& cfg, int64_t tokens) const;
};

StateSize ComputeStateSize(const ModelConfig& cfg);

}  // namespace numoe
