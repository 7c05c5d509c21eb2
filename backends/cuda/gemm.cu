// y = x · Wᵀ on the GPU: the fp32 SIMT path (fp32 mode, F32 weights) and the one dispatcher that picks the
// path: the GEMV (gemv.cu) for one row, the weight-streaming mma kernel (gemm_stream.cu) for 2-64 rows where
// it applies, else the older tensor-core kernels (sm80_gemm_mma.cu) with a split-K factor.
#include <algorithm>
#include <string>

#include "backends/cuda/device_util.cuh"
#include "backends/cuda/kernels.h"
#include "backends/cuda/launch_note.h"

namespace numoe::cuda {

const char* WTypeName(WType t) {
  switch (t) {
    case WType::kF32:
      return "f32";
    case WType::kBF16:
      return "bf16";
    case WType::kFP8:
      return "fp8";
  }
  return "?";
}

int64_t WTypeBytes(WType t) { return t == WType::kF32 ? 4 : t == WType::kBF16 ? 2 : 1; }

DevW DevW::Rows(int64_t r0, int64_t count) const {
  DevW v = *this;
  v.data = static_cast<const char*>(data) + r0 * in * WTypeBytes(type);
  v.out = count;
  v.row_base = row_base + r0;
  return v;
}

namespace {

constexpr int kBM = 64, kBN = 32, kBK = 16;

// Classic register-tiled fp32 GEMM: a 64 (out) x 32 (rows of x) tile per 256-thread block, each thread 4 x 2.
// Weights are dequantized into shared memory, so any format works; used for the fp32 golden mode and for
// F32 weights (mHC mixing) in bf16 mode.
__global__ void __launch_bounds__(256) GemmSimtKernel(GemmCall c, DevW w, int ksplit, int64_t kspan) {
  __shared__ float ws[kBK][kBM + 4];
  __shared__ float xs[kBK][kBN + 4];
  const int g = blockIdx.z / ksplit, kz = blockIdx.z % ksplit;
  const int64_t o0 = static_cast<int64_t>(blockIdx.x) * kBM, n0 = static_cast<int64_t>(blockIdx.y) * kBN;
  const int64_t k_begin = kz * kspan, k_end = min(w.in, k_begin + kspan);
  const float* x = c.x + g * c.x_group_cols;
  float* y = c.y + g * c.y_group_cols;
  const int64_t grow = static_cast<int64_t>(g) * w.out;
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  float acc[4][2] = {};
  const int lr = tid >> 2, lk = (tid & 3) * 4;
  const int xr = tid >> 3, xk = (tid & 7) * 2;
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kBK) {
    const int64_t o = o0 + lr;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t k = k0 + lk + j;
      ws[lk + j][lr] = (o < w.out && k < k_end) ? LoadWElem(w, grow + o, k) : 0.0f;
    }
    const int64_t nn = n0 + xr;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int64_t k = k0 + xk + j;
      xs[xk + j][xr] = (nn < c.n && k < k_end) ? x[nn * c.ldx + k] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kBK; ++kk) {
      float a[4], b[2];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = ws[kk][tx * 4 + i];
#pragma unroll
      for (int j = 0; j < 2; ++j) b[j] = xs[kk][ty * 2 + j];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 2; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int64_t o = o0 + tx * 4 + i, nn = n0 + ty * 2 + j;
      if (o < w.out && nn < c.n) {
        float* dst = &y[nn * c.ldy + o];
        if (ksplit > 1) {
          atomicAdd(dst, acc[i][j]);
        } else {
          *dst = acc[i][j];
        }
      }
    }
  }
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

void Gemm(const GemmCall& c, bool tensor_cores, int sms, cudaStream_t stream) {
  const DevW& w = *c.w;
  if (c.n <= 0 || w.out <= 0) return;
  const bool mma = tensor_cores && w.type != WType::kF32;
  // One row with BF16/FP8 weights: the GEMV (fp32 FMAs, like the SIMT kernel, so also without tensor cores).
  if (mma ? GemvApplies(c) : GemvApplies(c, 1)) {
    const GemvPlan gp = PlanGemv(c, sms);
    const LaunchNote launch_note(c.groups * (w.data_bytes() + c.n * (w.in + w.out) * 4), [&] {
      return std::string(WTypeName(w.type)) + " " + std::to_string(w.out) + "x" + std::to_string(w.in) +
             (c.groups > 1 ? " x" + std::to_string(c.groups) + " groups" : "") + ", " + std::to_string(c.n) +
             (c.n == 1 ? " row" : " rows") + ", gemv" + (gp.rows_per_warp == 4 ? " 4 rows/warp" : "") +
             (gp.k_warps > 1 ? ", split-k " + std::to_string(gp.k_warps) + " warps" : "") +
             (gp.unroll != 2 ? ", unroll " + std::to_string(gp.unroll) : "") +
             (gp.min_blocks != 1 ? ", " + std::to_string(gp.min_blocks) + " blocks/SM" : "");
    });
    Gemv(c, gp, stream);
    return;
  }
  // What a launch moves: the weights (and FP8 block scales) once, x and y once per group.
  const int64_t scale_bytes =
      w.type == WType::kFP8 ? CeilDiv(w.out, w.bo) * CeilDiv(w.in, w.bi) * static_cast<int64_t>(sizeof(float)) : 0;
  const int64_t bytes = c.groups * (w.data_bytes() + scale_bytes + c.n * (w.in + w.out) * 4);
  auto note = [&](int64_t ksplit, const char* path) {
    std::string s = std::string(WTypeName(w.type)) + " " + std::to_string(w.out) + "x" + std::to_string(w.in);
    if (c.groups > 1) s += " x" + std::to_string(c.groups) + " groups";
    s += ", " + std::to_string(c.n) + (c.n == 1 ? " row" : " rows");
    if (ksplit > 1) s += ", split-k " + std::to_string(ksplit);
    return s + ", " + path;
  };
  StreamPlan plan;
  if (mma && PlanGemmStream(c, sms, &plan)) {
    const LaunchNote launch_note(bytes, [&] {
      const char* path = plan.blocks_per_sm > 1 ? (plan.split ? "stream hi/lo, 2 blocks/SM" : "stream, 2 blocks/SM")
                                                : (plan.split ? "stream hi/lo" : "stream");
      return note(plan.ksplit, path);
    });
    if (plan.ksplit > 1) cudaMemsetAsync(c.y, 0, static_cast<size_t>(c.n * c.ldy) * sizeof(float), stream);
    GemmStream(c, plan, stream);
    return;
  }
  // Tiles of the output; when they cannot fill the GPU twice over, split the reduction dimension and
  // accumulate with atomics (only when y is dense, so one memset zeroes it).
  const bool wide = mma && c.n > kMmaNarrowRows;
  const int64_t tile_out = wide ? kMmaWideOutTile : 64;
  const int64_t tile_n = wide ? MmaWideRowTile(c.n) : mma ? (c.n <= 8 ? 8 : 16) : kBN;
  const int64_t k_chunk = mma ? 128 : kBK;
  const int64_t tiles = CeilDiv(w.out, tile_out) * CeilDiv(c.n, tile_n) * c.groups;
  int64_t ksplit = 1;
  // (Groups whose outputs tile y exactly, like the grouped output projection, zero in one memset too.)
  const bool dense_y = c.groups == 1 ? c.ldy == w.out : (c.y_group_cols == w.out && c.ldy == w.out * c.groups);
  // Decode rows are few, so a GEMM is a weight stream: enough blocks in flight (4 per SM for the mma path, 8
  // for the SIMT one) and short reduction loops keep the loads overlapped.
  const int64_t target = (wide ? 2 : mma ? 4 : 8) * static_cast<int64_t>(sms);
  if (dense_y && tiles < target) {
    ksplit = std::min(CeilDiv(target, tiles), CeilDiv(w.in, mma ? 256 : 64));
  }
  int64_t kspan = CeilDiv(CeilDiv(w.in, ksplit), k_chunk) * k_chunk;
  ksplit = CeilDiv(w.in, kspan);
  if (ksplit > 1) cudaMemsetAsync(c.y, 0, static_cast<size_t>(c.n * c.ldy) * sizeof(float), stream);
  const LaunchNote launch_note(bytes, [&] { return note(ksplit, mma ? (wide ? "mma wide" : "mma narrow") : "simt"); });
  if (mma) {
    GemmMma(c, static_cast<int>(ksplit), stream);
  } else {
    const dim3 grid(static_cast<unsigned>(CeilDiv(w.out, kBM)), static_cast<unsigned>(CeilDiv(c.n, kBN)),
                    static_cast<unsigned>(c.groups * ksplit));
    GemmSimtKernel<<<grid, 256, 0, stream>>>(c, w, static_cast<int>(ksplit), kspan);
  }
}

}  // namespace numoe::cuda
