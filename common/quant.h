// Number formats of the official checkpoint and their dequantization.
//
//   FP8 E4M3FN byte b: sign b>>7, E=(b>>3)&15, M=b&7; E=0 -> (M/8)*2^-6 else (1+M/8)*2^(E-7);
//                     0x7F / 0xFF are NaN; no infinities; max 448.
//   E8M0 scale byte e: 2^(e-127); 255 is NaN.
//   FP4 E2M1 nibble n: [0,0.5,1,1.5,2,3,4,6][n&7], negated when n&8 (so 0x8 is -0).
//   MXFP4 tensor [out, in]: stored as I8/U8 [out, in/2], byte k of a row holds columns 2k (LOW nibble)
//                     and 2k+1 (high nibble); scale [out, ceil(in/32)] E8M0 per 32 inputs.
//   FP8 block tensor [out, in]: F8_E4M3 [out, in] with scale [ceil(out/128), ceil(in/128)] (E8M0 or F32);
//                     W[r,c] = fp8(q[r,c]) * S[r/128][c/128]  (a multiply).
#pragma once

#include <cstdint>
#include <vector>

#include "common/safetensors.h"
#include "common/status.h"

namespace numoe {

float Fp8E4M3ToFloat(uint8_t b);
float E8M0ToFloat(uint8_t e);
float Fp4E2M1ToFloat(uint8_t nibble);  // uses the low 4 bits
float Bf16ToFloat(uint16_t v);
float F16ToFloat(uint16_t v);
uint16_t FloatToBf16(float f);  // round to nearest even; NaN stays NaN

// Encoders (used to write checkpoints: tests, `numoe mkmodel`). Round to nearest, ties to even.
uint8_t FloatToFp8E4M3(float f);   // saturates to +-448; NaN -> 0x7F
uint8_t FloatToFp4E2M1(float f);   // a nibble; saturates to +-6; NaN -> 0
// The smallest power-of-two scale 2^(e-127) with amax / scale <= max_code (E8M0 byte e), clamped to
// [0, 254]; amax <= 0 gives 127 (scale 1).
uint8_t E8M0ScaleFor(float amax, float max_code);

// A dense fp32 tensor owned by value (row-major).
struct F32Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
  int64_t numel() const;
};

// Dequantizes one logical weight to fp32:
//   - F32/BF16/F16 tensors as they are;
//   - F8_E4M3 `name` with block scales `scale` ([ceil(out/b0), ceil(in/b1)], E8M0 or F32), `block` = {b0,b1};
//   - MXFP4 (I8/U8 packed) `name` with per-32 E8M0 scales: logical shape [out, 2*stored_in].
// `scale` may be null for unscaled tensors. Errors name the tensor and the mismatch.
StatusOr<F32Tensor> DequantizeFp8Block(const TensorView& weight, const TensorView& scale, int64_t block_out = 128,
                                       int64_t block_in = 128);
StatusOr<F32Tensor> DequantizeMxfp4(const TensorView& weight, const TensorView& scale);
StatusOr<F32Tensor> ToF32(const TensorView& t);  // F32/BF16/F16/I32/I64 -> fp32 values

}  // namespace numoe
