// Weight-streaming tensor-core GEMM for decode-sized passes (2..kStreamMaxRows rows of x) on FP8-block or BF16
// weights: the path the GEMM launcher (gemm.cu) takes between the one-row GEMV and the wide mma kernel.
//
// Swap AB: the weights are the mma's A operand (16 output features per m16n8k16), the few rows of x its B
// operand (8 per fragment), so at 8 rows every column of the mma is used. A block of 8 warps owns a tile of
// kStreamWarps·16·R weight rows (R = 2 row tiles per warp, 1 at 64 rows of x) and streams it through a ring of
// `stages` shared-memory buffers with cp.async, 128 bytes of every row per stage (FP8: 128 k, BF16: 64 k),
// 16-byte copies whose 16-byte pieces are XOR-swizzled by row so that the fragment reads are conflict free.
// x (the block's k range of its rows, all of them) is converted once per block to bf16 fragments in shared
// memory; a block then walks several output tiles of its k range (grid.x blocks per k range and group), so x
// is read from L2 once per block, not once per tile.
//
// Numbers: FP8 codes become bf16 exactly (sign and 7 magnitude bits moved into place give the code times
// 2^-120, one bf16x2 multiply by 2^120 rebases it, subnormal codes included: the same instructions on sm_80,
// sm_86 and sm_90, so the H200 times the Ampere path); the block scale multiplies each 128-k chunk's fp32
// partial sums, so the weights are exact. x is a bf16 hi/lo pair (2^-17, two mma per k step) when
// GemmCall::split_x asks for it, else one bf16 (2^-9). The hi/lo split is needed for the goldens: the
// checkpoints' block scales are powers of two (E8M0), so the older kernels' bf16 scale·code was exact too and
// their only error was x's 2^-17; with x rounded once, tiny-v4's bf16-mode goldens with FP8 weights failed
// (logits off by 0.9 at prefill, 5.9 after steps, against 5e-2) and the hidden states drifted 2.5x as far.
// fp32 accumulation; split-K adds with atomics.
//
// The k order inside a lane's run is permuted the same way for weights and x, as in sm80_gemm_mma.cu: lane
// (g = lane/4, t = lane%4) reads bytes [32t, 32t + 32) of rows g and g + 8 of a 16-row tile, and k step s
// uses run elements [4s, 4s + 4) as fragment columns {2t, 2t+1, 2t+8, 2t+9} (FP8 bytes pair as (0, 2), (1, 3)).
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "backends/cuda/device_util.cuh"
#include "backends/cuda/kernels.h"

namespace numoe::cuda {
namespace {

constexpr int kStreamWarps = 8;
constexpr int kStreamThreads = kStreamWarps * 32;
constexpr int kRowBytes = 128;  // bytes of each weight row per stage

template <int NF>
__host__ __device__ constexpr int RowTiles() {
  return NF >= 8 ? 1 : 2;  // 16-row mma tiles per warp (registers: 4·R·NF accumulators, twice for FP8)
}
__host__ __device__ constexpr int TileRows(int nf) { return kStreamWarps * 16 * (nf >= 8 ? 1 : 2); }
__host__ __device__ constexpr int ChunkK(WType t) { return t == WType::kFP8 ? 128 : 64; }
__host__ __device__ constexpr int Frags(int64_t n) { return n <= 8 ? 1 : n <= 16 ? 2 : n <= 32 ? 4 : 8; }

struct StreamArgs {
  DevW w;
  const float* x = nullptr;
  int64_t ldx = 0, x_group_cols = 0;
  float* y = nullptr;
  int64_t ldy = 0, y_group_cols = 0;
  int n = 0;
  int64_t kspan = 0;   // k per block (multiple of the chunk)
  int tiles = 0;       // output tiles per group
  int stages = 0;      // weight buffers in the ring (2..4)
  bool x_vec = false;  // x rows 16-byte aligned
  bool atomic = false; // split-K: add into a zeroed y
};

__device__ __forceinline__ uint32_t Fp8PairToBf16(uint32_t x) {  // codes in bits 0-7 and 16-23 -> exact bf16x2
  const uint32_t bits = ((x << 8) & 0x80008000u) | ((x << 4) & 0x07F007F0u);
  constexpr uint32_t kRebase = 0x7B807B80u;  // bf16 2^120 twice
  const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits),
                                   *reinterpret_cast<const __nv_bfloat162*>(&kRebase));
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <int N>
__device__ __forceinline__ void CpAsyncWaitUpTo(int pending) {  // wait_group needs a constant
  if constexpr (N == 0) {
    CpAsyncWait<0>();
  } else {
    if (pending >= N) {
      CpAsyncWait<N>();
    } else {
      CpAsyncWaitUpTo<N - 1>(pending);
    }
  }
}

template <WType WT, int NF, bool SPLIT>
__global__ void __launch_bounds__(kStreamThreads, 1) GemmStreamKernel(StreamArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int C = ChunkK(WT);
  constexpr int kSteps = C / 16;  // k steps per chunk
  constexpr int L = C / 4;        // run length of a lane (elements)
  constexpr int R = RowTiles<NF>();
  constexpr int kTile = kStreamWarps * 16 * R;
  constexpr int kStage = kTile * kRowBytes;
  constexpr int kCopies = kTile * (kRowBytes / 16) / kStreamThreads;  // 16-byte copies per thread and stage
  constexpr int kWBytes = WT == WType::kFP8 ? 1 : 2;
  const DevW& w = a.w;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int kz = blockIdx.y, grp = blockIdx.z;
  const int64_t k_begin = kz * a.kspan, k_end = min(w.in, k_begin + a.kspan);
  if (k_begin >= k_end) return;
  const int nchunks = static_cast<int>((k_end - k_begin) / C);
  const int my_tiles = (a.tiles - static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - 1) / static_cast<int>(gridDim.x);
  if (my_tiles <= 0) return;
  const int total = my_tiles * nchunks;
  const int64_t grow = static_cast<int64_t>(grp) * w.out;
  const char* wdata = static_cast<const char*>(w.data);
  unsigned char* wsm = smem;
  unsigned char* xsm = smem + a.stages * kStage;

  // ---- producer: stage p = (my tile p / nchunks, chunk p % nchunks) into buffer p % stages
  auto issue = [&](int p) {
    if (p < total) {
      const int ti = p / nchunks, ci = p - ti * nchunks;
      const int64_t o0 = (static_cast<int64_t>(blockIdx.x) + static_cast<int64_t>(ti) * gridDim.x) * kTile;
      const int64_t k0 = k_begin + static_cast<int64_t>(ci) * C;
      unsigned char* dst = wsm + (p % a.stages) * kStage;
#pragma unroll
      for (int j = 0; j < kCopies; ++j) {
        const int id = tid + kStreamThreads * j, row = id >> 3, pc = id & 7;
        const bool valid = o0 + row < w.out;
        const char* src = wdata + ((grow + (valid ? o0 + row : 0)) * w.in + k0) * kWBytes + pc * 16;
        CpAsync16(dst + row * kRowBytes + ((pc ^ (row & 7)) << 4), src, valid);
      }
    }
    CpAsyncCommit();  // (empty groups keep the count uniform)
  };
  for (int p = 0; p < a.stages - 1; ++p) issue(p);

  // ---- x: the block's k range of all 8·NF rows as bf16 B fragments, converted once (during the first tile,
  // one chunk ahead of the mma: loaded before a chunk's math, stored after it)
  constexpr int kXq = 2 * NF * C;                                      // float4s of x per chunk
  constexpr int kXu = (kXq + kStreamThreads - 1) / kStreamThreads;     // per thread
  const float* xg = a.x + grp * a.x_group_cols + k_begin;
  float4 xr[kXu];
  auto load_x = [&](int chunk) {
#pragma unroll
    for (int u = 0; u < kXu; ++u) {
      const int i = tid + kStreamThreads * u, row = i / (C / 4), q = i % (C / 4);
      xr[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (i < kXq && row < a.n) {
        const float* src = xg + row * a.ldx + chunk * C + 4 * q;
        if (a.x_vec) {
          xr[u] = __ldg(reinterpret_cast<const float4*>(src));
        } else {
          xr[u] = make_float4(src[0], src[1], src[2], src[3]);
        }
      }
    }
  };
  auto store_x = [&](int chunk) {
#pragma unroll
    for (int u = 0; u < kXu; ++u) {
      const int i = tid + kStreamThreads * u, row = i / (C / 4), q = i % (C / 4);
      if (i >= kXq) break;
      const int f = row >> 3, ln = (row & 7) * 4 + (4 * q) / L, s = (4 * q) % L / 4;
      const float4 v = xr[u];
      float2 p0, p1;
      if constexpr (WT == WType::kFP8) {  // the weight pairs are (k, k+2) and (k+1, k+3)
        p0 = make_float2(v.x, v.z);
        p1 = make_float2(v.y, v.w);
      } else {
        p0 = make_float2(v.x, v.y);
        p1 = make_float2(v.z, v.w);
      }
      const uint32_t b0 = PackBf16(p0.x, p0.y), b1 = PackBf16(p1.x, p1.y);
      if constexpr (SPLIT) {
        const float2 r0 = Bf16PairToF32(b0), r1 = Bf16PairToF32(b1);
        reinterpret_cast<uint4*>(xsm)[((chunk * NF + f) * kSteps + s) * 32 + ln] =
            make_uint4(b0, b1, PackBf16(p0.x - r0.x, p0.y - r0.y), PackBf16(p1.x - r1.x, p1.y - r1.y));
      } else {
        reinterpret_cast<uint2*>(xsm)[(((chunk * NF + f) * (kSteps / 2) + (s >> 1)) * 32 + ln) * 2 + (s & 1)] =
            make_uint2(b0, b1);
      }
    }
  };
  load_x(0);
  store_x(0);

  float acc[R][NF][4];
  float part[WT == WType::kFP8 ? R : 1][NF][4];
#pragma unroll
  for (int j = 0; j < R; ++j)
#pragma unroll
    for (int f = 0; f < NF; ++f)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][f][i] = 0.0f;
#pragma unroll
  for (int j = 0; j < (WT == WType::kFP8 ? R : 1); ++j)
#pragma unroll
    for (int f = 0; f < NF; ++f)
#pragma unroll
      for (int i = 0; i < 4; ++i) part[j][f][i] = 0.0f;
  // This warp's FP8 scale rows (row block of each 16-row tile; null: the tile is past the end) in the tile at work.
  [[maybe_unused]] const float* srow[R];
  int ti = 0, ci = 0;
  auto tile_rows = [&](int tile_i) {
    const int64_t o0 = (static_cast<int64_t>(blockIdx.x) + static_cast<int64_t>(tile_i) * gridDim.x) * kTile;
    if constexpr (WT == WType::kFP8) {
#pragma unroll
      for (int j = 0; j < R; ++j) {
        const int64_t o = o0 + warp * 16 * R + j * 16;
        srow[j] = o < w.out ? w.scale + ((w.row_base + grow + o) / w.bo) * w.scale_cols : nullptr;
      }
    }
    return o0;
  };
  int64_t o0 = tile_rows(0);

  for (int p = 0; p < total; ++p) {
    CpAsyncWaitUpTo<2>(a.stages - 2);
    __syncthreads();  // stage p (and x) visible to all; buffer (p - 1) % stages free
    issue(p + a.stages - 1);

    const bool stage_x = ti == 0 && ci + 1 < nchunks;
    if (stage_x) load_x(ci + 1);  // in flight during this chunk's math
    const unsigned char* st = wsm + (p % a.stages) * kStage;
    const int64_t k0 = k_begin + static_cast<int64_t>(ci) * C;
    [[maybe_unused]] float scale[R];
    if constexpr (WT == WType::kFP8) {
      const int kb = static_cast<int>(w.col_base + k0) / w.bi;
#pragma unroll
      for (int j = 0; j < R; ++j) scale[j] = srow[j] != nullptr ? __ldg(srow[j] + kb) : 0.0f;
    }
    // A: lane's 32-byte runs of rows g and g + 8 of each row tile.
    uint4 ra[R][2][2];  // [tile][row g / g+8][piece]
#pragma unroll
    for (int j = 0; j < R; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = warp * 16 * R + j * 16 + g + 8 * h;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          ra[j][h][q] = *reinterpret_cast<const uint4*>(st + row * kRowBytes + (((2 * t + q) ^ (row & 7)) << 4));
        }
      }
    }
#pragma unroll
    for (int sp = 0; sp < kSteps / 2; ++sp) {
      [[maybe_unused]] uint4 bp[NF];  // two k steps of x per 16-byte read (unsplit x)
      if constexpr (!SPLIT) {
#pragma unroll
        for (int f = 0; f < NF; ++f) bp[f] = reinterpret_cast<const uint4*>(xsm)[((ci * NF + f) * (kSteps / 2) + sp) * 32 + lane];
      }
#pragma unroll
      for (int s2 = 0; s2 < 2; ++s2) {
        const int s = 2 * sp + s2;
        uint32_t b[NF][4];  // hi0, hi1 (lo0, lo1)
#pragma unroll
        for (int f = 0; f < NF; ++f) {
          if constexpr (SPLIT) {
            const uint4 v = reinterpret_cast<const uint4*>(xsm)[((ci * NF + f) * kSteps + s) * 32 + lane];
            b[f][0] = v.x, b[f][1] = v.y, b[f][2] = v.z, b[f][3] = v.w;
          } else {
            const uint4& v = bp[f];
            b[f][0] = s2 ? v.z : v.x;
            b[f][1] = s2 ? v.w : v.y;
          }
        }
#pragma unroll
        for (int j = 0; j < R; ++j) {
          uint32_t a0, a1, a2, a3;
          if constexpr (WT == WType::kFP8) {
            // word s of the 32-byte run
            const uint4& qa = ra[j][0][s >> 2];
            const uint4& qb = ra[j][1][s >> 2];
            const uint32_t wa = (s & 3) == 0 ? qa.x : (s & 3) == 1 ? qa.y : (s & 3) == 2 ? qa.z : qa.w;
            const uint32_t wb = (s & 3) == 0 ? qb.x : (s & 3) == 1 ? qb.y : (s & 3) == 2 ? qb.z : qb.w;
            a0 = Fp8PairToBf16(wa);
            a2 = Fp8PairToBf16(wa >> 8);
            a1 = Fp8PairToBf16(wb);
            a3 = Fp8PairToBf16(wb >> 8);
          } else {
            // words 2s, 2s + 1 of the run: piece s / 2, words (s % 2)·2 ..
            const uint4& qa = ra[j][0][s >> 1];
            const uint4& qb = ra[j][1][s >> 1];
            a0 = (s & 1) ? qa.z : qa.x;
            a2 = (s & 1) ? qa.w : qa.y;
            a1 = (s & 1) ? qb.z : qb.x;
            a3 = (s & 1) ? qb.w : qb.y;
          }
#pragma unroll
          for (int f = 0; f < NF; ++f) {
            if constexpr (WT == WType::kFP8) {
              Mma(part[j][f], a0, a1, a2, a3, b[f][0], b[f][1]);
              if constexpr (SPLIT) Mma(part[j][f], a0, a1, a2, a3, b[f][2], b[f][3]);
            } else {
              Mma(acc[j][f], a0, a1, a2, a3, b[f][0], b[f][1]);
              if constexpr (SPLIT) Mma(acc[j][f], a0, a1, a2, a3, b[f][2], b[f][3]);
            }
          }
        }
      }
    }
    if constexpr (WT == WType::kFP8) {  // this chunk's block scale
#pragma unroll
      for (int j = 0; j < R; ++j)
#pragma unroll
        for (int f = 0; f < NF; ++f)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            acc[j][f][i] = fmaf(part[j][f][i], scale[j], acc[j][f][i]);
            part[j][f][i] = 0.0f;
          }
    }

    if (stage_x) store_x(ci + 1);  // published by the next iteration's barrier

    if (++ci == nchunks) {  // the tile is done: write it out
      float* y = a.y + grp * a.y_group_cols;
#pragma unroll
      for (int j = 0; j < R; ++j) {
#pragma unroll
        for (int f = 0; f < NF; ++f) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int64_t o = o0 + warp * 16 * R + j * 16 + g + (i >= 2 ? 8 : 0);
            const int nn = f * 8 + 2 * t + (i & 1);
            if (o < w.out && nn < a.n) {
              float* dst = y + nn * a.ldy + o;
              if (a.atomic) {
                atomicAdd(dst, acc[j][f][i]);
              } else {
                *dst = acc[j][f][i];
              }
            }
            acc[j][f][i] = 0.0f;
          }
        }
      }
      ci = 0;
      if (++ti < my_tiles) o0 = tile_rows(ti);
    }
  }
  CpAsyncWait<0>();  // (only empty groups can be left)
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int XBytesPerK(int nf, bool split) { return nf * 8 * 2 * (split ? 2 : 1); }

// Shared memory a block may use on the current device (cached per device).
int SmemOptin() {
  static std::atomic<int> cache[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  int v = cache[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) v = -1;
    cache[dev].store(v, std::memory_order_relaxed);
  }
  return v;
}

// Shared memory of one SM (cached per device).
int SmemPerSm() {
  static std::atomic<int> cache[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  int v = cache[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) != cudaSuccess) v = -1;
    cache[dev].store(v, std::memory_order_relaxed);
  }
  return v;
}

// NUMOE_GEMM_STREAM_BLOCKS_PER_SM=2: passes of up to 8 rows plan for two blocks per SM (their kernel's ~100
// registers a thread allow it), each in half the SM's shared memory: 16 warps instead of 8 to hide the mma and
// conversion latencies, a shallower ring and shorter k ranges. A variant for a device run to compare.
int BlocksPerSm(int nf) {
  static const int env = [] {
    const char* v = std::getenv("NUMOE_GEMM_STREAM_BLOCKS_PER_SM");
    return v != nullptr && std::strcmp(v, "2") == 0 ? 2 : 1;
  }();
  return nf == 1 ? env : 1;
}

bool Disabled() {
  static const bool off = [] {
    const char* v = std::getenv("NUMOE_GEMM_STREAM");
    return v != nullptr && std::strcmp(v, "0") == 0;
  }();
  return off;
}

template <WType WT, int NF, bool SPLIT>
cudaError_t LaunchStream(const StreamArgs& a, const StreamPlan& plan, cudaStream_t stream) {
  // The attribute is per device: set it once for each device this kernel runs on.
  static std::atomic<uint64_t> set_on{0};
  int dev = 0;
  cudaGetDevice(&dev);
  const uint64_t bit = 1ull << (dev & 63);
  if ((set_on.load(std::memory_order_relaxed) & bit) == 0) {
    const int optin = SmemOptin();
    const cudaError_t err =
        cudaFuncSetAttribute(GemmStreamKernel<WT, NF, SPLIT>, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
    if (err != cudaSuccess) return err;
    set_on.fetch_or(bit, std::memory_order_relaxed);
  }
  const dim3 grid(static_cast<unsigned>(plan.blocks), static_cast<unsigned>(plan.ksplit),
                  static_cast<unsigned>(plan.groups));
  GemmStreamKernel<WT, NF, SPLIT><<<grid, kStreamThreads, static_cast<size_t>(plan.smem_bytes), stream>>>(a);
  return cudaPeekAtLastError();  // (the caller checks the segment's error once; do not clear it here)
}

template <WType WT, bool SPLIT>
cudaError_t DispatchNf(const StreamArgs& a, const StreamPlan& plan, cudaStream_t stream) {
  switch (plan.frags) {
    case 1:
      return LaunchStream<WT, 1, SPLIT>(a, plan, stream);
    case 2:
      return LaunchStream<WT, 2, SPLIT>(a, plan, stream);
    case 4:
      return LaunchStream<WT, 4, SPLIT>(a, plan, stream);
    default:
      return LaunchStream<WT, 8, SPLIT>(a, plan, stream);
  }
}

}  // namespace

bool PlanGemmStream(const GemmCall& c, int sms, StreamPlan* plan) {
  const DevW& w = *c.w;
  if (Disabled() || c.n < kStreamMinRows || c.n > kStreamMaxRows || w.out <= 0 || c.groups < 1) return false;
  if (w.type != WType::kFP8 && w.type != WType::kBF16) return false;
  const int64_t C = ChunkK(w.type);
  // Whole chunks, 16-byte copies.
  if (w.in % C != 0 || reinterpret_cast<uintptr_t>(w.data) % 16 != 0) return false;
  if (w.type == WType::kFP8) {
    // A chunk inside one scale block column, a 16-row mma tile inside one scale block row.
    if (w.scale == nullptr || w.bi % C != 0 || w.col_base % C != 0 || w.bo % 16 != 0 || w.row_base % 16 != 0) return false;
    if (c.groups > 1 && w.out % 16 != 0) return false;
  }
  const bool split = c.split_x;
  const int nf = Frags(c.n);
  const int64_t stage = static_cast<int64_t>(TileRows(nf)) * kRowBytes;
  const int bps = BlocksPerSm(nf);
  int64_t optin = SmemOptin();
  if (optin <= 0) return false;
  if (bps > 1) optin = std::min<int64_t>(optin, SmemPerSm() / bps - 1024);  // (1 KiB per block is reserved)
  // The deepest ring (up to 4 buffers) that leaves room for at least 4 chunks of x.
  const int64_t xk = XBytesPerK(nf, split);
  int stages = 4;
  while (stages > 2 && optin - stages * stage < 4 * C * xk) --stages;
  const int64_t kspan_max = (optin - stages * stage) / xk / C * C;
  if (kspan_max < C) return false;
  const int64_t tiles = CeilDiv(w.out, TileRows(nf));
  // Split K (ks ranges of whole chunks) and spread each range's tiles over `per` blocks, one block per SM
  // (the ring and x take most of its shared memory): pick the split whose slowest block streams the fewest
  // chunks, counting one chunk for the pipeline's fill and one for the memset and atomics of a split.
  const int64_t chunks = w.in / C, slots = static_cast<int64_t>(sms) * bps;
  const int64_t ks_min = CeilDiv(w.in, kspan_max);
  const bool dense_y = c.groups == 1 ? c.ldy == w.out : (c.y_group_cols == w.out && c.ldy == w.out * c.groups);
  if (ks_min > 1 && !dense_y) return false;  // k does not fit x's buffer and y cannot take atomics
  int64_t best_cost = INT64_MAX, ksplit = 1, kspan = 0, per = 1;
  const int64_t ks_max = dense_y ? std::min<int64_t>(chunks, 4 * slots) : 1;
  for (int64_t ks = ks_min; ks <= ks_max; ++ks) {
    const int64_t span = CeilDiv(chunks, ks), real_ks = CeilDiv(chunks, span);
    if (real_ks != ks) continue;  // the same split as a smaller ks
    const int64_t p = std::clamp<int64_t>(slots / (ks * c.groups), 1, tiles);
    const int64_t waves = CeilDiv(p * ks * c.groups, slots);
    const int64_t cost = waves * CeilDiv(tiles, p) * span + 1 + (ks > 1 ? 1 : 0);
    if (cost < best_cost) {
      best_cost = cost;
      ksplit = ks;
      kspan = span * C;
      per = p;
    }
  }
  if (kspan == 0) return false;
  plan->blocks = static_cast<int>(per);
  plan->ksplit = static_cast<int>(ksplit);
  plan->kspan = kspan;
  plan->groups = c.groups;
  plan->tiles = static_cast<int>(tiles);
  plan->frags = nf;
  plan->stages = stages;
  plan->split = split;
  plan->blocks_per_sm = bps;
  plan->smem_bytes = static_cast<int>(stages * stage + kspan * xk);
  return true;
}

cudaError_t GemmStream(const GemmCall& c, const StreamPlan& plan, cudaStream_t stream) {
  StreamArgs a;
  a.w = *c.w;
  a.x = c.x;
  a.ldx = c.ldx;
  a.x_group_cols = c.x_group_cols;
  a.y = c.y;
  a.ldy = c.ldy;
  a.y_group_cols = c.y_group_cols;
  a.n = static_cast<int>(c.n);
  a.kspan = plan.kspan;
  a.tiles = plan.tiles;
  a.stages = plan.stages;
  a.x_vec = c.ldx % 4 == 0 && c.x_group_cols % 4 == 0 && reinterpret_cast<uintptr_t>(c.x) % 16 == 0;
  a.atomic = plan.ksplit > 1;
  if (a.w.type == WType::kFP8) {
    return plan.split ? DispatchNf<WType::kFP8, true>(a, plan, stream) : DispatchNf<WType::kFP8, false>(a, plan, stream);
  }
  if (plan.split) return DispatchNf<WType::kBF16, true>(a, plan, stream);
  return DispatchNf<WType::kBF16, false>(a, plan, stream);
}

}  // namespace numoe::cuda
