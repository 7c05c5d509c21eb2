// fp32 building blocks of the CPU backend. Row-major everywhere; weights are [out, in] as in the
// checkpoint, so a linear layer is y[n, out] = x[n, in] · W[out, in]ᵀ. Activations and accumulation are
// fp32; a weight is held either as fp32 or, when the checkpoint stores it as BF16, as the BF16 bits
// themselves (bf16 -> fp32 is exact, so both hold the same values and BF16 halves the bytes).
#pragma once

#include <cstdint>
#include <vector>

namespace numoe {
class ThreadPool;
}

namespace numoe::cpu {

// The fp32 value of one BF16 value (its bits are the high half of the fp32's).
inline float Bf16ToF32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
}

// A dense weight [out, in]: exactly one of `w` (fp32) and `w_bf16` (BF16 bits) holds out·in values.
struct Linear {
  int64_t out = 0;
  int64_t in = 0;
  std::vector<float> w;
  std::vector<uint16_t> w_bf16;

  bool is_bf16() const { return !w_bf16.empty(); }
  // Bytes of weight data held (and read by one MatMul).
  int64_t bytes() const {
    return static_cast<int64_t>(w.size() * sizeof(float) + w_bf16.size() * sizeof(uint16_t));
  }
  // Row `r` (0 <= r < out) as fp32 into dst[in] (an embedding lookup).
  void Row(int64_t r, float* dst) const;
};

// y[n, out] = x[n, in] · Wᵀ, fp32 accumulation whatever W holds. `x_stride`/`y_stride` are row strides in
// floats (0 = dense). Parallel over output columns when a pool is given.
void MatMul(const float* x, int64_t n, const Linear& w, float* y, ThreadPool* pool = nullptr,
            int64_t x_stride = 0, int64_t y_stride = 0);
// The same on rows [row0, row0 + rows) of W only (one group of a grouped projection): y[n, rows].
void MatMulRows(const float* x, int64_t n, const Linear& w, int64_t row0, int64_t rows, float* y, ThreadPool* pool,
                int64_t x_stride, int64_t y_stride);
// The same on a raw fp32 weight block w[out, in].
void MatMulRaw(const float* x, int64_t n, const float* w, int64_t out, int64_t in, float* y, ThreadPool* pool,
               int64_t x_stride, int64_t y_stride);
// The same on a raw BF16 weight block w[out, in]. Each product and each of the 16 partial sums is computed
// as Dot does on the fp32 values, so the result is bit-identical to MatMulRaw on the widened weight. Uses
// AVX-512F when the CPU has it (GetCpuFeatures) unless `allow_avx512` is false (tests of the fallback).
void MatMulRawBf16(const float* x, int64_t n, const uint16_t* w, int64_t out, int64_t in, float* y, ThreadPool* pool,
                   int64_t x_stride, int64_t y_stride, bool allow_avx512 = true);
// Whether MatMulRawBf16 takes its AVX-512 path on this CPU.
bool Bf16MatMulUsesAvx512();

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
