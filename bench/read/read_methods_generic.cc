// The yardstick's baseline read loops (x86-64 baseline flags: SSE2), for any CPU, and the old yardstick's
// loop kept as a method so its distance from the best one stays visible in every run.
#include <emmintrin.h>

#include <cstring>

#include "bench/read/read_methods.h"
#include "bench/read/read_streams.h"

namespace numoe::bench {
namespace {

uint64_t Fold128(__m128i a) {  // the fold every loop returns (read_methods.h)
  uint64_t v[2];
  std::memcpy(v, &a, 16);
  return v[0] + v[1];
}

struct V128 {  // read_streams.h's vector type
  using T = __m128i;
  static constexpr int kBytes = 16;
  static T Zero() { return _mm_setzero_si128(); }
  static T Load(const uint8_t* p) { return _mm_load_si128(reinterpret_cast<const __m128i*>(p)); }
  static T Xor(T a, T b) { return _mm_xor_si128(a, b); }
  static uint64_t Fold(T a) { return Fold128(a); }
};

// Four 128-bit loads per line, 4 lines per iteration, 16 xor accumulators.
uint64_t ReadSse2(const uint8_t* p, size_t bytes) {
  __m128i acc[16];
  for (auto& a : acc) a = _mm_setzero_si128();
  for (size_t i = 0; i < bytes; i += 256) {
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      acc[j] = _mm_xor_si128(acc[j], _mm_load_si128(reinterpret_cast<const __m128i*>(p + i + 16 * j)));
    }
  }
  for (int j = 1; j < 16; ++j) acc[0] = _mm_xor_si128(acc[0], acc[j]);
  return Fold128(acc[0]);
}

// The loop numoe-bench used until it was found to read 20-35% below what the threads can:
// 8 uint64 lanes per line with one software prefetch per line 2 KiB ahead.
uint64_t ReadU64x8Prefetch(const uint8_t* p, size_t bytes) {
  uint64_t acc[8] = {};
  for (size_t i = 0; i + 64 <= bytes; i += 64) {
    __builtin_prefetch(p + i + 2048, 0, 3);
    uint64_t v[8];
    std::memcpy(v, p + i, 64);
    for (int j = 0; j < 8; ++j) acc[j] += v[j];
  }
  uint64_t s = 0;
  for (uint64_t a : acc) s += a;
  return s;
}

constexpr ReadMethod kMethods[] = {
    {"sse2-x4", ReadSse2},
    {"sse2-s4-pf2k", read_streams::ReadStreams<V128, 4, 2048>},
    // Claimed pieces, as the AVX-512 table (read_methods_avx512.cc has why).
    {"sse2-s4-pf2k-272k", read_streams::ReadTileGroups<V128, 4, 2048, kKernelTileBytes>, kKernelPieceBytes},
    {"sse2-x4-272k", ReadSse2, kKernelPieceBytes},
};
constexpr ReadMethod kOld = {"u64x8-pf2k", ReadU64x8Prefetch};

}  // namespace

std::span<const ReadMethod> GenericReadMethods() { return kMethods; }
const ReadMethod& OldYardstickReadMethod() { return kOld; }

}  // namespace numoe::bench
