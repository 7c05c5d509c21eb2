// The AVX-512 VNNI expert kernel (expert_kernels_avx512.cc) with the VBMI nibble decode
// (simd_avx512_vbmi.h): the same results, fewer uops per weight byte. MoeCompute picks it where the CPU
// has AVX-512 VBMI.
#include "worker/kernels/avx512/simd_avx512_vbmi.h"
#include "worker/kernels/int8_tiles.h"

namespace numoe::experts {
namespace {

constexpr KernelOps kOpsHigh = {"avx512-vbmi", Int8ActBytes<2>, Int8PrepareActsFor<SimdAvx512Vbmi, 2>,
                                Int8ScratchBytes, Int8Tiles<SimdAvx512Vbmi, 2>};
constexpr KernelOps kOpsLow = {"avx512-vbmi-int8", Int8ActBytes<1>, Int8PrepareActsFor<SimdAvx512Vbmi, 1>,
                               Int8ScratchBytes, Int8Tiles<SimdAvx512Vbmi, 1>};
constexpr KernelOps kPrefillHigh = {"avx512-vbmi-prefill", Int8ActBytes<2>, Int8PrefillPrepareActs<2>,
                                    Int8PrefillScratchBytes<2>, Int8PrefillTiles<SimdAvx512Vbmi, 2>};
constexpr KernelOps kPrefillLow = {"avx512-vbmi-prefill-int8", Int8ActBytes<1>, Int8PrefillPrepareActs<1>,
                                   Int8PrefillScratchBytes<1>, Int8PrefillTiles<SimdAvx512Vbmi, 1>};

}  // namespace

const KernelOps& Avx512VbmiKernelOps(ActivationPrecision precision) {
  return precision == ActivationPrecision::kHigh ? kOpsHigh : kOpsLow;
}

const KernelOps& Avx512VbmiPrefillKernelOps(ActivationPrecision precision) {
  return precision == ActivationPrecision::kHigh ? kPrefillHigh : kPrefillLow;
}

}  // namespace numoe::experts
