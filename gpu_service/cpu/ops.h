// fp32 building blocks of the CPU backend. Row-major everywhere; weights are [out, in] as in the
// checkpoint, so a linear layer is y[n, out] = x[n, in] · W[out, in]ᵀ.
#pragma once

#include <cstdint>
#include <vector>

namespace numoe {
class ThreadPool;
}

namespace numoe::cpu {

// A dense fp32 weight [out, in].
struct Linear {
  int64_t out = 0;
  int64_t in = 0;
  std::vector<float> w;
};

// y[n, out] = x[n, in] · Wᵀ. `x_stride`/`y_stride` are row strides in floats (0 = dense).
// Parallel over output columns when a pool is given.
void MatMul(const float* x, int64_t n, const Linear& w, float* y, ThreadPool* pool = nullptr,
            int64_t x_stride = 0, int64_t y_stride = 0);
// The same on a raw weight block w[out, in] (e.g. one group of a grouped projection).
void MatMulRaw(const float* x, int64_t n, const float* w, int64_t out, int64_t in, float* y, ThreadPool* pool,
               int64_t x_stride, int64_t y_stride);

float Dot(const float* a, const float* b, int64_t n);

// out[i] = x[i] / sqrt(mean(x²) + eps) (· w[i] when w != nullptr); in place allowed.
void RmsNorm(const float* x, const float* w, int64_t d, float eps, float* out);

// Rotates the trailing `rope_dim` channels of v[dim] by position·inv_freq on interleaved pairs
// (2i, 2i+1); `inverse` rotates by the negative angle (de-rotation of attention outputs).
void ApplyRope(float* v, int64_t dim, int64_t rope_dim, const float* inv_freq, int64_t position,
               bool inverse = false);

inline float Sigmoid(float x);
float Silu(float x);
// torch.nn.functional.softplus with beta 1, threshold 20.
float Softplus(float x);

// Softmax in place over n values (max-subtracted, fp32).
void SoftmaxInPlace(float* x, int64_t n);

// Attention of one query row q[H, hd] over `keys` (each [hd]; K = V) with one learned sink logit per
// head joining the softmax denominator; scale hd^-0.5; the output o[H, hd] is de-rotated (inverse rope
// at `position`). `scratch` is reused between calls.
void AttendRow(const float* q, const std::vector<const float*>& keys, const float* sink, int64_t H, int64_t hd,
               int64_t rd, const float* inv, int64_t position, float* o, std::vector<float>* scratch);

}  // namespace numoe::cpu

#include <cmath>
inline float numoe::cpu::Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
