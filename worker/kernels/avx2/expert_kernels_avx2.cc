// AVX2 expert kernel: the int8 tile kernel (worker/kernels/int8_tiles.h, same error bound as AVX-512)
// on 8-row registers with vpmaddubsw + vpmaddwd in place of vpdpbusd.
#include "worker/kernels/avx2/simd_avx2.h"
#include "worker/kernels/int8_tiles.h"

namespace numoe::experts {
namespace {

constexpr KernelOps kOpsHigh = {"avx2", Int8ActBytes<2>, Int8PrepareActsFor<SimdAvx2, 2>, Int8ScratchBytes,
                                Int8Tiles<SimdAvx2, 2>};
constexpr KernelOps kOpsLow = {"avx2-int8", Int8ActBytes<1>, Int8PrepareActsFor<SimdAvx2, 1>, Int8ScratchBytes,
                               Int8Tiles<SimdAvx2, 1>};

}  // namespace

const KernelOps& Avx2KernelOps(ActivationPrecision precision) {
  return precision == ActivationPrecision::kHigh ? kOpsHigh : kOpsLow;
}

}  // namespace numoe::experts
