// The SIMD value type of the int8 tile kernel (worker/kernels/int8_tiles.h) for AVX-512 VNNI: one zmm
// holds a whole 16-row tile (lane j = row j), so one vpdpbusd does 16 rows x 4 columns.
// Include only from translation units compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace numoe::experts {
namespace {  // NOLINT(build/namespaces): internal linkage, see int8_tiles.h

struct SimdAvx512 {
  using VI = __m512i;
  using VF = __m512;
  static constexpr int kLanes = 16;  // tile rows per register (one pass per tile)
  // Activation rows per pass: one fp32 accumulator plus one int32 accumulator per level and row.
  // Vector registers the kernel may fill with accumulators and decoded weights (int8_tiles.h StreamsFor).
  static constexpr int kAccRegs = 26;
  template <int kLevels>
  static constexpr int Group() {
    return kLevels == 2 ? 6 : 8;
  }

  // Nibble -> 2 * fp4 + 12 (see int8_tiles.h), replicated in each 128-bit lane for vpshufb.
  static VI WeightLut() {
    return _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  }
  static VI LoadChunk(const uint8_t* p) { return _mm512_load_si512(p); }
  static VI LowNibbles(VI v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static VI HighNibbles(VI v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
  // A chunk's low and high nibbles, looked up.
  static void Decode(VI lut, VI v, VI& lo, VI& hi) {
    lo = Lookup(lut, LowNibbles(v));
    hi = Lookup(lut, HighNibbles(v));
  }
  static VI Lookup(VI lut, VI idx) { return _mm512_shuffle_epi8(lut, idx); }
  static VI Dot(VI acc, VI w, int32_t x4) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4)); }
  static VI ShiftAdd8(VI hi, VI lo) { return _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo); }
  static VI SetI(int32_t v) { return _mm512_set1_epi32(v); }
  static VF SetF(float v) { return _mm512_set1_ps(v); }
  static VF ZeroF() { return _mm512_setzero_ps(); }
  static VI ZeroI() { return _mm512_setzero_si512(); }
  static VI AddI(VI a, VI b) { return _mm512_add_epi32(a, b); }
  // 16 E8M0 bytes -> 2^(e-127) (e = 0 gives 0 instead of 2^-127; e = 255 is rejected when packing).
  static VF Scales(const uint8_t* p) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
  static VF Mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
  static VF ScaleAdd(VI block_sum, VF scale, VF acc) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_sum), scale, acc);
  }
  static void StoreF(float* p, VF v) { _mm512_storeu_ps(p, v); }
  // The prefill path's decoded tiles (int8_tiles.h DecodeTile), 64-byte aligned.
  static void StoreChunk(uint8_t* p, VI v) { _mm512_store_si512(p, v); }
  static VF LoadF(const float* p) { return _mm512_load_ps(p); }
  static VF LoadUF(const float* p) { return _mm512_loadu_ps(p); }  // the prefill path's accumulators in `out`
};

}  // namespace
}  // namespace numoe::experts
