// Streaming-read loops for the read-bandwidth yardstick (bench/read_bandwidth.h), one translation unit per
// ISA (read_methods_{generic,avx2,avx512}.cc), each compiled with only its ISA's flags, like
// worker/kernels/*/: no wide instruction can leak into code that runs on a CPU without it, and GCC puts the
// vzeroupper at the end of each function itself (it does not for target-attribute functions, commit 6a50c09).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "common/packed_layout.h"

namespace numoe::bench {

struct ReadMethod {
  // e.g. "avx512-x4" (4 lines per iteration into 4 accumulators), "avx512-x4-pf2k" (software prefetch 2 KiB
  // ahead, into L1), "avx512-x4-pf2-8k" (into L2, 8 KiB ahead), "avx512-x4-nt" (non-temporal vmovntdqa loads),
  // "sse2-s4-pf2k" (4 streams in lock step, each prefetched 2 KiB ahead: read/read_streams.h),
  // "avx512-s4-pf2k-272k" (the kernel's way: 272 KiB pieces claimed in turn, 4 tile streams at a time),
  // "avx512-x8-272k" (the same pieces, each read as one stream).
  const char* name;
  // Reads [p, p + bytes) once and returns a value that depends on every byte (so no load can be dropped):
  // for every method but the old one, the two 64-bit halves, summed, of the xor of all 16-byte words
  // (the same value whatever the ISA, stream count or order). p is 64-byte aligned and bytes a multiple of
  // kReadBlock.
  uint64_t (*read)(const uint8_t* p, size_t bytes);
  // 0: ReadPass gives each thread one contiguous share of a span. > 0: it cuts the span into pieces of this
  // many bytes (a multiple of kReadBlock; the last one shorter) that the threads claim in turn from a shared
  // counter (ThreadPool::RunOnAvailable), as the decode kernel claims its work units.
  size_t piece_bytes = 0;
};

inline constexpr size_t kReadBlock = 512;  // bytes per loop iteration of the widest method

// The decode kernel's reads, for the method that copies them: a V4-Flash gate/up tile (16 rows x 4096
// columns packed: 34 KiB) is one stream, four are read at once, and a work unit is 4 gate/up tile pairs
// (MoeComputeOptions::gate_up_chunk), 272 KiB.
inline constexpr size_t kKernelTileBytes = experts::PackedMatrixShape{2048, 4096}.tile_bytes();
inline constexpr size_t kKernelPieceBytes = 8 * kKernelTileBytes;
static_assert(kKernelTileBytes % kReadBlock == 0 && kKernelPieceBytes == 272 * 1024);

// Only call a table's methods when its ISA is available (read_bandwidth.cc checks).
std::span<const ReadMethod> GenericReadMethods();  // SSE2 (x86-64 baseline)
std::span<const ReadMethod> Avx2ReadMethods();
std::span<const ReadMethod> Avx512ReadMethods();
// The loop of the old yardstick ("u64x8-pf2k"), timed next to the others so that its distance stays visible.
const ReadMethod& OldYardstickReadMethod();

}  // namespace numoe::bench
