// The yardstick's 256-bit read loops (compiled with -mavx2 only), for CPUs without AVX-512.
#include <immintrin.h>

#include "bench/read/read_methods.h"
#include "bench/read/read_streams.h"

namespace numoe::bench {
namespace {

// The fold every loop returns (read_methods.h): the xor of the two 128-bit halves, its halves summed.
uint64_t Fold256(__m256i a) {
  alignas(32) uint64_t v[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(v), a);
  return (v[0] ^ v[2]) + (v[1] ^ v[3]);
}

struct V256 {  // read_streams.h's vector type
  using T = __m256i;
  static constexpr int kBytes = 32;
  static T Zero() { return _mm256_setzero_si256(); }
  static T Load(const uint8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
  static T Xor(T a, T b) { return _mm256_xor_si256(a, b); }
  static uint64_t Fold(T a) { return Fold256(a); }
};

// kLines 64-byte lines per iteration, two 256-bit loads each, into 2 * kLines xor accumulators; kNt:
// non-temporal loads (vmovntdqa); kAhead > 0: one prefetch per line into L1, kAhead bytes ahead.
template <int kLines, bool kNt, int kAhead>
uint64_t Read256(const uint8_t* p, size_t bytes) {
  static_assert(kReadBlock % (kLines * 64) == 0);
  __m256i acc[2 * kLines];
  for (int j = 0; j < 2 * kLines; ++j) acc[j] = _mm256_setzero_si256();
  for (size_t i = 0; i < bytes; i += 64 * kLines) {
    const uint8_t* q = p + i;
#pragma GCC unroll 8
    for (int j = 0; j < 2 * kLines; ++j) {
      if constexpr (kAhead > 0) {
        if (j % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(q + kAhead + 32 * j), _MM_HINT_T0);
      }
      const auto* v = reinterpret_cast<const __m256i*>(q + 32 * j);
      acc[j] = _mm256_xor_si256(acc[j], kNt ? _mm256_stream_load_si256(v) : _mm256_load_si256(v));
    }
  }
  for (int j = 1; j < 2 * kLines; ++j) acc[0] = _mm256_xor_si256(acc[0], acc[j]);
  return Fold256(acc[0]);
}

constexpr ReadMethod kMethods[] = {
    {"avx2-x4", Read256<4, false, 0>},
    {"avx2-x4-pf2k", Read256<4, false, 2048>},
    {"avx2-x4-nt", Read256<4, true, 0>},
    // Claimed pieces, as the AVX-512 table (read_methods_avx512.cc has why).
    {"avx2-s4-pf2k-272k", read_streams::ReadTileGroups<V256, 4, 2048, kKernelTileBytes>, kKernelPieceBytes},
    {"avx2-x4-272k", Read256<4, false, 0>, kKernelPieceBytes},
};

}  // namespace

std::span<const ReadMethod> Avx2ReadMethods() { return kMethods; }

}  // namespace numoe::bench
