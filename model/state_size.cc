#include "model/state_size.h"

namespace numoe {

StateSize ComputeStateSize(const ModelConfig& cfg) {
  StateSize s;
  const int64_t hd = cfg.head_dim, id = cfg.index_head_dim;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    s.fixed_values += cfg.sliding_window * hd;
    const AttnType t = cfg.layer_types[static_cast<size_t>(l)];
    const int64_t rate = cfg.CompressRate(l);
    if (t == AttnType::kHCA) {
      s.growing_values_per_token += static_cast<double>(hd) / static_cast<double>(rate);
      s.fixed_values += 2 * rate * hd;  // pending kv + gate
    } else if (t == AttnType::kCSA) {
      s.growing_values_per_token += static_cast<double>(hd + id) / static_cast<double>(rate);
      s.fixed_values += 2 * rate * 2 * hd + 2 * rate * hd;  // pending (coff 2) + overlap
      s.fixed_values += 2 * rate * 2 * id + 2 * rate * id;  // the indexer's
    }
  }
  return s;
}

int64_t StateSize::GrowingValuesAt(const ModelConfig& cfg, int64_t tokens) const {
  int64_t v = 0;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const AttnType t = cfg.layer_types[static_cast<size_t>(l)];
    const int64_t rate = cfg.CompressRate(l);
    if (t == AttnType::kHCA) v += (tokens / rate) * cfg.head_dim;
    if (t == AttnType::kCSA) v += (tokens / rate) * (cfg.head_dim + cfg.index_head_dim);
  }
  return v;
}

}  // namespace numoe
