// Routed experts of the DSpark drafter stages on the device (CudaOptions::drafter_experts = "gpu"): MXFP4
// weights with E8M0 per-32 scales, exactly as the checkpoint stores them, dequantized on the fly.
//
// One call = one stage's MoE for n rows: the (row, slot) pairs are bucketed by expert on the device (one
// block, counting sort), then every used expert's weight rows are streamed once per kPairs pairs routed to
// it (a warp per kRows weight rows, a grid of used experts x row tiles), and the pairs' outputs are combined per row in slot order (deterministic: no atomics on the output). No host round trip.
#include <algorithm>

#include "backends/cuda/device_util.cuh"
#include "backends/cuda/kernels.h"

namespace numoe::cuda {
namespace {

constexpr int kWarps = 8;  // warps per block
constexpr int kPairs = 8;  // (row, expert) pairs that share one pass over a weight row
constexpr int kRows = 4;   // weight rows per warp (each loaded activation serves all of them)

__device__ __forceinline__ float E8m0ToF32(uint32_t e) {
  if (e == 0) return __uint_as_float(0x00400000u);  // 2^-127 (subnormal)
  if (e == 255) return __uint_as_float(0x7fc00000u);
  return __uint_as_float(e << 23);
}

__device__ __forceinline__ float Fp4ToF32(uint32_t n) {
  constexpr float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float v = kMag[n & 7];
  return (n & 8) ? -v : v;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// acc[r][j] += W_r · x_j for kRows weight rows W_r (`cols` MXFP4 columns, cols % 32 == 0, with cols / 32
// scales each) and the m (<= kPairs) inputs x_j. Lane l takes the 32-column blocks l, l + 32, ...; each x
// value loaded serves all kRows rows. `lut` holds the 16 FP4 values; code · scale is exact (a power of two).
__device__ __forceinline__ void RowDots(const uint8_t* const (&codes)[kRows], const uint8_t* const (&scales)[kRows],
                                        int64_t cols, const float* const (&x)[kPairs], int m, const float* lut,
                                        int lane, float (&acc)[kRows][kPairs]) {
  const int64_t nb = cols / 32;
  for (int64_t b = lane; b < nb; b += 32) {
    uint4 q[kRows];
    float s[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      q[r] = *reinterpret_cast<const uint4*>(codes[r] + b * 16);
      s[r] = E8m0ToF32(scales[r][b]);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      // Word k holds bytes 4k..4k+3, i.e. columns 8k..8k+7 in nibble order (low nibble first).
      float w[kRows][8];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const uint32_t word = k == 0 ? q[r].x : k == 1 ? q[r].y : k == 2 ? q[r].z : q[r].w;
#pragma unroll
        for (int t = 0; t < 8; ++t) w[r][t] = lut[(word >> (4 * t)) & 15u] * s[r];
      }
#pragma unroll
      for (int j = 0; j < kPairs; ++j) {
        if (j < m) {
          const float4* xp = reinterpret_cast<const float4*>(x[j] + b * 32 + 8 * k);
          const float4 a = xp[0], c = xp[1];
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            acc[r][j] += w[r][0] * a.x + w[r][1] * a.y + w[r][2] * a.z + w[r][3] * a.w + w[r][4] * c.x +
                         w[r][5] * c.y + w[r][6] * c.z + w[r][7] * c.w;
          }
        }
      }
    }
  }
}

// offs[e] .. offs[e + 1]: the slice of `list` holding the pair indices (row · K + slot) routed to expert e;
// offs[E + 1] = the number of experts used, offs[E + 2 + u] = the u-th of them. Ids outside [0, E) are left
// out (their pairs contribute nothing).
__global__ void BucketKernel(const int32_t* ids, int pairs, int E, int32_t* offs, int32_t* list) {
  extern __shared__ int32_t sh[];
  int32_t* cnt = sh;
  int32_t* cur = sh + E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    cnt[e] = 0;
    cur[e] = 0;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = ids[p];
    if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int acc = 0, used = 0;
    for (int e = 0; e < E; ++e) {
      const int c = cnt[e];
      offs[e] = acc;
      cnt[e] = acc;
      acc += c;
      if (c > 0) offs[E + 2 + used++] = e;
    }
    offs[E] = acc;
    offs[E + 1] = used;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = ids[p];
    if (e >= 0 && e < E) list[cnt[e] + atomicAdd(&cur[e], 1)] = p;
  }
}

__device__ __forceinline__ void FillLut(float* lut) {
  if (threadIdx.x < 16) lut[threadIdx.x] = Fp4ToF32(threadIdx.x);
  __syncthreads();
}

// Block (u, y): the u-th used expert; warp w: gate/up rows i0, i0 + 1 with i0 = 2 (y · kWarps + w).
// h[p, i] = silu(min(g, L)) · clamp(u, -L, L) with g = w1[e]·x_row(p), u = w3[e]·x_row(p) (L = 0: no clamp).
__global__ void __launch_bounds__(kWarps * 32)
    GateUpKernel(Mxfp4Experts w, const float* x, int64_t K, float lim, const int32_t* offs, const int32_t* list,
                 float* h) {
  __shared__ float lut[16];
  FillLut(lut);
  const int E = static_cast<int>(w.experts);
  if (static_cast<int>(blockIdx.x) >= offs[E + 1]) return;
  const int e = offs[E + 2 + blockIdx.x];
  const int b0 = offs[e], cnt = offs[e + 1] - b0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t i0 = 2 * (static_cast<int64_t>(blockIdx.y) * kWarps + warp);
  if (i0 >= w.inter) return;
  const int64_t D = w.hidden, I = w.inter;
  const uint8_t* codes[kRows];
  const uint8_t* scales[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {  // rows 0, 1: w1; rows 2, 3: w3 (i0 + r % 2; inter is even)
    const int64_t row = static_cast<int64_t>(e) * I + i0 + (r % 2);
    codes[r] = (r < 2 ? w.w1 : w.w3) + row * (D / 2);
    scales[r] = (r < 2 ? w.s1 : w.s3) + row * (D / 32);
  }
  for (int c0 = 0; c0 < cnt; c0 += kPairs) {
    const int m = min(kPairs, cnt - c0);
    const float* xr[kPairs];
    float acc[kRows][kPairs];
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      xr[j] = x + static_cast<int64_t>(list[b0 + c0 + min(j, m - 1)] / K) * D;
#pragma unroll
      for (int r = 0; r < kRows; ++r) acc[r][j] = 0.0f;
    }
    RowDots(codes, scales, D, xr, m, lut, lane, acc);
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        float gv = WarpSum(acc[t][j]), uv = WarpSum(acc[2 + t][j]);
        if (lane == 0 && j < m) {
          if (lim > 0.0f) {
            gv = fminf(gv, lim);
            uv = fminf(fmaxf(uv, -lim), lim);
          }
          h[static_cast<int64_t>(list[b0 + c0 + j]) * I + i0 + t] = gv / (1.0f + expf(-gv)) * uv;
        }
      }
    }
  }
}

// Block (u, y): the u-th used expert; warp w: output columns c0 .. c0 + kRows - 1, c0 = kRows (y · kWarps + w).
// y[p, c] = w2[e]·h[p] (the expert's output before its routing weight).
__global__ void __launch_bounds__(kWarps * 32)
    DownKernel(Mxfp4Experts w, const int32_t* offs, const int32_t* list, const float* h, float* y) {
  __shared__ float lut[16];
  FillLut(lut);
  const int E = static_cast<int>(w.experts);
  if (static_cast<int>(blockIdx.x) >= offs[E + 1]) return;
  const int e = offs[E + 2 + blockIdx.x];
  const int b0 = offs[e], cnt = offs[e + 1] - b0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t o0 = kRows * (static_cast<int64_t>(blockIdx.y) * kWarps + warp);
  if (o0 >= w.hidden) return;
  const int64_t D = w.hidden, I = w.inter;
  const uint8_t* codes[kRows];
  const uint8_t* scales[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {  // hidden is a multiple of 32, so o0 + r < hidden
    const int64_t row = static_cast<int64_t>(e) * D + o0 + r;
    codes[r] = w.w2 + row * (I / 2);
    scales[r] = w.s2 + row * (I / 32);
  }
  for (int c0 = 0; c0 < cnt; c0 += kPairs) {
    const int m = min(kPairs, cnt - c0);
    const float* hr[kPairs];
    float acc[kRows][kPairs];
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      hr[j] = h + static_cast<int64_t>(list[b0 + c0 + min(j, m - 1)]) * I;
#pragma unroll
      for (int r = 0; r < kRows; ++r) acc[r][j] = 0.0f;
    }
    RowDots(codes, scales, I, hr, m, lut, lane, acc);
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float v = WarpSum(acc[r][j]);
        if (lane == 0 && j < m) y[static_cast<int64_t>(list[b0 + c0 + j]) * D + o0 + r] = v;
      }
    }
  }
}

// out[r, c] = sum_k wts[r, k] · y[r·K + k, c], slots in order; pairs with an invalid id contribute nothing.
__global__ void CombineKernel(const float* y, const int32_t* ids, const float* wts, int64_t n, int64_t K, int64_t D,
                              int E, float* out) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n * D) return;
  const int64_t r = idx / D, c = idx % D;
  float acc = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    const int e = ids[r * K + k];
    if (e >= 0 && e < E) acc += wts[r * K + k] * y[(r * K + k) * D + c];
  }
  out[idx] = acc;
}

}  // namespace

void RoutedExpertsMxfp4(const Mxfp4Experts& w, const float* x, const int32_t* ids, const float* wts, int64_t n,
                        int64_t K, float swiglu_limit, const Mxfp4Scratch& s, float* out, cudaStream_t stream) {
  if (n <= 0 || K <= 0) return;
  const int E = static_cast<int>(w.experts);
  for (int64_t r0 = 0; r0 < n; r0 += s.max_rows) {
    const int64_t m = std::min(s.max_rows, n - r0);
    const int pairs = static_cast<int>(m * K);
    BucketKernel<<<1, 1024, static_cast<size_t>(2 * E) * sizeof(int32_t), stream>>>(ids + r0 * K, pairs, E, s.offs,
                                                                                     s.list);
    const unsigned grid_x = static_cast<unsigned>(std::min<int64_t>(E, pairs));  // used experts <= both
    GateUpKernel<<<dim3(grid_x, static_cast<unsigned>(w.inter / (2 * kWarps))), kWarps * 32, 0, stream>>>(
        w, x + r0 * w.hidden, K, swiglu_limit, s.offs, s.list, s.h);
    DownKernel<<<dim3(grid_x, static_cast<unsigned>(w.hidden / (kRows * kWarps))), kWarps * 32, 0, stream>>>(
        w, s.offs, s.list, s.h, s.y);
    const int64_t total = m * w.hidden;
    CombineKernel<<<static_cast<unsigned>((total + 255) / 256), 256, 0, stream>>>(
        s.y, ids + r0 * K, wts + r0 * K, m, K, w.hidden, E, out + r0 * w.hidden);
  }
}

}  // namespace numoe::cuda
