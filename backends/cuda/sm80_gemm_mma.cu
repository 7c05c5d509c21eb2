// Tensor-core GEMM for BF16 and FP8-block weights (weight-only: FP8 codes are scaled and widened to bf16 in
// registers), fp32 activations rounded to bf16, fp32 accumulation. mma.sync m16n8k16 needs sm_80+, which
// covers every architecture we build (80, 86, 90).
//
// Layout: a warp owns 16 output rows (weight rows) and 8·NFRAG rows of x. The weight is the A operand and
// is read straight from global memory: lane (g = lane/4, t = lane%4) reads a contiguous run of 32 weights of
// rows g and g+8 at k0 + 32t. The k order inside a 128-wide chunk is permuted consistently for A and B (a
// dot product does not care), so that run covers the lane's A fragments of all 8 k-steps: k-step s uses run
// elements [4s, 4s+4) as fragment columns {2t, 2t+1, 2t+8, 2t+9}, and the lane loads x at the same
// physical k for its B fragment. No shared memory, 16-byte weight loads, one pass over the weights.
// That kernel serves passes of up to kMmaNarrowRows rows (decode); wider passes use GemmMmaWideKernel below.
#include <cuda_bf16.h>

#include <algorithm>

#include "backends/cuda/device_util.cuh"
#include "backends/cuda/kernels.h"

namespace numoe::cuda {
namespace {

constexpr int kChunk = 128;  // k per iteration per warp (32 per lane)
constexpr int kWarps = 4;

// The raw bytes of one lane's 32-weight run of one row.
template <WType WT>
struct Raw;
template <>
struct Raw<WType::kFP8> {
  uint4 v[2];
};
template <>
struct Raw<WType::kBF16> {
  uint4 v[4];
};

template <WType WT>
__device__ __forceinline__ void LoadRaw(const DevW& w, int64_t row, int64_t k, Raw<WT>& r) {
  const uint4* p = reinterpret_cast<const uint4*>(static_cast<const char*>(w.data) + (row * w.in + k) * (WT == WType::kFP8 ? 1 : 2));
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(Raw<WT>) / 16); ++i) r.v[i] = __ldg(p + i);
}

// Raw run -> 16 packed bf16 pairs (element 2i in the low half).
__device__ __forceinline__ void Convert(const Raw<WType::kBF16>& r, float, uint32_t (&out)[16]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[4 * i + 0] = r.v[i].x;
    out[4 * i + 1] = r.v[i].y;
    out[4 * i + 2] = r.v[i].z;
    out[4 * i + 3] = r.v[i].w;
  }
}
// FP8 E4M3 -> bf16 pairs with integer ops: the 7 magnitude bits of a code, shifted left by 4, are a bf16 whose
// value is the code's times 2^-120 (subnormal codes included), so one bf16x2 multiply by scale·2^120 finishes
// the job; ~2 instructions per weight instead of ~6 through fp32. Bytes (b0, b2) and (b1, b3) of a word form the
// two pairs, so the k order inside a run is permuted the same way for x (see LoadX).
__device__ __forceinline__ uint32_t Fp8PairBits(uint32_t x) {  // x = two codes in bits 0-7 and 16-23
  return ((x << 8) & 0x80008000u) | ((x << 4) & 0x07F007F0u);
}
__device__ __forceinline__ void Convert(const Raw<WType::kFP8>& r, float scale, uint32_t (&out)[16]) {
  if (!(scale < 0x1p7f)) {  // scale·2^120 would overflow bf16: widen through fp32 instead (same pair order)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t words[4] = {r.v[i].x, r.v[i].y, r.v[i].z, r.v[i].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t b = words[j];
        out[8 * i + 2 * j] = PackBf16(Fp8ToF32(b & 0xFF) * scale, Fp8ToF32((b >> 16) & 0xFF) * scale);
        out[8 * i + 2 * j + 1] = PackBf16(Fp8ToF32((b >> 8) & 0xFF) * scale, Fp8ToF32(b >> 24) * scale);
      }
    }
    return;
  }
  const __nv_bfloat162 s2 = __float2bfloat162_rn(scale * 0x1p120f);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t words[4] = {r.v[i].x, r.v[i].y, r.v[i].z, r.v[i].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t even = Fp8PairBits(words[j]), odd = Fp8PairBits(words[j] >> 8);
      __nv_bfloat162 e = *reinterpret_cast<const __nv_bfloat162*>(&even);
      __nv_bfloat162 o = *reinterpret_cast<const __nv_bfloat162*>(&odd);
      e = __hmul2(e, s2);
      o = __hmul2(o, s2);
      out[8 * i + 2 * j] = *reinterpret_cast<const uint32_t*>(&e);
      out[8 * i + 2 * j + 1] = *reinterpret_cast<const uint32_t*>(&o);
    }
  }
}

// Element-wise (tails, unaligned shapes, scale blocks not aligned to the run), in the same pair order as
// Convert: natural pairs (2i, 2i+1) for BF16; (4s + q, 4s + q + 2) for word 2s + q with FP8.
template <WType WT>
__device__ __forceinline__ void LoadSlow(const DevW& w, int64_t row, bool valid, int64_t k, int64_t k_end,
                                         uint32_t (&out)[16]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    int64_t ka, kb;
    if constexpr (WT == WType::kFP8) {
      ka = k + 4 * (i >> 1) + (i & 1);
      kb = ka + 2;
    } else {
      ka = k + 2 * i;
      kb = ka + 1;
    }
    const float a = (valid && ka < k_end) ? LoadWElem(w, row, ka) : 0.0f;
    const float b = (valid && kb < k_end) ? LoadWElem(w, row, kb) : 0.0f;
    out[i] = PackBf16(a, b);
  }
}

template <WType WT, int NFRAG>
__global__ void __launch_bounds__(kWarps * 32) GemmMmaKernel(GemmCall c, DevW w, int ksplit, int64_t kspan,
                                                             bool fast_ok, bool x_vec) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int grp = blockIdx.z / ksplit, kz = blockIdx.z % ksplit;
  const int64_t o_base = static_cast<int64_t>(blockIdx.x) * (kWarps * 16) + warp * 16;
  const int64_t n_base = static_cast<int64_t>(blockIdx.y) * (8 * NFRAG);
  if (o_base >= w.out) return;
  const int64_t grow = static_cast<int64_t>(grp) * w.out;
  const bool va = o_base + g < w.out, vb = o_base + g + 8 < w.out;
  const int64_t ra = grow + o_base + g, rb = ra + 8;
  const float* x = c.x + grp * c.x_group_cols;
  float* y = c.y + grp * c.y_group_cols;
  const int64_t k_begin = kz * kspan, k_end = min(w.in, k_begin + kspan);

  float acc[NFRAG][4];
#pragma unroll
  for (int f = 0; f < NFRAG; ++f) acc[f][0] = acc[f][1] = acc[f][2] = acc[f][3] = 0.0f;

  auto scale_of = [&](int64_t row, int64_t k) -> float {
    if constexpr (WT == WType::kFP8) {
      return w.scale[((w.row_base + row) / w.bo) * w.scale_cols + (w.col_base + k) / w.bi];
    } else {
      return 1.0f;
    }
  };
  auto full = [&](int64_t k) { return fast_ok && k + 32 <= k_end; };

  Raw<WT> cur_a, cur_b, nxt_a, nxt_b;
  {
    const int64_t kl = k_begin + 32 * t;
    if (full(kl)) {
      LoadRaw<WT>(w, va ? ra : grow, kl, cur_a);
      LoadRaw<WT>(w, vb ? rb : grow, kl, cur_b);
    }
  }
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kChunk) {
    const int64_t kl = k0 + 32 * t, kn = kl + kChunk;
    if (k0 + kChunk < k_end && full(kn)) {
      LoadRaw<WT>(w, va ? ra : grow, kn, nxt_a);
      LoadRaw<WT>(w, vb ? rb : grow, kn, nxt_b);
    }
    uint32_t wa[16], wb[16];
    if (full(kl)) {
      Convert(cur_a, va ? scale_of(ra, kl) : 0.0f, wa);
      Convert(cur_b, vb ? scale_of(rb, kl) : 0.0f, wb);
      if (!va) {
#pragma unroll
        for (int i = 0; i < 16; ++i) wa[i] = 0;
      }
      if (!vb) {
#pragma unroll
        for (int i = 0; i < 16; ++i) wb[i] = 0;
      }
    } else {
      LoadSlow<WT>(w, ra, va, kl, k_end, wa);
      LoadSlow<WT>(w, rb, vb, kl, k_end, wb);
    }
#pragma unroll
    for (int f = 0; f < NFRAG; ++f) {
      const int64_t nn = n_base + f * 8 + g;
      const bool vx = nn < c.n;
      const float* xr = x + nn * c.ldx;
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        const int64_t k = kl + 4 * s;
        float4 xv;
        if (vx && x_vec && k + 4 <= k_end) {
          xv = __ldg(reinterpret_cast<const float4*>(xr + k));
        } else {
          xv.x = (vx && k < k_end) ? xr[k] : 0.0f;
          xv.y = (vx && k + 1 < k_end) ? xr[k + 1] : 0.0f;
          xv.z = (vx && k + 2 < k_end) ? xr[k + 2] : 0.0f;
          xv.w = (vx && k + 3 < k_end) ? xr[k + 3] : 0.0f;
        }
        if constexpr (WT == WType::kFP8) {  // the weight pairs are (k, k+2) and (k+1, k+3): see Convert
          const float t = xv.y;
          xv.y = xv.z;
          xv.z = t;
        }
        const uint32_t h0 = PackBf16(xv.x, xv.y), h1 = PackBf16(xv.z, xv.w);
        Mma(acc[f], wa[2 * s], wb[2 * s], wa[2 * s + 1], wb[2 * s + 1], h0, h1);
        if (c.split_x) {
          const float2 r0 = Bf16PairToF32(h0), r1 = Bf16PairToF32(h1);
          Mma(acc[f], wa[2 * s], wb[2 * s], wa[2 * s + 1], wb[2 * s + 1], PackBf16(xv.x - r0.x, xv.y - r0.y),
              PackBf16(xv.z - r1.x, xv.w - r1.y));
        }
      }
    }
    cur_a = nxt_a;
    cur_b = nxt_b;
  }

#pragma unroll
  for (int f = 0; f < NFRAG; ++f) {
    const int64_t n0 = n_base + f * 8 + 2 * t;
    const int64_t oa = o_base + g, ob = oa + 8;
    const float vals[4] = {acc[f][0], acc[f][1], acc[f][2], acc[f][3]};
    const int64_t os[4] = {oa, oa, ob, ob};
    const int64_t ns[4] = {n0, n0 + 1, n0, n0 + 1};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (os[i] < w.out && ns[i] < c.n) {
        float* dst = &y[ns[i] * c.ldy + os[i]];
        if (ksplit > 1) {
          atomicAdd(dst, vals[i]);
        } else {
          *dst = vals[i];
        }
      }
    }
  }
}

// ---- wide passes (17..~256 rows: speculative verify, prefill chunks) --------------------------------------
//
// The kernel above gives every warp its own copy of x, loaded from global memory and split into bf16 hi/lo
// fragments per warp: fine for 8-16 rows, but at 32+ rows those loads and conversions dominate and each
// 32-row tile re-streams the weights. Here a block of 8 warps (128 weight rows, each warp's A fragments still
// read straight from global memory as above) shares x: per 128-wide k chunk the block converts 8·NF rows of x
// once into packed bf16 fragments in shared memory (one 16-byte {hi0, hi1, lo0, lo1} per lane and k-step,
// conflict-free reads) and every warp runs its mma over all of them. The n tiles are the fastest grid
// dimension, so the blocks sharing one weight tile run together and only the first reads it from HBM.
constexpr int kWideWarps = 8;

template <WType WT, int NF>
__global__ void __launch_bounds__(kWideWarps * 32) GemmMmaWideKernel(GemmCall c, DevW w, int ksplit, int64_t kspan,
                                                                     bool fast_ok, bool x_vec) {
  __shared__ uint4 xs[NF * 8 * 32];  // [f][s][lane]
  constexpr int kLoads = NF;         // float4s of x per thread per chunk: 8·NF rows x 32 float4 / 256 threads
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int grp = blockIdx.z / ksplit, kz = blockIdx.z % ksplit;
  const int64_t n_base = static_cast<int64_t>(blockIdx.x) * (8 * NF);
  const int64_t o_base = static_cast<int64_t>(blockIdx.y) * (kWideWarps * 16) + warp * 16;
  const bool active = o_base < w.out;  // idle warps still stage x and meet the barriers
  const int64_t grow = static_cast<int64_t>(grp) * w.out;
  const bool va = o_base + g < w.out, vb = o_base + g + 8 < w.out;
  const int64_t ra = grow + o_base + g, rb = ra + 8;
  const float* x = c.x + grp * c.x_group_cols;
  float* y = c.y + grp * c.y_group_cols;
  const int64_t k_begin = kz * kspan, k_end = min(w.in, k_begin + kspan);
  const bool split = c.split_x;

  float acc[NF][4];
#pragma unroll
  for (int f = 0; f < NF; ++f) acc[f][0] = acc[f][1] = acc[f][2] = acc[f][3] = 0.0f;

  // Thread tid stages float4s i = tid + 256·j: row i / 32 of the tile, lane run t' = i % 4, k-step s' = i / 4 % 8,
  // i.e. x[row, k0 + 32 t' + 4 s' ...]: a warp reads one row's 512 contiguous bytes.
  float4 xr[kLoads];
  auto load_x = [&](int64_t k0) {
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int i = tid + kWideWarps * 32 * j;
      const int64_t nn = n_base + (i >> 5);
      const int64_t k = k0 + 32 * (i & 3) + 4 * ((i >> 2) & 7);
      const bool vx = nn < c.n;
      const float* xrow = x + nn * c.ldx;
      if (vx && x_vec && k + 4 <= k_end) {
        xr[j] = __ldg(reinterpret_cast<const float4*>(xrow + k));
      } else {
        xr[j].x = (vx && k < k_end) ? xrow[k] : 0.0f;
        xr[j].y = (vx && k + 1 < k_end) ? xrow[k + 1] : 0.0f;
        xr[j].z = (vx && k + 2 < k_end) ? xrow[k + 2] : 0.0f;
        xr[j].w = (vx && k + 3 < k_end) ? xrow[k + 3] : 0.0f;
      }
    }
  };
  auto store_x = [&]() {
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int i = tid + kWideWarps * 32 * j;
      const int row = i >> 5, tt = i & 3, ss = (i >> 2) & 7;
      float4 v = xr[j];
      if constexpr (WT == WType::kFP8) {  // same pair order as the weights (see Convert)
        const float tmp = v.y;
        v.y = v.z;
        v.z = tmp;
      }
      uint4 packed;
      packed.x = PackBf16(v.x, v.y);
      packed.y = PackBf16(v.z, v.w);
      packed.z = packed.w = 0;
      if (split) {
        const float2 r0 = Bf16PairToF32(packed.x), r1 = Bf16PairToF32(packed.y);
        packed.z = PackBf16(v.x - r0.x, v.y - r0.y);
        packed.w = PackBf16(v.z - r1.x, v.w - r1.y);
      }
      xs[((row >> 3) * 8 + ss) * 32 + (row & 7) * 4 + tt] = packed;
    }
  };

  auto scale_of = [&](int64_t row, int64_t k) -> float {
    if constexpr (WT == WType::kFP8) {
      return w.scale[((w.row_base + row) / w.bo) * w.scale_cols + (w.col_base + k) / w.bi];
    } else {
      return 1.0f;
    }
  };
  auto full = [&](int64_t k) { return fast_ok && k + 32 <= k_end; };

  Raw<WT> cur_a, cur_b, nxt_a, nxt_b;
  if (active) {
    const int64_t kl = k_begin + 32 * t;
    if (full(kl)) {
      LoadRaw<WT>(w, va ? ra : grow, kl, cur_a);
      LoadRaw<WT>(w, vb ? rb : grow, kl, cur_b);
    }
  }
  load_x(k_begin);
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kChunk) {
    const int64_t kl = k0 + 32 * t, kn = kl + kChunk;
    const bool more = k0 + kChunk < k_end;
    if (active && more && full(kn)) {
      LoadRaw<WT>(w, va ? ra : grow, kn, nxt_a);
      LoadRaw<WT>(w, vb ? rb : grow, kn, nxt_b);
    }
    __syncthreads();  // every warp is done with the previous chunk's x
    store_x();
    __syncthreads();
    if (more) load_x(k0 + kChunk);  // in flight during this chunk's mma
    if (active) {
      uint32_t wa[16], wb[16];
      if (full(kl)) {
        Convert(cur_a, va ? scale_of(ra, kl) : 0.0f, wa);
        Convert(cur_b, vb ? scale_of(rb, kl) : 0.0f, wb);
        if (!va) {
#pragma unroll
          for (int i = 0; i < 16; ++i) wa[i] = 0;
        }
        if (!vb) {
#pragma unroll
          for (int i = 0; i < 16; ++i) wb[i] = 0;
        }
      } else {
        LoadSlow<WT>(w, ra, va, kl, k_end, wa);
        LoadSlow<WT>(w, rb, vb, kl, k_end, wb);
      }
#pragma unroll
      for (int f = 0; f < NF; ++f) {
#pragma unroll
        for (int s = 0; s < 8; ++s) {
          const uint4 v = xs[(f * 8 + s) * 32 + lane];
          Mma(acc[f], wa[2 * s], wb[2 * s], wa[2 * s + 1], wb[2 * s + 1], v.x, v.y);
          if (split) Mma(acc[f], wa[2 * s], wb[2 * s], wa[2 * s + 1], wb[2 * s + 1], v.z, v.w);
        }
      }
    }
    cur_a = nxt_a;
    cur_b = nxt_b;
  }
  if (!active) return;

#pragma unroll
  for (int f = 0; f < NF; ++f) {
    const int64_t n0 = n_base + f * 8 + 2 * t;
    const int64_t oa = o_base + g, ob = oa + 8;
    const float vals[4] = {acc[f][0], acc[f][1], acc[f][2], acc[f][3]};
    const int64_t os[4] = {oa, oa, ob, ob};
    const int64_t ns[4] = {n0, n0 + 1, n0, n0 + 1};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (os[i] < w.out && ns[i] < c.n) {
        float* dst = &y[ns[i] * c.ldy + os[i]];
        if (ksplit > 1) {
          atomicAdd(dst, vals[i]);
        } else {
          *dst = vals[i];
        }
      }
    }
  }
}

template <WType WT>
void Launch(const GemmCall& c, int ksplit, int64_t kspan, bool fast_ok, bool x_vec, cudaStream_t stream) {
  const DevW& w = *c.w;
  if (c.n > kMmaNarrowRows) {
    const int64_t tn = MmaWideRowTile(c.n);
    const dim3 grid(static_cast<unsigned>((c.n + tn - 1) / tn),
                    static_cast<unsigned>((w.out + kMmaWideOutTile - 1) / kMmaWideOutTile),
                    static_cast<unsigned>(c.groups * ksplit));
    if (tn == 32) {
      GemmMmaWideKernel<WT, 4><<<grid, kWideWarps * 32, 0, stream>>>(c, w, ksplit, kspan, fast_ok, x_vec);
    } else {
      GemmMmaWideKernel<WT, 8><<<grid, kWideWarps * 32, 0, stream>>>(c, w, ksplit, kspan, fast_ok, x_vec);
    }
    return;
  }
  const int nfrag = c.n <= 8 ? 1 : 2;
  const dim3 grid(static_cast<unsigned>((w.out + kWarps * 16 - 1) / (kWarps * 16)),
                  static_cast<unsigned>((c.n + 8 * nfrag - 1) / (8 * nfrag)), static_cast<unsigned>(c.groups * ksplit));
  if (nfrag == 1) {
    GemmMmaKernel<WT, 1><<<grid, kWarps * 32, 0, stream>>>(c, w, ksplit, kspan, fast_ok, x_vec);
  } else {
    GemmMmaKernel<WT, 2><<<grid, kWarps * 32, 0, stream>>>(c, w, ksplit, kspan, fast_ok, x_vec);
  }
}

}  // namespace

void GemmMma(const GemmCall& c, int ksplit, cudaStream_t stream) {
  const DevW& w = *c.w;
  const int64_t per = (w.in + ksplit - 1) / ksplit;
  const int64_t kspan = (per + kChunk - 1) / kChunk * kChunk;
  const int64_t elems16 = 16 / WTypeBytes(w.type);  // elements per 16-byte load
  // 16-byte weight loads need every row start aligned; an FP8 run must sit inside one scale block.
  bool fast_ok = (w.in % elems16 == 0) && (reinterpret_cast<uintptr_t>(w.data) % 16 == 0);
  if (w.type == WType::kFP8) fast_ok = fast_ok && w.bi % 32 == 0 && w.col_base % 32 == 0;
  const bool x_vec = c.ldx % 4 == 0 && c.x_group_cols % 4 == 0 && reinterpret_cast<uintptr_t>(c.x) % 16 == 0;
  if (w.type == WType::kFP8) {
    Launch<WType::kFP8>(c, ksplit, kspan, fast_ok, x_vec, stream);
  } else {
    Launch<WType::kBF16>(c, ksplit, kspan, fast_ok, x_vec, stream);
  }
}

}  // namespace numoe::cuda
