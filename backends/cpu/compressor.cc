#include "backends/cpu/compressor.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/log.h"
#include "backends/cpu/ops.h"

namespace numoe::cpu {

float* ChunkedRows::Append() {
  if (rows_ == static_cast<int64_t>(blocks_.size()) * per_block_) {
    blocks_.push_back(std::make_unique<float[]>(static_cast<size_t>(per_block_ * width_)));
  }
  float* row = blocks_[rows_ / per_block_].get() + (rows_ % per_block_) * width_;
  ++rows_;
  return row;
}

ChunkedRows::ChunkedRows(const ChunkedRows& other) : width_(other.width_), per_block_(other.per_block_) {
  *this = other;
}

ChunkedRows& ChunkedRows::operator=(const ChunkedRows& other) {
  if (this == &other) return *this;
  width_ = other.width_;
  per_block_ = other.per_block_;
  rows_ = 0;
  blocks_.clear();
  for (int64_t r = 0; r < other.rows_; ++r) std::memcpy(Append(), other.Row(r), static_cast<size_t>(width_) * sizeof(float));
  return *this;
}

void ChunkedRows::Truncate(int64_t rows) {
  if (rows < rows_) rows_ = rows < 0 ? 0 : rows;
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

namespace {

void PutBytes(std::vector<uint8_t>* out, const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  out->insert(out->end(), b, b + n);
}

bool TakeBytes(const uint8_t** p, const uint8_t* end, void* to, size_t n) {
  if (static_cast<size_t>(end - *p) < n) return false;
  std::memcpy(to, *p, n);
  *p += n;
  return true;
}

}  // namespace

void CompressorState::SaveFixed(std::vector<uint8_t>* out) const {
  const int64_t head[2] = {next_position_, has_prev_ ? 1 : 0};
  PutBytes(out, head, sizeof(head));
  for (const std::vector<float>* v : {&pend_kv_, &pend_gate_, &prev_kv_, &prev_gate_}) {
    PutBytes(out, v->data(), v->size() * sizeof(float));
  }
}

bool CompressorState::LoadFixed(const uint8_t** p, const uint8_t* end) {
  int64_t head[2];
  if (!TakeBytes(p, end, head, sizeof(head)) || head[0] < 0) return false;
  next_position_ = head[0];
  has_prev_ = head[1] != 0;
  for (std::vector<float>* v : {&pend_kv_, &pend_gate_, &prev_kv_, &prev_gate_}) {
    if (!TakeBytes(p, end, v->data(), v->size() * sizeof(float))) return false;
  }
  return true;
}

void CompressorState::Append(int64_t position, const float* kv, const float* gate) {
  NCHECK(position == next_position_) << "compressor positions must be consecutive";
  ++next_position_;
  const int64_t w = p_.coff() * p_.dim;
  const int64_t s = position % p_.rate;
  if (recording_) {
    UndoRecord u;
    u.position = position;
    u.slot_kv.assign(pend_kv_.begin() + s * w, pend_kv_.begin() + (s + 1) * w);
    u.slot_gate.assign(pend_gate_.begin() + s * w, pend_gate_.begin() + (s + 1) * w);
    if (s == p_.rate - 1) {
      u.emitted = true;
      u.had_prev = has_prev_;
      u.prev_kv = prev_kv_;
      u.prev_gate = prev_gate_;
    }
    undo_.push_back(std::move(u));
  }
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

namespace numoe::cpu {

void CompressorState::BeginUndo() {
  undo_.clear();
  recording_ = true;
}

void CompressorState::EndUndo() {
  undo_.clear();
  recording_ = false;
}

void CompressorState::RewindTo(int64_t position) {
  const int64_t w = p_.coff() * p_.dim;
  while (!undo_.empty() && undo_.back().position >= position) {
    UndoRecord& u = undo_.back();
    const int64_t s = u.position % p_.rate;
    std::copy(u.slot_kv.begin(), u.slot_kv.end(), pend_kv_.begin() + s * w);
    std::copy(u.slot_gate.begin(), u.slot_gate.end(), pend_gate_.begin() + s * w);
    if (u.emitted) {
      entries_.Truncate(entries_.rows() - 1);
      has_prev_ = u.had_prev;
      prev_kv_ = std::move(u.prev_kv);
      prev_gate_ = std::move(u.prev_gate);
    }
    next_position_ = u.position;
    undo_.pop_back();
  }
}

}  // namespace numoe::cpu
