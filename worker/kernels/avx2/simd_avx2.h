// The SIMD value type of the int8 tile kernel (worker/kernels/int8_tiles.h) for AVX2: a ymm holds 8 rows
// (two passes per 16-row tile). There is no dpbusd: vpmaddubsw (u8 x s8 -> s16 pairs) + vpmaddwd with
// ones does the same 4-wide dot; it cannot saturate because |(w + 12) q| pairs are at most
// 2 * 24 * 127 = 6096 < 32767.
// Include only from translation units compiled with -mavx2 -mfma.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace numoe::experts {
namespace {  // NOLINT(build/namespaces): internal linkage, see int8_tiles.h

struct SimdAvx2 {
  using VI = __m256i;
  using VF = __m256;
  static constexpr int kLanes = 8;  // tile rows per register (two passes per tile)
  // Activation rows per pass: one fp32 accumulator plus one int32 accumulator per level and row.
  // Vector registers the kernel may fill with accumulators and decoded weights (int8_tiles.h StreamsFor).
  static constexpr int kAccRegs = 12;
  template <int kLevels>
  static constexpr int Group() {
    return kLevels == 2 ? 2 : 3;
  }

  static VI WeightLut() {
    return _mm256_broadcastsi128_si256(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  }
  static VI LoadChunk(const uint8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
  static VI LowNibbles(VI v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  static VI HighNibbles(VI v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
  // A chunk's low and high nibbles, looked up.
  static void Decode(VI lut, VI v, VI& lo, VI& hi) {
    lo = Lookup(lut, LowNibbles(v));
    hi = Lookup(lut, HighNibbles(v));
  }
  static VI Lookup(VI lut, VI idx) { return _mm256_shuffle_epi8(lut, idx); }
  static VI Dot(VI acc, VI w, int32_t x4) {
    const __m256i pairs = _mm256_maddubs_epi16(w, _mm256_set1_epi32(x4));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static VI ShiftAdd8(VI hi, VI lo) { return _mm256_add_epi32(_mm256_slli_epi32(hi, 8), lo); }
  static VI SetI(int32_t v) { return _mm256_set1_epi32(v); }
  static VF SetF(float v) { return _mm256_set1_ps(v); }
  static VF ZeroF() { return _mm256_setzero_ps(); }
  static VF Scales(const uint8_t* p) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  static VF Mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
  static VF ScaleAdd(VI block_sum, VF scale, VF acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sum), scale, acc);
  }
  static void StoreF(float* p, VF v) { _mm256_storeu_ps(p, v); }
};

}  // namespace
}  // namespace numoe::experts
