// Routed experts of a prefill step on the device, reading the worker's packed expert layout
// (common/packed_layout.h) with bf16 tensor cores (mma.sync m16n8k16: sm_80, sm_86, sm_90).
//
// One call, no host round trip:
//   1. Bucket: the (row, slot) pairs p = row·k + slot are sorted by expert on the device (one block: counting
//      sort, a stable scatter, so each expert's pairs stay in pair order) and cut into M tiles of kBm pairs of
//      one expert: tiles[t] = {expert, first sorted position, pairs}.
//   2. Prep: x -> bf16 (hi, lo) rows in the GEMM's operand order (below), once per row, not per pair.
//   3. w13 GEMM per (N block, M tile): [pairs x hidden] · [gate/up rows]ᵀ, SwiGLU in registers (the packed
//      w13 interleaves gate tile t and up tile t, so a warp's 32 weight rows are 16 gate and the matching 16
//      up rows), h written as bf16 (hi, lo) in the same operand order, per sorted pair.
//   4. w2 GEMM per (N block, M tile): [pairs x inter] · w2ᵀ -> y[pair] (fp32, before the routing weight).
//   5. Combine: out[r] = Σ_slots in order weights[r, j] · y[r·k + j] (deterministic: no atomics).
//
// GEMM block: kBm = 64 pairs x kBnTiles = 8 packed row tiles (128 weight rows) x one 128-column super-block
// per stage, double-buffered with cp.async: the activations (gathered by row index, zero-filled past the
// tile's pairs) and the raw packed bytes (8 x 1088) go to shared memory; 8 warps of 32 pairs x 32 weight rows
// each. The weights are decoded straight from the raw bytes into B fragments, never stored decoded:
//
//   In super-block s of a tile, 32-bit word (b, c, j) at byte 256b + 64c + 4j holds 8 nibbles of row j,
//   nibble 2q + h (byte q, h = high) = column 32b + 16h + 4c + q. Lane (g, t) of an n fragment takes the
//   words (b = 0..3, c = t) of its row g: the pair of nibbles (i, i + 4), i = 0..3, sits at bits 4i and
//   4i + 16 of the word, and ((x & 0x00080008) << 12) | ((x & 0x00070007) << 6) turns it into two bf16 whose
//   exponent field is the E2M1 exponent (subnormal for exponent 0), i.e. the FP4 value times 2^-126; one
//   bf16 multiply by 2^(e-1) (two for scales above 2) applies that and the block's E8M0 scale 2^(e-127),
//   exactly. Word b of lane t feeds k steps 2b (registers of nibble pairs 0, 1) and 2b + 1 (pairs 2, 3).
//   So the GEMM's k order inside a super-block is a permutation of the columns (a dot product does not care):
//   logical k = 16 (2b + u) + 8h + 2t + e  <->  column 32b + 16h + 4t + u + 2e   (u, e in {0, 1}),
//   and the activations are stored in logical order (ActLogical): [row][super][hi: 128 bf16][lo: 128 bf16].
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <string>

#include "backends/cuda/device_util.cuh"
#include "backends/cuda/kernels.h"
#include "common/packed_layout.h"

namespace numoe::cuda {
namespace {

using experts::kSuperBytes;
using experts::kSuperCols;
using experts::kTileRows;
using experts::PackedExpertShape;

constexpr int kBm = 64;                                          // pairs per M tile
constexpr int kMf = 2;                                           // m16 fragments per warp (32 pairs)
constexpr int kBnTiles = 8;                                      // packed row tiles per block (128 weight rows)
constexpr int kThreads = 256;                                    // 8 warps: 2 (M) x 4 (N)
constexpr int kActSuperBytes = 2 * kSuperCols * 2;               // hi + lo bf16 of one row's super-block: 512
constexpr int kAStage = kBm * kActSuperBytes;                    // 32 KiB
constexpr int kBStage = kBnTiles * static_cast<int>(kSuperBytes);  // 8704
constexpr int kGemmSmem = 2 * (kAStage + kBStage);               // 82944: opt-in above 48 KiB (sm_86 max 99 KiB)
constexpr int kBucketThreads = 1024;
static_assert(kSuperBytes % 16 == 0 && kBm == 32 * kMf * 1, "tile geometry");

// ---- scratch -----------------------------------------------------------------------------------------------

struct Layout {
  int64_t meta = 0, tiles = 0, list = 0, xa = 0, h = 0, y = 0, total = 0;
};
int64_t Align256(int64_t v) { return (v + 255) & ~int64_t{255}; }
// Upper bound on M tiles: Σ_e ceil(c_e / kBm) <= P / kBm + (experts used) and experts used <= min(E, P).
int64_t MaxTiles(int64_t pairs, int64_t experts) { return experts::CeilDiv(pairs, kBm) + std::min(pairs, experts); }
Layout ScratchLayout(int64_t n, int64_t k, int64_t hidden, int64_t inter) {
  const int64_t P = n * k;
  const int64_t hidden_p = experts::RoundUp(hidden, kSuperCols), inter_p = experts::RoundUp(inter, kSuperCols);
  Layout l;
  int64_t off = 0;
  const auto take = [&](int64_t bytes) {
    const int64_t at = off;
    off += Align256(bytes);
    return at;
  };
  l.meta = take(64 * sizeof(int32_t));
  l.tiles = take(3 * MaxTiles(P, P) * static_cast<int64_t>(sizeof(int32_t)));
  l.list = take(P * static_cast<int64_t>(sizeof(int32_t)));
  l.xa = take(n * hidden_p * 4);  // bf16 hi + lo per column
  l.h = take(P * inter_p * 4);
  l.y = take(P * hidden * static_cast<int64_t>(sizeof(float)));
  l.total = off;
  return l;
}

// Its arguments streamed into one string (host error messages).
template <typename... T>
std::string Cat(const T&... v) {
  std::ostringstream os;
  (os << ... << v);
  return os.str();
}

// ---- device helpers ----------------------------------------------------------------------------------------

// a · b per bf16 half, exact for power-of-two b within range (subnormals kept: fma.rn.bf16x2 supports them).
__device__ __forceinline__ uint32_t MulBf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// Two FP4 nibbles at bits 0-3 and 16-19 -> two bf16 of value FP4 · 2^-126 (see the header comment).
__device__ __forceinline__ uint32_t Fp4PairBits(uint32_t x) {
  return ((x & 0x00080008u) << 12) | ((x & 0x00070007u) << 6);
}

// The logical k (0..127) of column p of a super-block (see the header comment).
__host__ __device__ __forceinline__ int ActLogical(int p) {
  const int b = p >> 5, h = (p >> 4) & 1, t = (p >> 2) & 3, u = p & 1, e = (p >> 1) & 1;
  return 16 * (2 * b + u) + 8 * h + 2 * t + e;
}

// ---- 1. bucket ---------------------------------------------------------------------------------------------

// meta[0] = M tiles, meta[1] = valid pairs; tiles[3t ..] = {expert, first sorted position, pairs};
// list[q] = the pair at sorted position q (experts ascending, pairs ascending within an expert).
__global__ void __launch_bounds__(kBucketThreads)
    BucketKernel(const int32_t* ids, int pairs, int E, int32_t* meta, int32_t* tiles, int32_t* list) {
  extern __shared__ int32_t sh[];
  int32_t* cnt = sh;
  int32_t* cur = sh + E;
  int32_t* toff = sh + 2 * E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = ids[p];
    if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int acc = 0, nt = 0;
    for (int e = 0; e < E; ++e) {
      cur[e] = acc;
      toff[e] = nt;
      acc += cnt[e];
      nt += (cnt[e] + kBm - 1) / kBm;
    }
    meta[0] = nt;
    meta[1] = acc;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int c = cnt[e];
    for (int j = 0; j * kBm < c; ++j) {
      int32_t* t = tiles + 3 * static_cast<int64_t>(toff[e] + j);
      t[0] = e;
      t[1] = cur[e] + j * kBm;
      t[2] = min(kBm, c - j * kBm);
    }
  }
  __syncthreads();  // the tiles read cur[] before the scatter advances it
  if (threadIdx.x < 32) {  // one warp, 32 pairs at a time in order: stable
    constexpr int kAhead = 8;  // rounds of ids loaded at once (their latencies overlap)
    const int lane = static_cast<int>(threadIdx.x);
    for (int base = 0; base < pairs; base += 32 * kAhead) {
      int ev[kAhead];
#pragma unroll
      for (int i = 0; i < kAhead; ++i) {
        const int p = base + 32 * i + lane;
        ev[i] = p < pairs ? ids[p] : -1;
      }
#pragma unroll
      for (int i = 0; i < kAhead; ++i) {
        const int p = base + 32 * i + lane, e = ev[i];
        const bool valid = e >= 0 && e < E;
        const unsigned group = __match_any_sync(0xffffffffu, valid ? e : -1);
        const int rank = __popc(group & ((1u << lane) - 1u));
        if (valid) list[cur[e] + rank] = p;
        __syncwarp();
        if (valid && rank == 0) cur[e] += __popc(group);
        __syncwarp();
      }
    }
  }
}

// ---- 2. activations ----------------------------------------------------------------------------------------

// xa[r][s] = the hi and lo bf16 of x[r, 128 s ...] in logical order; columns past `hidden` are zeros. One thread
// per 4 consecutive columns 4c .. 4c + 3 of a super-block (c = 8b + 4h + t): their logical positions are L0,
// L0 + 16, L0 + 1, L0 + 17 with L0 = ActLogical(4c), i.e. two bf16 pairs.
__global__ void PrepActsKernel(const float* x, int64_t n, int64_t hidden, int supers, bool split, bool vec,
                               uint32_t* xa) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n * supers * 32) return;
  const int64_t r = idx / (supers * 32);
  const int rem = static_cast<int>(idx % (supers * 32)), s = rem >> 5, c = rem & 31;
  const int64_t col = static_cast<int64_t>(s) * kSuperCols + 4 * c;
  const float* xr = x + r * hidden;
  float v[4];
  if (vec && col + 4 <= hidden) {
    const float4 q = *reinterpret_cast<const float4*>(xr + col);
    v[0] = q.x;
    v[1] = q.y;
    v[2] = q.z;
    v[3] = q.w;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = col + i < hidden ? xr[col + i] : 0.0f;
  }
  const int L0 = ActLogical(4 * c);
  uint32_t* row = xa + (r * supers + s) * (kActSuperBytes / 4);
  const uint32_t h0 = PackBf16(v[0], v[2]), h1 = PackBf16(v[1], v[3]);
  row[L0 / 2] = h0;
  row[(L0 + 16) / 2] = h1;
  if (split) {
    const float2 a = Bf16PairToF32(h0), b = Bf16PairToF32(h1);
    row[(kSuperCols + L0) / 2] = PackBf16(v[0] - a.x, v[2] - a.y);
    row[(kSuperCols + L0 + 16) / 2] = PackBf16(v[1] - b.x, v[3] - b.y);
  }
}

// ---- 3./4. the GEMMs ---------------------------------------------------------------------------------------

struct GemmParams {
  const uint8_t* layer = nullptr;
  int64_t stride = 0;      // bytes between experts
  int64_t mat_offset = 0;  // the matrix inside an expert (w13: 0, w2: w2_offset)
  int64_t tile_bytes = 0;  // bytes per packed row tile
  int num_tiles = 0;       // packed row tiles of the matrix
  int supers = 0;          // super-blocks per tile (K / 128)
  const uint8_t* a = nullptr;  // activations in logical order, a_row_bytes = supers · 512 per row
  int64_t a_row_bytes = 0;
  const int32_t* meta = nullptr;
  const int32_t* tiles = nullptr;
  const int32_t* list = nullptr;
  int k = 0;
  bool split = true;
  float lim = 0;
  // w13: h [sorted pair][inter supers] in logical order (h_row_bytes each); gate/up tile pairs = inter_tiles.
  uint8_t* h = nullptr;
  int64_t h_row_bytes = 0;
  // w2: y [pair][hidden].
  float* y = nullptr;
  int64_t hidden = 0;
};

// kMode 0: w13 + SwiGLU -> h; 1: w2 -> y. Grid: (N blocks of kBnTiles tiles, M tiles bound); blocks past the
// tile count return at once.
template <int kMode>
__global__ void __launch_bounds__(kThreads) PackedGemmKernel(GemmParams p) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int32_t arow[kBm];  // activation row of each pair slot (-1: none)
  __shared__ int32_t orow[kBm];  // output row: w13 sorted position, w2 pair
  const int tile = static_cast<int>(blockIdx.y);
  if (tile >= p.meta[0]) return;
  const int32_t* td = p.tiles + 3 * static_cast<int64_t>(tile);
  const int e = td[0], begin = td[1], rows = td[2];
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int warp_m = warp >> 2, warp_n = warp & 3;
  for (int m = tid; m < kBm; m += kThreads) {
    int a = -1, o = -1;
    if (m < rows) {
      const int q = begin + m;
      const int pair = p.list[q];
      if constexpr (kMode == 0) {
        a = pair / p.k;
        o = q;
      } else {
        a = q;
        o = pair;
      }
    }
    arow[m] = a;
    orow[m] = o;
  }
  __syncthreads();
  const int tile0 = static_cast<int>(blockIdx.x) * kBnTiles;
  const int ntiles = min(kBnTiles, p.num_tiles - tile0);
  const uint8_t* wbase = p.layer + static_cast<int64_t>(e) * p.stride + p.mat_offset +
                         static_cast<int64_t>(tile0) * p.tile_bytes;
  uint8_t* As = smem;
  uint8_t* Bs = smem + 2 * kAStage;

  const auto load = [&](int s, int buf) {
    uint8_t* ad = As + buf * kAStage;
#pragma unroll
    for (int i = 0; i < kBm * 32 / kThreads; ++i) {
      const int c = tid + kThreads * i, row = c >> 5, ch = c & 31;
      const int ar = arow[row];
      const uint8_t* src =
          ar >= 0 ? p.a + static_cast<int64_t>(ar) * p.a_row_bytes + s * kActSuperBytes + ch * 16 : p.a;
      CpAsync16(ad + row * kActSuperBytes + ((ch ^ (row & 7)) << 4), src, ar >= 0);
    }
    uint8_t* bd = Bs + buf * kBStage;
    constexpr int kChunks = static_cast<int>(kSuperBytes) / 16;  // 68 per tile
    for (int c = tid; c < ntiles * kChunks; c += kThreads) {
      const int tl = c / kChunks, off = c - tl * kChunks;
      CpAsync16(bd + tl * static_cast<int>(kSuperBytes) + off * 16,
                wbase + static_cast<int64_t>(tl) * p.tile_bytes + static_cast<int64_t>(s) * kSuperBytes + off * 16,
                true);
    }
  };

  const bool vt0 = 2 * warp_n < ntiles, vt1 = 2 * warp_n + 1 < ntiles;  // the warp's two row tiles exist
  const int mrows = rows - warp_m * 16 * kMf;                          // this warp's pairs (<= 0: none)
  const bool active = vt0 && mrows > 0;
  float acc[kMf][4][4];
#pragma unroll
  for (int mf = 0; mf < kMf; ++mf)
#pragma unroll
    for (int f = 0; f < 4; ++f) acc[mf][f][0] = acc[mf][f][1] = acc[mf][f][2] = acc[mf][f][3] = 0.0f;

  load(0, 0);
  CpAsyncCommit();
  for (int s = 0; s < p.supers; ++s) {
    if (s + 1 < p.supers) load(s + 1, (s + 1) & 1);
    CpAsyncCommit();
    CpAsyncWait<1>();
    __syncthreads();
    if (active) {
      const uint8_t* A = As + (s & 1) * kAStage;
      const uint8_t* B = Bs + (s & 1) * kBStage;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        uint32_t breg[4][4];
#pragma unroll
        for (int f = 0; f < 4; ++f) {
          const bool v = (f >> 1) ? vt1 : vt0;
          if (v) {
            const uint8_t* tb = B + (2 * warp_n + (f >> 1)) * static_cast<int>(kSuperBytes);
            const int row = (f & 1) * 8 + g;
            const uint32_t word = *reinterpret_cast<const uint32_t*>(tb + 256 * b + 64 * t + 4 * row);
            const uint32_t sc = tb[experts::kSuperNibbleBytes + 16 * b + row];
            const bool big = sc > 128;  // 2^(sc - 1) would overflow bf16: two multiplies
            const uint32_t m1 = big ? (253u << 7) : ((sc + 126u) << 7);
            const uint32_t m1x2 = m1 | (m1 << 16), m2x2 = (sc << 7) | (sc << 23);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              uint32_t r = MulBf16x2(Fp4PairBits(word >> (4 * i)), m1x2);
              if (big) r = MulBf16x2(r, m2x2);
              breg[f][i] = r;
            }
          } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) breg[f][i] = 0;
          }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int step = 2 * b + u;
#pragma unroll
          for (int mf = 0; mf < kMf; ++mf) {
            if (mf * 16 >= mrows) continue;
            const int r = warp_m * 16 * kMf + mf * 16 + (lane & 15);
            const int j = 2 * step + (lane >> 4);
            uint32_t a[4];
            Ldmatrix4(a, A + r * kActSuperBytes + ((j ^ (r & 7)) << 4));
#pragma unroll
            for (int f = 0; f < 4; ++f) Mma(acc[mf][f], a[0], a[1], a[2], a[3], breg[f][2 * u], breg[f][2 * u + 1]);
            if (p.split) {
              Ldmatrix4(a, A + r * kActSuperBytes + (((j + 16) ^ (r & 7)) << 4));
#pragma unroll
              for (int f = 0; f < 4; ++f) Mma(acc[mf][f], a[0], a[1], a[2], a[3], breg[f][2 * u], breg[f][2 * u + 1]);
            }
          }
        }
      }
    }
    __syncthreads();  // everyone is done with this buffer before the next load overwrites it
  }
  if (!active) return;

  // Accumulator (mf, f): c0, c1 = pair slot warp_m·32 + mf·16 + g, weight rows 2t, 2t + 1 of fragment f;
  // c2, c3 = the same 8 pair slots further.
  if constexpr (kMode == 0) {
    const int64_t qg = static_cast<int64_t>(blockIdx.x) * (kBnTiles / 2) + warp_n;  // gate (and up) tile index
    const float lim = p.lim;
#pragma unroll
    for (int mf = 0; mf < kMf; ++mf) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int m = warp_m * 16 * kMf + mf * 16 + g + 8 * half;
        if (m >= rows) continue;
        __nv_bfloat16* hrow = reinterpret_cast<__nv_bfloat16*>(p.h + static_cast<int64_t>(orow[m]) * p.h_row_bytes);
#pragma unroll
        for (int f = 0; f < 2; ++f) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float gv = acc[mf][f][2 * half + c], uv = acc[mf][f + 2][2 * half + c];
            if (lim > 0.0f) {
              gv = fminf(gv, lim);
              uv = fminf(fmaxf(uv, -lim), lim);
            }
            const float hv = gv / (1.0f + expf(-gv)) * uv;
            const int64_t i = qg * kTileRows + f * 8 + 2 * t + c;
            __nv_bfloat16* sup = hrow + (i / kSuperCols) * (2 * kSuperCols);
            const int L = ActLogical(static_cast<int>(i % kSuperCols));
            const __nv_bfloat16 hi = __float2bfloat16_rn(hv);
            sup[L] = hi;
            if (p.split) sup[kSuperCols + L] = __float2bfloat16_rn(hv - __bfloat162float(hi));
          }
        }
      }
    }
  } else {
#pragma unroll
    for (int mf = 0; mf < kMf; ++mf) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int m = warp_m * 16 * kMf + mf * 16 + g + 8 * half;
        if (m >= rows) continue;
        float* yrow = p.y + static_cast<int64_t>(orow[m]) * p.hidden;
#pragma unroll
        for (int f = 0; f < 4; ++f) {
          if (!((f >> 1) ? vt1 : vt0)) continue;
          const int64_t col = static_cast<int64_t>(tile0 + 2 * warp_n + (f >> 1)) * kTileRows + (f & 1) * 8 + 2 * t;
          if (col >= p.hidden) continue;  // hidden is even: col + 1 < hidden too
          *reinterpret_cast<float2*>(yrow + col) = make_float2(acc[mf][f][2 * half], acc[mf][f][2 * half + 1]);
        }
      }
    }
  }
}

// ---- 5. combine --------------------------------------------------------------------------------------------

__global__ void CombineKernel(const float* y, const int32_t* ids, const float* w, int64_t n, int k, int64_t hidden,
                              int E, float* out) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n * hidden) return;
  const int64_t r = idx / hidden, c = idx - r * hidden;
  float acc = 0.0f;
  for (int j = 0; j < k; ++j) {
    const int64_t pr = r * k + j;
    const int e = ids[pr];
    if (e >= 0 && e < E) acc += w[pr] * y[pr * hidden + c];
  }
  out[idx] = acc;
}

// ---- the mma peak ------------------------------------------------------------------------------------------

constexpr int kPeakChains = 8;  // independent accumulators per warp (hide the mma latency)
__global__ void __launch_bounds__(256) MmaPeakKernel(int iters, float* sink) {
  float acc[kPeakChains][4];
#pragma unroll
  for (int c = 0; c < kPeakChains; ++c) acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = 0.0f;
  const uint32_t a0 = 0x3F803F80u ^ threadIdx.x, a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3, b0 = a0 ^ 5u, b1 = a0 ^ 9u;
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int c = 0; c < kPeakChains; ++c) Mma(acc[c], a0, a1, a2, a3, b0, b1);
  }
  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < kPeakChains; ++c) s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  if (s == 1234.5f) sink[threadIdx.x] = s;  // never true in practice; keeps the loop alive
}


// ---- random packed experts (benchmarks) --------------------------------------------------------------------

__device__ __forceinline__ uint32_t HashU32(uint64_t v) {
  v ^= v >> 33;
  v *= 0xff51afd7ed558ccdull;
  v ^= v >> 33;
  v *= 0xc4ceb9fe1a85ec53ull;
  v ^= v >> 33;
  return static_cast<uint32_t>(v);
}

// Byte o of an expert: random nibbles, scale bytes in [scale_lo, scale_lo + 3], zeros past the data.
__global__ void FillPackedKernel(uint8_t* layer, int64_t total, int64_t stride, int64_t w2_offset, int64_t gu_tile,
                                 int64_t down_tile, int64_t data_bytes, int scale_lo, uint64_t seed) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t o = i % stride;
    const uint32_t r = HashU32(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i));
    uint8_t v = 0;
    if (o < data_bytes) {
      const int64_t in_tile = o < w2_offset ? o % gu_tile : (o - w2_offset) % down_tile;
      v = in_tile % kSuperBytes >= experts::kSuperNibbleBytes ? static_cast<uint8_t>(scale_lo + (r & 3))
                                                              : static_cast<uint8_t>(r);
    }
    layer[i] = v;
  }
}

}  // namespace

void FillPackedExperts(uint8_t* layer, int64_t num_experts, int64_t hidden, int64_t inter, int64_t stride,
                       int scale_lo, uint64_t seed, cudaStream_t stream) {
  const PackedExpertShape shape{hidden, inter};
  FillPackedKernel<<<4096, 256, 0, stream>>>(layer, num_experts * stride, stride, shape.w2_offset(),
                                             shape.gate_up().tile_bytes(), shape.down().tile_bytes(),
                                             shape.data_bytes(), scale_lo, seed);
}

int64_t PackedMoeScratchBytes(int64_t n, int64_t k, int64_t hidden, int64_t inter) {
  if (n < 0 || k < 0 || hidden < 0 || inter < 0) return 0;
  return ScratchLayout(n, k, hidden, inter).total;
}

std::string PackedMoeCheck(const PackedMoeArgs& a) {
  if (a.n < 0 || a.n > kPackedMoeMaxRows) return Cat("PackedMoe: n = ", a.n, " outside [0, ", kPackedMoeMaxRows, "]");
  if (a.k < 0 || a.k > kPackedMoeMaxK) return Cat("PackedMoe: k = ", a.k, " outside [0, ", kPackedMoeMaxK, "]");
  if (a.num_experts < 1 || a.num_experts > kPackedMoeMaxExperts) {
    return Cat("PackedMoe: num_experts = ", a.num_experts, " outside [1, ", kPackedMoeMaxExperts, "]");
  }
  if (a.hidden < 2 || a.hidden % 2 != 0 || a.hidden > (1 << 20)) {
    return Cat("PackedMoe: hidden = ", a.hidden, " must be even, in [2, 2^20]");
  }
  if (a.inter < 2 || a.inter % 2 != 0 || a.inter > (1 << 20)) {
    return Cat("PackedMoe: inter = ", a.inter, " must be even, in [2, 2^20]");
  }
  const PackedExpertShape shape{a.hidden, a.inter};
  if (a.stride < shape.data_bytes() || a.stride % 16 != 0) {
    return Cat("PackedMoe: stride = ", a.stride, " must be a multiple of 16 and >= the packed expert's ",
                        shape.data_bytes(), " bytes");
  }
  if (!std::isfinite(a.swiglu_limit) || a.swiglu_limit < 0.0f) {
    return Cat("PackedMoe: swiglu_limit = ", a.swiglu_limit, " must be finite and >= 0 (0 = no clamp)");
  }
  if (a.n == 0) return "";
  if (a.out == nullptr) return "PackedMoe: out is null";
  if (a.k == 0) return "";
  if (a.layer == nullptr) return "PackedMoe: layer is null";
  if (reinterpret_cast<uintptr_t>(a.layer) % 16 != 0) return "PackedMoe: layer is not 16-byte aligned";
  if (a.x == nullptr) return "PackedMoe: x is null";
  if (a.ids == nullptr) return "PackedMoe: ids is null";
  if (a.weights == nullptr) return "PackedMoe: weights is null";
  if (a.scratch == nullptr) return "PackedMoe: scratch is null";
  if (reinterpret_cast<uintptr_t>(a.scratch) % 256 != 0) return "PackedMoe: scratch is not 256-byte aligned";
  if (reinterpret_cast<uintptr_t>(a.out) % 4 != 0) return "PackedMoe: out is not 4-byte aligned";
  const int64_t m_tiles = MaxTiles(a.n * a.k, a.num_experts);
  if (m_tiles > 65535) {
    return Cat("PackedMoe: n · k = ", a.n * a.k, " rows need ", m_tiles, " M tiles, more than a grid's 65535");
  }
  const int64_t n_blocks = std::max(experts::CeilDiv(2 * shape.gate_up().tiles(), kBnTiles),
                                    experts::CeilDiv(shape.down().tiles(), kBnTiles));
  if (n_blocks > 65535) return Cat("PackedMoe: hidden/inter need ", n_blocks, " N blocks, more than 65535");
  return "";
}

cudaError_t PackedMoe(const PackedMoeArgs& a, cudaStream_t stream) {
  if (!PackedMoeCheck(a).empty()) return cudaErrorInvalidValue;
  if (a.n == 0) return cudaSuccess;
  if (a.k == 0) return cudaMemsetAsync(a.out, 0, static_cast<size_t>(a.n * a.hidden) * sizeof(float), stream);
  const PackedExpertShape shape{a.hidden, a.inter};
  const Layout l = ScratchLayout(a.n, a.k, a.hidden, a.inter);
  uint8_t* base = static_cast<uint8_t*>(a.scratch);
  int32_t* meta = reinterpret_cast<int32_t*>(base + l.meta);
  int32_t* tiles = reinterpret_cast<int32_t*>(base + l.tiles);
  int32_t* list = reinterpret_cast<int32_t*>(base + l.list);
  uint8_t* xa = base + l.xa;
  uint8_t* h = base + l.h;
  float* y = reinterpret_cast<float*>(base + l.y);
  const int E = static_cast<int>(a.num_experts), k = static_cast<int>(a.k);
  const int64_t P = a.n * a.k;
  const int hidden_supers = static_cast<int>(shape.gate_up().supers());
  const int inter_supers = static_cast<int>(shape.down().supers());

  BucketKernel<<<1, kBucketThreads, static_cast<size_t>(3 * E) * sizeof(int32_t), stream>>>(
      a.ids, static_cast<int>(P), E, meta, tiles, list);
  {
    const int64_t threads = a.n * hidden_supers * 32;
    const bool vec = reinterpret_cast<uintptr_t>(a.x) % 16 == 0 && a.hidden % 4 == 0;
    PrepActsKernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(
        a.x, a.n, a.hidden, hidden_supers, a.split_activations, vec, reinterpret_cast<uint32_t*>(xa));
  }
  // h columns past the gate/up tiles (inter not a multiple of 128) are read by the w2 GEMM against zero
  // weights: they must be zeros, not garbage that could be NaN.
  if (shape.gate_up().tiles() * kTileRows < shape.down().padded_cols()) {
    const cudaError_t err = cudaMemsetAsync(h, 0, static_cast<size_t>(P * inter_supers * kActSuperBytes), stream);
    if (err != cudaSuccess) return err;
  }
  constexpr cudaFuncAttribute kSmemAttr = cudaFuncAttributeMaxDynamicSharedMemorySize;
  cudaError_t err = cudaFuncSetAttribute(PackedGemmKernel<0>, kSmemAttr, kGemmSmem);
  if (err == cudaSuccess) err = cudaFuncSetAttribute(PackedGemmKernel<1>, kSmemAttr, kGemmSmem);
  if (err != cudaSuccess) return err;
  const unsigned m_tiles = static_cast<unsigned>(MaxTiles(P, a.num_experts));

  GemmParams g;
  g.layer = a.layer;
  g.stride = a.stride;
  g.meta = meta;
  g.tiles = tiles;
  g.list = list;
  g.k = k;
  g.split = a.split_activations;
  g.lim = a.swiglu_limit;
  // w13 + SwiGLU.
  g.mat_offset = 0;
  g.tile_bytes = shape.gate_up().tile_bytes();
  g.num_tiles = static_cast<int>(2 * shape.gate_up().tiles());
  g.supers = hidden_supers;
  g.a = xa;
  g.a_row_bytes = static_cast<int64_t>(hidden_supers) * kActSuperBytes;
  g.h = h;
  g.h_row_bytes = static_cast<int64_t>(inter_supers) * kActSuperBytes;
  PackedGemmKernel<0><<<dim3(static_cast<unsigned>(experts::CeilDiv(g.num_tiles, kBnTiles)), m_tiles), kThreads,
                        kGemmSmem, stream>>>(g);
  // w2.
  g.mat_offset = shape.w2_offset();
  g.tile_bytes = shape.down().tile_bytes();
  g.num_tiles = static_cast<int>(shape.down().tiles());
  g.supers = inter_supers;
  g.a = h;
  g.a_row_bytes = g.h_row_bytes;
  g.h = nullptr;
  g.y = y;
  g.hidden = a.hidden;
  PackedGemmKernel<1><<<dim3(static_cast<unsigned>(experts::CeilDiv(g.num_tiles, kBnTiles)), m_tiles), kThreads,
                        kGemmSmem, stream>>>(g);
  const int64_t total = a.n * a.hidden;
  CombineKernel<<<static_cast<unsigned>((total + 255) / 256), 256, 0, stream>>>(y, a.ids, a.weights, a.n, k, a.hidden,
                                                                                E, a.out);
  return cudaGetLastError();
}

double MmaBf16PeakFlops(double ms) {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    return 0;
  }
  float* sink = nullptr;
  if (cudaMalloc(&sink, 256 * sizeof(float)) != cudaSuccess) return 0;
  cudaEvent_t e0, e1;
  (void)cudaEventCreate(&e0);
  (void)cudaEventCreate(&e1);
  const unsigned blocks = static_cast<unsigned>(sms) * 4;  // 32 warps per SM
  int iters = 1024;
  double flops = 0;
  for (int round = 0; round < 8; ++round) {
    (void)cudaEventRecord(e0);
    MmaPeakKernel<<<blocks, 256>>>(iters, sink);
    (void)cudaEventRecord(e1);
    (void)cudaEventSynchronize(e1);
    float got = 0;
    (void)cudaEventElapsedTime(&got, e0, e1);
    const double mma = static_cast<double>(blocks) * 8 * iters * kPeakChains;  // 8 warps per block
    flops = std::max(flops, mma * 2.0 * 16 * 8 * 16 / (got * 1e-3));
    if (got >= ms) break;
    iters = static_cast<int>(std::min<double>(1 << 30, iters * std::max(2.0, 1.2 * ms / std::max(got, 1e-3f))));
  }
  (void)cudaEventDestroy(e0);
  (void)cudaEventDestroy(e1);
  (void)cudaFree(sink);
  return cudaGetLastError() == cudaSuccess ? flops : 0;
}

}  // namespace numoe::cuda
