// Streaming-read loops for the read-bandwidth yardstick (bench/read_bandwidth.h), one translation unit per
// ISA (read_methods_{generic,avx2,avx512}.cc), each compiled with only its ISA's flags, like
// worker/kernels/*/: no wide instruction can leak into code that runs on a CPU without it, and GCC puts the
// vzeroupper at the end of each function itself (it does not for target-attribute functions, commit 6a50c09).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace numoe::bench {

struct ReadMethod {
  // e.g. "avx512-x4" (4 lines per iteration into 4 accumulators), "avx512-x4-pf2k" (software prefetch 2 KiB
  // ahead, into L1), "avx512-x4-pf2-8k" (into L2, 8 KiB ahead), "avx512-x4-nt" (non-temporal vmovntdqa loads).
  const char* name;
  // Reads [p, p + bytes) once, front to back, and returns a value that depends on every byte (so no load
  // can be dropped). p is 64-byte aligned and bytes a multiple of kReadBlock.
  uint64_t (*read)(const uint8_t* p, size_t bytes);
};

inline constexpr size_t kReadBlock = 512;  // bytes per loop iteration of the widest method

// Only call a table's methods when its ISA is available (read_bandwidth.cc checks).
std::span<const ReadMethod> GenericReadMethods();  // SSE2 (x86-64 baseline)
std::span<const ReadMethod> Avx2ReadMethods();
std::span<const ReadMethod> Avx512ReadMethods();
// The loop of the old yardstick ("u64x8-pf2k"), timed next to the others so that its distance stays visible.
const ReadMethod& OldYardstickReadMethod();

}  // namespace numoe::bench
