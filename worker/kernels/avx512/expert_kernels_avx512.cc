// AVX-512 VNNI expert kernel: int8 vpdpbusd on nibbles looked up to int8 (worker/kernels/int8_tiles.h).
//
// Why int8 VNNI and not BF16 (vdpbf16ps): measured on this machine (AMD EPYC Zen 5, one core, a 512 KB
// packed working set in L2, the same row-tile layout), GB/s of packed weights consumed for T rows:
//            T=1    T=2    T=4    T=6    T=8
//   int8    ~100    73     43     30     24
//   bf16     43     32     16      8      5
// BF16 needs twice the decode work (a nibble becomes 16 bits, vpermw per 32 weights) and does half the
// multiply-adds per instruction, so it falls below the DRAM rate (~12 GB/s per core) already at T=4,
// while int8 stays above it up to T=8 (speculative decode routes up to ~6 rows to an expert).
// Cost: activations are quantised to int8 per 32 columns; the bound is in int8_tiles.h.
#include <ctime>

#include "worker/kernels/avx512/simd_avx512.h"
#include "worker/kernels/int8_tiles.h"

namespace numoe::experts {
namespace {

constexpr KernelOps kOpsHigh = {"avx512", Int8ActBytes<2>, Int8PrepareActsFor<SimdAvx512, 2>, Int8ScratchBytes,
                                Int8Tiles<SimdAvx512, 2>};
constexpr KernelOps kOpsLow = {"avx512-int8", Int8ActBytes<1>, Int8PrepareActsFor<SimdAvx512, 1>, Int8ScratchBytes,
                               Int8Tiles<SimdAvx512, 1>};
constexpr KernelOps kPrefillHigh = {"avx512-prefill", Int8ActBytes<2>, Int8PrefillPrepareActs<2>,
                                    Int8PrefillScratchBytes<2>, Int8PrefillTiles<SimdAvx512, 2>};
constexpr KernelOps kPrefillLow = {"avx512-prefill-int8", Int8ActBytes<1>, Int8PrefillPrepareActs<1>,
                                   Int8PrefillScratchBytes<1>, Int8PrefillTiles<SimdAvx512, 1>};

double Now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace

double Avx512VnniPeakFlops(double seconds) {
  __m512i acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_epi32(i);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  const double t0 = Now();
  double t = t0;
  int64_t iters = 0;
  while (t - t0 < seconds) {
    for (int r = 0; r < 10000; ++r) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    }
    iters += 10000;
    t = Now();
  }
  volatile int sink = 0;
  for (int i = 0; i < 12; ++i) sink = sink + _mm512_reduce_add_epi32(acc[i]);
  return static_cast<double>(iters) * 12 * 64 * 2 / (t - t0);
}

const KernelOps& Avx512KernelOps(ActivationPrecision precision) {
  return precision == ActivationPrecision::kHigh ? kOpsHigh : kOpsLow;
}

const KernelOps& Avx512PrefillKernelOps(ActivationPrecision precision) {
  return precision == ActivationPrecision::kHigh ? kPrefillHigh : kPrefillLow;
}

}  // namespace numoe::experts
