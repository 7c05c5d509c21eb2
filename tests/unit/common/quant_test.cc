// Number formats against hand-computed values (common/quant.h defines them).
#include "common/quant.h"
#include "tests/support/status_matchers.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

namespace numoe {
namespace {

using ::testing::HasSubstr;

TensorView View(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data) {
  TensorView t;
  t.name = name;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data = static_cast<const uint8_t*>(data);
  t.nbytes = static_cast<size_t>(t.numel()) * DTypeSize(dtype);
  return t;
}

TEST(Fp8E4M3, HandValues) {
  EXPECT_EQ(Fp8E4M3ToFloat(0x00), 0.0f);
  EXPECT_FALSE(std::signbit(Fp8E4M3ToFloat(0x00)));
  EXPECT_EQ(Fp8E4M3ToFloat(0x80), 0.0f);
  EXPECT_TRUE(std::signbit(Fp8E4M3ToFloat(0x80)));      // -0
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), std::ldexp(1.0f, -9));  // smallest subnormal 1/8 * 2^-6
  EXPECT_EQ(Fp8E4M3ToFloat(0x07), 7.0f / 8 / 64);         // largest subnormal
  EXPECT_EQ(Fp8E4M3ToFloat(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(Fp8E4M3ToFloat(0x38), 1.0f);                  // E=7, M=0
  EXPECT_EQ(Fp8E4M3ToFloat(0x3C), 1.5f);
  EXPECT_EQ(Fp8E4M3ToFloat(0xC0), -2.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0xFE), -448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x77), 240.0f);  // E=14, M=7: 1.875 * 128; not NaN (no infinities)
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(0x7F)));
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(0xFF)));
}

TEST(Fp8E4M3, EncoderRoundTripsEveryCode) {
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7F) == 0x7F) continue;
    const float v = Fp8E4M3ToFloat(static_cast<uint8_t>(b));
    EXPECT_EQ(FloatToFp8E4M3(v), b == 0x80 ? 0x80 : b) << b;
  }
  EXPECT_EQ(FloatToFp8E4M3(1000.0f), 0x7E);   // saturates
  EXPECT_EQ(FloatToFp8E4M3(-1000.0f), 0xFE);
  EXPECT_EQ(FloatToFp8E4M3(1.0625f), 0x38);   // halfway 1 and 1.125: ties to even (1.0)
  EXPECT_EQ(FloatToFp8E4M3(1.1875f), 0x3A);   // halfway 1.125 and 1.25: even is 1.25
  EXPECT_EQ(FloatToFp8E4M3(NAN), 0x7F);
}

TEST(E8M0, HandValues) {
  EXPECT_EQ(E8M0ToFloat(127), 1.0f);
  EXPECT_EQ(E8M0ToFloat(128), 2.0f);
  EXPECT_EQ(E8M0ToFloat(120), 1.0f / 128);
  EXPECT_EQ(E8M0ToFloat(0), std::ldexp(1.0f, -127));
  EXPECT_EQ(E8M0ToFloat(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(E8M0ToFloat(255)));
  EXPECT_EQ(E8M0ScaleFor(448.0f, 448.0f), 127);
  EXPECT_EQ(E8M0ScaleFor(449.0f, 448.0f), 128);
  EXPECT_EQ(E8M0ScaleFor(3.0f, 6.0f), 126);
  EXPECT_EQ(E8M0ScaleFor(0.0f, 6.0f), 127);
}

TEST(Fp4E2M1, AllSixteenCodes) {
  const float want[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int n = 0; n < 16; ++n) {
    EXPECT_EQ(Fp4E2M1ToFloat(static_cast<uint8_t>(n)), want[n]) << n;
    EXPECT_EQ(std::signbit(Fp4E2M1ToFloat(static_cast<uint8_t>(n))), n >= 8) << n;
    EXPECT_EQ(Fp4E2M1ToFloat(static_cast<uint8_t>(0xF0 | n)), want[n]) << "high bits ignored";
    if (n != 8) {
      EXPECT_EQ(FloatToFp4E2M1(want[n]), n);
    }
  }
  EXPECT_EQ(FloatToFp4E2M1(0.25f), 0);  // tie 0 / 0.5 -> even code 0
  EXPECT_EQ(FloatToFp4E2M1(0.75f), 2);  // tie 0.5 / 1 -> even code 2
  EXPECT_EQ(FloatToFp4E2M1(5.0f), 6);   // tie 4 / 6 -> even code 6 (4.0)
  EXPECT_EQ(FloatToFp4E2M1(100.0f), 7);
}

TEST(Bf16, Values) {
  EXPECT_EQ(Bf16ToFloat(0x3F80), 1.0f);
  EXPECT_EQ(Bf16ToFloat(0xC000), -2.0f);
  EXPECT_EQ(Bf16ToFloat(0x0001), std::ldexp(1.0f, -133));  // smallest subnormal
  EXPECT_TRUE(std::isinf(Bf16ToFloat(0x7F80)));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(0x7FC0)));
  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (0x3F80); 1 + 3*2^-8 -> up to 0x3F82.
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(NAN))));
  EXPECT_EQ(FloatToBf16(INFINITY), 0x7F80);
}

TEST(F16, Values) {
  EXPECT_EQ(F16ToFloat(0x3C00), 1.0f);
  EXPECT_EQ(F16ToFloat(0xC000), -2.0f);
  EXPECT_EQ(F16ToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(F16ToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(F16ToFloat(0x03FF), 1023 * std::ldexp(1.0f, -24));
  EXPECT_EQ(F16ToFloat(0x0400), std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_TRUE(std::signbit(F16ToFloat(0x8000)));
  EXPECT_TRUE(std::isinf(F16ToFloat(0x7C00)));
  EXPECT_LT(F16ToFloat(0xFC00), 0);
  EXPECT_TRUE(std::isnan(F16ToFloat(0x7E00)));
}

TEST(Fp8Block, CeilGridAndMultiply) {
  // out = 130 -> 2 row blocks, in = 3 -> 1 column block.
  const int64_t rows = 130, cols = 3;
  std::vector<uint8_t> q(rows * cols, 0x38);  // 1.0
  q[0] = 0x40;                                 // 2.0
  q[129 * cols + 2] = 0xC4;                    // -3.0
  const uint8_t s[2] = {128, 125};             // 2.0 for rows 0..127, 0.25 for rows 128..129
  auto w = View("w.weight", DType::kF8_E4M3, {rows, cols}, q.data());
  auto sc = View("w.scale", DType::kF8_E8M0, {2, 1}, s);
  auto out = DequantizeFp8Block(w, sc);
  ASSERT_OK(out);
  EXPECT_EQ(out->shape, (std::vector<int64_t>{130, 3}));
  EXPECT_EQ(out->data[0], 4.0f);
  EXPECT_EQ(out->data[1], 2.0f);
  EXPECT_EQ(out->data[127 * cols], 2.0f);
  EXPECT_EQ(out->data[128 * cols], 0.25f);
  EXPECT_EQ(out->data[129 * cols + 2], -0.75f);

  // F32 scales work the same; a floor-sized grid [1, 1] is rejected naming both tensors.
  const float fs[2] = {0.5f, 3.0f};
  auto out2 = DequantizeFp8Block(w, View("w.scale", DType::kF32, {2, 1}, fs));
  ASSERT_OK(out2);
  EXPECT_EQ(out2->data[129 * cols + 2], -9.0f);
  auto bad = DequantizeFp8Block(w, View("w.scale", DType::kF8_E8M0, {1, 1}, s));
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("w.scale"));
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("w.weight"));
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("[2, 1]"));
}

TEST(Fp8Block, SmallBlocks) {
  // 2x4 weight with 1x2 blocks: scale grid [2, 2].
  const uint8_t q[8] = {0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38};
  const uint8_t s[4] = {127, 128, 129, 130};
  auto out = DequantizeFp8Block(View("w", DType::kF8_E4M3, {2, 4}, q), View("s", DType::kF8_E8M0, {2, 2}, s), 1, 2);
  ASSERT_OK(out);
  EXPECT_EQ(out->data, (std::vector<float>{1, 1, 2, 2, 4, 4, 8, 8}));
}

TEST(Mxfp4, LowNibbleFirst) {
  // One row of 64 logical columns: 32 bytes, 2 scale blocks.
  std::vector<uint8_t> q(32, 0);
  q[0] = 0x21;   // col 0 = code 1 (0.5), col 1 = code 2 (1.0)
  q[1] = 0xF7;   // col 2 = 6, col 3 = -6
  q[16] = 0x8B;  // col 32 = code 0xB (-1.5), col 33 = code 8 (-0)
  const uint8_t s[2] = {127, 129};  // 1, 4
  auto out = DequantizeMxfp4(View("e.weight", DType::kI8, {1, 32}, q.data()), View("e.scale", DType::kF8_E8M0, {1, 2}, s));
  ASSERT_OK(out);
  EXPECT_EQ(out->shape, (std::vector<int64_t>{1, 64}));
  EXPECT_EQ(out->data[0], 0.5f);
  EXPECT_EQ(out->data[1], 1.0f);
  EXPECT_EQ(out->data[2], 6.0f);
  EXPECT_EQ(out->data[3], -6.0f);
  EXPECT_EQ(out->data[31], 0.0f);
  EXPECT_EQ(out->data[32], -6.0f);
  EXPECT_EQ(out->data[33], 0.0f);
  EXPECT_TRUE(std::signbit(out->data[33]));

  auto bad = DequantizeMxfp4(View("e.weight", DType::kI8, {1, 32}, q.data()), View("e.scale", DType::kF8_E8M0, {1, 1}, s));
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("e.scale"));
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("[1, 2]"));
  auto wrong_type = DequantizeMxfp4(View("e.weight", DType::kF32, {1, 8}, q.data()), View("e.scale", DType::kF8_E8M0, {1, 1}, s));
  ASSERT_FALSE(wrong_type.ok());
  EXPECT_THAT(std::string(wrong_type.status().message()), HasSubstr("I8/U8"));
}

TEST(ToF32, IntegerAndFloatTypes) {
  const int64_t i64[3] = {-5, 0, 7};
  auto a = ToF32(View("t", DType::kI64, {3}, i64));
  ASSERT_OK(a);
  EXPECT_EQ(a->data, (std::vector<float>{-5, 0, 7}));
  const int32_t i32[2] = {3, -1};
  auto b = ToF32(View("t", DType::kI32, {2}, i32));
  ASSERT_OK(b);
  EXPECT_EQ(b->data, (std::vector<float>{3, -1}));
  const uint16_t bf[2] = {0x3F80, 0xC000};
  auto c = ToF32(View("t", DType::kBF16, {2}, bf));
  ASSERT_OK(c);
  EXPECT_EQ(c->data, (std::vector<float>{1, -2}));
  // A view whose byte count disagrees with its shape is refused, not read past its end.
  TensorView lie = View("lie", DType::kF32, {2}, bf);
  lie.shape = {100};
  auto d = ToF32(lie);
  ASSERT_FALSE(d.ok());
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("lie"));
}

}  // namespace
}  // namespace numoe
