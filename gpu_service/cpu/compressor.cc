#include "gpu_service/cpu/compressor.h"

#include <cmath>
#include <cstring>

#include "common/log.h"
#include "gpu_service/cpu/ops.h"

namespace numoe::cpu {

float* ChunkedRows::Append() {
  if (rows_ == static_cast<int64_t>(blocks_.size()) * per_block_) {
    blocks_.push_back(std::make_unique<float[]>(static_cast<size_t>(per_block_ * width_)));
  }
  float* row = blocks_[rows_ / per_block_].get() + (rows_ % per_block_) * width_;
  ++rows_;
  return row;
}

CompressorState::CompressorState(const CompressorParams& p)
    : p_(p),
      pend_kv_(static_cast<size_t>(p.rate * p.coff() * p.dim)),
      pend_gate_(static_cast<size_t>(p.rate * p.coff() * p.dim)),
      prev_kv_(p.overlap ? static_cast<size_t>(p.rate * p.dim) : 0),
      prev_gate_(p.overlap ? static_cast<size_t>(p.rate * p.dim) : 0),
      entries_(p.dim),
      scratch_(static_cast<size_t>(p.dim)) {}

int64_t CompressorState::fixed_bytes() const {
  return static_cast<int64_t>((pend_kv_.size() + pend_gate_.size() + prev_kv_.size() + prev_gate_.size() +
                               scratch_.size()) *
                              sizeof(float));
}

void CompressorState::Append(int64_t position, const float* kv, const float* gate) {
  NCHECK(position == next_position_) << "compressor positions must be consecutive";
  ++next_position_;
  const int64_t w = p_.coff() * p_.dim;
  const int64_t s = position % p_.rate;
  std::memcpy(pend_kv_.data() + s * w, kv, static_cast<size_t>(w) * sizeof(float));
  for (int64_t c = 0; c < w; ++c) pend_gate_[s * w + c] = gate[c] + p_.ape[s * w + c];
  if (s == p_.rate - 1) Emit(position / p_.rate);
}

void CompressorState::Emit(int64_t window) {
  const int64_t d = p_.dim, rate = p_.rate, w = p_.coff() * d;
  float* out = scratch_.data();
  // Slots: (kv, gate) pairs per channel. Overlap: Ca of the previous window then Cb of this one.
  const int64_t cb = p_.overlap ? d : 0;  // offset of the half pooled from this window
  for (int64_t c = 0; c < d; ++c) {
    float m = -INFINITY;
    if (p_.overlap && has_prev_) {
      for (int64_t s = 0; s < rate; ++s) m = std::fmax(m, prev_gate_[s * d + c]);
    }
    for (int64_t s = 0; s < rate; ++s) m = std::fmax(m, pend_gate_[s * w + cb + c]);
    float denom = 0.0f, acc = 0.0f;
    if (p_.overlap && has_prev_) {
      for (int64_t s = 0; s < rate; ++s) {
        const float e = std::exp(prev_gate_[s * d + c] - m);
        denom += e;
        acc += e * prev_kv_[s * d + c];
      }
    }
    for (int64_t s = 0; s < rate; ++s) {
      const float e = std::exp(pend_gate_[s * w + cb + c] - m);
      denom += e;
      acc += e * pend_kv_[s * w + cb + c];
    }
    out[c] = acc / denom;
  }
  if (p_.overlap) {
    for (int64_t s = 0; s < rate; ++s) {
      std::memcpy(prev_kv_.data() + s * d, pend_kv_.data() + s * w, static_cast<size_t>(d) * sizeof(float));
      std::memcpy(prev_gate_.data() + s * d, pend_gate_.data() + s * w, static_cast<size_t>(d) * sizeof(float));
    }
    has_prev_ = true;
  }
  float* entry = entries_.Append();
  RmsNorm(out, p_.norm, d, p_.eps, entry);
  ApplyRope(entry, d, p_.rope_dim, p_.inv_freq, window * rate);
}

}  // namespace numoe::cpu
