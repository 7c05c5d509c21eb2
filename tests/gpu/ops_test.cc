// The CUDA backend's kernels one by one against a CPU reference (label gpu): every GEMM path (FP8 block-scaled
// and BF16 weights on the GEMV, narrow and wide tensor-core kernels, fp32 SIMT; 1, 16, 17, 64 and 640 rows; shapes
// with tails; split-K; grouped projections; strided x and y), and the row kernels (RMSNorm, SwiGLU, argmax), each
// with a stated error bound and guard bytes around every output; attention (sliding, CSA, HCA; split and unsplit
// keys; the fp32 kernel and the tensor-core one at 4, 8 and 32 decode rows, verify and prefill rows) and
// the indexer's scores and top-k on caches laid out as the backend lays them out; and the routed
// experts of a prefill step on the worker's packed layout (PackedMoe) against a float64 reference from the
// checkpoint-format weights; the mHC kernels (HcMix, HcPre, HcPostMix; 1/8/32/64 decode rows, prefill rows on
// the GEMM path, the head collapse), NormRope's two-job launches, the router (MoeGate), and the compressors (CSA main + indexer in
// one call, HCA; decode, verify and prefill rows) against the CPU backend's CompressorState. Skips without a
// device, and compiles to a skip in a build without CUDA.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "backends/cuda/cuda_model.h"
#include "common/quant.h"

#if NUMOE_OPS_TEST_CUDA
#include <cuda_runtime.h>

#include "backends/cpu/compressor.h"
#include "backends/cpu/ops.h"
#include "backends/cuda/kernels.h"
#include "tests/kernels/expert_test_util.h"
#include "worker/experts/expert_layer.h"
#endif

namespace numoe {
namespace {

#if NUMOE_OPS_TEST_CUDA

constexpr int64_t kGuard = 256;              // floats of guard on each side of every device output
constexpr uint32_t kSentinel = 0x7FC0BEEFu;  // a NaN no kernel writes

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

// A device buffer of `count` elements of T.
template <typename T>
struct Dev {
  T* p = nullptr;
  explicit Dev(size_t count) { EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)), cudaSuccess); }
  Dev(const Dev&) = delete;
  ~Dev() { cudaFree(p); }
  void Put(const std::vector<T>& v) { EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess); }
  std::vector<T> Get(size_t count) const {
    std::vector<T> v(count);
    EXPECT_EQ(cudaMemcpy(v.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
};

// An fp32 output region of `count` floats with kGuard sentinel floats before and after it (and everywhere
// inside it the kernel is not meant to write).
struct Guarded {
  Dev<float> buf;
  size_t count;
  explicit Guarded(size_t n) : buf(n + 2 * kGuard), count(n) {
    float s;
    std::memcpy(&s, &kSentinel, sizeof(s));
    buf.Put(std::vector<float>(n + 2 * kGuard, s));
  }
  float* out() { return buf.p + kGuard; }
  std::vector<float> All() const { return buf.Get(count + 2 * kGuard); }
};
bool IsSentinel(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u == kSentinel;
}
bool GuardsIntact(const std::vector<float>& all) {
  for (int64_t i = 0; i < kGuard; ++i) {
    if (!IsSentinel(all[static_cast<size_t>(i)]) || !IsSentinel(all[all.size() - 1 - static_cast<size_t>(i)])) return false;
  }
  return true;
}

int Sms() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  return sms;
}

struct GemmCase {
  cuda::WType type;
  int64_t out, in, n;
  int groups = 1;
  int64_t x_pad = 0, y_pad = 0;  // extra floats per row of x and y (strided operands)
  bool tensor_cores = true;
  bool split_x = true;
  int stream = -1;  // 1: must take the weight-streaming kernel, 0: must not (falls back), -1: either
};
std::string Name(const GemmCase& c) {
  return std::string(cuda::WTypeName(c.type)) + " " + std::to_string(c.out) + "x" + std::to_string(c.in) + " x" +
         std::to_string(c.groups) + " groups, " + std::to_string(c.n) + " rows, pads " + std::to_string(c.x_pad) + "/" +
         std::to_string(c.y_pad) + (c.tensor_cores ? ", mma" : ", simt") + (c.split_x ? "" : ", x unsplit");
}

// y = x · Wᵀ on the device vs the same product in double on the host from the dequantized weights. Bound per
// output, times Σ|w||x| (+ 1e-6): 4e-3 on the older tensor-core kernels (each scaled weight rounded to bf16,
// 2^-9 relative, x a bf16 hi/lo pair, ~2^-16; fp32 accumulation adds less); on the weight-streaming kernel
// 2e-4 with x as hi/lo (the weights are exact: BF16, or FP8 codes in bf16 with the block scale on the fp32
// partial sums; x 2^-17, plus fp32 accumulation over up to 8192 columns, as PackedMoe's bound) and 2.2e-3 with
// x as one bf16 (2^-9 = 1.95e-3). On the streaming kernel with hi/lo x the normwise relative error must also
// stay below 3e-4: x rounded once gives ~1.5e-3 there, and that failed tiny-v4's bf16-mode goldens with FP8
// weights (their block scales are powers of two, so the older kernels' bf16 weights were exact). Outside [y, y + n·ldy) and, for strided y, between rows, nothing may change.
void CheckGemm(const GemmCase& c) {
  SCOPED_TRACE(Name(c));
  std::mt19937 rng(static_cast<uint32_t>(c.out * 131 + c.in * 7 + c.n + c.groups * 1000 + static_cast<int>(c.type)));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), us(0.5f, 2.0f);
  const int64_t rows = c.out * c.groups;  // weight storage rows
  const int64_t sr = (rows + 127) / 128, sc = (c.in + 127) / 128;
  std::vector<float> wf(static_cast<size_t>(rows * c.in));  // dequantized weights
  std::vector<uint8_t> w8;
  std::vector<uint16_t> w16;
  std::vector<float> w32, scale;
  if (c.type == cuda::WType::kFP8) {
    scale.resize(static_cast<size_t>(sr * sc));
    for (float& s : scale) s = us(rng) / 64.0f;
    w8.resize(wf.size());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = 0; k < c.in; ++k) {
        const size_t i = static_cast<size_t>(r * c.in + k);
        w8[i] = FloatToFp8E4M3(2.0f * u(rng));
        wf[i] = Fp8E4M3ToFloat(w8[i]) * scale[static_cast<size_t>((r / 128) * sc + k / 128)];
      }
    }
  } else if (c.type == cuda::WType::kBF16) {
    w16.resize(wf.size());
    for (size_t i = 0; i < wf.size(); ++i) {
      w16[i] = FloatToBf16(u(rng) / 16.0f);
      const uint32_t bits = static_cast<uint32_t>(w16[i]) << 16;
      std::memcpy(&wf[i], &bits, sizeof(float));
    }
  } else {
    w32.resize(wf.size());
    for (size_t i = 0; i < wf.size(); ++i) wf[i] = w32[i] = u(rng) / 16.0f;
  }
  const int64_t ldx = c.in * c.groups + c.x_pad, ldy = c.out * c.groups + c.y_pad;
  std::vector<float> x(static_cast<size_t>(c.n * ldx));
  for (float& v : x) v = u(rng);

  Dev<uint8_t> dw(static_cast<size_t>(rows * c.in * cuda::WTypeBytes(c.type)));
  if (!w8.empty()) dw.Put(w8);
  if (!w16.empty()) {
    CUDA_OK(cudaMemcpy(dw.p, w16.data(), w16.size() * 2, cudaMemcpyHostToDevice));
  }
  if (!w32.empty()) {
    CUDA_OK(cudaMemcpy(dw.p, w32.data(), w32.size() * 4, cudaMemcpyHostToDevice));
  }
  Dev<float> dscale(scale.size());
  if (!scale.empty()) dscale.Put(scale);
  Dev<float> dx(x.size());
  dx.Put(x);
  Guarded y(static_cast<size_t>(c.n * ldy));

  cuda::DevW w;
  w.type = c.type;
  w.data = dw.p;
  w.scale = scale.empty() ? nullptr : dscale.p;
  w.out = c.out;
  w.in = c.in;
  w.scale_cols = sc;
  cuda::GemmCall call;
  call.w = &w;
  call.x = dx.p;
  call.ldx = ldx;
  call.n = c.n;
  call.y = y.out();
  call.ldy = ldy;
  call.groups = c.groups;
  call.x_group_cols = c.in;
  call.y_group_cols = c.out;
  call.split_x = c.split_x;
  cuda::StreamPlan plan;
  const bool stream = c.tensor_cores && c.n > 1 && cuda::PlanGemmStream(call, Sms(), &plan);
  if (c.stream >= 0) {
    ASSERT_EQ(stream, c.stream == 1) << "weight-streaming kernel " << (stream ? "taken" : "not taken");
  }
  if (stream) {
    SCOPED_TRACE("stream: " + std::to_string(plan.blocks) + " blocks x split-k " + std::to_string(plan.ksplit) +
                 " (kspan " + std::to_string(plan.kspan) + ") x " + std::to_string(plan.groups) + " groups, " +
                 std::to_string(plan.stages) + " stages, " + std::to_string(plan.smem_bytes) + " B shared");
  }
  // The GEMV multiplies exact weights by fp32 x with fp32 FMAs: a few dozen roundings of 2^-24 per sum.
  const bool mma = c.tensor_cores && c.type != cuda::WType::kF32;
  const bool gemv = mma ? cuda::GemvApplies(call) : cuda::GemvApplies(call, 1);
  if (gemv) {
    const cuda::GemvPlan gp = cuda::PlanGemv(call, Sms());
    SCOPED_TRACE("gemv: " + std::to_string(gp.rows_per_warp) + " rows per warp, " + std::to_string(gp.k_warps) +
                 " k warps, unroll " + std::to_string(gp.unroll));
  }
  const double rel = gemv ? 1e-5 : !stream ? 4e-3 : plan.split ? 2e-4 : 2.2e-3;
  cuda::Gemm(call, c.tensor_cores, Sms(), nullptr);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> all = y.All();
  ASSERT_TRUE(GuardsIntact(all)) << "a kernel wrote outside its output";
  int64_t bad = 0;
  double worst = 0, err2 = 0, ref2 = 0;
  for (int64_t r = 0; r < c.n; ++r) {
    for (int64_t g = 0; g < c.groups; ++g) {
      for (int64_t o = 0; o < c.out; ++o) {
        double ref = 0, mag = 0;
        const float* xr = &x[static_cast<size_t>(r * ldx + g * c.in)];
        const float* wr = &wf[static_cast<size_t>((g * c.out + o) * c.in)];
        for (int64_t k = 0; k < c.in; ++k) {
          ref += static_cast<double>(wr[k]) * xr[k];
          mag += std::fabs(static_cast<double>(wr[k]) * xr[k]);
        }
        const float got = all[static_cast<size_t>(kGuard + r * ldy + g * c.out + o)];
        const double err = std::fabs(got - ref), bound = rel * mag + 1e-6;
        err2 += err * err;
        ref2 += ref * ref;
        worst = std::max(worst, err / bound);
        if (!(err <= bound) && bad++ < 5) {
          ADD_FAILURE() << "row " << r << " group " << g << " out " << o << ": " << got << " vs " << ref
                        << " (bound " << bound << ")";
        }
      }
    }
    for (int64_t p = 0; p < c.y_pad; ++p) {  // the padding of strided y rows stays untouched
      ASSERT_TRUE(IsSentinel(all[static_cast<size_t>(kGuard + r * ldy + c.out * c.groups + p)])) << "row " << r;
    }
  }
  EXPECT_EQ(bad, 0) << "worst error / bound " << worst;
  // Normwise: x rounded once to bf16 leaves ~1.5e-3 (what failed tiny-v4's bf16-mode goldens with FP8 weights);
  // the hi/lo split ~1e-5.
  const double normwise = std::sqrt(err2 / std::max(ref2, 1e-300));
  std::printf("  %s: normwise relative error %.2e%s\n", Name(c).c_str(), normwise,
              stream ? (plan.split ? " (stream, hi/lo)" : " (stream, one bf16)") : "");
  if (stream && plan.split) {
    EXPECT_LE(normwise, 3e-4);
  }
}

bool HaveDevice() { return CudaCompiledIn() && CudaDeviceCount() > 0; }

TEST(CudaOpsTest, GemmEveryPathAgainstTheCpu) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  using cuda::WType;
  for (WType t : {WType::kFP8, WType::kBF16}) {
    for (int64_t n : {1, 16, 17, 64, 640}) {
      CheckGemm({t, 1536, 2048, n});            // whole tiles, no split-K at 640 rows
      CheckGemm({t, 1000, 1000, n});            // tails in both dimensions (FP8: partial scale blocks)
      CheckGemm({t, 256, 4096, n});             // few tiles: split-K with atomics
    }
    CheckGemm({t, 1536, 2000, 1});              // the GEMV path (1-2 rows, >= 1024 weight rows) with a k tail
    CheckGemm({t, 2048, 1000, 2});              // BF16: GEMV with a tail; FP8: 1000 is no multiple of 16
    CheckGemm({t, 4096, 1024, 2, 1, 4, 0});     // GEMV on strided x
    CheckGemm({t, 512, 1024, 1, 4});            // grouped projection, decode
    CheckGemm({t, 512, 1024, 40, 4});           // grouped projection, wide
    CheckGemm({t, 768, 1024, 3, 1, 4, 8});      // strided x and y (no split-K: y is not dense)
    CheckGemm({t, 768, 1024, 33, 1, 4, 8});
  }
  for (int64_t n : {1, 17, 64}) CheckGemm({WType::kF32, 600, 700, n, 1, 0, 0, /*tensor_cores=*/false});
  CheckGemm({WType::kBF16, 300, 500, 5, 1, 0, 0, /*tensor_cores=*/false});
}

// The one-row GEMV and its split of k over a block's warps: the plans V4-Flash's shapes get on a 132-SM GPU
// (every k-warp count, both row counts per warp), then each of those shapes and ones with tails (k not a
// whole step, outputs not a whole block, groups) against the CPU, on the tensor-core path and the fp32 one
// (the router gate keeps fp32 logits), with guard bytes around y.
// (The plans are host arithmetic: checked without a device too.)
TEST(CudaOpsTest, GemvPlansForV4FlashShapes) {
  using cuda::WType;
  struct Want {
    WType t;
    int64_t out, in;
    int groups;
    int rows_per_warp, k_warps;
  };
  // Split only below 66 blocks unsplit (half of 132 SMs): fp8 1536x4096 (48 blocks) and the bf16 router gate
  // (32) double their k warps up to 528 blocks or 8 warps; fp8 1024x1024 (32 blocks) stops at 2 (its 2 k steps).
  for (const Want& want : {Want{WType::kFP8, 32768, 1024, 1, 4, 1}, Want{WType::kFP8, 8192, 1024, 1, 4, 1},
                           Want{WType::kFP8, 4096, 4096, 1, 4, 1}, Want{WType::kFP8, 1024, 4096, 8, 4, 1},
                           Want{WType::kFP8, 1536, 4096, 1, 4, 8}, Want{WType::kFP8, 1024, 1024, 1, 4, 2},
                           Want{WType::kBF16, 256, 4096, 1, 1, 8}, Want{WType::kBF16, 1024, 4096, 1, 1, 1},
                           Want{WType::kBF16, 2624, 4096, 1, 1, 1}, Want{WType::kBF16, 129280, 4096, 1, 4, 1}}) {
    cuda::DevW w;
    w.type = want.t;
    w.out = want.out;
    w.in = want.in;
    cuda::GemmCall call;
    call.w = &w;
    call.ldx = want.in * want.groups;
    call.n = 1;
    call.groups = want.groups;
    call.x_group_cols = want.in;
    const cuda::GemvPlan gp = cuda::PlanGemv(call, 132);
    EXPECT_EQ(gp.rows_per_warp, want.rows_per_warp) << want.out << "x" << want.in;
    EXPECT_EQ(gp.k_warps, want.k_warps) << want.out << "x" << want.in;
    EXPECT_EQ(gp.unroll, 2);
  }
}

TEST(CudaOpsTest, GemvSplitKAgainstTheCpu) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  using cuda::WType;
  for (WType t : {WType::kFP8, WType::kBF16}) {
    CheckGemm({t, 1536, 4096, 1});              // FP8: 8 k warps; BF16: unsplit, 1 row per warp
    CheckGemm({t, 1024, 1024, 1});              // FP8: 2 k warps
    CheckGemm({t, 4096, 2048, 1});              // unsplit
    CheckGemm({t, 1024, 1024, 1, 2});           // grouped, FP8: 2 k warps (64 blocks)
    CheckGemm({t, 1100, 2000, 1});              // k tail inside a step, rows inside a block
    CheckGemm({t, 1040, 1040, 1});              // one step and a 16-wide tail
    CheckGemm({t, 256, 4096, 1, 1, 0, 0, /*tensor_cores=*/false});  // the router gate's shape: 8 k warps
    CheckGemm({t, 24, 4096, 1, 1, 0, 0, /*tensor_cores=*/false});   // fewer rows than a block holds
    CheckGemm({t, 203, 2000, 1, 3, 0, 0, /*tensor_cores=*/false});  // groups whose rows end inside a block, k tail
  }
  CheckGemm({WType::kBF16, 16384, 1024, 1});    // 4 rows per warp, unsplit
}

// The weight-streaming kernel (2-64 rows): every fragment count (rows 2, 8 | 9, 16 | 17, 32 | 33, 64), partial
// row fragments, output tails, split-K, long k (several tiles per block), grouped projections, strided and
// unaligned x, strided y (no split-K), BF16 with and without the hi/lo split of x; and the shapes it must
// leave to the older kernels.
TEST(CudaOpsTest, GemmStreamAgainstTheCpu) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  using cuda::WType;
  for (WType t : {WType::kFP8, WType::kBF16}) {
    for (int64_t n : {2, 8, 9, 17, 32, 33, 64}) {
      CheckGemm({t, 1536, 2048, n, 1, 0, 0, true, true, 1});   // 6 or 12 tiles: split-K
      CheckGemm({t, 1000, 1024, n, 1, 0, 0, true, true, 1});   // an output tail inside a 16-row tile
      CheckGemm({t, 512, 8192, n, 1, 0, 0, true, true, 1});    // long k: a deep split
    }
    for (int64_t n : {2, 8}) CheckGemm({t, 40960, 1024, n, 1, 0, 0, true, true, 1});  // > 1 tile per block
    for (int64_t n : {2, 32}) {
      CheckGemm({t, 512, 1024, n, 4, 0, 0, true, true, 1});    // grouped projection
      CheckGemm({t, 768, 1024, n, 1, 4, 0, true, true, 1});    // strided x
      CheckGemm({t, 768, 1024, n, 1, 3, 0, true, true, 1});    // x rows not 16-byte aligned
      CheckGemm({t, 768, 512, n, 1, 4, 8, true, true, 1});     // strided y: no split-K
    }
    CheckGemm({t, 1536, 2048, 24, 1, 0, 0, true, /*split_x=*/false, 1});
    // The older kernels: k not a whole number of chunks, 65 rows, one row.
    CheckGemm({t, 1024, 1000, 8, 1, 0, 0, true, true, 0});
    CheckGemm({t, 1024, 2000, 32, 1, 0, 0, true, true, 0});
    CheckGemm({t, 1024, 1024, 65, 1, 0, 0, true, true, 0});
    CheckGemm({t, 1024, 1024, 1, 1, 0, 0, true, true, 0});
  }
  CheckGemm({WType::kBF16, 1024, 1088, 8, 1, 0, 0, true, true, 1});  // BF16 chunks are 64 wide
  CheckGemm({WType::kFP8, 1024, 1088, 8, 1, 0, 0, true, true, 0});   // FP8 ones 128
  CheckGemm({WType::kFP8, 1000, 1024, 8, 3, 0, 0, true, true, 0});   // groups of 1000 rows: tiles across scale rows
}

TEST(CudaOpsTest, RowKernelsAgainstTheCpu) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  // RMSNorm rows (weighted), in place: |err| <= 1e-5 relative.
  {
    const int64_t n = 17, D = 4096;
    std::vector<float> x(static_cast<size_t>(n * D)), w(D);
    for (float& v : x) v = u(rng);
    for (float& v : w) v = u(rng);
    Guarded dx(x.size());
    CUDA_OK(cudaMemcpy(dx.out(), x.data(), x.size() * 4, cudaMemcpyHostToDevice));
    Dev<float> dw(w.size());
    dw.Put(w);
    cuda::RmsNormRows(dx.out(), n, D, dw.p, 1e-6f, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> all = dx.All();
    ASSERT_TRUE(GuardsIntact(all));
    for (int64_t r = 0; r < n; ++r) {
      double ss = 0;
      for (int64_t i = 0; i < D; ++i) ss += static_cast<double>(x[static_cast<size_t>(r * D + i)]) * x[static_cast<size_t>(r * D + i)];
      const double inv = 1.0 / std::sqrt(ss / D + 1e-6);
      for (int64_t i = 0; i < D; ++i) {
        const double ref = x[static_cast<size_t>(r * D + i)] * inv * w[static_cast<size_t>(i)];
        ASSERT_NEAR(all[static_cast<size_t>(kGuard + r * D + i)], ref, 1e-5 * std::fabs(ref) + 1e-6) << r << "," << i;
      }
    }
  }
  // SwiGLU with a clamp: h = silu(min(g, lim)) · clamp(u, -lim, lim); strided g/u rows.
  {
    const int64_t n = 5, I = 2048, ld = 2 * I;
    const float lim = 2.5f;
    std::vector<float> gu(static_cast<size_t>(n * ld));
    for (float& v : gu) v = u(rng);
    Dev<float> dgu(gu.size());
    dgu.Put(gu);
    Guarded h(static_cast<size_t>(n * I));
    cuda::SwiGlu(dgu.p, dgu.p + I, ld, h.out(), n, I, lim, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> all = h.All();
    ASSERT_TRUE(GuardsIntact(all));
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t i = 0; i < I; ++i) {
        const double g = std::min(gu[static_cast<size_t>(r * ld + i)], lim);
        const double uu = std::clamp(gu[static_cast<size_t>(r * ld + I + i)], -lim, lim);
        const double ref = g / (1.0 + std::exp(-g)) * uu;
        ASSERT_NEAR(all[static_cast<size_t>(kGuard + r * I + i)], ref, 1e-5 * std::fabs(ref) + 1e-6) << r << "," << i;
      }
    }
  }
  // Argmax over a V4-sized vocabulary, ties to the lowest id.
  {
    const int64_t m = 3, V = 129280;
    std::vector<float> logits(static_cast<size_t>(m * V));
    for (float& v : logits) v = u(rng);
    logits[static_cast<size_t>(0 * V + 77)] = 50.0f;
    logits[static_cast<size_t>(1 * V + 129279)] = 60.0f;
    logits[static_cast<size_t>(2 * V + 5000)] = 70.0f;
    logits[static_cast<size_t>(2 * V + 90000)] = 70.0f;  // a tie: the lower id wins
    Dev<float> dl(logits.size());
    dl.Put(logits);
    Dev<unsigned long long> packed(static_cast<size_t>(m));
    cuda::ArgmaxRows(dl.p, m, V, packed.p, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<unsigned long long> got = packed.Get(static_cast<size_t>(m));
    EXPECT_EQ(cuda::ArgmaxOf(got[0]), 77);
    EXPECT_EQ(cuda::ArgmaxOf(got[1]), 129279);
    EXPECT_EQ(cuda::ArgmaxOf(got[2]), 5000);
  }
}

// ---- PackedMoe ---------------------------------------------------------------------------------------------

struct MoeCase {
  int64_t hidden, inter, experts, n, k;
  float limit;
  bool split = true;
  int64_t check_rows = -1;   // rows compared with the reference (-1: all; else row 0, the last and random ones)
  int scale_shift = 0;       // added to every scale byte (large shifts exercise the decode's two-multiply path)
};
std::string Name(const MoeCase& c) {
  return "hidden " + std::to_string(c.hidden) + " inter " + std::to_string(c.inter) + " experts " +
         std::to_string(c.experts) + ", " + std::to_string(c.n) + " rows x " + std::to_string(c.k) + " slots, limit " +
         std::to_string(c.limit) + (c.split ? ", hi+lo" : ", bf16") + ", scale shift " + std::to_string(c.scale_shift);
}

// The routing of a case: every third expert (from 1) is never used; one "hot" expert takes ~30% of the slots
// (many M tiles); ~10% of the slots are -1, ~10% repeat the row's previous slot; row 0 (of n > 1) has every
// slot unused and the last row routes one slot past the last expert (ignored like -1).
void MoeRouting(const MoeCase& c, std::mt19937& rng, std::vector<int32_t>* ids, std::vector<float>* weights) {
  std::vector<int32_t> used;
  for (int32_t e = 0; e < c.experts; ++e)
    if (e % 3 != 1) used.push_back(e);
  std::uniform_int_distribution<size_t> pick(0, used.size() - 1);
  std::uniform_real_distribution<float> u01(0.0f, 1.0f), uw(0.05f, 1.0f);
  const int32_t hot = used[used.size() / 2];
  ids->assign(static_cast<size_t>(c.n * c.k), 0);
  weights->assign(ids->size(), 0.0f);
  for (int64_t r = 0; r < c.n; ++r) {
    for (int64_t j = 0; j < c.k; ++j) {
      const size_t i = static_cast<size_t>(r * c.k + j);
      const float dice = u01(rng);
      int32_t e = dice < 0.3f ? hot : used[pick(rng)];
      if (dice > 0.9f) e = -1;
      if (dice > 0.8f && dice <= 0.9f && j > 0) e = (*ids)[i - 1];
      if (c.n > 1 && r == 0) e = -1;
      if (c.n > 1 && r == c.n - 1 && j == 0) e = static_cast<int32_t>(c.experts);
      (*ids)[i] = e;
      (*weights)[i] = uw(rng);
    }
  }
}

// PackedMoe on random experts packed by ExpertLayer::Pack vs test::ReferenceMoe (float64 on the checkpoint
// format) with its error bound per output: the activations x and h as a bf16 hi + lo pair are off by at most
// 2^-16 relative (test::ActError::kInt8x2 covers that), one bf16 by 2^-8 (kInt8), plus fp32 accumulation (kEps
// below, relative to Σ|w||a|: the tensor cores add with truncation, about one ulp per k16 step, so ~3e-5 over
// 4096 columns, 6e-5 with the two products of hi + lo; the weights are exact in bf16). On top, the normwise
// relative error must stay below 1e-3 (hi + lo) or 4e-2 (bf16): that is the figure to choose the activation
// precision by, printed for every case. Two runs must agree bit for bit, and nothing outside `out` may change.
void CheckPackedMoe(const MoeCase& c) {
  SCOPED_TRACE(Name(c));
  constexpr double kEps = 2e-4;
  std::mt19937 rng(
      static_cast<uint32_t>(c.hidden * 7 + c.inter * 13 + c.experts * 31 + c.n * 3 + c.k + c.scale_shift));
  std::vector<test::OwnedExpert> experts = test::RandomExperts(c.experts, c.hidden, c.inter, rng);
  if (c.scale_shift != 0) {
    for (auto& e : experts)
      for (test::OwnedMxfp4* m : {&e.w1, &e.w3, &e.w2})
        for (uint8_t& s : m->scales) s = static_cast<uint8_t>(s + c.scale_shift);
  }
  auto layer_or = ExpertLayer::Pack(c.hidden, c.inter, test::Refs(experts), Isa::kGeneric, {.huge_pages = false});
  ASSERT_TRUE(layer_or.ok()) << layer_or.status();
  const std::unique_ptr<ExpertLayer> layer = std::move(layer_or).value();
  const int64_t stride = layer->shape().stride();
  ASSERT_EQ(layer->expert_data(1) - layer->expert_data(0), stride);

  std::uniform_real_distribution<float> ux(-1.0f, 1.0f), u01(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(c.n * c.hidden));
  for (float& v : x) v = ux(rng) * (u01(rng) < 0.05f ? 8.0f : 1.0f);  // some outliers
  std::vector<int32_t> ids;
  std::vector<float> weights;
  MoeRouting(c, rng, &ids, &weights);

  Dev<uint8_t> dlayer(static_cast<size_t>(c.experts * stride));
  CUDA_OK(cudaMemcpy(dlayer.p, layer->expert_data(0), static_cast<size_t>(c.experts * stride), cudaMemcpyHostToDevice));
  Dev<float> dx(x.size());
  dx.Put(x);
  Dev<int32_t> dids(ids.size());
  dids.Put(ids);
  Dev<float> dw(weights.size());
  dw.Put(weights);
  const int64_t scratch_bytes = cuda::PackedMoeScratchBytes(c.n, c.k, c.hidden, c.inter);
  ASSERT_GT(scratch_bytes, 0);
  Dev<uint8_t> scratch(static_cast<size_t>(scratch_bytes));
  CUDA_OK(cudaMemset(scratch.p, 0xFF, static_cast<size_t>(scratch_bytes)));  // NaN-ish garbage, not zeros
  Guarded out(static_cast<size_t>(c.n * c.hidden)), again(static_cast<size_t>(c.n * c.hidden));

  cuda::PackedMoeArgs a;
  a.layer = dlayer.p;
  a.num_experts = c.experts;
  a.hidden = c.hidden;
  a.inter = c.inter;
  a.stride = stride;
  a.x = dx.p;
  a.ids = dids.p;
  a.weights = dw.p;
  a.n = c.n;
  a.k = c.k;
  a.swiglu_limit = c.limit;
  a.out = out.out();
  a.scratch = scratch.p;
  a.split_activations = c.split;
  ASSERT_EQ(cuda::PackedMoeCheck(a), "");
  CUDA_OK(cuda::PackedMoe(a, nullptr));
  a.out = again.out();
  CUDA_OK(cuda::PackedMoe(a, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> all = out.All(), all2 = again.All();
  ASSERT_TRUE(GuardsIntact(all)) << "PackedMoe wrote outside its output";
  ASSERT_TRUE(GuardsIntact(all2)) << "PackedMoe wrote outside its output";
  ASSERT_EQ(std::memcmp(all.data(), all2.data(), all.size() * sizeof(float)), 0) << "two runs differ";

  // The rows to check, and their routing with unused slots sent to expert 0 at weight 0 (contributing 0).
  std::vector<int64_t> rows;
  if (c.check_rows < 0 || c.check_rows >= c.n) {
    for (int64_t r = 0; r < c.n; ++r) rows.push_back(r);
  } else {
    rows = {0, c.n - 1};
    std::uniform_int_distribution<int64_t> pick(1, c.n - 2);
    while (static_cast<int64_t>(rows.size()) < c.check_rows) rows.push_back(pick(rng));
  }
  const int64_t m = static_cast<int64_t>(rows.size());
  std::vector<float> sx(static_cast<size_t>(m * c.hidden)), sw(static_cast<size_t>(m * c.k));
  std::vector<int32_t> sid(static_cast<size_t>(m * c.k));
  for (int64_t i = 0; i < m; ++i) {
    const int64_t r = rows[static_cast<size_t>(i)];
    std::copy_n(&x[static_cast<size_t>(r * c.hidden)], c.hidden, &sx[static_cast<size_t>(i * c.hidden)]);
    for (int64_t j = 0; j < c.k; ++j) {
      const int32_t e = ids[static_cast<size_t>(r * c.k + j)];
      const bool valid = e >= 0 && e < c.experts;
      sid[static_cast<size_t>(i * c.k + j)] = valid ? e : 0;
      sw[static_cast<size_t>(i * c.k + j)] = valid ? weights[static_cast<size_t>(r * c.k + j)] : 0.0f;
    }
  }
  const test::Reference ref = test::ReferenceMoe(experts, c.hidden, c.inter, c.limit, sx, sid, sw, m, c.k,
                                                 c.split ? test::ActError::kInt8x2 : test::ActError::kInt8, kEps);
  int64_t bad = 0;
  double worst = 0, err2 = 0, ref2 = 0;
  for (int64_t i = 0; i < m; ++i) {
    const int64_t r = rows[static_cast<size_t>(i)];
    for (int64_t d = 0; d < c.hidden; ++d) {
      const float got = all[static_cast<size_t>(kGuard + r * c.hidden + d)];
      const double want = ref.out[static_cast<size_t>(i * c.hidden + d)];
      const double bound = ref.bound[static_cast<size_t>(i * c.hidden + d)];
      const double err = std::fabs(got - want);
      err2 += err * err;
      ref2 += want * want;
      worst = std::max(worst, err / bound);
      if (!(err <= bound) && bad++ < 5) {
        ADD_FAILURE() << "row " << r << " col " << d << ": " << got << " vs " << want << " (bound " << bound << ")";
      }
    }
  }
  const double rel = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  std::printf("PackedMoe %s: %lld rows checked, normwise relative error %.3g, worst error / bound %.3g\n",
              Name(c).c_str(), static_cast<long long>(m), rel, worst);
  EXPECT_EQ(bad, 0) << "worst error / bound " << worst;
  EXPECT_LE(rel, c.split ? 1e-3 : 4e-2);
  if (c.n > 1) {  // row 0 routes nowhere: exactly zero
    for (int64_t d = 0; d < c.hidden; ++d) ASSERT_EQ(all[static_cast<size_t>(kGuard + d)], 0.0f) << d;
  }
}

TEST(CudaOpsTest, PackedMoeAgainstTheCpu) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  // The tiny fixture's shapes (tests/data/tiny-v4: hidden 128, inter 64 (padded to one super-block), 8
  // experts, limit 1), with its expert count and with 256, every row checked.
  for (int64_t n : {1, 17, 640, 4096}) {
    CheckPackedMoe({128, 64, 8, n, 6, 1.0f});
    CheckPackedMoe({128, 64, 256, n, 6, 1.0f});
  }
  // V4-Flash's shapes (hidden 4096, inter 2048, limit 10) on 12 experts (4 never routed to).
  for (int64_t n : {1, 17, 640, 4096}) CheckPackedMoe({4096, 2048, 12, n, 6, 10.0f, true, 12});
  CheckPackedMoe({4096, 2048, 12, 640, 6, 10.0f, /*split=*/false, 12});  // one bf16 term: the precision choice
  CheckPackedMoe({384, 256, 16, 300, 8, 0.0f});                         // k = 8, no clamp, 3 N blocks of w2
  CheckPackedMoe({256, 160, 5, 70, 6, 0.0f, true, -1, 16});             // scales past 2 (two multiplies); inter tail
  CheckPackedMoe({200, 96, 7, 33, 3, 2.0f});                            // hidden no multiple of 16 or 128
}

// Host-side checks only: runs without a device too.
TEST(CudaOpsTest, PackedMoeRejectsBadArguments) {
  cuda::PackedMoeArgs a;
  a.num_experts = 256;
  a.hidden = 4096;
  a.inter = 2048;
  a.stride = 1;
  a.n = 4;
  a.k = 6;
  EXPECT_NE(cuda::PackedMoeCheck(a).find("stride"), std::string::npos) << cuda::PackedMoeCheck(a);
  EXPECT_EQ(cuda::PackedMoe(a, nullptr), cudaErrorInvalidValue);
  a.stride = 13 << 20;
  EXPECT_NE(cuda::PackedMoeCheck(a).find("out is null"), std::string::npos) << cuda::PackedMoeCheck(a);
  a.k = 99;
  EXPECT_NE(cuda::PackedMoeCheck(a).find("k = 99"), std::string::npos) << cuda::PackedMoeCheck(a);
  a.k = 6;
  a.hidden = 4095;
  EXPECT_NE(cuda::PackedMoeCheck(a).find("hidden = 4095"), std::string::npos) << cuda::PackedMoeCheck(a);
  a.hidden = 4096;
  a.swiglu_limit = -1.0f;
  EXPECT_NE(cuda::PackedMoeCheck(a).find("swiglu_limit"), std::string::npos) << cuda::PackedMoeCheck(a);
  a.swiglu_limit = 0.0f;
  a.n = 0;  // nothing to do
  EXPECT_EQ(cuda::PackedMoeCheck(a), "");
  EXPECT_EQ(cuda::PackedMoe(a, nullptr), cudaSuccess);
}

// ---- attention and the indexer's top-k -------------------------------------------------------------------

// Caches laid out as CudaModel lays them out, with random contents: slot s's window ring at fixed + s·slot_bytes
// (ring_off 0), compressed entries in pages of `epp` entries whose table is a shuffled permutation (so a wrong
// page lookup reads another sequence's data). Values are bf16-exact, so the fp32 and bf16 caches hold the same
// numbers and one host reference serves both.
struct Caches {
  int64_t slots = 0, window = 0, dim = 0, epp = 0, max_pages = 0;
  std::vector<float> ring;     // [slots, window, dim]
  std::vector<float> entries;  // [slots, max_pages·epp, dim]: entry e of slot s
  std::vector<int32_t> table;  // [slots, max_pages]
  float Entry(int64_t slot, int64_t e, int64_t d) const {
    return entries[static_cast<size_t>((slot * max_pages * epp + e) * dim + d)];
  }
  float Ring(int64_t slot, int64_t pos, int64_t d) const {
    return ring[static_cast<size_t>((slot * window + pos % window) * dim + d)];
  }
};

float Bf16Exact(float f) { return Bf16ToFloat(FloatToBf16(f)); }

template <typename CacheT>
std::vector<CacheT> ToCache(const std::vector<float>& v) {
  std::vector<CacheT> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    if constexpr (std::is_same_v<CacheT, float>) {
      o[i] = v[i];
    } else {
      o[i] = __nv_bfloat16(__nv_bfloat16_raw{FloatToBf16(v[i])});
    }
  }
  return o;
}

Caches MakeCaches(int64_t slots, int64_t window, int64_t dim, int64_t max_entries, int64_t epp, std::mt19937& rng,
                  bool equal_entries_in_slot0 = false) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Caches c;
  c.slots = slots, c.window = window, c.dim = dim, c.epp = epp;
  c.max_pages = (max_entries + epp - 1) / epp;
  c.ring.resize(static_cast<size_t>(slots * window * dim));
  for (float& v : c.ring) v = Bf16Exact(u(rng));
  c.entries.resize(static_cast<size_t>(slots * c.max_pages * epp * dim));
  for (float& v : c.entries) v = Bf16Exact(u(rng));
  if (equal_entries_in_slot0) {  // every entry of slot 0 the same: all its scores tie
    for (int64_t e = 1; e < c.max_pages * epp; ++e) {
      std::copy_n(c.entries.begin(), dim, c.entries.begin() + e * dim);
    }
  }
  c.table.resize(static_cast<size_t>(slots * c.max_pages));
  for (size_t i = 0; i < c.table.size(); ++i) c.table[i] = static_cast<int32_t>(i);
  std::shuffle(c.table.begin(), c.table.end(), rng);
  return c;
}

// The caches in device memory as CacheT, and the CacheDev that describes them.
template <typename CacheT>
struct DevCaches {
  Dev<CacheT> fixed, pages;
  Dev<int32_t> table;
  cuda::CacheDev dev;
  explicit DevCaches(const Caches& c)
      : fixed(c.ring.size()), pages(c.entries.size()), table(c.table.size()) {
    fixed.Put(ToCache<CacheT>(c.ring));
    // Page table[s·max_pages + k] holds entries [k·epp, (k+1)·epp) of slot s.
    std::vector<float> by_page(c.entries.size());
    const size_t page = static_cast<size_t>(c.epp * c.dim);
    for (int64_t s = 0; s < c.slots; ++s) {
      for (int64_t k = 0; k < c.max_pages; ++k) {
        const size_t src = static_cast<size_t>((s * c.max_pages + k)) * page;
        const size_t dst = static_cast<size_t>(c.table[static_cast<size_t>(s * c.max_pages + k)]) * page;
        std::copy_n(c.entries.begin() + static_cast<std::ptrdiff_t>(src), page, by_page.begin() + static_cast<std::ptrdiff_t>(dst));
      }
    }
    pages.Put(ToCache<CacheT>(by_page));
    table.Put(c.table);
    dev.fixed = reinterpret_cast<char*>(fixed.p);
    dev.slot_bytes = c.window * c.dim * static_cast<int64_t>(sizeof(CacheT));
    dev.pages = pages.p;
    dev.page_elems = c.epp * c.dim;
    dev.table = table.p;
    dev.max_pages = static_cast<int32_t>(c.max_pages);
  }
};

// A step of several sequences on the device.
struct SeqSpec {
  int32_t slot, rows, start_pos;
};
struct Step {
  std::vector<cuda::StepSeq> seqs;
  std::vector<int32_t> pos, seq;
  std::unique_ptr<Dev<int32_t>> dpos, dseq;
  std::unique_ptr<Dev<cuda::StepSeq>> dseqs;
  cuda::StepDev dev;
  explicit Step(const std::vector<SeqSpec>& list) {
    for (const SeqSpec& q : list) {
      const int32_t begin = static_cast<int32_t>(pos.size());
      seqs.push_back({q.slot, begin, begin + q.rows, q.start_pos});
      for (int32_t t = 0; t < q.rows; ++t) {
        pos.push_back(q.start_pos + t);
        seq.push_back(static_cast<int32_t>(seqs.size() - 1));
      }
    }
    dpos = std::make_unique<Dev<int32_t>>(pos.size());
    dseq = std::make_unique<Dev<int32_t>>(seq.size());
    dseqs = std::make_unique<Dev<cuda::StepSeq>>(seqs.size());
    dpos->Put(pos);
    dseq->Put(seq);
    dseqs->Put(seqs);
    dev.pos = dpos->p;
    dev.seq = dseq->p;
    dev.seqs = dseqs->p;
    dev.n = static_cast<int32_t>(pos.size());
    dev.num_seqs = static_cast<int32_t>(seqs.size());
  }
};

struct AttnCase {
  int type;  // 0 sliding, 1 CSA, 2 HCA
  int heads, hd, rope_dim, window, rate, topk;
};

// The rows of one attention pass: a decode row deep in its context (slot 1; CSA: more entries visible than
// the top-k), a 5-row prefill chunk (slot 0) and the first 3 rows of a sequence (slot 2: fewer keys than the
// window, no compressed entry yet).
std::vector<SeqSpec> MixedRows() { return {{1, 1, 2100}, {0, 5, 333}, {2, 3, 0}}; }
// `rows` decode rows, one per sequence (slot), at scattered positions up to ~2200 (key counts that end in
// every kind of partial tile).
std::vector<SeqSpec> DecodeRows(int rows) {
  std::vector<SeqSpec> v;
  for (int i = 0; i < rows; ++i) v.push_back({i, 1, 2100 - 61 * i + (i % 3) * 7});
  return v;
}
// A verify step: two sequences of 6 rows each (the drafted tokens and the one before them) sharing their keys.
std::vector<SeqSpec> VerifyRows() { return {{0, 6, 2094}, {1, 6, 611}}; }

// Attention of every row against a float64 host reference: softmax over the window keys (this pass's rows,
// then the ring) and the compressed entries (all visible for HCA, the selected ones for CSA), with the sink in
// the denominator, then the output de-rotated by the query position. Keys are values (MQA). Run unsplit, with
// 7 and 40 key splits (more than a warp of splits: the combine's second half) and with the splits
// AttentionSplits picks on a 132-SM GPU (as CudaModel asks: part for 16 x 16 row-splits). `plan_mma`: the
// tensor-core kernel must be the one chosen.
//
// Bounds per output, with w_j the reference's softmax weights (sink included) and M = Σ_j w_j |v_j| (the pair
// of de-roped dims shares the sum of both dims' M):
//   fp32 kernel: 2e-5 · M + 1e-6 (fp32 accumulation over a few hundred keys).
//   tensor-core kernel: (exp(2δ + 2.01u) - 1 + 1e-5) · M + 1e-6, u = 2^-9 (bf16 rounding), where
//   δ = scale · max_j (Σ_i |q_i - bf16(q_i)| · |k_ji| + hd · 2^-24 · 1.01 · Σ_i |q_i k_ji|) bounds the score
//   error from rounding the query to bf16 (keys are bf16 in the cache already) and from summing the hd products
//   in fp32. A score off by at most δ moves each softmax weight by a
//   factor within exp(±2δ); each probability is then rounded to bf16 (relative u) and the sum is taken of the
//   rounded values (another factor (1 ± u)). With queries that are bf16-exact (q_exact) δ is only the fp32
//   term and the bound ~0.4% of M; with random fp32 queries of a head_dim of 512 it is ~2% of M.
template <typename CacheT>
void CheckAttention(const AttnCase& c, const std::vector<SeqSpec>& rows, bool q_exact = false,
                    bool plan_mma = false) {
  const std::string what = std::string(std::is_same_v<CacheT, float> ? "fp32" : "bf16") + " cache, type " +
                           std::to_string(c.type) + ", " + std::to_string(c.heads) + " heads x " +
                           std::to_string(c.hd) + ", " + std::to_string(rows.size()) + " sequences" +
                           (q_exact ? ", bf16-exact queries" : "");
  SCOPED_TRACE(what);
  std::mt19937 rng(11 + c.type);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Step step(rows);
  int64_t slots = 0, max_pos = 0;
  for (const SeqSpec& q : rows) {
    slots = std::max<int64_t>(slots, q.slot + 1);
    max_pos = std::max<int64_t>(max_pos, q.start_pos + q.rows);
  }
  const int64_t n = step.dev.n, ld = static_cast<int64_t>(c.heads) * c.hd;
  const int64_t max_entries = c.rate > 0 ? max_pos / c.rate + 1 : 1;
  const Caches caches = MakeCaches(slots, c.window, c.hd, max_entries, 16, rng);
  DevCaches<CacheT> dc(caches);
  std::vector<float> q(static_cast<size_t>(n * ld)), kv_new(static_cast<size_t>(n * c.hd)), sink(c.heads),
      inv_freq(static_cast<size_t>(c.rope_dim / 2));
  for (float& v : q) v = q_exact ? Bf16Exact(u(rng)) : u(rng);
  for (float& v : kv_new) v = Bf16Exact(u(rng));
  for (float& v : sink) v = u(rng);
  for (int i = 0; i < c.rope_dim / 2; ++i) inv_freq[static_cast<size_t>(i)] = std::pow(10000.0f, -2.0f * i / c.rope_dim);
  std::vector<int32_t> sel(static_cast<size_t>(n * std::max(c.topk, 1)), -1);
  if (c.type == 1) {
    for (int64_t r = 0; r < n; ++r) {
      const int64_t vis = (step.pos[static_cast<size_t>(r)] + 1) / c.rate;
      std::vector<int32_t> all(static_cast<size_t>(vis));
      for (int64_t e = 0; e < vis; ++e) all[static_cast<size_t>(e)] = static_cast<int32_t>(e);
      std::shuffle(all.begin(), all.end(), rng);
      for (int64_t j = 0; j < std::min<int64_t>(c.topk, vis); ++j) sel[static_cast<size_t>(r * c.topk + j)] = all[static_cast<size_t>(j)];
    }
  }
  const std::vector<CacheT> kv_dev = ToCache<CacheT>(kv_new);
  Dev<float> dq(q.size()), dsink(sink.size()), dinv(std::max<size_t>(inv_freq.size(), 1));
  Dev<CacheT> dkv(kv_dev.size());
  Dev<int32_t> dsel(sel.size());
  dq.Put(q);
  dsink.Put(sink);
  dinv.Put(inv_freq);
  dkv.Put(kv_dev);
  dsel.Put(sel);

  cuda::AttnArgs a;
  a.q = dq.p;
  a.ldq = ld;
  a.heads = c.heads;
  a.hd = c.hd;
  a.kv_new = dkv.p;
  a.ring_off = 0;
  a.window = c.window;
  a.type = c.type;
  a.rate = c.rate;
  a.page_off = 0;
  a.epp = static_cast<int32_t>(caches.epp);
  a.sel = c.type == 1 ? dsel.p : nullptr;
  a.topk = c.topk;
  a.sink = dsink.p;
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.hd));
  a.scale = scale;
  a.rope_dim = c.rope_dim;
  a.inv_freq = dinv.p;
  a.ldo = ld;
  const cuda::AttnPlan plan = cuda::PlanAttention<CacheT>(a, dc.dev, n);
  int dev = 0, major = 0;
  CUDA_OK(cudaGetDevice(&dev));
  CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (major >= 9) {  // sm_90 holds both block shapes' tiles; smaller parts may take the fp32 kernel
    EXPECT_EQ(plan.mma, plan_mma);
  }

  // The host reference.
  std::vector<double> ref(static_cast<size_t>(n * ld)), mag(static_cast<size_t>(n * ld)),
      delta(static_cast<size_t>(n * c.heads), 0.0);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t p = step.pos[static_cast<size_t>(r)];
    const cuda::StepSeq& sq = step.seqs[static_cast<size_t>(step.seq[static_cast<size_t>(r)])];
    std::vector<const float*> keys;
    const int64_t nwin = std::min<int64_t>(c.window, p + 1);
    for (int64_t kpos = p - nwin + 1; kpos <= p; ++kpos) {
      if (kpos >= sq.start_pos) {
        keys.push_back(&kv_new[static_cast<size_t>((sq.begin + kpos - sq.start_pos) * c.hd)]);
      } else {
        keys.push_back(&caches.ring[static_cast<size_t>((sq.slot * c.window + kpos % c.window) * c.hd)]);
      }
    }
    const int64_t vis = c.rate > 0 ? (p + 1) / c.rate : 0;
    const int64_t ncomp = c.type == 2 ? vis : c.type == 1 ? std::min<int64_t>(c.topk, vis) : 0;
    for (int64_t j = 0; j < ncomp; ++j) {
      const int64_t e = c.type == 2 ? j : sel[static_cast<size_t>(r * c.topk + j)];
      keys.push_back(&caches.entries[static_cast<size_t>((sq.slot * caches.max_pages * caches.epp + e) * c.hd)]);
    }
    for (int h = 0; h < c.heads; ++h) {
      const float* qh = &q[static_cast<size_t>(r * ld + h * c.hd)];
      std::vector<double> qerr(static_cast<size_t>(c.hd));
      for (int i = 0; i < c.hd; ++i) {
        qerr[static_cast<size_t>(i)] = std::fabs(static_cast<double>(qh[i]) - Bf16Exact(qh[i]));
      }
      std::vector<double> s(keys.size());
      double m = sink[static_cast<size_t>(h)], dmax = 0;
      for (size_t j = 0; j < keys.size(); ++j) {
        double d = 0, e = 0, sa = 0;
        for (int i = 0; i < c.hd; ++i) {
          d += static_cast<double>(qh[i]) * keys[j][i];
          e += qerr[static_cast<size_t>(i)] * std::fabs(keys[j][i]);
          sa += std::fabs(static_cast<double>(qh[i]) * keys[j][i]);
        }
        s[j] = d * scale;
        dmax = std::max(dmax, (e + c.hd * std::ldexp(1.0, -24) * 1.01 * sa) * scale);
        m = std::max(m, s[j]);
      }
      delta[static_cast<size_t>(r * c.heads + h)] = dmax;
      double L = std::exp(sink[static_cast<size_t>(h)] - m);
      for (double& v : s) L += (v = std::exp(v - m));
      std::vector<double> o(static_cast<size_t>(c.hd), 0.0), om(static_cast<size_t>(c.hd), 0.0);
      for (size_t j = 0; j < keys.size(); ++j) {
        for (int i = 0; i < c.hd; ++i) {
          o[static_cast<size_t>(i)] += s[j] / L * keys[j][i];
          om[static_cast<size_t>(i)] += s[j] / L * std::fabs(keys[j][i]);
        }
      }
      const int base = c.hd - c.rope_dim;
      for (int d = 0; d < c.hd; d += 2) {
        double o0 = o[static_cast<size_t>(d)], o1 = o[static_cast<size_t>(d + 1)];
        if (d >= base) {
          const double ang = static_cast<double>(p) * inv_freq[static_cast<size_t>((d - base) / 2)];
          const double cs = std::cos(ang), sn = std::sin(ang);
          const double t0 = o0 * cs + o1 * sn, t1 = o1 * cs - o0 * sn;
          o0 = t0, o1 = t1;
        }
        ref[static_cast<size_t>(r * ld + h * c.hd + d)] = o0;
        ref[static_cast<size_t>(r * ld + h * c.hd + d + 1)] = o1;
        mag[static_cast<size_t>(r * ld + h * c.hd + d)] = om[static_cast<size_t>(d)] + om[static_cast<size_t>(d + 1)];
        mag[static_cast<size_t>(r * ld + h * c.hd + d + 1)] = om[static_cast<size_t>(d)] + om[static_cast<size_t>(d + 1)];
      }
    }
  }

  // The queries also as CudaModel hands them to the tensor-core kernel in bf16 mode: rounded to bf16 by
  // NormRope (round to nearest even, as the kernel rounds q itself), so the same bound holds.
  std::vector<float> q_rounded(q.size());
  for (size_t i = 0; i < q.size(); ++i) q_rounded[i] = Bf16Exact(q[i]);
  const std::vector<CacheT> q16_host = ToCache<CacheT>(q_rounded);
  Dev<CacheT> dq16(q16_host.size());
  dq16.Put(q16_host);
  const int chosen = cuda::AttentionSplits<CacheT>(a, dc.dev, n, 132, 16, 16 * 16);
  for (int run = 0; run < (plan.mma ? 8 : 4); ++run) {
    const int splits = std::array<int, 4>{1, 7, 40, chosen}[static_cast<size_t>(run % 4)];
    a.q16 = run >= 4 ? dq16.p : nullptr;
    const std::string how = std::to_string(splits) + " splits" + (run >= 4 ? ", bf16 queries given" : "");
    Guarded out(static_cast<size_t>(n * ld));
    Dev<float> part(static_cast<size_t>(n * c.heads * splits * (c.hd + 2)));
    a.out = out.out();
    a.splits = splits;
    a.part = splits > 1 ? part.p : nullptr;
    cuda::Attention<CacheT>(a, step.dev, dc.dev, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> all = out.All();
    ASSERT_TRUE(GuardsIntact(all)) << what << ", " << how;
    int bad = 0;
    double worst = 0;  // the largest error as a share of its bound
    for (int64_t i = 0; i < n * ld; ++i) {
      const double M = mag[static_cast<size_t>(i)];
      const double dl = delta[static_cast<size_t>((i / ld) * c.heads + (i % ld) / c.hd)];
      const double bound = plan.mma ? (std::expm1(2 * dl + 2.01 * std::ldexp(1.0, -9)) + 1e-5) * M + 1e-6
                                    : 2e-5 * M + 1e-6;
      const double err = std::fabs(all[static_cast<size_t>(kGuard + i)] - ref[static_cast<size_t>(i)]);
      worst = std::max(worst, err / bound);
      if (!(err <= bound) && bad++ < 5) {
        ADD_FAILURE() << what << ", " << how << ": row " << i / ld << " head " << (i % ld) / c.hd
                      << " dim " << i % c.hd << ": " << all[static_cast<size_t>(kGuard + i)] << " vs "
                      << ref[static_cast<size_t>(i)] << " (bound " << bound << ")";
      }
    }
    EXPECT_EQ(bad, 0) << what << ", " << how;
    std::printf("attention %s (%s kernel), %s: worst error %.3g of the bound\n", what.c_str(),
                plan.mma ? "tensor-core" : "fp32", how.c_str(), worst);
  }
}

TEST(CudaOpsTest, AttentionEveryTypeSplitAndUnsplitAgainstTheCpu) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  // V4-Flash's attention shape (head_dim 512, rope 64, window 128, CSA rate 4 / top-k 512, HCA rate 128) with
  // 8 local heads (the fp32 kernel for either cache: fewer than 32 heads), and tiny-v4's (4 heads of 64, rope
  // 16, window 8, top-k 3).
  for (const AttnCase& c : {AttnCase{0, 8, 512, 64, 128, 0, 0}, AttnCase{1, 8, 512, 64, 128, 4, 512},
                            AttnCase{2, 8, 512, 64, 128, 128, 0}, AttnCase{0, 4, 64, 16, 8, 0, 0},
                            AttnCase{1, 4, 64, 16, 8, 4, 3}, AttnCase{2, 4, 64, 16, 8, 128, 0},
                            AttnCase{1, 6, 64, 16, 8, 4, 3}}) {  // 6 heads: two blocks of 2 heads (HeadsPerBlock)
    CheckAttention<float>(c, MixedRows());
    CheckAttention<__nv_bfloat16>(c, MixedRows());
  }
}

// The tensor-core kernel (bf16 caches, head_dim 512): 64 local heads (one block per row and split) and 32
// (TP=2: the 32-head block), every attention type, on decode passes of 4, 8 and 32 rows (1 row: the fp32
// kernel), a verify pass and mixed prefill rows; fp32 caches of the same shape take the fp32 kernel and meet its tighter bound.
TEST(CudaOpsTest, AttentionTensorCoresAgainstTheCpu) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  for (int heads : {64, 32}) {
    for (const AttnCase& c : {AttnCase{0, heads, 512, 64, 128, 0, 0}, AttnCase{1, heads, 512, 64, 128, 4, 512},
                              AttnCase{2, heads, 512, 64, 128, 128, 0}}) {
      // One row takes the fp32 kernel (kAttnMmaMinRows); four are the fewest on tensor cores.
      CheckAttention<__nv_bfloat16>(c, DecodeRows(1), false, false);
      CheckAttention<__nv_bfloat16>(c, DecodeRows(4), true, true);
      CheckAttention<__nv_bfloat16>(c, DecodeRows(8), false, true);
      CheckAttention<__nv_bfloat16>(c, VerifyRows(), false, true);
      CheckAttention<__nv_bfloat16>(c, MixedRows(), true, true);
      if (heads == 64) {
        CheckAttention<__nv_bfloat16>(c, DecodeRows(32), false, true);
        CheckAttention<float>(c, DecodeRows(8), false, false);
      }
    }
  }
}

// The indexer: scores of every visible entry against the host formula (Σ_h w_h/√ih · relu(q_h·k)) / √id, bound
// 1e-5 · Σ|terms| + 1e-6), and the selection exact against the kernel's own scores: top-k, the k-th score's
// ties to the lowest entries. Rows with fewer entries than k, just more, a few thousand (scores in shared
// memory) and over 24576 (the radix select reads them from global memory), and a slot whose entries are all
// equal (every score ties: entries 0..k-1).
template <typename CacheT>
void CheckIndexTopK(int ih, int id, int rate, int topk, int extra_rows = 0) {
  const std::string what = std::string(std::is_same_v<CacheT, float> ? "fp32" : "bf16") + " cache, " +
                           std::to_string(ih) + " heads x " + std::to_string(id) + ", top-" + std::to_string(topk) +
                           ", " + std::to_string(extra_rows) + " extra rows";
  std::mt19937 rng(5 + topk);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const int32_t deep = 4 * 26000 + 3;
  std::vector<SeqSpec> rows = {{1, 1, rate * (topk / 2)}, {2, 2, rate * (topk + 1) - 1}, {1, 1, rate * 3000 + 1},
                               {0, 2, rate * (topk + 5)}};
  // More decode rows (a batch-32 pass: several groups of entries per block), before the deep one.
  for (int i = 0; i < extra_rows; ++i) rows.push_back({1 + i % 2, 1, rate * (topk + 37 * i) + i % rate});
  rows.push_back({2, 1, deep});
  Step step(rows);
  const int64_t n = step.dev.n, max_vis = (deep + 1) / rate;
  int64_t max_vis_rest = 0;  // of every row but the last (deep) one
  for (int64_t r = 0; r + 1 < n; ++r) max_vis_rest = std::max<int64_t>(max_vis_rest, (step.pos[static_cast<size_t>(r)] + 1) / rate);
  const Caches caches = MakeCaches(3, 1, id, max_vis + 1, 64, rng, /*equal_entries_in_slot0=*/true);
  DevCaches<CacheT> dc(caches);
  std::vector<float> iq(static_cast<size_t>(n * ih * id)), iw(static_cast<size_t>(n * ih));
  for (float& v : iq) v = u(rng);
  for (float& v : iw) v = u(rng);
  Dev<float> diq(iq.size()), diw(iw.size()), scores(static_cast<size_t>(n * max_vis));
  Dev<int32_t> sel(static_cast<size_t>(n * topk));
  diq.Put(iq);
  diw.Put(iw);
  sel.Put(std::vector<int32_t>(static_cast<size_t>(n * topk), -7));
  cuda::IndexArgs a;
  a.iq = diq.p;
  a.ldq = static_cast<int64_t>(ih) * id;
  a.iw = diw.p;
  a.ldw = ih;
  a.ih = ih, a.id = id, a.rate = rate, a.topk = topk;
  a.page_off = 0;
  a.epp = static_cast<int32_t>(caches.epp);
  // Two calls, as the backend makes them for row ranges: the short rows (scores in shared memory), then the
  // deep row alone (scores and row r0 + i at scores + i·lds).
  cuda::IndexTopK<CacheT>(a, step.dev, dc.dev, 0, n - 1, max_vis_rest, scores.p, max_vis, sel.p, nullptr);
  cuda::IndexTopK<CacheT>(a, step.dev, dc.dev, n - 1, 1, max_vis, scores.p + (n - 1) * max_vis, max_vis, sel.p,
                          nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got_s = scores.Get(static_cast<size_t>(n * max_vis));
  const std::vector<int32_t> got = sel.Get(static_cast<size_t>(n * topk));
  for (int64_t r = 0; r < n; ++r) {
    const int64_t vis = (step.pos[static_cast<size_t>(r)] + 1) / rate;
    const int64_t slot = step.seqs[static_cast<size_t>(step.seq[static_cast<size_t>(r)])].slot;
    const float* sc = &got_s[static_cast<size_t>(r * max_vis)];
    int bad = 0;
    for (int64_t e = 0; e < vis; ++e) {
      double ref = 0, mag = 0;
      for (int h = 0; h < ih; ++h) {
        double d = 0;
        for (int i = 0; i < id; ++i) d += static_cast<double>(iq[static_cast<size_t>((r * ih + h) * id + i)]) * caches.Entry(slot, e, i);
        const double w = iw[static_cast<size_t>(r * ih + h)] / std::sqrt(static_cast<double>(ih));
        ref += w * std::max(d, 0.0);
        mag += std::fabs(w) * std::fabs(d);
      }
      ref /= std::sqrt(static_cast<double>(id));
      mag /= std::sqrt(static_cast<double>(id));
      if (!(std::fabs(sc[e] - ref) <= 1e-5 * mag + 1e-6) && bad++ < 5) {
        ADD_FAILURE() << what << ": row " << r << " entry " << e << " score " << sc[e] << " vs " << ref;
      }
    }
    const int64_t k = std::min<int64_t>(topk, vis);
    std::vector<char> chosen(static_cast<size_t>(vis), 0);
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = got[static_cast<size_t>(r * topk + j)];
      ASSERT_TRUE(e >= 0 && e < vis) << what << ": row " << r << " slot " << j << " = " << e << " (visible " << vis << ")";
      ASSERT_FALSE(chosen[static_cast<size_t>(e)]) << what << ": row " << r << " picks entry " << e << " twice";
      chosen[static_cast<size_t>(e)] = 1;
    }
    for (int64_t j = k; j < topk; ++j) {
      EXPECT_EQ(got[static_cast<size_t>(r * topk + j)], -7) << what << ": row " << r;
    }
    float kth = INFINITY;
    int64_t last_tied = -1;
    for (int64_t e = 0; e < vis; ++e) {
      if (chosen[static_cast<size_t>(e)]) kth = std::min(kth, sc[e]);
    }
    for (int64_t e = 0; e < vis; ++e) {
      if (chosen[static_cast<size_t>(e)] && sc[e] == kth) last_tied = e;
    }
    for (int64_t e = 0; e < vis; ++e) {
      if (chosen[static_cast<size_t>(e)]) continue;
      ASSERT_LE(sc[e], kth) << what << ": row " << r << " leaves out entry " << e << " above the k-th score";
      if (sc[e] == kth) {
        ASSERT_GT(e, last_tied) << what << ": row " << r << ": a tie must go to the lower entry";
      }
    }
    if (slot == 0 && vis > topk) {  // every score equal: the first k entries
      for (int64_t j = 0; j < k; ++j) {
        EXPECT_TRUE(chosen[static_cast<size_t>(j)]) << what << ": row " << r << " entry " << j;
      }
    }
  }
}

TEST(CudaOpsTest, IndexerScoresAndTopKAgainstTheCpu) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  CheckIndexTopK<float>(64, 128, 4, 512);  // V4-Flash's indexer
  CheckIndexTopK<__nv_bfloat16>(64, 128, 4, 512);
  CheckIndexTopK<__nv_bfloat16>(64, 128, 4, 512, 33);  // 39 rows in the first call
  CheckIndexTopK<float>(8, 32, 4, 3, 30);
  CheckIndexTopK<float>(8, 32, 4, 3);      // tiny-v4's
}

// ---- mHC (HcMix, HcPre, HcPostMix) and norm + rope ------------------------------------------------------------

// The mHC pre step of one row as the CPU backend computes it (CpuModel::HyperPre and CollapseStreams, which
// are private to it; here in double): the mix from the RMS-normalised streams, pre and post, the Sinkhorn
// comb, u = Σ pre_j X_j and xn = RMSNorm_w(u).
struct HcRef {
  std::vector<double> post, comb, u, xn;
};
struct HcW {
  int hc = 4;
  int64_t D = 0;
  std::vector<float> fn, base, norm_w;
  float scale[3] = {0.5f, 0.7f, 1.3f};
  int m(bool head) const { return head ? hc : (2 + hc) * hc; }
};
HcW MakeHcW(int64_t D, bool head, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  HcW w;
  w.D = D;
  const int64_t K = w.hc * D;
  w.fn.resize(static_cast<size_t>(w.m(head) * K));
  for (float& v : w.fn) v = u(rng) * 1.5f / std::sqrt(static_cast<float>(K));  // mix values of order 1
  w.base.resize(static_cast<size_t>(w.m(head)));
  for (float& v : w.base) v = 0.5f * u(rng);
  w.norm_w.resize(static_cast<size_t>(D));
  for (float& v : w.norm_w) v = 1.0f + 0.5f * u(rng);
  return w;
}
constexpr double kHcEps = 1e-6, kRmsEps = 1e-6;
constexpr int kSinkhornIters = 20;

HcRef HcPreRef(const float* x, const HcW& w, bool head) {
  const int hc = w.hc, m = w.m(head);
  const int64_t D = w.D, K = hc * D;
  auto sig = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  double ss = 0;
  for (int64_t k = 0; k < K; ++k) ss += static_cast<double>(x[k]) * x[k];
  const double inv = 1.0 / std::sqrt(ss / static_cast<double>(K) + kRmsEps);
  std::vector<double> mix(static_cast<size_t>(m));
  for (int o = 0; o < m; ++o) {
    double s = 0;
    for (int64_t k = 0; k < K; ++k) s += static_cast<double>(x[k]) * w.fn[static_cast<size_t>(o * K + k)];
    mix[static_cast<size_t>(o)] = s * inv;
  }
  HcRef ref;
  std::vector<double> pre(static_cast<size_t>(hc));
  for (int j = 0; j < hc; ++j) pre[static_cast<size_t>(j)] = sig(mix[static_cast<size_t>(j)] * w.scale[0] + w.base[static_cast<size_t>(j)]) + kHcEps;
  if (!head) {
    ref.post.resize(static_cast<size_t>(hc));
    for (int j = 0; j < hc; ++j) {
      ref.post[static_cast<size_t>(j)] = 2.0 * sig(mix[static_cast<size_t>(hc + j)] * w.scale[1] + w.base[static_cast<size_t>(hc + j)]);
    }
    std::vector<double>& C = ref.comb;
    C.resize(static_cast<size_t>(hc * hc));
    for (int j = 0; j < hc; ++j) {
      double mx = -1e300, s = 0;
      for (int i = 0; i < hc; ++i) {
        const size_t e = static_cast<size_t>(j * hc + i);
        C[e] = mix[static_cast<size_t>(2 * hc) + e] * w.scale[2] + w.base[static_cast<size_t>(2 * hc) + e];
        mx = std::max(mx, C[e]);
      }
      for (int i = 0; i < hc; ++i) s += (C[static_cast<size_t>(j * hc + i)] = std::exp(C[static_cast<size_t>(j * hc + i)] - mx));
      for (int i = 0; i < hc; ++i) C[static_cast<size_t>(j * hc + i)] = C[static_cast<size_t>(j * hc + i)] / s + kHcEps;
    }
    auto norm = [&](bool cols) {
      for (int a = 0; a < hc; ++a) {
        double s = 0;
        for (int b = 0; b < hc; ++b) s += C[static_cast<size_t>(cols ? b * hc + a : a * hc + b)];
        for (int b = 0; b < hc; ++b) C[static_cast<size_t>(cols ? b * hc + a : a * hc + b)] /= (s + kHcEps);
      }
    };
    norm(true);
    for (int it = 1; it < kSinkhornIters; ++it) {
      norm(false);
      norm(true);
    }
  }
  ref.u.resize(static_cast<size_t>(D));
  double su = 0;
  for (int64_t d = 0; d < D; ++d) {
    double s = 0;
    for (int j = 0; j < hc; ++j) s += pre[static_cast<size_t>(j)] * x[j * D + d];
    ref.u[static_cast<size_t>(d)] = s;
    su += s * s;
  }
  const double inv_u = 1.0 / std::sqrt(su / static_cast<double>(D) + kRmsEps);
  ref.xn.resize(static_cast<size_t>(D));
  for (int64_t d = 0; d < D; ++d) ref.xn[static_cast<size_t>(d)] = ref.u[static_cast<size_t>(d)] * inv_u * w.norm_w[static_cast<size_t>(d)];
  return ref;
}

// The mHC weights on the device and HcPre's arguments for them (outputs not set).
struct DevHcW {
  Dev<float> fn, base, scale, norm_w;
  cuda::DevW w;
  explicit DevHcW(const HcW& h, bool head) : fn(h.fn.size()), base(h.base.size()), scale(3), norm_w(h.norm_w.size()) {
    fn.Put(h.fn);
    base.Put(h.base);
    scale.Put(std::vector<float>(h.scale, h.scale + 3));
    norm_w.Put(h.norm_w);
    w.type = cuda::WType::kF32;
    w.data = fn.p;
    w.out = h.m(head);
    w.in = h.hc * h.D;
  }
  cuda::HcPreArgs Args(const float* X, int64_t n, const HcW& h, bool head) const {
    cuda::HcPreArgs a;
    a.base = base.p;
    a.scale = scale.p;
    a.X = X;
    a.norm_w = norm_w.p;
    a.n = n;
    a.D = h.D;
    a.hc = h.hc;
    a.iters = kSinkhornIters;
    a.hc_eps = static_cast<float>(kHcEps);
    a.rms_eps = static_cast<float>(kRmsEps);
    a.head_mode = head;
    return a;
  }
};

bool NoSentinel(const std::vector<float>& all) {
  for (int64_t i = kGuard; i < static_cast<int64_t>(all.size()) - kGuard; ++i) {
    if (IsSentinel(all[static_cast<size_t>(i)])) return false;
  }
  return true;
}

// HcPre of n rows of X on the device (HcMix's partial sums where HcMixFits, else RowInvRms + the fp32 GEMM, as
// CudaModel::HcPreStep chooses; `part` given: those sums were made already) against HcPreRef. Bounds: post
// and comb 2e-5 absolute (values in (0, 2)), xn and u 1e-4 relative + 1e-5.
void CheckHcPreRows(const float* dX, const std::vector<float>& X, int64_t n, const HcW& h, const DevHcW& dw, bool head,
                    const float* part, const std::string& what) {
  SCOPED_TRACE(what + ": " + std::to_string(n) + " rows, D " + std::to_string(h.D) + (head ? ", head" : ""));
  const int hc = h.hc, m = h.m(head);
  const int64_t D = h.D, K = hc * D;
  Guarded xn(static_cast<size_t>(n * D)), post(static_cast<size_t>(n * hc)), comb(static_cast<size_t>(n * hc * hc)),
      u_out(static_cast<size_t>(n * D));
  Dev<float> dpart(static_cast<size_t>(std::min<int64_t>(n, cuda::kHcMixMaxRows) * cuda::kHcMixSplits * (m + 1)));
  Dev<float> inv(static_cast<size_t>(n)), mix(static_cast<size_t>(n * m));
  cuda::HcPreArgs a = dw.Args(dX, n, h, head);
  if (part != nullptr) {
    a.part = part;
  } else if (cuda::HcMixFits(dw.w, n)) {
    cuda::HcMix(dX, dw.w, n, dpart.p, nullptr);
    a.part = dpart.p;
  } else {
    cuda::RowInvRms(dX, n, K, static_cast<float>(kRmsEps), inv.p, nullptr);
    cuda::GemmCall g;
    g.w = &dw.w;
    g.x = dX;
    g.ldx = K;
    g.n = n;
    g.y = mix.p;
    g.ldy = m;
    cuda::Gemm(g, false, Sms(), nullptr);
    a.mixraw = mix.p;
    a.inv = inv.p;
  }
  a.xn = xn.out();
  if (head) {
    a.u_out = u_out.out();
  } else {
    a.post = post.out();
    a.comb = comb.out();
  }
  cuda::HcPre(a, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> gx = xn.All(), gp = post.All(), gc = comb.All(), gu = u_out.All();
  ASSERT_TRUE(GuardsIntact(gx) && GuardsIntact(gp) && GuardsIntact(gc) && GuardsIntact(gu));
  ASSERT_TRUE(NoSentinel(gx));
  ASSERT_TRUE(head ? NoSentinel(gu) : NoSentinel(gp) && NoSentinel(gc));
  for (int64_t r = 0; r < n; ++r) {
    const HcRef ref = HcPreRef(X.data() + r * K, h, head);
    for (int64_t d = 0; d < D; ++d) {
      const double want = ref.xn[static_cast<size_t>(d)];
      ASSERT_NEAR(gx[static_cast<size_t>(kGuard + r * D + d)], want, 1e-4 * std::fabs(want) + 1e-5) << "xn " << r << "," << d;
      if (head) {
        const double wu = ref.u[static_cast<size_t>(d)];
        ASSERT_NEAR(gu[static_cast<size_t>(kGuard + r * D + d)], wu, 1e-4 * std::fabs(wu) + 1e-5) << "u " << r << "," << d;
      }
    }
    if (head) continue;
    for (int j = 0; j < hc; ++j) {
      ASSERT_NEAR(gp[static_cast<size_t>(kGuard + r * hc + j)], ref.post[static_cast<size_t>(j)], 2e-5) << "post " << r << "," << j;
    }
    for (int e = 0; e < hc * hc; ++e) {
      ASSERT_NEAR(gc[static_cast<size_t>(kGuard + r * hc * hc + e)], ref.comb[static_cast<size_t>(e)], 2e-5) << "comb " << r << "," << e;
    }
  }
}

void CheckHcPre(int64_t n, int64_t D, bool head, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const HcW h = MakeHcW(D, head, rng);
  const DevHcW dw(h, head);
  std::vector<float> X(static_cast<size_t>(n * h.hc * D));
  for (float& v : X) v = u(rng);
  Dev<float> dX(X.size());
  dX.Put(X);
  CheckHcPreRows(dX.p, X, n, h, dw, head, nullptr, cuda::HcMixFits(dw.w, n) ? "HcMix + HcPre" : "GEMM + HcPre");
}

// HcPostMix: X' = post·(y [+ y2]) + combᵀ·X (as the CPU's HyperPost, in double) in place with guards, its partial sums
// added over the chunks against X'·fnᵀ and |X'|² (1e-5 of the sum of |terms|), and HcPre on them.
void CheckHcPostMix(int64_t n, int64_t D, bool with_y2, std::mt19937& rng) {
  SCOPED_TRACE("HcPostMix: " + std::to_string(n) + " rows, D " + std::to_string(D) + (with_y2 ? ", y + y2" : ""));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const HcW h = MakeHcW(D, false, rng);
  const DevHcW dw(h, false);
  const int hc = h.hc, m = h.m(false);
  const int64_t K = hc * D;
  ASSERT_TRUE(cuda::HcPostMixFits(dw.w, n, hc, D));
  std::vector<float> X(static_cast<size_t>(n * K)), y(static_cast<size_t>(n * D)), y2(y.size(), 0.0f),
      post(static_cast<size_t>(n * hc)), comb(static_cast<size_t>(n * hc * hc));
  for (float& v : X) v = u(rng);
  for (float& v : y) v = u(rng);
  if (with_y2) {
    for (float& v : y2) v = u(rng);
  }
  for (float& v : post) v = 1.0f + u(rng);
  for (float& v : comb) v = 0.25f + 0.2f * u(rng);
  Guarded gX(X.size()), part(static_cast<size_t>(n * cuda::kHcMixSplits * (m + 1)));
  CUDA_OK(cudaMemcpy(gX.out(), X.data(), X.size() * 4, cudaMemcpyHostToDevice));
  Dev<float> dy(y.size()), dy2(y2.size()), dpost(post.size()), dcomb(comb.size());
  dy.Put(y);
  dy2.Put(y2);
  dpost.Put(post);
  dcomb.Put(comb);
  cuda::HcPostMixArgs a;
  a.y = dy.p;
  a.y2 = with_y2 ? dy2.p : nullptr;
  a.post = dpost.p;
  a.comb = dcomb.p;
  a.X = gX.out();
  a.W = dw.fn.p;
  a.part = part.out();
  a.n = n;
  a.D = D;
  cuda::HcPostMix(a, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> gx = gX.All(), gpart = part.All();
  ASSERT_TRUE(GuardsIntact(gx) && GuardsIntact(gpart) && NoSentinel(gpart));
  std::vector<float> Xp(X.size());
  for (int64_t r = 0; r < n; ++r) {
    for (int i = 0; i < hc; ++i) {
      for (int64_t d = 0; d < D; ++d) {
        const float yv = y[static_cast<size_t>(r * D + d)] + y2[static_cast<size_t>(r * D + d)];
        double s = static_cast<double>(post[static_cast<size_t>(r * hc + i)]) * yv;
        for (int j = 0; j < hc; ++j) {
          s += static_cast<double>(comb[static_cast<size_t>(r * hc * hc + j * hc + i)]) * X[static_cast<size_t>(r * K + j * D + d)];
        }
        const size_t at = static_cast<size_t>(r * K + i * D + d);
        ASSERT_NEAR(gx[kGuard + at], s, 1e-5 * std::fabs(s) + 1e-6) << "X " << r << "," << i << "," << d;
        Xp[at] = gx[kGuard + at];
      }
    }
    for (int o = 0; o <= m; ++o) {
      double want = 0, mag = 0, got = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double x = Xp[static_cast<size_t>(r * K + k)];
        const double t = o < m ? x * h.fn[static_cast<size_t>(o * K + k)] : x * x;
        want += t;
        mag += std::fabs(t);
      }
      for (int s = 0; s < cuda::kHcMixSplits; ++s) got += gpart[static_cast<size_t>(kGuard + (r * cuda::kHcMixSplits + s) * (m + 1) + o)];
      ASSERT_NEAR(got, want, 1e-5 * mag + 1e-6) << "mix " << r << "," << o;
    }
  }
  CheckHcPreRows(gX.out(), Xp, n, h, dw, false, part.out(), "HcPostMix + HcPre");
}

TEST(CudaOpsTest, MhcKernelsAgainstTheCpu) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(11);
  for (const int64_t n : {1, 8, 32, 64, 65, 100}) CheckHcPre(n, 4096, false, rng);  // 65, 100: prefill (the GEMM)
  for (const int64_t n : {1, 8, 65}) CheckHcPre(n, 4096, true, rng);
  CheckHcPre(3, 256, false, rng);  // tiny-v4's width
  CheckHcPre(1, 102, false, rng);  // no float4 path, no HcMix
  for (const int64_t n : {1, 8, 32, 64}) CheckHcPostMix(n, 4096, n == 8, rng);
  CheckHcPostMix(1, 4096, true, rng);
  CheckHcPostMix(5, 256, false, rng);
}

// NormRope, two jobs per launch as the attention phase runs them (q_a's norm with kv's norm + rope in one
// buffer; the heads of q with the indexer's unnormed queries), against the CPU's RmsNorm and ApplyRope per
// head: 1e-5 relative + 1e-5 (the rope's angles reach ~5000 rad), the CacheT copy within its rounding.
template <typename CacheT>
void CheckNormRope(int64_t n, std::mt19937& rng) {
  SCOPED_TRACE(std::string("NormRope ") + (std::is_same_v<CacheT, float> ? "fp32" : "bf16") + ", " +
               std::to_string(n) + " rows");
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  const int rope = 64;
  std::vector<float> inv_freq(rope / 2);
  for (int i = 0; i < rope / 2; ++i) inv_freq[static_cast<size_t>(i)] = std::pow(10000.0f, -2.0f * i / rope);
  std::vector<int32_t> pos(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) pos[static_cast<size_t>(r)] = static_cast<int32_t>(4000 + 37 * r);
  Dev<float> dfreq(inv_freq.size());
  dfreq.Put(inv_freq);
  Dev<int32_t> dpos(pos.size());
  dpos.Put(pos);
  struct Job {
    int heads, hd;
    int64_t ld, col;  // row stride and first column in the buffer
    bool norm, weighted, rope, copy;
  };
  auto run = [&](const std::vector<Job>& jobs, int64_t width) {
    std::vector<float> x(static_cast<size_t>(n * width));
    for (float& v : x) v = u(rng);
    Guarded gx(x.size());
    CUDA_OK(cudaMemcpy(gx.out(), x.data(), x.size() * 4, cudaMemcpyHostToDevice));
    std::vector<std::vector<float>> w(jobs.size());
    std::vector<std::unique_ptr<Dev<float>>> dw;
    std::vector<std::unique_ptr<Dev<CacheT>>> copy;
    cuda::NormRopeJobs<CacheT> nj;
    for (size_t i = 0; i < jobs.size(); ++i) {
      const Job& jb = jobs[i];
      w[i].resize(static_cast<size_t>(jb.hd));
      for (float& v : w[i]) v = 1.0f + 0.3f * u(rng);
      dw.push_back(std::make_unique<Dev<float>>(w[i].size()));
      dw.back()->Put(w[i]);
      copy.push_back(std::make_unique<Dev<CacheT>>(static_cast<size_t>(n * jb.heads * jb.hd)));
      nj.j[nj.count++] = {gx.out() + jb.col, jb.heads, jb.hd, jb.ld, jb.weighted ? dw.back()->p : nullptr, jb.norm,
                          1e-6f, jb.rope ? rope : 0, jb.rope ? dfreq.p : nullptr, jb.copy ? copy.back()->p : nullptr};
    }
    cuda::NormRope<CacheT>(nj, n, dpos.p, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> all = gx.All();
    ASSERT_TRUE(GuardsIntact(all));
    std::vector<bool> touched(x.size(), false);
    for (size_t i = 0; i < jobs.size(); ++i) {
      const Job& jb = jobs[i];
      std::vector<CacheT> cp;
      if (jb.copy) cp = copy[i]->Get(static_cast<size_t>(n * jb.heads * jb.hd));
      for (int64_t r = 0; r < n; ++r) {
        for (int h = 0; h < jb.heads; ++h) {
          const size_t at = static_cast<size_t>(r * jb.ld + jb.col + h * jb.hd);
          std::vector<float> v(x.begin() + static_cast<std::ptrdiff_t>(at), x.begin() + static_cast<std::ptrdiff_t>(at + jb.hd));
          if (jb.norm) cpu::RmsNorm(v.data(), jb.weighted ? w[i].data() : nullptr, jb.hd, 1e-6f, v.data());
          if (jb.rope) cpu::ApplyRope(v.data(), jb.hd, rope, inv_freq.data(), pos[static_cast<size_t>(r)]);
          for (int d = 0; d < jb.hd; ++d) {
            const float got = all[kGuard + at + static_cast<size_t>(d)];
            ASSERT_NEAR(got, v[static_cast<size_t>(d)], 1e-5 * std::fabs(v[static_cast<size_t>(d)]) + 1e-5)
                << "job " << i << " row " << r << " head " << h << " ch " << d;
            touched[at + static_cast<size_t>(d)] = true;
            if (jb.copy) {
              float c;
              if constexpr (std::is_same_v<CacheT, float>) {
                c = cp[static_cast<size_t>((r * jb.heads + h) * jb.hd + d)];
              } else {
                c = __bfloat162float(cp[static_cast<size_t>((r * jb.heads + h) * jb.hd + d)]);
              }
              const float want = std::is_same_v<CacheT, float> ? got : Bf16Exact(got);
              ASSERT_EQ(c, want) << "copy of job " << i << " row " << r << " head " << h << " ch " << d;
            }
          }
        }
      }
    }
    for (size_t k = 0; k < x.size(); ++k) {
      if (touched[k]) continue;
      ASSERT_EQ(all[kGuard + k], x[k]) << "column outside every job changed at " << k;
    }
  };
  // q_a (1024, weighted norm) and kv (512, weighted norm + rope, copied) side by side in one row of 1600.
  run({{1, 1024, 1600, 0, true, true, false, false}, {1, 512, 1600, 1024, true, true, true, true}}, 1600);
  // q heads (normed, roped, copied) and the indexer's heads (roped only) in two buffers of one allocation.
  run({{8, 512, 8 * 512, 0, true, false, true, true}, {4, 128, 4 * 128, n * 8 * 512, false, false, true, false}},
      8 * 512 + 4 * 128);
  // One job: small heads, every channel roped.
  run({{2, 64, 128, 0, true, true, true, true}}, 128);
}

TEST(CudaOpsTest, NormRopeAgainstTheCpu) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(13);
  for (const int64_t n : {1, 8, 32, 65}) {
    CheckNormRope<float>(n, rng);
    CheckNormRope<__nv_bfloat16>(n, rng);
  }
}

// MoeGate against the CPU backend's routing (CpuModel::Moe: the scores with cpu::Softplus / SoftmaxInPlace,
// the top-k of score + bias with ties to the lower id, weights renormalised · route_scale): the ids must
// be the CPU's, except that two experts whose biased scores are within 1e-5 may trade places; weights 1e-5
// relative. Row 0's logits all tie (without a bias its ids are exactly 0..K-1).
void CheckMoeGate(int64_t n, int E, int K, int scoring, bool with_bias, bool hash, std::mt19937& rng) {
  SCOPED_TRACE("MoeGate: " + std::to_string(n) + " rows, E " + std::to_string(E) + ", K " + std::to_string(K) +
               ", scoring " + std::to_string(scoring) + (with_bias ? ", bias" : "") + (hash ? ", hash" : ""));
  std::uniform_int_distribution<int> grid(-256, 256);
  std::vector<float> logits(static_cast<size_t>(n * E)), bias(static_cast<size_t>(E), 0.0f);
  for (float& v : logits) v = static_cast<float>(grid(rng)) / 64.0f;
  std::fill_n(logits.begin(), E, 0.5f);
  if (with_bias) {
    for (float& v : bias) v = static_cast<float>(grid(rng)) / 512.0f;
  }
  const int vocab = 50;
  std::vector<int32_t> tid2eid(static_cast<size_t>(vocab * K)), token(static_cast<size_t>(n));
  for (int t = 0; t < vocab; ++t) {
    for (int k = 0; k < K; ++k) tid2eid[static_cast<size_t>(t * K + k)] = (t * 7 + k * 13) % E;
  }
  for (int64_t r = 0; r < n; ++r) token[static_cast<size_t>(r)] = static_cast<int32_t>((r * 11) % vocab);
  Dev<float> dl(logits.size()), db(bias.size());
  dl.Put(logits);
  db.Put(bias);
  Dev<int32_t> dt(tid2eid.size()), dtok(token.size());
  dt.Put(tid2eid);
  dtok.Put(token);
  Guarded wts(static_cast<size_t>(n * K)), ids_f(static_cast<size_t>(n * K));  // ids as int32 bits in a guarded buffer
  const float scale = 2.5f;
  cuda::MoeGate(dl.p, n, E, K, scoring, with_bias ? db.p : nullptr, hash ? dt.p : nullptr, dtok.p, scale,
                reinterpret_cast<int32_t*>(ids_f.out()), wts.out(), nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> gw = wts.All(), gi = ids_f.All();
  ASSERT_TRUE(GuardsIntact(gw) && GuardsIntact(gi) && NoSentinel(gw) && NoSentinel(gi));
  for (int64_t r = 0; r < n; ++r) {
    std::vector<float> s(logits.begin() + r * E, logits.begin() + (r + 1) * E);
    if (scoring == 0) {
      for (float& v : s) v = std::sqrt(cpu::Softplus(v));
    } else if (scoring == 2) {
      for (float& v : s) v = 1.0f / (1.0f + std::exp(-v));
    } else {
      cpu::SoftmaxInPlace(s.data(), E);
    }
    std::vector<int32_t> ref(static_cast<size_t>(K)), got(static_cast<size_t>(K));
    std::vector<float> sel(static_cast<size_t>(E));
    for (int e = 0; e < E; ++e) sel[static_cast<size_t>(e)] = s[static_cast<size_t>(e)] + bias[static_cast<size_t>(e)];
    if (hash) {
      std::copy_n(tid2eid.begin() + token[static_cast<size_t>(r)] * K, K, ref.begin());
    } else {
      std::vector<int32_t> order(static_cast<size_t>(E));
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int32_t i, int32_t j) {
        return sel[static_cast<size_t>(i)] > sel[static_cast<size_t>(j)] || (sel[static_cast<size_t>(i)] == sel[static_cast<size_t>(j)] && i < j);
      });
      std::copy_n(order.begin(), K, ref.begin());
    }
    for (int k = 0; k < K; ++k) std::memcpy(&got[static_cast<size_t>(k)], &gi[static_cast<size_t>(kGuard + r * K + k)], 4);
    for (int k = 0; k < K; ++k) {
      const int32_t g = got[static_cast<size_t>(k)], w = ref[static_cast<size_t>(k)];
      ASSERT_TRUE(g >= 0 && g < E) << "row " << r << " slot " << k << " id " << g;
      if (hash || (r == 0 && !with_bias)) {
        ASSERT_EQ(g, w) << "row " << r << " slot " << k;
      } else if (g != w) {
        ASSERT_NEAR(sel[static_cast<size_t>(g)], sel[static_cast<size_t>(w)], 1e-5) << "row " << r << " slot " << k;
      }
    }
    float sum = 0.0f;
    for (int k = 0; k < K; ++k) sum += s[static_cast<size_t>(got[static_cast<size_t>(k)])];
    const float mul = scale / (sum + 1e-20f);
    for (int k = 0; k < K; ++k) {
      const double want = s[static_cast<size_t>(got[static_cast<size_t>(k)])] * mul;
      ASSERT_NEAR(gw[static_cast<size_t>(kGuard + r * K + k)], want, 1e-5 * std::fabs(want) + 1e-7) << "row " << r << " slot " << k;
    }
  }
}

TEST(CudaOpsTest, MoeGateAgainstTheCpu) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(19);
  for (const int64_t n : {1, 8, 32, 65}) {
    CheckMoeGate(n, 256, 6, 0, true, false, rng);  // V4-Flash: sqrt(softplus), biased top-6 of 256
    CheckMoeGate(n, 256, 6, 0, true, true, rng);   // its hash layers
  }
  CheckMoeGate(8, 256, 8, 1, false, false, rng);   // softmax, no bias
  CheckMoeGate(8, 64, 16, 2, true, false, rng);    // sigmoid, K = 16
  CheckMoeGate(3, 2000, 6, 0, true, false, rng);   // many experts per lane, a partial last word
  CheckMoeGate(2, 8192, 6, 0, false, false, rng);  // the largest E the backend takes
}

// ---- compressors ---------------------------------------------------------------------------------------------

// CompressStep on sequences whose history went through the CPU backend's CompressorState: each slot's pending
// and overlap state is the CPU's (SaveFixed's layout is the slot's), the pass's rows go to both, and the
// entries of the windows the pass closes (pages looked up through a shuffled table) must match the CPU's: fp32
// caches 2e-5 relative + 2e-6, bf16 ones within one rounding (1/128 relative) of that. Entries nobody closed
// keep their sentinel; afterwards the open window's pending slots and the overlap halves match the CPU's
// exactly (they are copies). CSA: the main compressor and the indexer's in one call (two jobs); HCA: one.
template <typename CacheT>
void CheckCompress(bool csa, const std::vector<SeqSpec>& specs, std::mt19937& rng) {
  const std::string name = std::string(csa ? "CSA" : "HCA") + (std::is_same_v<CacheT, float> ? " fp32" : " bf16");
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const int rate = csa ? 4 : 128, rope = 64, epp = 16;
  const bool overlap = csa;
  const std::vector<int> dims = csa ? std::vector<int>{512, 128} : std::vector<int>{512};
  const int jobs = static_cast<int>(dims.size()), coff = overlap ? 2 : 1;
  std::vector<float> inv_freq(rope / 2);
  for (int i = 0; i < rope / 2; ++i) inv_freq[static_cast<size_t>(i)] = std::pow(10000.0f, -2.0f * i / rope);
  Dev<float> dfreq(inv_freq.size());
  dfreq.Put(inv_freq);
  // Per job: ape, norm; columns of its kv and gate in a comp row; its state's offset in a slot; its page_off.
  std::vector<std::vector<float>> ape(dims.size()), norm(dims.size());
  std::vector<std::unique_ptr<Dev<float>>> dape, dnorm;
  std::vector<int64_t> kv_col(dims.size()), state_off(dims.size()), page_off(dims.size());
  int64_t ld = 0, slot_bytes = 0, page_elems = 0;
  for (int j = 0; j < jobs; ++j) {
    const int64_t cw = coff * dims[static_cast<size_t>(j)];
    ape[static_cast<size_t>(j)].resize(static_cast<size_t>(rate * cw));
    for (float& v : ape[static_cast<size_t>(j)]) v = 0.5f * u(rng);
    norm[static_cast<size_t>(j)].resize(static_cast<size_t>(dims[static_cast<size_t>(j)]));
    for (float& v : norm[static_cast<size_t>(j)]) v = 1.0f + 0.3f * u(rng);
    dape.push_back(std::make_unique<Dev<float>>(ape[static_cast<size_t>(j)].size()));
    dape.back()->Put(ape[static_cast<size_t>(j)]);
    dnorm.push_back(std::make_unique<Dev<float>>(norm[static_cast<size_t>(j)].size()));
    dnorm.back()->Put(norm[static_cast<size_t>(j)]);
    kv_col[static_cast<size_t>(j)] = ld;
    ld += 2 * cw;
    state_off[static_cast<size_t>(j)] = slot_bytes;
    slot_bytes += (2 * rate * cw + (overlap ? 2 * rate * dims[static_cast<size_t>(j)] : 0)) * 4;
    page_off[static_cast<size_t>(j)] = page_elems;
    page_elems += epp * dims[static_cast<size_t>(j)];
  }
  ld += 3;  // a row stride that is no multiple of anything
  int32_t slots = 0;
  int64_t max_entries = 1, n = 0;
  for (const SeqSpec& q : specs) {
    slots = std::max(slots, q.slot + 1);
    max_entries = std::max<int64_t>(max_entries, (q.start_pos + q.rows) / rate + 1);
    n += q.rows;
  }
  const int32_t max_pages = static_cast<int32_t>((max_entries + epp - 1) / epp);
  std::vector<int32_t> table(static_cast<size_t>(slots * max_pages));
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i);
  std::shuffle(table.begin(), table.end(), rng);
  const CacheT sentinel = ToCache<CacheT>({std::nanf("")})[0];
  std::vector<CacheT> pages(static_cast<size_t>(slots * max_pages * page_elems), sentinel);
  std::vector<uint8_t> fixed(static_cast<size_t>(slots * slot_bytes), 0);
  // The CPU side: history, then the slot state from it.
  std::vector<std::vector<cpu::CompressorState>> cpu(static_cast<size_t>(slots));
  for (const SeqSpec& q : specs) {
    for (int j = 0; j < jobs; ++j) {
      cpu::CompressorParams p;
      p.rate = rate;
      p.dim = dims[static_cast<size_t>(j)];
      p.overlap = overlap;
      p.ape = ape[static_cast<size_t>(j)].data();
      p.norm = norm[static_cast<size_t>(j)].data();
      p.rope_dim = rope;
      p.inv_freq = inv_freq.data();
      cpu[static_cast<size_t>(q.slot)].emplace_back(p);
      cpu::CompressorState& st = cpu[static_cast<size_t>(q.slot)].back();
      std::vector<float> kv(static_cast<size_t>(coff * p.dim)), g(kv.size());
      for (int32_t t = 0; t < q.start_pos; ++t) {
        for (float& v : kv) v = u(rng);
        for (float& v : g) v = u(rng);
        st.Append(t, kv.data(), g.data());
      }
      std::vector<uint8_t> bytes;
      st.SaveFixed(&bytes);
      std::copy(bytes.begin() + 16, bytes.end(), fixed.begin() + q.slot * slot_bytes + state_off[static_cast<size_t>(j)]);
    }
  }
  // The pass's rows.
  std::vector<float> comp(static_cast<size_t>(n * ld));
  for (float& v : comp) v = u(rng);
  Step step(specs);
  int max_windows = 0;
  for (const SeqSpec& q : specs) {
    max_windows = std::max(max_windows, (q.start_pos + q.rows) / rate - q.start_pos / rate);
    for (int32_t t = 0; t < q.rows; ++t) {
      const int64_t row = step.seqs[&q - specs.data()].begin + t;
      for (int j = 0; j < jobs; ++j) {
        const int64_t cw = coff * dims[static_cast<size_t>(j)];
        const float* kv = comp.data() + row * ld + kv_col[static_cast<size_t>(j)];
        cpu[static_cast<size_t>(q.slot)][static_cast<size_t>(j)].Append(q.start_pos + t, kv, kv + cw);
      }
    }
  }
  Dev<float> dcomp(comp.size());
  dcomp.Put(comp);
  Dev<uint8_t> dfixed(fixed.size());
  dfixed.Put(fixed);
  Dev<CacheT> dpages(pages.size());
  dpages.Put(pages);
  Dev<int32_t> dtable(table.size());
  dtable.Put(table);
  cuda::CacheDev cache;
  cache.fixed = reinterpret_cast<char*>(dfixed.p);
  cache.slot_bytes = slot_bytes;
  cache.pages = dpages.p;
  cache.page_elems = page_elems;
  cache.table = dtable.p;
  cache.max_pages = max_pages;
  cuda::CompJobs cj;
  for (int j = 0; j < jobs; ++j) {
    const int64_t cw = coff * dims[static_cast<size_t>(j)], off = state_off[static_cast<size_t>(j)];
    cuda::CompArgs& a = cj.c[cj.count++];
    a.rate = rate;
    a.dim = dims[static_cast<size_t>(j)];
    a.overlap = overlap;
    a.ckv = dcomp.p + kv_col[static_cast<size_t>(j)];
    a.cg = a.ckv + cw;
    a.ld = ld;
    a.ape = dape[static_cast<size_t>(j)]->p;
    a.norm_w = dnorm[static_cast<size_t>(j)]->p;
    a.eps = 1e-6f;
    a.rope_dim = rope;
    a.inv_freq = dfreq.p;
    a.pend_kv_off = off;
    a.pend_gate_off = off + rate * cw * 4;
    a.prev_kv_off = off + 2 * rate * cw * 4;
    a.prev_gate_off = a.prev_kv_off + rate * a.dim * 4;
    a.page_off = page_off[static_cast<size_t>(j)];
    a.epp = epp;
  }
  // Decode-shaped passes take the one-launch path; with max_windows <= 1 also try the wider grid's path.
  for (const bool wide : {false, true}) {
    if (wide && max_windows > 1) break;
    SCOPED_TRACE(name + ", " + std::to_string(n) + " rows, max_windows " + std::to_string(max_windows) +
                 (wide ? " (emit + update kernels)" : ""));
    dfixed.Put(fixed);
    dpages.Put(pages);
    cuda::CompressStep<CacheT>(cj, step.dev, cache, wide ? 2 : max_windows, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<CacheT> gp = dpages.Get(pages.size());
    const std::vector<uint8_t> gf = dfixed.Get(fixed.size());
    auto val = [](CacheT c) {
      if constexpr (std::is_same_v<CacheT, float>) {
        return c;
      } else {
        return __bfloat162float(c);
      }
    };
    const double rel = std::is_same_v<CacheT, float> ? 2e-5 : 1.0 / 128;
    for (const SeqSpec& q : specs) {
      const int64_t first = q.start_pos / rate, end_w = (q.start_pos + q.rows) / rate;
      for (int j = 0; j < jobs; ++j) {
        const cpu::CompressorState& st = cpu[static_cast<size_t>(q.slot)][static_cast<size_t>(j)];
        const int dim = dims[static_cast<size_t>(j)];
        ASSERT_EQ(st.entries().rows(), end_w);
        for (int64_t w = 0; w < max_pages * epp; ++w) {
          const int32_t page = table[static_cast<size_t>(q.slot * max_pages + w / epp)];
          const size_t at = static_cast<size_t>(page * page_elems + page_off[static_cast<size_t>(j)] + (w % epp) * dim);
          for (int c = 0; c < dim; ++c) {
            const float got = val(gp[at + static_cast<size_t>(c)]);
            if (w >= first && w < end_w) {
              const float want = st.entries().Row(w)[c];
              ASSERT_NEAR(got, want, rel * std::fabs(want) + 2e-6) << "slot " << q.slot << " job " << j << " window " << w << " ch " << c;
            } else {
              ASSERT_TRUE(std::isnan(got)) << "slot " << q.slot << " job " << j << " entry " << w << " written";
            }
          }
        }
        std::vector<uint8_t> bytes;
        st.SaveFixed(&bytes);
        const float* want = reinterpret_cast<const float*>(bytes.data() + 16);
        const float* got = reinterpret_cast<const float*>(gf.data() + q.slot * slot_bytes + state_off[static_cast<size_t>(j)]);
        const int64_t cw = coff * dim, end = q.start_pos + q.rows;
        for (int64_t p = (end / rate) * rate; p < end; ++p) {  // the open window's tokens
          const int64_t t = p % rate;
          for (int64_t c = 0; c < cw; ++c) {
            ASSERT_EQ(got[t * cw + c], want[t * cw + c]) << "pending kv slot " << q.slot << " job " << j << " t " << t;
            ASSERT_EQ(got[rate * cw + t * cw + c], want[rate * cw + t * cw + c]) << "pending gate " << q.slot << " t " << t;
          }
        }
        if (overlap && end_w > 0) {
          for (int64_t e = 0; e < 2 * rate * dim; ++e) {
            ASSERT_EQ(got[2 * rate * cw + e], want[2 * rate * cw + e]) << "overlap state slot " << q.slot << " job " << j;
          }
        }
      }
    }
  }
}

TEST(CudaOpsTest, CompressorsAgainstTheCpu) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(17);
  // Decode rows: one closes its CSA window (position 4k + 3), one opens one, one is the first token, and
  // one closes the first window (no overlap half before it).
  const std::vector<SeqSpec> decode = {{0, 1, 303}, {1, 1, 300}, {2, 1, 0}, {3, 1, 3}};
  // Verify-sized and prefill rows: several windows per sequence.
  const std::vector<SeqSpec> verify = {{0, 6, 297}, {1, 6, 130}, {2, 6, 0}};
  const std::vector<SeqSpec> prefill = {{0, 37, 0}, {1, 1, 255}, {2, 21, 110}};
  for (const auto* specs : {&decode, &verify, &prefill}) {
    CheckCompress<float>(true, *specs, rng);
    CheckCompress<__nv_bfloat16>(true, *specs, rng);
  }
  // HCA (rate 128): a decode row that closes its window, one that does not, a prefill across two windows.
  const std::vector<SeqSpec> hca = {{0, 1, 255}, {1, 1, 200}, {2, 140, 120}};
  CheckCompress<float>(false, hca, rng);
  CheckCompress<__nv_bfloat16>(false, hca, rng);
  CheckCompress<float>(false, {{0, 1, 127}, {1, 1, 5}}, rng);
}

#else  // a build without CUDA

TEST(CudaOpsTest, GemmEveryPathAgainstTheCpu) { GTEST_SKIP() << "numoe was built without CUDA"; }
TEST(CudaOpsTest, GemvPlansForV4FlashShapes) { GTEST_SKIP() << "numoe was built without CUDA"; }
TEST(CudaOpsTest, GemvSplitKAgainstTheCpu) { GTEST_SKIP() << "numoe was built without CUDA"; }
TEST(CudaOpsTest, RowKernelsAgainstTheCpu) { GTEST_SKIP() << "numoe was built without CUDA"; }
TEST(CudaOpsTest, PackedMoeAgainstTheCpu) { GTEST_SKIP() << "numoe was built without CUDA"; }
TEST(CudaOpsTest, AttentionEveryTypeSplitAndUnsplitAgainstTheCpu) { GTEST_SKIP() << "numoe was built without CUDA"; }
TEST(CudaOpsTest, AttentionTensorCoresAgainstTheCpu) { GTEST_SKIP() << "numoe was built without CUDA"; }
TEST(CudaOpsTest, IndexerScoresAndTopKAgainstTheCpu) { GTEST_SKIP() << "numoe was built without CUDA"; }
TEST(CudaOpsTest, MhcKernelsAgainstTheCpu) { GTEST_SKIP() << "numoe was built without CUDA"; }
TEST(CudaOpsTest, NormRopeAgainstTheCpu) { GTEST_SKIP() << "numoe was built without CUDA"; }
TEST(CudaOpsTest, CompressorsAgainstTheCpu) { GTEST_SKIP() << "numoe was built without CUDA"; }
TEST(CudaOpsTest, MoeGateAgainstTheCpu) { GTEST_SKIP() << "numoe was built without CUDA"; }

#endif

}  // namespace
}  // namespace numoe
