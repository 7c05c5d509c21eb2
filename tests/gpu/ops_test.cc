// The CUDA backend's kernels one by one against a CPU reference (label gpu): every GEMM path (FP8 block-scaled
// and BF16 weights on the GEMV, narrow and wide tensor-core kernels, fp32 SIMT; 1, 16, 17, 64 and 640 rows; shapes
// with tails; split-K; grouped projections; strided x and y), and the row kernels (RMSNorm, SwiGLU, argmax), each
// with a stated error bound and guard bytes around every output. Skips without a device, and compiles to a
// skip in a build without CUDA.
#include <gtest/gtest.h>

#include <cmath>
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

#else  // a build without CUDA

TEST(CudaOpsTest, GemmEveryPathAgainstTheCpu) { GTEST_SKIP() << "numoe was built without CUDA"; }
TEST(CudaOpsTest, RowKernelsAgainstTheCpu) { GTEST_SKIP() << "numoe was built without CUDA"; }

#endif

}  // namespace
}  // namespace numoe
