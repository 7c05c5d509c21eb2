// Random MXFP4 experts and an independent float64 reference of the routed-expert FFN, computed from the
// checkpoint-format data (not the packed layout), for the differential tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "worker/experts/expert_layer.h"

namespace numoe::test {

// A checkpoint-format MXFP4 matrix that owns its bytes.
struct OwnedMxfp4 {
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> packed, scales;

  int64_t blocks() const { return (cols + 31) / 32; }
  Mxfp4Matrix view() const { return Mxfp4Matrix{packed.data(), scales.data(), rows, cols}; }
  // The exact value of W[r, c], straight from the format definition.
  double at(int64_t r, int64_t c) const {
    static constexpr double kFp4[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    const int n = (packed[r * (cols / 2) + c / 2] >> (4 * (c & 1))) & 0xF;
    const double v = (n & 8) ? -kFp4[n & 7] : kFp4[n & 7];
    return std::ldexp(v, static_cast<int>(scales[r * blocks() + c / 32]) - 127);
  }
  // All of W, row-major (computed on first use: edit the bytes before the first call).
  const std::vector<double>& dense() const {
    if (dense_.empty()) {
      dense_.resize(rows * cols);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) dense_[r * cols + c] = at(r, c);
    }
    return dense_;
  }
  mutable std::vector<double> dense_;
};

// Scales are drawn from [scale_center - 2, scale_center + 1].
inline OwnedMxfp4 RandomMxfp4(int64_t rows, int64_t cols, int scale_center, std::mt19937& rng) {
  OwnedMxfp4 m;
  m.rows = rows;
  m.cols = cols;
  m.packed.resize(rows * cols / 2);
  m.scales.resize(rows * m.blocks());
  std::uniform_int_distribution<int> byte(0, 255), scale(scale_center - 2, scale_center + 1);
  for (auto& b : m.packed) b = static_cast<uint8_t>(byte(rng));
  for (auto& s : m.scales) s = static_cast<uint8_t>(scale(rng));
  return m;
}

// A scale exponent that makes a K-long dot product with O(1) activations come out around `target`.
inline int ScaleCenterFor(int64_t k, double target) {
  const double w_rms = target / (std::sqrt(static_cast<double>(k)) * 0.6);
  return 127 + static_cast<int>(std::lround(std::log2(w_rms / 2.93)));
}

struct OwnedExpert {
  OwnedMxfp4 w1, w3, w2;
  ExpertWeightsRef ref() const { return ExpertWeightsRef{w1.view(), w3.view(), w2.view()}; }
};

inline std::vector<OwnedExpert> RandomExperts(int64_t n, int64_t hidden, int64_t inter, std::mt19937& rng) {
  std::vector<OwnedExpert> experts(n);
  const int c_up = ScaleCenterFor(hidden, 6.0), c_down = ScaleCenterFor(inter, 3.0);
  for (auto& e : experts) {
    e.w1 = RandomMxfp4(inter, hidden, c_up, rng);
    e.w3 = RandomMxfp4(inter, hidden, c_up, rng);
    e.w2 = RandomMxfp4(hidden, inter, c_down, rng);
  }
  return experts;
}

inline std::vector<ExpertWeightsRef> Refs(const std::vector<OwnedExpert>& experts) {
  std::vector<ExpertWeightsRef> refs;
  for (const auto& e : experts) refs.push_back(e.ref());
  return refs;
}

// How the activations of a GEMV are perturbed by a kernel, for the error bound.
enum class ActError {
  kNone,      // fp32 activations (generic)
  kInt8,      // one int8 level per 32 columns: |err_c| <= max_{block of c} |a| / 254 (covers bf16: 2^-9 |a_c|)
  kInt8x2,    // two int8 levels: |err_c| <= max_{block of c} |a| / 32512 (covers two bf16 terms: 2^-17 |a_c|)
};

// y[i] = sum_c W[i,c] a[c] in float64, plus a bound on |y_kernel - y| given that the kernel's activations
// may differ from `a` by up to a_err (elementwise, before its own quantisation) and `mode`.
// eps covers fp32 rounding of the sums: eps * sum |W| (|a| + a_err).
inline void GemvWithBound(const OwnedMxfp4& w, const std::vector<double>& a, const std::vector<double>& a_err,
                          ActError mode, double eps, std::vector<double>* y, std::vector<double>* bound) {
  const int64_t k = w.cols;
  std::vector<double> q(k, 0.0);  // per-column activation quantisation error
  if (mode != ActError::kNone) {
    const double levels = mode == ActError::kInt8 ? 254.0 : 32512.0;
    for (int64_t b = 0; b * 32 < k; ++b) {
      double amax = 0;
      for (int64_t c = 32 * b; c < std::min(k, 32 * b + 32); ++c) amax = std::max(amax, std::abs(a[c]) + a_err[c]);
      for (int64_t c = 32 * b; c < std::min(k, 32 * b + 32); ++c) q[c] = amax / levels * (1 + 1e-6);
    }
  }
  y->assign(w.rows, 0.0);
  bound->assign(w.rows, 0.0);
  for (int64_t i = 0; i < w.rows; ++i) {
    double s = 0, e = 0, mag = 0;
    const double* row = w.dense().data() + i * k;
    for (int64_t c = 0; c < k; ++c) {
      const double wv = row[c];
      s += wv * a[c];
      e += std::abs(wv) * (a_err[c] + q[c]);
      mag += std::abs(wv) * (std::abs(a[c]) + a_err[c]);
    }
    (*y)[i] = s;
    (*bound)[i] = e + eps * mag + 1e-30;
  }
}

struct Reference {
  std::vector<double> out;    // [rows, hidden]
  std::vector<double> bound;  // [rows, hidden]: the ISA's documented error bound
};

inline double Silu(double g) { return g / (1.0 + std::exp(-g)); }

// The MoE step in float64 with the bound for `mode` composed through SwiGLU (silu is 1.1-Lipschitz,
// min/clamp are 1-Lipschitz).
inline Reference ReferenceMoe(const std::vector<OwnedExpert>& experts, int64_t hidden, int64_t inter, double limit,
                              const std::vector<float>& x, const std::vector<int32_t>& ids,
                              const std::vector<float>& weights, int64_t rows, int64_t top_k, ActError mode,
                              double eps) {
  Reference ref;
  ref.out.assign(rows * hidden, 0.0);
  ref.bound.assign(rows * hidden, 0.0);
  std::vector<double> xr(hidden), zero_h(hidden, 0.0), g, gb, u, ub, y, yb, h(inter), hb(inter);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < hidden; ++c) xr[c] = x[r * hidden + c];
    for (int64_t k = 0; k < top_k; ++k) {
      const OwnedExpert& e = experts[ids[r * top_k + k]];
      const double w = weights[r * top_k + k];
      GemvWithBound(e.w1, xr, zero_h, mode, eps, &g, &gb);
      GemvWithBound(e.w3, xr, zero_h, mode, eps, &u, &ub);
      for (int64_t i = 0; i < inter; ++i) {
        double gi = g[i], ui = u[i];
        if (limit > 0) {
          gi = std::min(gi, limit);
          ui = std::clamp(ui, -limit, limit);
        }
        h[i] = Silu(gi) * ui;
        hb[i] = 1.1 * gb[i] * (std::abs(ui) + ub[i]) + std::abs(Silu(gi)) * ub[i] + eps * std::abs(h[i]);
      }
      GemvWithBound(e.w2, h, hb, mode, eps, &y, &yb);
      for (int64_t j = 0; j < hidden; ++j) {
        ref.out[r * hidden + j] += w * y[j];
        ref.bound[r * hidden + j] += std::abs(w) * (yb[j] + eps * std::abs(y[j]));
      }
    }
  }
  return ref;
}

}  // namespace numoe::test
