// Row-wise kernels of the CUDA backend: embedding, RMSNorm + rope, mHC (with Sinkhorn), router, SwiGLU,
// argmax, and the deterministic random fills used by synthetic models. The math mirrors backends/cpu/.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backends/cuda/device_util.cuh"
#include "backends/cuda/kernels.h"

namespace numoe::cuda {
namespace {

constexpr int kMaxHc = 8;

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__global__ void __launch_bounds__(1024) EmbedKernel(DevW table, const int32_t* token, int hc, float* X) {
  const int64_t r = blockIdx.x, D = table.in;
  const int64_t t = token[r];
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    const float v = LoadWElem(table, t, d);
    for (int j = 0; j < hc; ++j) X[(r * hc + j) * D + d] = v;
  }
}

__global__ void __launch_bounds__(1024) RowInvRmsKernel(const float* x, int64_t len, float eps, float* inv) {
  __shared__ float red[32];
  const float* xr = x + blockIdx.x * len;
  float ss = 0.0f;
  if (len % 4 == 0) {  // rows of the residual streams: 16-byte aligned, hc·D wide
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    for (int64_t i = threadIdx.x; i < len / 4; i += blockDim.x) {
      const float4 v = x4[i];
      ss = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss))));
    }
  } else {
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
  }
  ss = BlockSum(ss, red);
  if (threadIdx.x == 0) inv[blockIdx.x] = 1.0f / sqrtf(ss / static_cast<float>(len) + eps);
}

// Block (chunk s, row group): the chunk's weights [M, kc] in shared memory, each warp a row at a time; a
// lane holds 4 consecutive k per 128. The warp's sums go through the same shuffle tree for every row.
template <int M>
__global__ void __launch_bounds__(256) HcMixKernel(const float* X, int64_t K, const float* W, int64_t n,
                                                   int rows_per_block, float* part) {
  extern __shared__ float4 w4s[];  // [M][kc / 4]
  const int s = blockIdx.x, kc = static_cast<int>(K / kHcMixSplits), kc4 = kc / 4;
  const int64_t k0 = static_cast<int64_t>(s) * kc;
  for (int i = threadIdx.x; i < M * kc4; i += blockDim.x) {
    const int o = i / kc4, j = i % kc4;
    w4s[i] = reinterpret_cast<const float4*>(W + o * K + k0)[j];
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r_begin = static_cast<int64_t>(blockIdx.y) * rows_per_block;
  const int64_t r_end = min(n, r_begin + rows_per_block);
  for (int64_t r = r_begin + warp; r < r_end; r += blockDim.x / 32) {
    const float4* x4 = reinterpret_cast<const float4*>(X + r * K + k0);
    float acc[M + 1];
#pragma unroll
    for (int o = 0; o <= M; ++o) acc[o] = 0.0f;
    for (int j = lane; j < kc4; j += 32) {
      const float4 x = x4[j];
      acc[M] = fmaf(x.x, x.x, fmaf(x.y, x.y, fmaf(x.z, x.z, fmaf(x.w, x.w, acc[M]))));
#pragma unroll
      for (int o = 0; o < M; ++o) {
        const float4 w = w4s[o * kc4 + j];
        acc[o] = fmaf(x.x, w.x, fmaf(x.y, w.y, fmaf(x.z, w.z, fmaf(x.w, w.w, acc[o]))));
      }
    }
    float* dst = part + (r * kHcMixSplits + s) * (M + 1);
#pragma unroll
    for (int o = 0; o <= M; ++o) {
      const float v = WarpSum(acc[o]);
      if (lane == 0) dst[o] = v;
    }
  }
}

// HcPost fused with the next HcMix (hc = 4, m = 24): block s owns the columns d in [s·dc, (s + 1)·dc) of all
// four streams (dc = D / kHcMixSplits) - a chunk of the mix's K of its own - with their weights in shared
// memory; a lane owns a column d: it applies the post to the four streams there (the same arithmetic as
// HcPostKernel), writes them back and adds their products with the weights (and their squares). Every load
// that does not wait on another is issued before the first is used: the weights (from HBM: 1.5 MB per mix)
// and the inputs of each warp's first row, then one barrier.
struct PostMixIn {
  float pst[4], C[16], old[4], y;
};

__device__ __forceinline__ PostMixIn LoadPostMixIn(const HcPostMixArgs& a, int64_t r, int64_t d) {
  PostMixIn in;
#pragma unroll
  for (int i = 0; i < 4; ++i) in.pst[i] = a.post[r * 4 + i];
#pragma unroll
  for (int i = 0; i < 16; ++i) in.C[i] = a.comb[r * 16 + i];
  const float* xr = a.X + r * 4 * a.D;
#pragma unroll
  for (int j = 0; j < 4; ++j) in.old[j] = xr[j * a.D + d];
  in.y = a.y2 ? a.y[r * a.D + d] + a.y2[r * a.D + d] : a.y[r * a.D + d];
  return in;
}

__global__ void __launch_bounds__(256) HcPostMixKernel(HcPostMixArgs a) {
  constexpr int kHc = 4, M = (2 + kHc) * kHc;
  extern __shared__ float4 ws4[];  // [M][kHc][dc]
  float* ws = reinterpret_cast<float*>(ws4);
  const int s = blockIdx.x;
  const int dc = static_cast<int>(a.D / kHcMixSplits);
  const int64_t d0 = static_cast<int64_t>(s) * dc, K = kHc * a.D;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r_begin = static_cast<int64_t>(blockIdx.y) * a.rows_per_block;
  const int64_t r_end = min(a.n, r_begin + a.rows_per_block);
  const bool first_row = r_begin + warp < r_end && lane < dc;
  PostMixIn first{};
  if (first_row) first = LoadPostMixIn(a, r_begin + warp, d0 + lane);
  if (dc % 4 == 0) {  // float4 runs of dc weights: 3 loads per thread at D = 4096, all in flight at once
    const int dc4 = dc / 4, total = M * kHc * dc4;
    constexpr int kBatch = 4;
    for (int e0 = threadIdx.x; e0 < total; e0 += kBatch * blockDim.x) {
      float4 v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * blockDim.x;
        if (e < total) {
          const int o = e / (kHc * dc4), j = (e / dc4) % kHc, i4 = e % dc4;
          v[u] = reinterpret_cast<const float4*>(a.W + o * K + j * a.D + d0)[i4];
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (e0 + u * blockDim.x < total) ws4[e0 + u * blockDim.x] = v[u];
      }
    }
  } else {
    for (int e = threadIdx.x; e < M * kHc * dc; e += blockDim.x) {
      const int o = e / (kHc * dc), j = (e / dc) % kHc, i = e % dc;
      ws[e] = a.W[o * K + j * a.D + d0 + i];
    }
  }
  __syncthreads();
  for (int64_t r = r_begin + warp; r < r_end; r += blockDim.x / 32) {
    float acc[M + 1];
#pragma unroll
    for (int o = 0; o <= M; ++o) acc[o] = 0.0f;
    float* xr = a.X + r * K;
    for (int i = lane; i < dc; i += 32) {
      const int64_t d = d0 + i;
      const PostMixIn in = first_row && r == r_begin + warp && i == lane ? first : LoadPostMixIn(a, r, d);
      float nw[kHc];
#pragma unroll
      for (int q = 0; q < kHc; ++q) {
        float v = in.pst[q] * in.y;
#pragma unroll
        for (int j = 0; j < kHc; ++j) v = fmaf(in.C[j * kHc + q], in.old[j], v);
        nw[q] = v;
        xr[q * a.D + d] = v;
      }
#pragma unroll
      for (int j = 0; j < kHc; ++j) {
        acc[M] = fmaf(nw[j], nw[j], acc[M]);
#pragma unroll
        for (int o = 0; o < M; ++o) acc[o] = fmaf(nw[j], ws[(o * kHc + j) * dc + i], acc[o]);
      }
    }
    float* dst = a.part + (r * kHcMixSplits + s) * (M + 1);
#pragma unroll
    for (int o = 0; o <= M; ++o) {
      const float v = WarpSum(acc[o]);
      if (lane == 0) dst[o] = v;
    }
  }
}

// Block (row, role). Role 0 collapses the streams: u = Σ pre_j X_j (dynamic shared memory holds u [D]) and
// xn = RMSNorm_w(u). Role 1 (not in head mode) does post and the Sinkhorn on warp 0, at the same time on
// another multiprocessor: the Sinkhorn is a chain of ~80 dependent steps and used to hold up xn. Both add
// HcMix's chunks (or take mixraw and inv) the same way, so both see the same mix.
__global__ void __launch_bounds__(1024) HcPreKernel(HcPreArgs a) {
  extern __shared__ float4 us4[];
  float* us = reinterpret_cast<float*>(us4);
  __shared__ float red[32];
  __shared__ float pre[kMaxHc], post[kMaxHc], C[kMaxHc * kMaxHc];
  __shared__ float mix_s[kMaxHc * (kMaxHc + 2) + 1];
  const int64_t r = blockIdx.x;
  const bool sinkhorn = blockIdx.y == 1;
  const int k = a.hc;
  const int m = a.head_mode ? k : (2 + k) * k;
  const float* mr = a.mixraw + r * m;
  // Role 0: the loads that do not depend on the mix are issued first, so that their latency overlaps the
  // reduction of the chunks: the thread's first float4 of each stream and pre's base and scale.
  const bool vec = a.D % 4 == 0 && reinterpret_cast<uintptr_t>(a.X) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(a.xn) % 16 == 0 && reinterpret_cast<uintptr_t>(a.norm_w) % 16 == 0 &&
                   (a.u_out == nullptr || reinterpret_cast<uintptr_t>(a.u_out) % 16 == 0);
  const float* xr = a.X + r * k * a.D;
  constexpr int kPrefetch = 4;  // streams prefetched (hc = 4 in V4), 16 registers
  float4 x0[kPrefetch] = {};
  float base0 = 0.0f, scale0 = 0.0f;
  if (!sinkhorn) {
    if (vec && threadIdx.x < a.D / 4) {
#pragma unroll
      for (int j = 0; j < kPrefetch; ++j) {
        if (j < k) x0[j] = reinterpret_cast<const float4*>(xr + j * a.D)[threadIdx.x];
      }
    }
    if (threadIdx.x < k) {
      base0 = a.base[threadIdx.x];
      scale0 = a.scale[0];
    }
  }
  // Role 1, hc = 4: the Sinkhorn's and post's base and scale likewise (lane t: comb element t, post t < 4).
  float base_c = 0.0f, scale_c = 0.0f, base_p = 0.0f, scale_p = 0.0f;
  if (sinkhorn && k == 4 && threadIdx.x < 32) {
    base_c = a.base[8 + (threadIdx.x & 15)];
    scale_c = a.scale[2];
    if (threadIdx.x < 4) {
      base_p = a.base[4 + threadIdx.x];
      scale_p = a.scale[1];
    }
  }
  float inv;
  if (a.part != nullptr) {  // add HcMix's chunks: warp o sums column o, lanes in a fixed order
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = warp; o <= m; o += blockDim.x / 32) {
      const float* col = a.part + r * kHcMixSplits * (m + 1) + o;
      float v = 0.0f;
      for (int s = lane; s < kHcMixSplits; s += 32) v += col[s * (m + 1)];
      v = WarpSum(v);
      if (lane == 0) mix_s[o] = v;
    }
    __syncthreads();
    mr = mix_s;
    inv = 1.0f / sqrtf(mix_s[m] / static_cast<float>(k * a.D) + a.rms_eps);
  } else {
    inv = a.inv[r];
  }
  if (sinkhorn) {
    if (threadIdx.x >= 32) return;
    if (k == 4) {
      // hc = 4: the 4x4 Sinkhorn on 16 lanes of warp 0 (element t = row j * 4 + column i; row sums over lane
      // xor 1, 2, column sums over xor 4, 8), instead of one thread doing ~700 divisions.
      const int t = threadIdx.x & 15;
      if (threadIdx.x < 4) a.post[r * 4 + t] = 2.0f * Sigmoid(mr[4 + t] * inv * scale_p + base_p);
      const float v = mr[8 + t] * inv * scale_c + base_c;
      auto rsum = [](float x) {
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        return x + __shfl_xor_sync(0xffffffffu, x, 2);
      };
      auto csum = [](float x) {
        x += __shfl_xor_sync(0xffffffffu, x, 4);
        return x + __shfl_xor_sync(0xffffffffu, x, 8);
      };
      float mx = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float e = expf(v - mx);
      float c = e / rsum(e) + a.hc_eps;
      c = c / (csum(c) + a.hc_eps);
      for (int it = 1; it < a.iters; ++it) {
        c = c / (rsum(c) + a.hc_eps);
        c = c / (csum(c) + a.hc_eps);
      }
      if (threadIdx.x < 16) a.comb[r * 16 + t] = c;
    } else if (threadIdx.x == 0) {
      for (int j = 0; j < k; ++j) post[j] = 2.0f * Sigmoid(mr[k + j] * inv * a.scale[1] + a.base[k + j]);
      for (int j = 0; j < k; ++j) {
        float mx = -INFINITY;
        for (int i = 0; i < k; ++i) {
          const float v = mr[2 * k + j * k + i] * inv * a.scale[2] + a.base[2 * k + j * k + i];
          C[j * k + i] = v;
          mx = fmaxf(mx, v);
        }
        float s = 0.0f;
        for (int i = 0; i < k; ++i) {
          C[j * k + i] = expf(C[j * k + i] - mx);
          s += C[j * k + i];
        }
        for (int i = 0; i < k; ++i) C[j * k + i] = C[j * k + i] / s + a.hc_eps;
      }
      auto col_norm = [&] {
        for (int i = 0; i < k; ++i) {
          float s = 0.0f;
          for (int j = 0; j < k; ++j) s += C[j * k + i];
          for (int j = 0; j < k; ++j) C[j * k + i] /= (s + a.hc_eps);
        }
      };
      auto row_norm = [&] {
        for (int j = 0; j < k; ++j) {
          float s = 0.0f;
          for (int i = 0; i < k; ++i) s += C[j * k + i];
          for (int i = 0; i < k; ++i) C[j * k + i] /= (s + a.hc_eps);
        }
      };
      col_norm();
      for (int it = 1; it < a.iters; ++it) {
        row_norm();
        col_norm();
      }
      for (int j = 0; j < k; ++j) a.post[r * k + j] = post[j];
      for (int j = 0; j < k * k; ++j) a.comb[r * k * k + j] = C[j];
    }
    return;
  }
  if (threadIdx.x < k) pre[threadIdx.x] = Sigmoid(mr[threadIdx.x] * inv * scale0 + base0) + a.hc_eps;
  __syncthreads();
  float ss = 0.0f;
  if (vec) {  // float4 loads: at D = 4096 a thread's loads are the ones it issued first
    const int64_t D4 = a.D / 4;
    for (int64_t d = threadIdx.x; d < D4; d += blockDim.x) {
      float4 u = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int j = 0; j < kMaxHc; ++j) {
        if (j >= k) break;
        const float4 x = j < kPrefetch && d == threadIdx.x ? x0[j % kPrefetch]
                                                          : reinterpret_cast<const float4*>(xr + j * a.D)[d];
        u.x = fmaf(pre[j], x.x, u.x);
        u.y = fmaf(pre[j], x.y, u.y);
        u.z = fmaf(pre[j], x.z, u.z);
        u.w = fmaf(pre[j], x.w, u.w);
      }
      us4[d] = u;
      ss = fmaf(u.x, u.x, ss);
      ss = fmaf(u.y, u.y, ss);
      ss = fmaf(u.z, u.z, ss);
      ss = fmaf(u.w, u.w, ss);
    }
  } else {
    for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) {
      float u = 0.0f;
      for (int j = 0; j < k; ++j) u = fmaf(pre[j], xr[j * a.D + d], u);
      us[d] = u;
      ss = fmaf(u, u, ss);
    }
  }
  ss = BlockSum(ss, red);
  const float inv_u = 1.0f / sqrtf(ss / static_cast<float>(a.D) + a.rms_eps);
  if (vec) {
    const int64_t D4 = a.D / 4;
    for (int64_t d = threadIdx.x; d < D4; d += blockDim.x) {
      const float4 u = us4[d], w = reinterpret_cast<const float4*>(a.norm_w)[d];
      reinterpret_cast<float4*>(a.xn + r * a.D)[d] =
          make_float4(u.x * inv_u * w.x, u.y * inv_u * w.y, u.z * inv_u * w.z, u.w * inv_u * w.w);
      if (a.u_out != nullptr) reinterpret_cast<float4*>(a.u_out + r * a.D)[d] = u;
    }
  } else {
    for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) a.xn[r * a.D + d] = us[d] * inv_u * a.norm_w[d];
    if (a.u_out != nullptr) {
      for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) a.u_out[r * a.D + d] = us[d];
    }
  }
}

__global__ void HcPostKernel(const float* y, const float* post, const float* comb, float* X, int64_t n, int hc,
                             int64_t D) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n * D) return;
  const int64_t r = idx / D, d = idx % D;
  float old[kMaxHc];
  float* xr = X + r * hc * D;
  for (int j = 0; j < hc; ++j) old[j] = xr[j * D + d];
  const float* C = comb + r * hc * hc;
  const float yv = y[r * D + d];
  for (int i = 0; i < hc; ++i) {
    float s = post[r * hc + i] * yv;
    for (int j = 0; j < hc; ++j) s = fmaf(C[j * hc + i], old[j], s);
    xr[i * D + d] = s;
  }
}

// Block (row, head of one of the jobs: heads of job 0 first). Each thread holds channel pairs (2i, 2i + 1) in
// registers, so the rope needs no shared memory and the only barrier is the norm's sum.
constexpr int kNormRopePairs = 4;  // pairs per thread at most: heads of up to 8·1024 channels

template <typename CacheT>
__global__ void __launch_bounds__(1024) NormRopeKernel(NormRopeJobs<CacheT> jobs, const int32_t* pos) {
  __shared__ float red[32];
  const int64_t r = blockIdx.x;
  int h = static_cast<int>(blockIdx.y);
  const bool second = jobs.count > 1 && h >= jobs.j[0].heads;
  const NormRopeArgs<CacheT> a = second ? jobs.j[1] : jobs.j[0];
  if (second) h -= jobs.j[0].heads;
  float* xh = a.x + r * a.ld + static_cast<int64_t>(h) * a.hd;
  const int pairs = a.hd / 2;
  float2 v[kNormRopePairs];
  float ss = 0.0f;
#pragma unroll
  for (int q = 0; q < kNormRopePairs; ++q) {
    const int i = threadIdx.x + q * blockDim.x;
    v[q] = make_float2(0.0f, 0.0f);
    if (i < pairs) {
      v[q] = make_float2(xh[2 * i], xh[2 * i + 1]);
      ss = fmaf(v[q].x, v[q].x, ss);
      ss = fmaf(v[q].y, v[q].y, ss);
    }
  }
  float inv = 1.0f;
  if (a.norm) {
    ss = BlockSum(ss, red);
    inv = 1.0f / sqrtf(ss / static_cast<float>(a.hd) + a.eps);
  }
  const float p = a.inv_freq != nullptr ? static_cast<float>(pos[r]) : 0.0f;
  const int base = (a.hd - a.rope_dim) / 2;  // first rotated pair
#pragma unroll
  for (int q = 0; q < kNormRopePairs; ++q) {
    const int i = threadIdx.x + q * blockDim.x;
    if (i >= pairs) continue;
    float x0 = v[q].x, x1 = v[q].y;
    if (a.norm) {
      x0 = a.w ? x0 * inv * a.w[2 * i] : x0 * inv;
      x1 = a.w ? x1 * inv * a.w[2 * i + 1] : x1 * inv;
    }
    if (a.inv_freq != nullptr && i >= base) {
      const float ang = p * a.inv_freq[i - base];
      const float c = cosf(ang), s = sinf(ang);
      const float r0 = x0 * c - x1 * s, r1 = x1 * c + x0 * s;
      x0 = r0;
      x1 = r1;
    }
    xh[2 * i] = x0;
    xh[2 * i + 1] = x1;
    if (a.copy_out) {
      CacheT* o = a.copy_out + (r * a.heads + h) * a.hd;
      o[2 * i] = FromF32<CacheT>(x0);
      o[2 * i + 1] = FromF32<CacheT>(x1);
    }
  }
}

// One block per row: its threads make the scores s and the biased scores sb (dynamic shared memory [2, E]),
// then warp 0 alone takes the top-k: K rounds of a lane scan over its experts e = lane + 32·i in increasing e
// and a warp argmax (ties to the lowest id); the chosen expert's sb becomes -inf (skipped as before: a -inf
// score is never taken). No block barrier inside the rounds.
constexpr int kMoeGateMaxE = 8192;  // CreateCudaModel's limit

__global__ void __launch_bounds__(256) MoeGateKernel(const float* logits, int E, int K, int scoring, const float* bias,
                                                     const int32_t* tid2eid, const int32_t* token, float route_scale,
                                                     int32_t* ids, float* weights) {
  extern __shared__ float s[];  // [E] scores, then [E] scores + bias
  float* sb = s + E;
  __shared__ float red[32];
  __shared__ int32_t chosen[16];
  const int64_t r = blockIdx.x;
  const float* lr = logits + r * E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const float l = lr[e];
    float v = l;
    if (scoring == 0) {
      v = sqrtf(l > 20.0f ? l : log1pf(expf(l)));
    } else if (scoring == 2) {
      v = Sigmoid(l);
    }
    s[e] = v;
  }
  if (scoring == 1) {  // softmax over all experts
    __syncthreads();
    float m = -INFINITY;
    for (int e = threadIdx.x; e < E; e += blockDim.x) m = fmaxf(m, s[e]);
    m = BlockMax(m, red);
    float sum = 0.0f;
    for (int e = threadIdx.x; e < E; e += blockDim.x) sum += expf(s[e] - m);
    sum = BlockSum(sum, red);
    for (int e = threadIdx.x; e < E; e += blockDim.x) s[e] = expf(s[e] - m) / sum;
  }
  if (tid2eid == nullptr) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) sb[e] = s[e] + (bias ? bias[e] : 0.0f);
  } else if (threadIdx.x < K) {
    chosen[threadIdx.x] = tid2eid[static_cast<int64_t>(token[r]) * K + threadIdx.x];
  }
  __syncthreads();
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  if (tid2eid == nullptr) {
    for (int k = 0; k < K; ++k) {
      float best = -INFINITY;
      int32_t bi = INT32_MAX;
      for (int e = lane; e < E; e += 32) {
        const float v = sb[e];
        if (v > best) {  // increasing e: the first maximum of this lane wins
          best = v;
          bi = e;
        }
      }
      WarpArgmax(best, bi);
      if (bi != INT32_MAX && bi % 32 == lane) sb[bi] = -INFINITY;
      if (lane == 0) chosen[k] = bi;
      __syncwarp();
    }
  }
  if (lane == 0) {
    float sum = 0.0f;
    for (int k = 0; k < K; ++k) sum += s[chosen[k]];
    const float mul = route_scale / (sum + 1e-20f);
    for (int k = 0; k < K; ++k) {
      ids[r * K + k] = chosen[k];
      weights[r * K + k] = s[chosen[k]] * mul;
    }
  }
}

__global__ void SwiGluKernel(const float* g, const float* u, int64_t ldgu, float* h, int64_t n, int64_t I, float lim) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n * I) return;
  const int64_t r = idx / I, i = idx % I;
  float gv = g[r * ldgu + i], uv = u[r * ldgu + i];
  if (lim > 0.0f) {
    gv = fminf(gv, lim);
    uv = fminf(fmaxf(uv, -lim), lim);
  }
  h[r * I + i] = gv / (1.0f + expf(-gv)) * uv;
}

__global__ void AddKernel(float* y, const float* a, int64_t count) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) y[i] += a[i];
}

__global__ void GatherKernel(const float* src, int64_t d, const int32_t* rows, float* dst) {
  const float* s = src + static_cast<int64_t>(rows[blockIdx.x]) * d;
  float* o = dst + static_cast<int64_t>(blockIdx.x) * d;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) o[i] = s[i];
}

__global__ void StreamMeanKernel(const float* X, int hc, int64_t D, float* out, int64_t ldo) {
  const int64_t r = blockIdx.x;
  const float* xr = X + r * hc * D;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    float f = 0.0f;
    for (int j = 0; j < hc; ++j) f += xr[j * D + d];
    out[r * ldo + d] = f / static_cast<float>(hc);
  }
}

__global__ void __launch_bounds__(1024) RmsNormRowsKernel(float* x, int64_t D, const float* w, float eps) {
  __shared__ float red[32];
  float* xr = x + blockIdx.x * D;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
  ss = BlockSum(ss, red);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(D) + eps);
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) xr[i] = xr[i] * inv * w[i];
}

__global__ void GatherBf16RowsKernel(const __nv_bfloat16* table, int64_t d, const int32_t* ids, float* out) {
  const __nv_bfloat16* src = table + static_cast<int64_t>(ids[blockIdx.x]) * d;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) out[blockIdx.x * d + i] = __bfloat162float(src[i]);
}

__global__ void LoadSpecRowsKernel(const char* src, int64_t slot_stride, int64_t words, int32_t T, const int32_t* map,
                                   uint32_t* dst, int64_t dst_ld) {
  const int32_t m = map[blockIdx.x];
  const uint32_t* s = reinterpret_cast<const uint32_t*>(src + static_cast<int64_t>(m / T) * slot_stride +
                                                        static_cast<int64_t>(m % T) * words * 4);
  uint32_t* o = dst + static_cast<int64_t>(blockIdx.x) * dst_ld;
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) o[i] = s[i];
}

__global__ void SaveSpecRowsKernel(const uint32_t* src, int64_t src_ld, int64_t words, const int32_t* map, int32_t T,
                                   char* dst, int64_t slot_stride, int64_t row_bytes) {
  const int32_t m = map[blockIdx.x];
  if (m < 0) return;
  const uint32_t* s = src + static_cast<int64_t>(blockIdx.x) * src_ld;
  uint32_t* o = reinterpret_cast<uint32_t*>(dst + static_cast<int64_t>(m / T) * slot_stride +
                                            static_cast<int64_t>(m % T) * row_bytes);
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) o[i] = s[i];
}

// Many blocks per row; each folds its slice into one 64-bit key (order-preserving float bits, then the
// complemented index so that ties go to the lowest id) and atomicMax-es it into packed[row].
__global__ void ArgmaxKernel(const float* logits, int64_t V, unsigned long long* packed) {
  __shared__ float rv[32];
  __shared__ int32_t ri[32];
  const float* l = logits + blockIdx.y * V;
  float best = -INFINITY;
  int32_t bi = INT32_MAX;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < V;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (l[i] > best) {  // strided in increasing i: the first maximum of this thread wins
      best = l[i];
      bi = static_cast<int32_t>(i);
    }
  }
  BlockArgmax(best, bi, rv, ri);
  if (threadIdx.x == 0 && bi != INT32_MAX) {
    const uint32_t u = __float_as_uint(best);
    const uint32_t key = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    const unsigned long long v =
        (static_cast<unsigned long long>(key) << 32) | static_cast<unsigned long long>(~static_cast<uint32_t>(bi));
    atomicMax(packed + blockIdx.y, v);
  }
}

__device__ __forceinline__ uint64_t Mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ float Uniform01(uint64_t seed, int64_t i) {
  return static_cast<float>(Mix64(seed * 0x100000001b3ull + static_cast<uint64_t>(i)) >> 40) * 0x1p-24f;
}

__global__ void FillF32Kernel(float* p, int64_t count, float lo, float hi, uint64_t seed) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    p[i] = lo + (hi - lo) * Uniform01(seed, i);
  }
}
__global__ void FillBf16Kernel(__nv_bfloat16* p, int64_t count, float amp, uint64_t seed) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    p[i] = __float2bfloat16_rn(amp * (2.0f * Uniform01(seed, i) - 1.0f));
  }
}
__global__ void FillFp8Kernel(uint8_t* p, int64_t count, uint64_t seed) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t h = Mix64(seed * 0x100000001b3ull + static_cast<uint64_t>(i));
    const uint32_t e = 1 + static_cast<uint32_t>(h % 7);  // exponent 1..7: |v| in [2^-6, 1.875]
    p[i] = static_cast<uint8_t>(((h >> 8) & 0x80) | (e << 3) | ((h >> 16) & 7));
  }
}
__global__ void FillI32Kernel(int32_t* p, int64_t count, int32_t mod, uint64_t seed) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    p[i] = static_cast<int32_t>(Mix64(seed * 0x100000001b3ull + static_cast<uint64_t>(i)) % static_cast<uint64_t>(mod));
  }
}
__global__ void ConvertKernel(const float* src, __nv_bfloat16* dst, int64_t count) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = __float2bfloat16_rn(src[i]);
  }
}

unsigned Blocks(int64_t count, int threads) {
  const int64_t b = (count + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 * 16 ? 65535 * 16 : b));
}

}  // namespace

void Embed(const DevW& table, const int32_t* token, int64_t n, int hc, float* X, cudaStream_t stream) {
  if (n <= 0) return;
  EmbedKernel<<<static_cast<unsigned>(n), 1024, 0, stream>>>(table, token, hc, X);
}

void RowInvRms(const float* x, int64_t n, int64_t len, float eps, float* inv, cudaStream_t stream) {
  if (n <= 0) return;
  RowInvRmsKernel<<<static_cast<unsigned>(n), 1024, 0, stream>>>(x, len, eps, inv);
}

void HcPre(const HcPreArgs& a, cudaStream_t stream) {
  if (a.n <= 0) return;
  // 1024 threads: with one row per block (decode), the row's loads must be spread wide to hide latency.
  const dim3 grid(static_cast<unsigned>(a.n), a.head_mode ? 1u : 2u);
  HcPreKernel<<<grid, 1024, static_cast<size_t>(a.D) * sizeof(float), stream>>>(a);
}

bool HcMixFits(const DevW& w, int64_t n) {
  return n >= 1 && n <= kHcMixMaxRows && w.type == WType::kF32 && (w.out == 24 || w.out == 4) &&
         w.in % (kHcMixSplits * 4) == 0 && w.in / kHcMixSplits <= 256 && w.row_base == 0 && w.col_base == 0 &&
         reinterpret_cast<uintptr_t>(w.data) % 16 == 0;  // float4 loads; at most 24 KB of shared memory
}

void HcMix(const float* X, const DevW& w, int64_t n, float* part, cudaStream_t stream) {
  if (n <= 0) return;
  const int rows_per_block = 16;  // 2 rows per warp: the chunk's weights are loaded once per 16 rows
  const dim3 grid(kHcMixSplits, static_cast<unsigned>((n + rows_per_block - 1) / rows_per_block));
  const size_t smem = static_cast<size_t>(w.out * (w.in / kHcMixSplits)) * sizeof(float);
  const float* W = static_cast<const float*>(w.data);
  if (w.out == 24) {
    HcMixKernel<24><<<grid, 256, smem, stream>>>(X, w.in, W, n, rows_per_block, part);
  } else {
    HcMixKernel<4><<<grid, 256, smem, stream>>>(X, w.in, W, n, rows_per_block, part);
  }
}

bool HcPostMixFits(const DevW& w, int64_t n, int hc, int64_t D) {
  return HcMixFits(w, n) && hc == 4 && w.out == 24 && w.in == hc * D && D % kHcMixSplits == 0;
}

void HcPostMix(const HcPostMixArgs& a, cudaStream_t stream) {
  if (a.n <= 0) return;
  HcPostMixArgs b = a;
  b.rows_per_block = 16;  // 2 rows per warp, as HcMix
  const dim3 grid(kHcMixSplits, static_cast<unsigned>((a.n + b.rows_per_block - 1) / b.rows_per_block));
  const size_t smem = static_cast<size_t>(24 * 4 * (a.D / kHcMixSplits)) * sizeof(float);
  HcPostMixKernel<<<grid, 256, smem, stream>>>(b);
}

void HcPost(const float* y, const float* post, const float* comb, float* X, int64_t n, int hc, int64_t D,
            cudaStream_t stream) {
  if (n <= 0) return;
  HcPostKernel<<<Blocks(n * D, 256), 256, 0, stream>>>(y, post, comb, X, n, hc, D);
}

template <typename CacheT>
void NormRope(const NormRopeJobs<CacheT>& jobs, int64_t n, const int32_t* pos, cudaStream_t stream) {
  if (n <= 0 || jobs.count <= 0) return;
  int heads = 0, pairs = 0;
  for (int i = 0; i < jobs.count; ++i) {
    heads += jobs.j[i].heads;
    pairs = std::max(pairs, jobs.j[i].hd / 2);
  }
  // Threads: one pair each up to 1024 (a 32-multiple), more pairs per thread beyond.
  const int threads = std::min(1024, std::max(32, (pairs + 31) / 32 * 32));
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(heads));
  NormRopeKernel<CacheT><<<grid, threads, 0, stream>>>(jobs, pos);
}
template void NormRope<float>(const NormRopeJobs<float>&, int64_t, const int32_t*, cudaStream_t);
template void NormRope<__nv_bfloat16>(const NormRopeJobs<__nv_bfloat16>&, int64_t, const int32_t*, cudaStream_t);

void MoeGate(const float* logits, int64_t n, int E, int K, int scoring, const float* bias, const int32_t* tid2eid,
             const int32_t* token, float route_scale, int32_t* ids, float* weights, cudaStream_t stream) {
  if (n <= 0) return;
  if (E > kMoeGateMaxE || K > 16) return;  // CreateCudaModel rejects such configs
  const size_t smem = 2 * static_cast<size_t>(E) * sizeof(float);
  if (smem > 48 * 1024) {
    cudaFuncSetAttribute(MoeGateKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  }
  MoeGateKernel<<<static_cast<unsigned>(n), 256, smem, stream>>>(
      logits, E, K, scoring, bias, tid2eid, token, route_scale, ids, weights);
}

void SwiGlu(const float* g, const float* u, int64_t ldgu, float* h, int64_t n, int64_t I, float lim,
            cudaStream_t stream) {
  if (n <= 0) return;
  SwiGluKernel<<<Blocks(n * I, 256), 256, 0, stream>>>(g, u, ldgu, h, n, I, lim);
}

void AddInPlace(float* y, const float* a, int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  AddKernel<<<Blocks(count, 256), 256, 0, stream>>>(y, a, count);
}

void GatherRows(const float* src, int64_t d, const int32_t* rows, int64_t m, float* dst, cudaStream_t stream) {
  if (m <= 0) return;
  GatherKernel<<<static_cast<unsigned>(m), 256, 0, stream>>>(src, d, rows, dst);
}

void StreamMean(const float* X, int64_t n, int hc, int64_t D, float* out, int64_t ldo, cudaStream_t stream) {
  if (n <= 0) return;
  StreamMeanKernel<<<static_cast<unsigned>(n), 256, 0, stream>>>(X, hc, D, out, ldo);
}

void RmsNormRows(float* x, int64_t n, int64_t D, const float* w, float eps, cudaStream_t stream) {
  if (n <= 0) return;
  RmsNormRowsKernel<<<static_cast<unsigned>(n), 1024, 0, stream>>>(x, D, w, eps);
}

void GatherBf16Rows(const __nv_bfloat16* table, int64_t d, const int32_t* ids, int64_t m, float* out,
                    cudaStream_t stream) {
  if (m <= 0) return;
  GatherBf16RowsKernel<<<static_cast<unsigned>(m), 256, 0, stream>>>(table, d, ids, out);
}

void LoadSpecRows(const void* src, int64_t slot_stride, int64_t width, int32_t T, const int32_t* map, int64_t n,
                  void* dst, int64_t dst_ld, cudaStream_t stream) {
  if (n <= 0 || width <= 0) return;
  LoadSpecRowsKernel<<<static_cast<unsigned>(n), 128, 0, stream>>>(static_cast<const char*>(src), slot_stride,
                                                                   width / 4, T, map, static_cast<uint32_t*>(dst),
                                                                   dst_ld / 4);
}

void SaveSpecRows(const void* src, int64_t src_ld, int64_t width, int64_t n, const int32_t* map, int32_t T,
                  void* dst, int64_t slot_stride, int64_t row_bytes, cudaStream_t stream) {
  if (n <= 0 || width <= 0) return;
  SaveSpecRowsKernel<<<static_cast<unsigned>(n), 128, 0, stream>>>(static_cast<const uint32_t*>(src), src_ld / 4,
                                                                   width / 4, map, T, static_cast<char*>(dst),
                                                                   slot_stride, row_bytes);
}

void ArgmaxRows(const float* logits, int64_t m, int64_t V, unsigned long long* packed, cudaStream_t stream) {
  if (m <= 0) return;
  cudaMemsetAsync(packed, 0, static_cast<size_t>(m) * sizeof(unsigned long long), stream);
  const int64_t blocks = std::min<int64_t>(64, (V + 8191) / 8192);
  ArgmaxKernel<<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(m)), 256, 0, stream>>>(logits, V, packed);
}

void FillUniformF32(float* p, int64_t count, float lo, float hi, uint64_t seed, cudaStream_t stream) {
  if (count <= 0) return;
  FillF32Kernel<<<Blocks(count, 256) > 4096 ? 4096 : Blocks(count, 256), 256, 0, stream>>>(p, count, lo, hi, seed);
}
void FillUniformBf16(__nv_bfloat16* p, int64_t count, float amp, uint64_t seed, cudaStream_t stream) {
  if (count <= 0) return;
  FillBf16Kernel<<<Blocks(count, 256) > 4096 ? 4096 : Blocks(count, 256), 256, 0, stream>>>(p, count, amp, seed);
}
void FillFp8(uint8_t* p, int64_t count, uint64_t seed, cudaStream_t stream) {
  if (count <= 0) return;
  FillFp8Kernel<<<Blocks(count, 256) > 4096 ? 4096 : Blocks(count, 256), 256, 0, stream>>>(p, count, seed);
}
void FillInt32Mod(int32_t* p, int64_t count, int32_t mod, uint64_t seed, cudaStream_t stream) {
  if (count <= 0) return;
  FillI32Kernel<<<Blocks(count, 256) > 4096 ? 4096 : Blocks(count, 256), 256, 0, stream>>>(p, count, mod, seed);
}
void ConvertF32ToBf16(const float* src, __nv_bfloat16* dst, int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  ConvertKernel<<<Blocks(count, 256) > 4096 ? 4096 : Blocks(count, 256), 256, 0, stream>>>(src, dst, count);
}

}  // namespace numoe::cuda
