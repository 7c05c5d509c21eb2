#include "gpu_service/cpu/ops.h"

#include <algorithm>
#include <cmath>

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

void MatMul(const float* x, int64_t n, const Linear& w, float* y, ThreadPool* pool, int64_t x_stride,
            int64_t y_stride) {
  MatMulRaw(x, n, w.w.data(), w.out, w.in, y, pool, x_stride, y_stride);
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
