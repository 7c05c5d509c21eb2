#include "common/quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace numoe {
namespace {

float BitsToFloat(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint32_t FloatToBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// Lookup tables: built once, then every dequant is a load.
struct Tables {
  float fp8[256];
  float e8m0[256];
  Tables() {
    for (int b = 0; b < 256; ++b) {
      const int sign = b >> 7, e = (b >> 3) & 15, m = b & 7;
      float v;
      if (e == 15 && m == 7) {
        v = std::numeric_limits<float>::quiet_NaN();
      } else if (e == 0) {
        v = std::ldexp(static_cast<float>(m) / 8.0f, -6);
      } else {
        v = std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
      }
      fp8[b] = sign ? -v : v;
      e8m0[b] = b == 255 ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, b - 127);
    }
  }
};
const Tables& T() {
  static const Tables t;
  return t;
}

constexpr float kFp4Values[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

std::string Shape(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) absl::StrAppend(&out, i ? ", " : "", s[i]);
  return out + "]";
}

// A view's byte count must agree with its shape before anything indexes into it.
Status CheckView(const TensorView& t) {
  int64_t n = 1;
  for (int64_t d : t.shape) {
    if (d < 0 || (d != 0 && n > std::numeric_limits<int64_t>::max() / d))
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': bad shape ", Shape(t.shape)));
    n *= d;
  }
  if (static_cast<uint64_t>(n) * DTypeSize(t.dtype) != t.nbytes || (t.nbytes > 0 && t.data == nullptr))
    return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': ", t.nbytes, " bytes do not hold ",
                                                   Shape(t.shape), " ", std::string(DTypeName(t.dtype))));
  return absl::OkStatus();
}

// Reads element i of a scale tensor (E8M0, F32, BF16 or F16) as fp32.
float ScaleAt(const TensorView& s, int64_t i) {
  switch (s.dtype) {
    case DType::kF8_E8M0:
      return E8M0ToFloat(s.data[i]);
    case DType::kF32: {
      float v;
      std::memcpy(&v, s.data + 4 * i, 4);
      return v;
    }
    case DType::kBF16: {
      uint16_t v;
      std::memcpy(&v, s.data + 2 * i, 2);
      return Bf16ToFloat(v);
    }
    case DType::kF16: {
      uint16_t v;
      std::memcpy(&v, s.data + 2 * i, 2);
      return F16ToFloat(v);
    }
    default:
      return std::numeric_limits<float>::quiet_NaN();
  }
}

bool IsScaleDType(DType t) {
  return t == DType::kF8_E8M0 || t == DType::kF32 || t == DType::kBF16 || t == DType::kF16;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

float Fp8E4M3ToFloat(uint8_t b) { return T().fp8[b]; }
float E8M0ToFloat(uint8_t e) { return T().e8m0[e]; }
float Fp4E2M1ToFloat(uint8_t nibble) {
  const float v = kFp4Values[nibble & 7];
  return (nibble & 8) ? -v : v;
}

float Bf16ToFloat(uint16_t v) { return BitsToFloat(static_cast<uint32_t>(v) << 16); }

float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F;
  const uint32_t man = h & 0x3FF;
  if (exp == 0) {
    // Zero or subnormal: man * 2^-24, exact in fp32.
    float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return BitsToFloat(sign | 0x7F800000u | (man << 13));  // inf / NaN (payload kept)
  return BitsToFloat(sign | ((exp - 15 + 127) << 23) | (man << 13));
}

uint16_t FloatToBf16(float f) {
  uint32_t bits = FloatToBits(f);
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040);  // quiet NaN, sign kept
  }
  const uint32_t rounding = 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

uint8_t FloatToFp8E4M3(float f) {
  if (std::isnan(f)) return 0x7F;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7E;
  // Subnormals (and the step to the first normal) are multiples of 2^-9: code = round(a / 2^-9).
  if (a < std::ldexp(1.0f, -6)) return sign | static_cast<uint8_t>(std::nearbyint(std::ldexp(a, 9)));
  int k = 0;
  const float frac = std::frexp(a, &k);  // a = frac * 2^k, frac in [0.5, 1)
  int e = k - 1;
  int m = static_cast<int>(std::nearbyint((frac * 2.0f - 1.0f) * 8.0f));
  if (m == 8) {
    m = 0;
    ++e;
  }
  const int code = ((e + 7) << 3) | m;
  return sign | static_cast<uint8_t>(std::min(code, 0x7E));
}

uint8_t FloatToFp4E2M1(float f) {
  if (std::isnan(f)) return 0;
  const uint8_t sign = std::signbit(f) ? 0x8 : 0x0;
  const float a = std::fabs(f);
  // Midpoints between neighbours; a tie goes to the even code.
  constexpr float kMid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  uint8_t code = 0;
  while (code < 7 && (a > kMid[code] || (a == kMid[code] && (code & 1)))) ++code;
  return sign | code;
}

uint8_t E8M0ScaleFor(float amax, float max_code) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return 127;
  const int e = static_cast<int>(std::ceil(std::log2(static_cast<double>(amax) / max_code)));
  return static_cast<uint8_t>(std::clamp(e + 127, 0, 254));
}

int64_t F32Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

StatusOr<F32Tensor> ToF32(const TensorView& t) {
  RETURN_IF_ERROR(CheckView(t));
  F32Tensor out;
  out.shape = t.shape;
  const int64_t n = t.numel();
  out.data.resize(static_cast<size_t>(n));
  float* o = out.data.data();
  const uint8_t* d = t.data;
  switch (t.dtype) {
    case DType::kF32:
      if (n > 0) std::memcpy(o, d, static_cast<size_t>(n) * 4);
      break;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, d + 2 * i, 2);
        o[i] = Bf16ToFloat(v);
      }
      break;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, d + 2 * i, 2);
        o[i] = F16ToFloat(v);
      }
      break;
    case DType::kF8_E4M3:
      for (int64_t i = 0; i < n; ++i) o[i] = Fp8E4M3ToFloat(d[i]);
      break;
    case DType::kF8_E8M0:
      for (int64_t i = 0; i < n; ++i) o[i] = E8M0ToFloat(d[i]);
      break;
    case DType::kI8:
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<float>(static_cast<int8_t>(d[i]));
      break;
    case DType::kU8:
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<float>(d[i]);
      break;
    case DType::kI32:
      for (int64_t i = 0; i < n; ++i) {
        int32_t v;
        std::memcpy(&v, d + 4 * i, 4);
        o[i] = static_cast<float>(v);
      }
      break;
    case DType::kI64:
      for (int64_t i = 0; i < n; ++i) {
        int64_t v;
        std::memcpy(&v, d + 8 * i, 8);
        o[i] = static_cast<float>(v);
      }
      break;
  }
  return out;
}

StatusOr<F32Tensor> DequantizeFp8Block(const TensorView& weight, const TensorView& scale, int64_t block_out,
                                       int64_t block_in) {
  RETURN_IF_ERROR(CheckView(weight));
  RETURN_IF_ERROR(CheckView(scale));
  if (weight.dtype != DType::kF8_E4M3 || weight.shape.size() != 2)
    return absl::InvalidArgumentError(absl::StrCat("tensor '", weight.name, "': FP8 block weight must be 2-D F8_E4M3, got ",
                                                   std::string(DTypeName(weight.dtype)), " ", Shape(weight.shape)));
  if (block_out <= 0 || block_in <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", weight.name, "': bad FP8 block size [", block_out, ", ", block_in, "]"));
  const int64_t rows = weight.shape[0], cols = weight.shape[1];
  const std::vector<int64_t> want = {CeilDiv(rows, block_out), CeilDiv(cols, block_in)};
  if (!IsScaleDType(scale.dtype) || scale.shape != want)
    return absl::InvalidArgumentError(absl::StrCat("tensor '", scale.name, "': scale of '", weight.name, "' ",
                                                   Shape(weight.shape), " must be F8_E8M0/F32 ", Shape(want),
                                                   " for ", block_out, "x", block_in, " blocks, got ",
                                                   std::string(DTypeName(scale.dtype)), " ", scale.ShapeString()));
  F32Tensor out;
  out.shape = {rows, cols};
  out.data.resize(static_cast<size_t>(rows * cols));
  const float* lut = T().fp8;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* q = weight.data + r * cols;
    float* o = out.data.data() + r * cols;
    const int64_t srow = (r / block_out) * want[1];
    for (int64_t cb = 0; cb < want[1]; ++cb) {
      const float s = ScaleAt(scale, srow + cb);
      const int64_t c1 = std::min(cols, (cb + 1) * block_in);
      for (int64_t c = cb * block_in; c < c1; ++c) o[c] = lut[q[c]] * s;
    }
  }
  return out;
}

StatusOr<F32Tensor> DequantizeMxfp4(const TensorView& weight, const TensorView& scale) {
  RETURN_IF_ERROR(CheckView(weight));
  RETURN_IF_ERROR(CheckView(scale));
  if ((weight.dtype != DType::kI8 && weight.dtype != DType::kU8) || weight.shape.size() != 2)
    return absl::InvalidArgumentError(absl::StrCat("tensor '", weight.name,
                                                   "': MXFP4 weight must be 2-D I8/U8 (two FP4 codes per byte), got ",
                                                   std::string(DTypeName(weight.dtype)), " ", Shape(weight.shape)));
  const int64_t rows = weight.shape[0], packed = weight.shape[1], cols = 2 * packed;
  const std::vector<int64_t> want = {rows, CeilDiv(cols, 32)};
  if (!IsScaleDType(scale.dtype) || scale.shape != want)
    return absl::InvalidArgumentError(absl::StrCat("tensor '", scale.name, "': scale of MXFP4 '", weight.name,
                                                   "' (logical [", rows, ", ", cols, "]) must be F8_E8M0 ",
                                                   Shape(want), ", got ", std::string(DTypeName(scale.dtype)), " ",
                                                   scale.ShapeString()));
  F32Tensor out;
  out.shape = {rows, cols};
  out.data.resize(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* q = weight.data + r * packed;
    float* o = out.data.data() + r * cols;
    for (int64_t k = 0; k < packed; ++k) {
      const int64_t c = 2 * k;
      // Both columns of a byte share a 32-wide block since 32 is even.
      const float s = ScaleAt(scale, r * want[1] + c / 32);
      o[c] = Fp4E2M1ToFloat(q[k] & 0xF) * s;
      o[c + 1] = Fp4E2M1ToFloat(q[k] >> 4) * s;
    }
  }
  return out;
}

}  // namespace numoe
