// The yardstick's 512-bit read loops (compiled with -mavx512f only). Why several: which read is fastest
// depends on the CPU and on how many threads share the memory (prefetchers, fill buffers, whether vmovntdqa
// differs from vmovdqa64 on write-back memory), so read_bandwidth.cc times them all on the buffer and keeps
// the best. On the Emerald Rapids host the winner changed with the thread count: avx512-x8 at 2 threads
// (25.3 GB/s against 22.2 for x4), a prefetching one at 16 (pf2k/pf4k/pf2-4k within 1% of each other).
#include <immintrin.h>

#include "bench/read/read_methods.h"
#include "bench/read/read_streams.h"

namespace numoe::bench {
namespace {

enum class Hint { kNone, kL1, kL2 };

// The fold every loop returns (read_methods.h): the xor of the four 128-bit quarters, its halves summed.
// (Through memory: GCC 12's extract intrinsics trip -Werror=uninitialized, as _mm512_reduce_add_epi64 does.)
uint64_t Fold512(__m512i a) {
  alignas(64) uint64_t v[8];
  _mm512_store_si512(v, a);
  return (v[0] ^ v[2] ^ v[4] ^ v[6]) + (v[1] ^ v[3] ^ v[5] ^ v[7]);
}

struct V512 {  // read_streams.h's vector type
  using T = __m512i;
  static constexpr int kBytes = 64;
  static T Zero() { return _mm512_setzero_si512(); }
  static T Load(const uint8_t* p) { return _mm512_load_si512(p); }
  static T Xor(T a, T b) { return _mm512_xor_si512(a, b); }
  static uint64_t Fold(T a) { return Fold512(a); }
};

using read_streams::ReadStreams;
using read_streams::ReadTileGroups;

// kLines lines per iteration into kLines independent xor accumulators (no dependency chain between loads);
// kNt: non-temporal loads; kHint/kAhead: one software prefetch per line, kAhead bytes ahead.
template <int kLines, bool kNt, Hint kHint, int kAhead>
uint64_t Read512(const uint8_t* p, size_t bytes) {
  static_assert(kLines * 64 <= static_cast<int>(kReadBlock) && kReadBlock % (kLines * 64) == 0);
  __m512i acc[kLines];
  for (int j = 0; j < kLines; ++j) acc[j] = _mm512_setzero_si512();
  for (size_t i = 0; i < bytes; i += 64 * kLines) {
    const uint8_t* q = p + i;
#pragma GCC unroll 8
    for (int j = 0; j < kLines; ++j) {
      if constexpr (kHint == Hint::kL1) _mm_prefetch(reinterpret_cast<const char*>(q + kAhead + 64 * j), _MM_HINT_T0);
      if constexpr (kHint == Hint::kL2) _mm_prefetch(reinterpret_cast<const char*>(q + kAhead + 64 * j), _MM_HINT_T1);
      const void* line = q + 64 * j;
      const __m512i v = kNt ? _mm512_stream_load_si512(const_cast<void*>(line)) : _mm512_load_si512(line);
      acc[j] = _mm512_xor_si512(acc[j], v);
    }
  }
  for (int j = 1; j < kLines; ++j) acc[0] = _mm512_xor_si512(acc[0], acc[j]);
  return Fold512(acc[0]);
}

// Timed on the 2-vCPU Emerald Rapids VM (2 threads, 10.27 GB, medians of 5 passes round robin, two runs, GB/s):
// x4 29.4 / 29.1, x8 32.1 / 32.1, x4-pf2k 33.4 / 33.7, x4-pf4k 30.2 / 29.9, x4-pf2-4k 30.7 / 30.5, x4-pf2-8k
// 29.7 / 29.8, x4-nt 26.6 / 26.5, s2 31.2 / 31.0, s4 32.6 / 32.5, s8 31.8 / 31.9, s2-pf2k 32.3 / 32.3, s4-pf2k
// 33.1 / 32.5, s8-pf2k 32.7 / 32.2, s4-pf2k-272k 32.4 / 32.1, and the old loop u64x8-pf2k 35.4 / 35.5 (it won
// both). Left out since: x4 (x8 read more in every run, here and on the GPU host), x4-pf4k (within 1% of
// x4-pf2k at 16 threads there, below it here), s2 and s2-pf2k (fewer streams than the kernel's four, below
// s4), s8 (below s8-pf2k). Kept: the best of each kind, for the thread counts of the GPU host.
constexpr ReadMethod kMethods[] = {
    {"avx512-x8", Read512<8, false, Hint::kNone, 0>},
    {"avx512-x4-pf2k", Read512<4, false, Hint::kL1, 2048>},
    {"avx512-x4-pf2-4k", Read512<4, false, Hint::kL2, 4096>},
    {"avx512-x4-pf2-8k", Read512<4, false, Hint::kL2, 8192>},
    {"avx512-x4-nt", Read512<4, true, Hint::kNone, 0>},
    {"avx512-s4", ReadStreams<V512, 4, 0>},
    {"avx512-s4-pf2k", ReadStreams<V512, 4, 2048>},
    {"avx512-s8-pf2k", ReadStreams<V512, 8, 2048>},
    {"avx512-s4-pf2k-272k", ReadTileGroups<V512, 4, 2048, kKernelTileBytes>, kKernelPieceBytes},
    // The same claimed pieces read as one stream: whether the claiming or the four streams make the difference.
    {"avx512-x8-272k", Read512<8, false, Hint::kNone, 0>, kKernelPieceBytes},
};

}  // namespace

std::span<const ReadMethod> Avx512ReadMethods() { return kMethods; }

}  // namespace numoe::bench
