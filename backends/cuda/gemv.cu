// Weight-streaming GEMV for decode passes of one row of x on FP8 (block-scaled) or BF16 weights: a warp streams
// 1 or 4 weight rows, each lane a 16-byte load (16 FP8 or 8 BF16 weights) per row and step, U steps in flight
// (2, or 4 with NUMOE_GEMV_UNROLL=4), fp32 multiply-adds on CUDA cores, a warp shuffle reduction at the end.
// Matrices with few rows per SM split k inside the block: KW (1, 2, 4 or 8) warps share a group of rows, each
// walking every KW-th k step, and their partial sums are added in shared memory in warp order (no atomics, no
// memset, the same sum for every launch), so small outputs still put enough loads in flight. No tensor cores: at one row the mma kernel
// (sm80_gemm_mma.cu) computes 8 columns for one and splits x into bf16 hi/lo halves; here every weight is
// exact in fp32 and each FP8 run's block scale is applied once to its partial sum.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>

#include "backends/cuda/device_util.cuh"
#include "backends/cuda/kernels.h"

namespace numoe::cuda {
namespace {

constexpr int kGemvWarps = 8;

// The 4 FP8 codes of `v` as fp32. sm_89+ converts pairs in hardware (exact: E4M3 fits fp16); elsewhere the
// sign and 7 magnitude bits are moved into place, which gives the values times 2^-120 (kFp8Rebase undoes it).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
constexpr float kFp8Rebase = 1.0f;
__device__ __forceinline__ void Fp8Word(uint32_t v, float (&out)[4]) {
  uint32_t lo, hi;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(lo) : "h"(static_cast<unsigned short>(v & 0xFFFFu)));
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hi) : "h"(static_cast<unsigned short>(v >> 16)));
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
  out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y;
}
#else
constexpr float kFp8Rebase = 0x1p60f;  // applied twice: 2^120
__device__ __forceinline__ void Fp8Word(uint32_t v, float (&out)[4]) {
  out[0] = __uint_as_float(((v << 24) & 0x80000000u) | ((v << 20) & 0x07F00000u));
  out[1] = __uint_as_float(((v << 16) & 0x80000000u) | ((v << 12) & 0x07F00000u));
  out[2] = __uint_as_float(((v << 8) & 0x80000000u) | ((v << 4) & 0x07F00000u));
  out[3] = __uint_as_float((v & 0x80000000u) | ((v >> 4) & 0x07F00000u));
}
#endif

// Each warp streams RPW weight rows at once, so every x value it loads serves that many weights; KW warps share
// those rows and split their k steps (warp w: rows group w / KW, steps w % KW, w % KW + KW, ...).
// MB: the blocks per SM its registers must allow (1: no bound; 3 caps them at 85).
template <WType WT, int RPW, int KW, int U, int MB>
__global__ void __launch_bounds__(kGemvWarps * 32, MB) GemvKernel(GemmCall c, DevW w) {
  constexpr int kPer = WT == WType::kFP8 ? 16 : 8;  // weights per lane per 16-byte load
  constexpr int64_t kStep = 32 * kPer;              // k per warp per step
  constexpr int kBytes = WT == WType::kFP8 ? 1 : 2;
  constexpr int kRowsPerBlock = kGemvWarps / KW * RPW;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, kw = warp % KW;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (warp / KW) * RPW;
  const int grp = blockIdx.y;
  if (KW == 1 && row0 >= w.out) return;  // (with KW > 1 every warp reaches the barrier; its rows repeat the last)
  const float* x = c.x + grp * c.x_group_cols;
  const char* wbase[RPW];
  int64_t scale_row[RPW];
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const int64_t wrow = static_cast<int64_t>(grp) * w.out + min(row0 + i, w.out - 1);  // past the end: a repeat
    wbase[i] = static_cast<const char*>(w.data) + wrow * w.in * kBytes;
    scale_row[i] = WT == WType::kFP8 ? ((w.row_base + wrow) / w.bo) * w.scale_cols : 0;
  }
  float acc[RPW];
#pragma unroll
  for (int i = 0; i < RPW; ++i) acc[i] = 0.0f;
  for (int64_t k0 = kw * kStep; k0 < w.in; k0 += kStep * U * KW) {  // steps kw + KW·(U·j + u)
    uint4 raw[U][RPW];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t k = k0 + u * KW * kStep + lane * kPer;
#pragma unroll
      for (int i = 0; i < RPW; ++i) {
        raw[u][i] = k < w.in ? __ldg(reinterpret_cast<const uint4*>(wbase[i] + k * kBytes)) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t k = k0 + u * KW * kStep + lane * kPer;
      if (k >= w.in) break;
      float4 xv[kPer / 4];
#pragma unroll
      for (int q = 0; q < kPer / 4; ++q) xv[q] = __ldg(reinterpret_cast<const float4*>(x + k) + q);
#pragma unroll
      for (int i = 0; i < RPW; ++i) {
        float wv[kPer];
        const uint32_t words[4] = {raw[u][i].x, raw[u][i].y, raw[u][i].z, raw[u][i].w};
        if constexpr (WT == WType::kFP8) {
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            float f[4];
            Fp8Word(words[q], f);
            wv[4 * q] = f[0], wv[4 * q + 1] = f[1], wv[4 * q + 2] = f[2], wv[4 * q + 3] = f[3];
          }
        } else {
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            wv[2 * q] = __uint_as_float(words[q] << 16);
            wv[2 * q + 1] = __uint_as_float(words[q] & 0xFFFF0000u);
          }
        }
        float part = 0.0f;
#pragma unroll
        for (int q = 0; q < kPer / 4; ++q) {
          part = fmaf(wv[4 * q], xv[q].x,
                      fmaf(wv[4 * q + 1], xv[q].y, fmaf(wv[4 * q + 2], xv[q].z, fmaf(wv[4 * q + 3], xv[q].w, part))));
        }
        if constexpr (WT == WType::kFP8) {
          // Without the hardware conversion the codes are the weights times 2^-120: 2^60 on each side keeps any
          // block scale below 2^68 finite.
          const float scale = w.scale[scale_row[i] + (w.col_base + k) / w.bi] * kFp8Rebase;
          acc[i] = fmaf(part * kFp8Rebase, scale, acc[i]);
        } else {
          acc[i] += part;
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[i] += __shfl_xor_sync(0xFFFFFFFFu, acc[i], off);
  }
  float* y = c.y + grp * c.y_group_cols;
  if constexpr (KW == 1) {
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < RPW; ++i) {
        if (row0 + i < w.out) y[row0 + i] = acc[i];
      }
    }
  } else {
    __shared__ float red[kGemvWarps][RPW];
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < RPW; ++i) red[warp][i] = acc[i];
    }
    __syncthreads();
    if (threadIdx.x < kRowsPerBlock) {
      const int rg = threadIdx.x / RPW, i = threadIdx.x % RPW;
      float sum = red[rg * KW][i];
#pragma unroll
      for (int j = 1; j < KW; ++j) sum += red[rg * KW + j][i];
      const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x;
      if (row < w.out) y[row] = sum;
    }
  }
}

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return end != v && *end == '\0' && n >= 0 && n <= 1024 ? static_cast<int>(n) : fallback;
}

}  // namespace

bool GemvApplies(const GemmCall& c, int64_t min_out) {
  const DevW& w = *c.w;
  if (c.n < 1 || c.n > kGemvMaxRows || (w.type != WType::kFP8 && w.type != WType::kBF16)) return false;
  const int64_t per = w.type == WType::kFP8 ? 16 : 8;
  const bool aligned = w.in % per == 0 && reinterpret_cast<uintptr_t>(w.data) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(c.x) % 16 == 0 && c.ldx % 4 == 0 && c.x_group_cols % 4 == 0;
  // An FP8 lane's 16 codes must share one block scale.
  const bool scales = w.type != WType::kFP8 || (w.bi % 16 == 0 && w.col_base % 16 == 0);
  // One warp per row: enough rows to fill the GPU.
  return aligned && scales && w.out * c.groups >= min_out;
}

namespace {

template <WType WT, int RPW, int KW, int U, int MB>
void LaunchGemvKernel(const GemmCall& c, cudaStream_t stream) {
  const DevW& w = *c.w;
  const int64_t rows_per_block = kGemvWarps / KW * RPW;
  const dim3 grid(static_cast<unsigned>((w.out + rows_per_block - 1) / rows_per_block), static_cast<unsigned>(c.groups));
  GemvKernel<WT, RPW, KW, U, MB><<<grid, kGemvWarps * 32, 0, stream>>>(c, w);
}

template <WType WT, int RPW, int U, int MB>
void DispatchKw(const GemmCall& c, int kw, cudaStream_t stream) {
  switch (kw) {
    case 1:
      return LaunchGemvKernel<WT, RPW, 1, U, MB>(c, stream);
    case 2:
      return LaunchGemvKernel<WT, RPW, 2, U, MB>(c, stream);
    case 4:
      return LaunchGemvKernel<WT, RPW, 4, U, MB>(c, stream);
    default:
      return LaunchGemvKernel<WT, RPW, 8, U, MB>(c, stream);
  }
}

template <WType WT>
void DispatchRpw(const GemmCall& c, const GemvPlan& p, cudaStream_t stream) {
  if (p.rows_per_warp == 4) {
    if (p.min_blocks == 3) {
      return p.unroll == 4 ? DispatchKw<WT, 4, 4, 3>(c, p.k_warps, stream) : DispatchKw<WT, 4, 2, 3>(c, p.k_warps, stream);
    }
    return p.unroll == 4 ? DispatchKw<WT, 4, 4, 1>(c, p.k_warps, stream) : DispatchKw<WT, 4, 2, 1>(c, p.k_warps, stream);
  }
  return p.unroll == 4 ? DispatchKw<WT, 1, 4, 1>(c, p.k_warps, stream) : DispatchKw<WT, 1, 2, 1>(c, p.k_warps, stream);
}

}  // namespace

GemvPlan PlanGemv(const GemmCall& c, int sms) {
  const DevW& w = *c.w;
  GemvPlan p;
  // Measured on the H200 (numoe-bench cuda --kernels): FP8 matrices of 1536-32768 rows stream faster with 4 rows
  // per warp (x loads are then a quarter of the weight bytes: the FP8 kernel is bound by its loads from L1);
  // BF16 ones below 8192 rows faster with 1 (they need every warp they can get; their x loads are half).
  static const int split = EnvInt("NUMOE_GEMV_SPLIT", 1);
  static const int unroll = EnvInt("NUMOE_GEMV_UNROLL", 2) == 4 ? 4 : 2;
  static const int per_sm = std::max(1, EnvInt("NUMOE_GEMV_BLOCKS_PER_SM", 4));
  static const int min_blocks = EnvInt("NUMOE_GEMV_MIN_BLOCKS", 1) == 3 ? 3 : 1;
  p.rows_per_warp = w.type == WType::kFP8 || w.out * c.groups >= 8192 ? 4 : 1;
  p.unroll = unroll;
  p.min_blocks = p.rows_per_warp == 4 ? min_blocks : 1;
  // k is split only when one warp per row group leaves most SMs without a block (fewer blocks than half the
  // SMs): then the k warps double until sms * per_sm blocks, at most one warp per k step. On the H200 that took
  // fp8 1536x4096 from 7.3 to 6.3 us and the bf16 router gate (256x4096) from 5.4 to 2.6 us, while splitting
  // matrices of 128+ blocks (fp8 4096x4096, 4096x8192, the grouped 1024x4096 x8) made them 20-45% slower.
  const int64_t per = w.type == WType::kFP8 ? 16 : 8;
  const int64_t steps = (w.in + 32 * per - 1) / (32 * per);
  auto blocks = [&](int kw) {
    const int64_t rows_per_block = kGemvWarps / kw * p.rows_per_warp;
    return (w.out + rows_per_block - 1) / rows_per_block * c.groups;
  };
  p.k_warps = 1;
  if (split != 0 && 2 * blocks(1) < sms) {
    while (p.k_warps < kGemvWarps && 2 * p.k_warps <= steps && blocks(p.k_warps) < static_cast<int64_t>(sms) * per_sm) {
      p.k_warps *= 2;
    }
  }
  return p;
}

void Gemv(const GemmCall& c, const GemvPlan& p, cudaStream_t stream) {
  if (c.w->type == WType::kFP8) {
    DispatchRpw<WType::kFP8>(c, p, stream);
  } else {
    DispatchRpw<WType::kBF16>(c, p, stream);
  }
}

}  // namespace numoe::cuda
