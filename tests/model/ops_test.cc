// The CPU backend's BF16 weights: the matmul kernels (AVX-512 and the scalar fallback) against the fp32
// kernel on the widened weights and against a double-precision reference, and which checkpoint tensors
// the loader keeps as BF16.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/checkpoint.h"
#include "common/cpu_features.h"
#include "common/thread_pool.h"
#include "backends/cpu/cpu_model.h"
#include "backends/cpu/ops.h"
#include "tests/support/status_matchers.h"

namespace numoe::cpu {
namespace {

uint16_t F32ToBf16Truncate(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>(u >> 16);
}

struct Case {
  std::vector<float> x;      // [n, xs]
  std::vector<uint16_t> wb;  // [out, in] BF16 bits
  std::vector<float> wf;     // the same values as fp32
};

Case MakeCase(int64_t n, int64_t xs, int64_t out, int64_t in, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Case c;
  c.x.resize(static_cast<size_t>(n * xs));
  for (float& v : c.x) v = nd(rng);
  c.wb.resize(static_cast<size_t>(out * in));
  c.wf.resize(c.wb.size());
  for (size_t i = 0; i < c.wb.size(); ++i) {
    c.wb[i] = F32ToBf16Truncate(nd(rng) * 0.05f);
    c.wf[i] = Bf16ToF32(c.wb[i]);
  }
  return c;
}

TEST(Bf16, WidensExactly) {
  EXPECT_EQ(Bf16ToF32(0x3F80), 1.0f);
  EXPECT_EQ(Bf16ToF32(0xC000), -2.0f);
  EXPECT_EQ(Bf16ToF32(0x0000), 0.0f);
  EXPECT_TRUE(std::isinf(Bf16ToF32(0x7F80)));
  EXPECT_EQ(Bf16ToF32(0x3E20), 0.15625f);  // 1.25 * 2^-3
}

// Every (n, in, out) mix of full/partial 4-row groups and 8-row blocks, 16-wide chunks and tails.
TEST(Bf16, MatMulMatchesFp32BitForBitAndTheDoubleReference) {
  for (const bool avx : {false, true}) {
    if (avx && !GetCpuFeatures().avx512f) continue;
    for (int64_t n : {1, 2, 3, 4, 5, 8, 9, 13}) {
      for (int64_t in : {1, 15, 16, 17, 48, 200}) {
        const int64_t out = 7, xs = in + 3, ys = out + 2;
        Case c = MakeCase(n, xs, out, in, static_cast<uint32_t>(n * 1000 + in));
        std::vector<float> yb(static_cast<size_t>(n * ys), -7.0f), yf(yb);
        MatMulRawBf16(c.x.data(), n, c.wb.data(), out, in, yb.data(), nullptr, xs, ys, avx);
        MatMulRaw(c.x.data(), n, c.wf.data(), out, in, yf.data(), nullptr, xs, ys);
        for (int64_t r = 0; r < n; ++r) {
          for (int64_t o = 0; o < out; ++o) {
            const size_t at = static_cast<size_t>(r * ys + o);
            double ref = 0, mag = 0;
            for (int64_t i = 0; i < in; ++i) {
              const double p = static_cast<double>(c.x[r * xs + i]) * c.wf[o * in + i];
              ref += p;
              mag += std::fabs(p);
            }
            ASSERT_EQ(yb[at], yf[at]) << "avx " << avx << " n " << n << " in " << in << " row " << r << " col " << o;
            ASSERT_NEAR(yb[at], ref, 1e-5 * mag + 1e-30) << "avx " << avx << " n " << n << " in " << in;
          }
          for (int64_t o = out; o < ys; ++o) {  // the stride gap is not written
            ASSERT_EQ(yb[static_cast<size_t>(r * ys + o)], -7.0f);
          }
        }
      }
    }
  }
}

TEST(Bf16, ParallelMatMulMatchesSerial) {
  ThreadPool pool(3);
  const int64_t n = 5, out = 1031, in = 272;  // n·out·in over the parallel threshold
  Case c = MakeCase(n, in, out, in, 7);
  std::vector<float> serial(static_cast<size_t>(n * out)), par(serial.size()), f32(serial.size());
  MatMulRawBf16(c.x.data(), n, c.wb.data(), out, in, serial.data(), nullptr, 0, 0);
  MatMulRawBf16(c.x.data(), n, c.wb.data(), out, in, par.data(), &pool, 0, 0);
  MatMulRaw(c.x.data(), n, c.wf.data(), out, in, f32.data(), &pool, 0, 0);
  EXPECT_EQ(serial, par);
  EXPECT_EQ(serial, f32);
}

TEST(Bf16, LinearRowsAndGroupsMatchFp32) {
  const int64_t n = 3, out = 12, in = 40;
  Case c = MakeCase(n, in, out, in, 11);
  Linear lb{out, in, {}, c.wb}, lf{out, in, c.wf, {}};
  ASSERT_TRUE(lb.is_bf16());
  ASSERT_FALSE(lf.is_bf16());
  EXPECT_EQ(lb.bytes(), out * in * 2);
  EXPECT_EQ(lf.bytes(), out * in * 4);
  std::vector<float> rb(static_cast<size_t>(in)), rf(rb.size());
  for (int64_t r : {0, 5, 11}) {
    lb.Row(r, rb.data());
    lf.Row(r, rf.data());
    EXPECT_EQ(rb, rf);
    EXPECT_EQ(rb[3], c.wf[static_cast<size_t>(r * in + 3)]);
  }
  // Rows [4, 8) of W, written with a wider output stride as the grouped projection does.
  std::vector<float> yb(static_cast<size_t>(n * 10), 0.0f), yf(yb);
  MatMulRows(c.x.data(), n, lb, 4, 4, yb.data() + 2, nullptr, in, 10);
  MatMulRows(c.x.data(), n, lf, 4, 4, yf.data() + 2, nullptr, in, 10);
  EXPECT_EQ(yb, yf);
  std::vector<float> full(static_cast<size_t>(n * out));
  MatMul(c.x.data(), n, lb, full.data());
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t o = 0; o < 4; ++o) EXPECT_EQ(yb[r * 10 + 2 + o], full[r * out + 4 + o]);
  }
}

// tiny-v4 stores embed/head/gates and the DSpark Markov + confidence heads as BF16, the other dense
// matrices as FP8: the former stay BF16 (same values as the fp32 dequantization), the latter are fp32.
TEST(Bf16, LoaderKeepsBf16TensorsAsBf16) {
  auto ck = Checkpoint::Open(std::string(NUMOE_TEST_DATA) + "/tiny-v4");
  ASSERT_OK(ck);
  auto w = LoadDenseWeights(**ck);
  ASSERT_OK(w);
  const ModelW& m = **w;
  EXPECT_TRUE(m.embed.is_bf16());
  EXPECT_TRUE(m.Head().is_bf16());
  EXPECT_TRUE(m.layers[0].ffn.gate.is_bf16());
  EXPECT_FALSE(m.layers[0].attn.wq_a.is_bf16());  // F8_E4M3 + block scales
  EXPECT_FALSE(m.layers[0].ffn.shared_w1.is_bf16());
  auto embed = (*ck)->LoadF32("embed.weight");
  ASSERT_OK(embed);
  const int64_t D = (*ck)->config().hidden_size;
  std::vector<float> row(static_cast<size_t>(D));
  for (int64_t t : {int64_t{0}, int64_t{1}, int64_t{517}, (*ck)->config().vocab_size - 1}) {
    m.embed.Row(t, row.data());
    for (int64_t d = 0; d < D; ++d) ASSERT_EQ(row[d], embed->data[static_cast<size_t>(t * D + d)]) << t << " " << d;
  }
  auto ds = LoadDsparkWeights(**ck);
  ASSERT_OK(ds);
  EXPECT_TRUE((*ds)->markov_w1.is_bf16());
  EXPECT_TRUE((*ds)->markov_w2.is_bf16());
  EXPECT_TRUE((*ds)->confidence.is_bf16());
  EXPECT_EQ((*ds)->confidence.out, 1);
  EXPECT_EQ((*ds)->confidence.in, D + (*ck)->config().dspark_markov_rank);

  auto model = CpuModel::Create(**ck, nullptr, CpuModelOptions{.drafter = true});
  ASSERT_OK(model);
  const CpuModel::WeightBytes b = (*model)->weight_bytes();
  const int64_t V = (*ck)->config().vocab_size;
  EXPECT_GE(b.bf16, 2 * V * D * 2);  // embed + head at 2 bytes a value
  EXPECT_GT(b.total, b.bf16);         // the FP8 matrices, norms and mHC params are fp32
}

}  // namespace
}  // namespace numoe::cpu
