// The yardstick's 512-bit read loops (compiled with -mavx512f only). Why several: which read is fastest
// depends on the CPU and on how many threads share the memory (prefetchers, fill buffers, whether vmovntdqa
// differs from vmovdqa64 on write-back memory), so read_bandwidth.cc times them all on the buffer and keeps
// the best. On the Emerald Rapids host the winner changed with the thread count: avx512-x8 at 2 threads,
// claimed pieces (x8-272k) at 8 and 16 (below).
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

// Which loops are timed, from the GPU host (Emerald Rapids, 16 cores; numoe-bench experts, 6.85 GB, medians
// of 2 passes, GB/s) and the 2-vCPU VM. Threads that CLAIM 272 KiB pieces in turn (piece_bytes: all threads
// read close together in the buffer, as the kernel's work units do) read more than any loop on contiguous
// per-thread shares at 16 threads, 1.20-1.36x in 4 runs: amx T=1 / T=4 x8-272k 130.1 / 140.1, s4-pf2k-272k
// 124.0 / 133.9, the best other 95.7 / 116.5 (s4-pf2k 93.1 / 112.1); at 8 threads 1.03-1.37x at T=1 (82.4
// and 78.0 against 60.2 in one run) but 0.91-1.03x at T=4 (x8 won 2 of 3). The four streams are not what does it
// (x8-272k, one stream, led s4-pf2k-272k in all 5 runs). At 2 threads there the winners were x8 (3 of 4) and
// x4-pf2-8k (1), 272k within 1-10% below; on the VM the old loop u64x8-pf2k won every run (35.4-36.7 against
// 33-34 for the rest). Never the best in any run on either machine, and left out: x4, x4-pf2k, x4-pf4k,
// x4-pf2-4k, s2, s2-pf2k, s4, s4-pf2k, s8, s8-pf2k (the contiguous multi-stream loops: their best from 24%
// below to 5% above x8). x4-nt never won either; it stays as the non-temporal load (issue #14 asks for it).
constexpr ReadMethod kMethods[] = {
    {"avx512-x8", Read512<8, false, Hint::kNone, 0>},
    {"avx512-x4-pf2-8k", Read512<4, false, Hint::kL2, 8192>},
    {"avx512-x4-nt", Read512<4, true, Hint::kNone, 0>},
    {"avx512-s4-pf2k-272k", ReadTileGroups<V512, 4, 2048, kKernelTileBytes>, kKernelPieceBytes},
    {"avx512-x8-272k", Read512<8, false, Hint::kNone, 0>, kKernelPieceBytes},
};

}  // namespace

std::span<const ReadMethod> Avx512ReadMethods() { return kMethods; }

}  // namespace numoe::bench
