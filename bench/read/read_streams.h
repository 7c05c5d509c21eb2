// The multi-stream read loops of the yardstick, one template for every ISA: each read_methods_<isa>.cc
// instantiates them with its own vector type V (declared in that file's anonymous namespace, so that each
// instantiation is compiled with that file's flags only). Why: the decode kernel reads four tiles at once,
// each its own sequential stream prefetched 2 KiB ahead into L1 (worker/kernels/int8_tiles.h,
// TilePassGroup), and at 16 threads on the Emerald Rapids host it read faster (1.11x) than every
// single-stream loop on contiguous per-thread shares. Measured since (read_methods_avx512.cc): what made the
// difference there was the kernel's claiming of 272 KiB work units in turn (ReadMethod::piece_bytes), not its
// four streams; ReadTileGroups stays as the loop that reads exactly like the kernel.
//
// V provides: T (a vector), kBytes (its size: 16, 32 or 64), Zero(), Load(p) (aligned), Xor(a, b), and
// Fold(a): the two 64-bit halves, summed, of the xor of a's 16-byte parts. Every loop of every ISA returns
// that fold of the xor of all its 16-byte words, so the tests can hold each to one scalar reference.
#pragma once

#include <xmmintrin.h>

#include <cstddef>
#include <cstdint>

#include "bench/read/read_methods.h"

namespace numoe::bench::read_streams {

// Reads [p, p + bytes) as kStreams equal sub-ranges in lock step: per iteration kEach consecutive lines of
// every stream (one line of each stream in turn, kEach times), so 8 lines per iteration whatever the
// stream count. kAhead > 0: every line is prefetched into L1 (prefetcht0) kAhead bytes ahead in its stream,
// like the kernel's prefetch; a prefetch that would pass the range's last line is of the line itself (no
// memory traffic; the kernel clamps at its call's tiles the same way). bytes: a multiple of kReadBlock.
// Returns the xor of all 16-byte words as a V::T (its kBytes / 16 parts xored together give it).
template <class V, int kStreams, int kAhead>
typename V::T XorStreams(const uint8_t* p, size_t bytes) {
  constexpr int kEach = kStreams >= 8 ? 1 : 8 / kStreams;
  constexpr int kLoads = 64 / V::kBytes;  // per line
  constexpr int kAcc = 8;                 // xor accumulators (independent chains; more would spill on SSE2)
  static_assert(kReadBlock % (64 * kEach * kStreams) == 0);
  const size_t len = bytes / kStreams;  // a multiple of 64 * kEach
  const uintptr_t last = reinterpret_cast<uintptr_t>(p) + bytes - 64;
  typename V::T acc[kAcc];
  for (auto& a : acc) a = V::Zero();
  for (size_t i = 0; i < len; i += 64 * kEach) {
#pragma GCC unroll 8
    for (int l = 0; l < kEach; ++l) {
#pragma GCC unroll 8
      for (int k = 0; k < kStreams; ++k) {
        const uint8_t* q = p + k * len + i + 64 * l;
        if constexpr (kAhead > 0) {
          const uintptr_t a = reinterpret_cast<uintptr_t>(q) + kAhead;
          _mm_prefetch(reinterpret_cast<const char*>(a > last ? reinterpret_cast<uintptr_t>(q) : a), _MM_HINT_T0);
        }
#pragma GCC unroll 4
        for (int j = 0; j < kLoads; ++j) {
          constexpr int kPerStep = kEach * kStreams * kLoads;
          const int n = ((l * kStreams + k) * kLoads + j) % (kPerStep < kAcc ? kPerStep : kAcc);
          acc[n] = V::Xor(acc[n], V::Load(q + j * V::kBytes));
        }
      }
    }
  }
  for (int j = 1; j < kAcc; ++j) acc[0] = V::Xor(acc[0], acc[j]);
  return acc[0];
}

template <class V, int kStreams, int kAhead>
uint64_t ReadStreams(const uint8_t* p, size_t bytes) {
  return V::Fold(XorStreams<V, kStreams, kAhead>(p, bytes));
}

// Reads like the decode kernel's gate/up work unit: [p, p + bytes) (one claimed piece) in groups of
// kStreams x kStreamBytes (four tiles), each group as kStreams streams in lock step (ReadStreams); a short
// last group is split the same way. bytes and kStreamBytes * kStreams: multiples of kReadBlock.
template <class V, int kStreams, int kAhead, size_t kStreamBytes>
uint64_t ReadTileGroups(const uint8_t* p, size_t bytes) {
  constexpr size_t kGroup = kStreams * kStreamBytes;
  static_assert(kGroup % kReadBlock == 0);
  typename V::T acc = V::Zero();
  for (size_t off = 0; off < bytes; off += kGroup) {
    acc = V::Xor(acc, XorStreams<V, kStreams, kAhead>(p + off, bytes - off < kGroup ? bytes - off : kGroup));
  }
  return V::Fold(acc);
}

}  // namespace numoe::bench::read_streams
