// SimdAvx512 with the nibble decode done by AVX-512 VBMI byte permutes: vpermb looks a byte up in a
// 64-entry table by its low 6 bits, so with the 16-entry weight table repeated four times it needs no mask
// (bits 4-5 select the same entry), and vpmultishiftqb moves each byte's high nibble down (taking the next
// byte's low nibble above it, which the table ignores as well). Three uops per chunk on the shuffle port
// instead of five (two masks, a shift, two vpshufb), the shift and masks of which compete with vpdpbusd.
// The looked-up bytes are identical, so the results are the same bit for bit as SimdAvx512's.
// Include only from translation units compiled with -mavx512vbmi in addition to SimdAvx512's flags.
#pragma once

#include "worker/kernels/avx512/simd_avx512.h"

namespace numoe::experts {
namespace {  // NOLINT(build/namespaces): internal linkage, see int8_tiles.h

struct SimdAvx512Vbmi : SimdAvx512 {
  static void Decode(VI lut, VI v, VI& lo, VI& hi) {
    // Byte j of each qword takes bits [8j + 4, 8j + 12): its own high nibble in bits 0-3.
    const VI shift = _mm512_set1_epi64(0x3C342C241C140C04LL);
    lo = _mm512_permutexvar_epi8(v, lut);
    hi = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(shift, v), lut);
  }
};

}  // namespace
}  // namespace numoe::experts
