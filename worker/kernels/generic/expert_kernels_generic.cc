// Generic (scalar) expert kernel: the reference every other ISA is tested against.
//
// Weights are dequantized exactly (an E2M1 value times a power-of-two E8M0 scale is exact in fp32) and
// multiplied with unquantized fp32 activations; each 32-column block is summed on its own and then added
// to the row's total, so the only error is fp32 rounding of the sums: |err| <= ~K * 2^-24 * sum|W||x|
// (in practice ~1e-7 relative), which is what the model's golden comparisons rely on.
#include <cmath>
#include <cstring>

#include "worker/experts/kernel_ops.h"
#include "common/packed_layout.h"

namespace numoe::experts {
namespace {

constexpr float kFp4[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                            -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

size_t ActBytes(int64_t m, int64_t kp) { return static_cast<size_t>(m * kp) * sizeof(float); }

void PrepareActs(const float* const* rows, int64_t m, int64_t k, int64_t kp, uint8_t* acts) {
  float* dst = reinterpret_cast<float*>(acts);
  for (int64_t i = 0; i < m; ++i) {
    std::memcpy(dst + i * kp, rows[i], sizeof(float) * k);
    std::memset(dst + i * kp + k, 0, sizeof(float) * (kp - k));
  }
}

size_t ScratchBytes(int64_t) { return kTileRows * kSuperCols * sizeof(float); }

void Tiles(const TileArgs& a) {
  const int64_t kp = a.supers * kSuperCols;
  const float* x = reinterpret_cast<const float*>(a.acts);
  float* w = reinterpret_cast<float*>(a.scratch);  // one super-block, unscaled: w[j][128]
  for (int64_t t = 0; t < a.num_tiles; ++t) {
    const uint8_t* tile = a.tiles + t * a.tile_stride;
    for (int64_t i = 0; i < a.m; ++i) {
      for (int j = 0; j < kTileRows; ++j) a.out[i * a.ldo + 16 * t + j] = 0.0f;
    }
    for (int64_t s = 0; s < a.supers; ++s) {
      const uint8_t* p = tile + s * kSuperBytes;
      for (int b = 0; b < 4; ++b) {
        for (int g = 0; g < 4; ++g) {
          for (int i = 0; i < 64; ++i) {
            const uint8_t byte = p[256 * b + 64 * g + i];
            float* row = w + (i / 4) * kSuperCols + 32 * b;
            row[4 * g + i % 4] = kFp4[byte & 15];
            row[16 + 4 * g + i % 4] = kFp4[byte >> 4];
          }
        }
      }
      float scale[kTileRows][4];
      for (int j = 0; j < kTileRows; ++j) {
        for (int b = 0; b < 4; ++b) {
          scale[j][b] = std::ldexp(1.0f, static_cast<int>(p[kSuperNibbleBytes + 16 * b + j]) - 127);
        }
      }
      for (int64_t i = 0; i < a.m; ++i) {
        const float* xs = x + i * kp + s * kSuperCols;
        float* out = a.out + i * a.ldo + 16 * t;
        for (int j = 0; j < kTileRows; ++j) {
          const float* row = w + j * kSuperCols;
          float total = 0.0f;
          for (int b = 0; b < 4; ++b) {
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
            for (int c = 32 * b; c < 32 * b + 32; c += 4) {
              s0 += row[c] * xs[c];
              s1 += row[c + 1] * xs[c + 1];
              s2 += row[c + 2] * xs[c + 2];
              s3 += row[c + 3] * xs[c + 3];
            }
            total += ((s0 + s1) + (s2 + s3)) * scale[j][b];
          }
          out[j] += total;
        }
      }
    }
  }
}

constexpr KernelOps kOps = {"generic", ActBytes, PrepareActs, ScratchBytes, Tiles};

}  // namespace

const KernelOps& GenericKernelOps() { return kOps; }

}  // namespace numoe::experts
