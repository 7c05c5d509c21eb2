// PackedMoe: one layer's routed experts on the device, straight from the worker's packed layout
// (common/packed_layout.h) as GPU prefill uploads it. A simple, correct version: one warp per output
// element (gate/up: per (row, slot) pair and intermediate row; down: per row and hidden column), each lane
// taking 32-column MXFP4 blocks of the weight row. Kept apart from the model's logic (cuda_model.cc): a
// faster kernel replaces this file without touching anything else.
#include "backends/cuda/kernels.h"
#include "common/packed_layout.h"

namespace numoe::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

__device__ __forceinline__ float PackedE8m0(uint32_t e) {
  if (e == 0) return __uint_as_float(0x00400000u);  // 2^-127 (subnormal)
  return __uint_as_float(e << 23);
}

__device__ __forceinline__ float PackedFp4(uint32_t n) {
  constexpr float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float v = kMag[n & 7];
  return (n & 8) ? -v : v;
}

// Row j (0..15) of one packed row tile (`supers` super-blocks) dotted with x[0, cols), summed over the warp.
__device__ float TileRowDot(const uint8_t* tile, int j, int64_t supers, const float* x, int64_t cols, int lane) {
  float acc = 0.0f;
  const int64_t blocks = supers * 4;
  for (int64_t blk = lane; blk < blocks; blk += 32) {
    const int64_t s = blk / 4;
    const int b = static_cast<int>(blk % 4);
    const int64_t c0 = s * experts::kSuperCols + 32 * b;
    if (c0 >= cols) continue;
    const uint8_t* sp = tile + s * experts::kSuperBytes;
    const float scale = PackedE8m0(sp[experts::kSuperNibbleBytes + 16 * b + j]);
    float part = 0.0f;
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const uint32_t word = *reinterpret_cast<const uint32_t*>(sp + 256 * b + 64 * g + 4 * j);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint32_t byte = (word >> (8 * q)) & 0xffu;
        const int64_t lo = c0 + 4 * g + q, hi = lo + 16;
        if (lo < cols) part += PackedFp4(byte & 15u) * x[lo];
        if (hi < cols) part += PackedFp4(byte >> 4) * x[hi];
      }
    }
    acc += part * scale;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  return acc;
}

struct Geo {
  int64_t num_experts, hidden, inter, stride, n, k;
  int64_t gu_supers, gu_tile_bytes;  // gate/up matrices [inter, hidden]
  int64_t dn_supers, dn_tile_bytes, w2_offset;
  float limit;
};

// h[p, i] = silu(min(g, L)) · clamp(u, -L, L) for pair p = (row, slot) and intermediate row i (0 for an unused slot).
__global__ void GateUpKernel(Geo g, const uint8_t* layer, const float* x, const int32_t* ids, float* h) {
  const int lane = threadIdx.x & 31;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (w >= g.n * g.k * g.inter) return;
  const int64_t p = w / g.inter, i = w % g.inter;
  const int32_t e = ids[p];
  if (e < 0 || e >= g.num_experts) {
    if (lane == 0) h[p * g.inter + i] = 0.0f;
    return;
  }
  const float* xr = x + (p / g.k) * g.hidden;
  const uint8_t* gate = layer + e * g.stride + 2 * (i / experts::kTileRows) * g.gu_tile_bytes;
  const int j = static_cast<int>(i % experts::kTileRows);
  float gv = TileRowDot(gate, j, g.gu_supers, xr, g.hidden, lane);
  float uv = TileRowDot(gate + g.gu_tile_bytes, j, g.gu_supers, xr, g.hidden, lane);
  if (lane == 0) {
    if (g.limit > 0.0f) {
      gv = fminf(gv, g.limit);
      uv = fminf(fmaxf(uv, -g.limit), g.limit);
    }
    h[p * g.inter + i] = gv / (1.0f + expf(-gv)) * uv;
  }
}

// out[r, c] = Σ_slots weights[r, slot] · (w2_e · h[r, slot])[c].
__global__ void DownKernel(Geo g, const uint8_t* layer, const int32_t* ids, const float* wts, const float* h,
                           float* out) {
  const int lane = threadIdx.x & 31;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (w >= g.n * g.hidden) return;
  const int64_t r = w / g.hidden, c = w % g.hidden;
  const int j = static_cast<int>(c % experts::kTileRows);
  float acc = 0.0f;
  for (int64_t s = 0; s < g.k; ++s) {
    const int64_t p = r * g.k + s;
    const int32_t e = ids[p];
    if (e < 0 || e >= g.num_experts) continue;
    const uint8_t* tile =
        layer + e * g.stride + g.w2_offset + (c / experts::kTileRows) * g.dn_tile_bytes;
    acc += wts[p] * TileRowDot(tile, j, g.dn_supers, h + p * g.inter, g.inter, lane);
  }
  if (lane == 0) out[r * g.hidden + c] = acc;
}

}  // namespace

int64_t PackedMoeScratchBytes(int64_t n, int64_t k, int64_t hidden, int64_t inter) {
  (void)hidden;
  return n * k * inter * static_cast<int64_t>(sizeof(float));
}

cudaError_t PackedMoe(const PackedMoeArgs& a, cudaStream_t stream) {
  const experts::PackedExpertShape shape{a.hidden, a.inter};
  if (a.n < 0 || a.k < 1 || a.num_experts < 1 || a.hidden < 1 || a.inter < 1 || a.stride < shape.data_bytes() ||
      !(a.swiglu_limit >= 0.0f)) {
    return cudaErrorInvalidValue;
  }
  if (a.n == 0) return cudaSuccess;
  if (a.layer == nullptr || a.x == nullptr || a.ids == nullptr || a.weights == nullptr || a.out == nullptr ||
      a.scratch == nullptr) {
    return cudaErrorInvalidValue;
  }
  Geo g;
  g.num_experts = a.num_experts;
  g.hidden = a.hidden;
  g.inter = a.inter;
  g.stride = a.stride;
  g.n = a.n;
  g.k = a.k;
  g.gu_supers = shape.gate_up().supers();
  g.gu_tile_bytes = shape.gate_up().tile_bytes();
  g.dn_supers = shape.down().supers();
  g.dn_tile_bytes = shape.down().tile_bytes();
  g.w2_offset = shape.w2_offset();
  g.limit = a.swiglu_limit;
  float* h = static_cast<float*>(a.scratch);
  const int64_t gu_warps = a.n * a.k * a.inter, dn_warps = a.n * a.hidden;
  GateUpKernel<<<static_cast<unsigned>((gu_warps + kWarpsPerBlock - 1) / kWarpsPerBlock), 32 * kWarpsPerBlock, 0,
                 stream>>>(g, a.layer, a.x, a.ids, h);
  DownKernel<<<static_cast<unsigned>((dn_warps + kWarpsPerBlock - 1) / kWarpsPerBlock), 32 * kWarpsPerBlock, 0,
               stream>>>(g, a.layer, a.ids, a.weights, h, a.out);
  return cudaGetLastError();
}

}  // namespace numoe::cuda
