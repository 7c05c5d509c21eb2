// Which instruction set the routed-expert kernels run on, chosen once at run time.
//
//   kGeneric  scalar fp32 on exactly dequantized weights: the reference (any x86-64)
//   kAvx2     int8 dot products (vpmaddubsw) on nibbles looked up to int8; needs AVX2 + FMA
//   kAvx512   int8 VNNI (vpdpbusd); needs AVX-512 F/BW/VL/VNNI
//   kAmx      bf16 tiles (TDPBF16PS) for experts with many rows, AVX-512 VNNI for the rest; needs AMX-TILE,
//             AMX-BF16, AVX512-BF16/VBMI and the kernel's XTILEDATA permission
// See worker/kernels/*/ for each kernel's error bound.
#pragma once

#include <string_view>

#include "common/cpu_features.h"
#include "common/status.h"
#include "worker/experts/activation_precision.h"

namespace numoe {

enum class Isa { kGeneric, kAvx2, kAvx512, kAmx };

const char* IsaName(Isa isa);  // "generic", "avx2", "avx512", "amx"
StatusOr<Isa> ParseIsa(std::string_view name);
// Whether `features` (CPU + OS support) can run `isa`.
bool IsaAvailable(Isa isa, const CpuFeatures& features);
bool IsaAvailable(Isa isa);  // on this machine

// The best ISA available here, or NUMOE_ISA=generic|avx2|avx512|amx when set (an error when the forced ISA
// is unknown or not available). Logs one line naming the choice (the first time each choice is made).
StatusOr<Isa> SelectIsa();

}  // namespace numoe
