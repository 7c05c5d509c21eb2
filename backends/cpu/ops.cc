#include "backends/cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <immintrin.h>

#include "common/cpu_features.h"
#include "common/log.h"
#include "common/thread_pool.h"

namespace numoe::cpu {

float Dot(const float* a, const float* b, int64_t n) {
  // 16 independent partial sums so the compiler vectorizes without -ffast-math.
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float s = 0.0f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s;
}

namespace {

// Rows [o0, o1) of W against rows of x, 4 output columns at a time for reuse of x in cache.
void MatMulRange(const float* x, int64_t n, const float* w, int64_t in, float* y, int64_t xs, int64_t ys,
                 int64_t o0, int64_t o1) {
  constexpr int64_t kRowBlock = 8;
  for (int64_t r0 = 0; r0 < n; r0 += kRowBlock) {
    const int64_t r1 = std::min(n, r0 + kRowBlock);
    for (int64_t o = o0; o < o1; ++o) {
      const float* wr = w + o * in;
      for (int64_t r = r0; r < r1; ++r) y[r * ys + o] = Dot(x + r * xs, wr, in);
    }
  }
}

}  // namespace

void MatMulRaw(const float* x, int64_t n, const float* w, int64_t out, int64_t in, float* y, ThreadPool* pool,
               int64_t x_stride, int64_t y_stride) {
  const int64_t xs = x_stride ? x_stride : in;
  const int64_t ys = y_stride ? y_stride : out;
  if (pool == nullptr || pool->size() <= 1 || n * out * in < (1 << 20)) {
    MatMulRange(x, n, w, in, y, xs, ys, 0, out);
    return;
  }
  pool->ParallelFor(out, [&](int64_t begin, int64_t end, int) { MatMulRange(x, n, w, in, y, xs, ys, begin, end); });
}

// ---- BF16 weights ------------------------------------------------------------------------------------
//
// The kernels below reproduce Dot's arithmetic exactly on the widened weights: lane j of the 16 partial
// sums accumulates x[i]·w[i] for i ≡ j (mod 16) with a separate multiply and add (no FMA: baseline x86-64
// code, which Dot is compiled as, has none), the tail is summed first and the lanes are added in order.
// So BF16 and fp32 storage of the same values give bit-identical outputs, on either path.

namespace {

// out[k] = Dot(x[k], widen(w), in) for NR rows of x.
template <int NR>
void DotRowsBf16Scalar(const float* const* x, const uint16_t* w, int64_t in, float* out) {
  float acc[NR][16] = {};
  float wf[16];
  int64_t i = 0;
  for (; i + 16 <= in; i += 16) {
    for (int j = 0; j < 16; ++j) wf[j] = Bf16ToF32(w[i + j]);
    for (int k = 0; k < NR; ++k) {
      for (int j = 0; j < 16; ++j) acc[k][j] += x[k][i + j] * wf[j];
    }
  }
  for (int k = 0; k < NR; ++k) {
    float s = 0.0f;
    for (int64_t t = i; t < in; ++t) s += x[k][t] * Bf16ToF32(w[t]);
    for (int j = 0; j < 16; ++j) s += acc[k][j];
    out[k] = s;
  }
}

// The same with AVX-512F: 16 BF16 values are widened by zero-extending to 32 bits and shifting into the
// high half. Only reached when GetCpuFeatures().avx512f (the target attribute keeps the rest of the
// library baseline x86-64).
// out = the tail x[in0, in) · w[in0, in) summed in order, plus the 16 partial sums in lane order. Kept out
// of line in baseline code: inside an AVX-512 function GCC would contract x·w + s into an FMA.
__attribute__((noinline)) float FinishDotBf16(const float* x, const uint16_t* w, int64_t in0, int64_t in,
                                              const float* lanes) {
  float s = 0.0f;
  for (int64_t t = in0; t < in; ++t) s += x[t] * Bf16ToF32(w[t]);
  for (int j = 0; j < 16; ++j) s += lanes[j];
  return s;
}

// GCC 12's _mm512_undefined_epi32 (inside cvtepu16/slli) trips -Wmaybe-uninitialized under a target
// attribute; the lanes it leaves undefined are all overwritten.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
template <int NR>
__attribute__((target("avx512f"))) void DotRowsBf16Avx512(const float* const* x, const uint16_t* w, int64_t in,
                                                          float* out) {
  __m512 acc[NR];
  for (int k = 0; k < NR; ++k) acc[k] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= in; i += 16) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i));
    const __m512 wv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    // The _round_ forms (current rounding mode: plain vmulps/vaddps) are builtins GCC does not fuse into
    // an FMA, which would round differently from Dot.
    for (int k = 0; k < NR; ++k) {
      const __m512 p = _mm512_mul_round_ps(_mm512_loadu_ps(x[k] + i), wv, _MM_FROUND_CUR_DIRECTION);
      acc[k] = _mm512_add_round_ps(acc[k], p, _MM_FROUND_CUR_DIRECTION);
    }
  }
  alignas(64) float lanes[NR][16];
  for (int k = 0; k < NR; ++k) _mm512_store_ps(lanes[k], acc[k]);
  // GCC emits no vzeroupper for target-attribute functions; without it the dirty upper ZMM state makes
  // every later legacy-SSE instruction of this thread (Dot and the rest of the baseline code) slow.
  _mm256_zeroupper();
  for (int k = 0; k < NR; ++k) out[k] = FinishDotBf16(x[k], w, i, in, lanes[k]);
}
#pragma GCC diagnostic pop

template <int NR>
void DotRowsBf16(bool avx512, const float* const* x, const uint16_t* w, int64_t in, float* out) {
  if (avx512) {
    DotRowsBf16Avx512<NR>(x, w, in, out);
  } else {
    DotRowsBf16Scalar<NR>(x, w, in, out);
  }
}

// Rows [o0, o1) of W against rows of x; each widened weight chunk is used for up to 4 rows of x.
void MatMulRangeBf16(bool avx512, const float* x, int64_t n, const uint16_t* w, int64_t in, float* y, int64_t xs,
                     int64_t ys, int64_t o0, int64_t o1) {
  constexpr int64_t kRowBlock = 8;
  const float* xr[4];
  float res[4];
  for (int64_t r0 = 0; r0 < n; r0 += kRowBlock) {
    const int64_t r1 = std::min(n, r0 + kRowBlock);
    for (int64_t o = o0; o < o1; ++o) {
      const uint16_t* wr = w + o * in;
      for (int64_t r = r0; r < r1; r += 4) {
        const int64_t m = std::min<int64_t>(4, r1 - r);
        for (int64_t k = 0; k < m; ++k) xr[k] = x + (r + k) * xs;
        switch (m) {
          case 4: DotRowsBf16<4>(avx512, xr, wr, in, res); break;
          case 3: DotRowsBf16<3>(avx512, xr, wr, in, res); break;
          case 2: DotRowsBf16<2>(avx512, xr, wr, in, res); break;
          default: DotRowsBf16<1>(avx512, xr, wr, in, res); break;
        }
        for (int64_t k = 0; k < m; ++k) y[(r + k) * ys + o] = res[k];
      }
    }
  }
}

}  // namespace

bool Bf16MatMulUsesAvx512() {
  static const bool avx512 = GetCpuFeatures().avx512f;
  return avx512;
}

void MatMulRawBf16(const float* x, int64_t n, const uint16_t* w, int64_t out, int64_t in, float* y, ThreadPool* pool,
                   int64_t x_stride, int64_t y_stride, bool allow_avx512) {
  const int64_t xs = x_stride ? x_stride : in;
  const int64_t ys = y_stride ? y_stride : out;
  const bool avx512 = allow_avx512 && Bf16MatMulUsesAvx512();
  if (pool == nullptr || pool->size() <= 1 || n * out * in < (1 << 20)) {
    MatMulRangeBf16(avx512, x, n, w, in, y, xs, ys, 0, out);
    return;
  }
  pool->ParallelFor(out, [&](int64_t begin, int64_t end, int) {
    MatMulRangeBf16(avx512, x, n, w, in, y, xs, ys, begin, end);
  });
}

void Linear::Row(int64_t r, float* dst) const {
  NCHECK(r >= 0 && r < out) << "row " << r << " of a [" << out << ", " << in << "] weight";
  if (is_bf16()) {
    const uint16_t* src = w_bf16.data() + r * in;
    for (int64_t i = 0; i < in; ++i) dst[i] = Bf16ToF32(src[i]);
  } else {
    std::memcpy(dst, w.data() + r * in, static_cast<size_t>(in) * sizeof(float));
  }
}

void MatMulRows(const float* x, int64_t n, const Linear& w, int64_t row0, int64_t rows, float* y, ThreadPool* pool,
                int64_t x_stride, int64_t y_stride) {
  NCHECK(row0 >= 0 && rows >= 0 && row0 + rows <= w.out) << "rows [" << row0 << ", " << row0 + rows << ") of "
                                                        << w.out;
  if (w.is_bf16()) {
    MatMulRawBf16(x, n, w.w_bf16.data() + row0 * w.in, rows, w.in, y, pool, x_stride, y_stride);
  } else {
    MatMulRaw(x, n, w.w.data() + row0 * w.in, rows, w.in, y, pool, x_stride, y_stride);
  }
}

void MatMul(const float* x, int64_t n, const Linear& w, float* y, ThreadPool* pool, int64_t x_stride,
            int64_t y_stride) {
  MatMulRows(x, n, w, 0, w.out, y, pool, x_stride, y_stride);
}

void RmsNorm(const float* x, const float* w, int64_t d, float eps, float* out) {
  float ss = 0.0f;
  for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
  if (w != nullptr) {
    for (int64_t i = 0; i < d; ++i) out[i] = x[i] * inv * w[i];
  } else {
    for (int64_t i = 0; i < d; ++i) out[i] = x[i] * inv;
  }
}

void ApplyRope(float* v, int64_t dim, int64_t rope_dim, const float* inv_freq, int64_t position, bool inverse) {
  float* r = v + (dim - rope_dim);
  const float pos = static_cast<float>(position);
  for (int64_t i = 0; i < rope_dim / 2; ++i) {
    const float angle = pos * inv_freq[i];
    const float c = std::cos(angle);
    const float s = inverse ? -std::sin(angle) : std::sin(angle);
    const float a = r[2 * i], b = r[2 * i + 1];
    r[2 * i] = a * c - b * s;
    r[2 * i + 1] = b * c + a * s;
  }
}

float Silu(float x) { return x / (1.0f + std::exp(-x)); }

float Softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

void SoftmaxInPlace(float* x, int64_t n) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    s += x[i];
  }
  for (int64_t i = 0; i < n; ++i) x[i] /= s;
}

// Attention of one query row (H heads of hd) over `keys` (K = V) with one sink logit per head; the
// output is de-rotated at the query position.
void AttendRow(const float* q, const std::vector<const float*>& keys, const float* sink, int64_t H, int64_t hd,
               int64_t rd, const float* inv, int64_t position, float* o, std::vector<float>* scratch) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t nk = static_cast<int64_t>(keys.size());
  std::vector<float>& logits = *scratch;
  logits.resize(static_cast<size_t>(nk));
  for (int64_t h = 0; h < H; ++h) {
    const float* qh = q + h * hd;
    float m = sink[h];
    for (int64_t j = 0; j < nk; ++j) {
      logits[j] = Dot(qh, keys[j], hd) * scale;
      m = std::max(m, logits[j]);
    }
    float denom = std::exp(sink[h] - m);
    for (int64_t j = 0; j < nk; ++j) {
      logits[j] = std::exp(logits[j] - m);
      denom += logits[j];
    }
    float* oh = o + h * hd;
    std::fill(oh, oh + hd, 0.0f);
    for (int64_t j = 0; j < nk; ++j) {
      const float pj = logits[j] / denom;
      const float* kj = keys[j];
      for (int64_t d = 0; d < hd; ++d) oh[d] += pj * kj[d];
    }
    ApplyRope(oh, hd, rd, inv, position, /*inverse=*/true);
  }
}

}  // namespace numoe::cpu
