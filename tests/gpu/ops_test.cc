// The CUDA backend's kernels one by one against a CPU reference (label gpu): every GEMM path (FP8 block-scaled
// and BF16 weights on the GEMV, narrow and wide tensor-core kernels, fp32 SIMT; 1, 16, 17, 64 and 640 rows; shapes
// with tails; split-K; grouped projections; strided x and y), and the row kernels (RMSNorm, SwiGLU, argmax), each
// with a stated error bound and guard bytes around every output, and the routed experts of a prefill step on
// the worker's packed layout (PackedMoe) against a float64 reference from the checkpoint-format weights.
// Skips without a device, and compiles to a skip in a build without CUDA.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/cuda_model.h"
#include "common/quant.h"

#if NUMOE_OPS_TEST_CUDA
#include <cuda_runtime.h>

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
};
std::string Name(const GemmCase& c) {
  return std::string(cuda::WTypeName(c.type)) + " " + std::to_string(c.out) + "x" + std::to_string(c.in) + " x" +
         std::to_string(c.groups) + " groups, " + std::to_string(c.n) + " rows, pads " + std::to_string(c.x_pad) + "/" +
         std::to_string(c.y_pad) + (c.tensor_cores ? ", mma" : ", simt");
}

// y = x · Wᵀ on the device vs the same product in double on the host from the dequantized weights. Bound per
// output: 4e-3 · Σ|w||x| + 1e-6 (the tensor-core path rounds each scaled weight to bf16, 2^-9 relative, and
// x to a bf16 hi/lo pair, ~2^-16; fp32 accumulation adds less). Outside [y, y + n·ldy) and, for strided y,
// between rows, nothing may change.
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
  cuda::Gemm(call, c.tensor_cores, Sms(), nullptr);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> all = y.All();
  ASSERT_TRUE(GuardsIntact(all)) << "a kernel wrote outside its output";
  int64_t bad = 0;
  double worst = 0;
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
        const double err = std::fabs(got - ref), bound = 4e-3 * mag + 1e-6;
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

#else  // a build without CUDA

TEST(CudaOpsTest, GemmEveryPathAgainstTheCpu) { GTEST_SKIP() << "numoe was built without CUDA"; }
TEST(CudaOpsTest, RowKernelsAgainstTheCpu) { GTEST_SKIP() << "numoe was built without CUDA"; }
TEST(CudaOpsTest, PackedMoeAgainstTheCpu) { GTEST_SKIP() << "numoe was built without CUDA"; }

#endif

}  // namespace
}  // namespace numoe
