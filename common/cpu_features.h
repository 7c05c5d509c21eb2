// What the CPU and the operating system let this process use, probed once.
//
// A feature is reported only when both the CPU advertises it (CPUID) and the OS has enabled the register
// state it needs: AVX/AVX2/FMA need XCR0 bits 1-2 (SSE+AVX state), AVX-512 additionally bits 5-7
// (opmask, ZMM_Hi256, Hi16_ZMM), and AMX needs XCR0 bits 17-18 plus, on Linux, a per-process permission
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); without it the first tile instruction raises
// SIGILL. GetCpuFeatures() asks for that permission once, and amx_os_enabled records whether it was given.
// Consequently amx_tile/amx_int8/amx_bf16 are true only when amx_os_enabled is true.
#pragma once

#include <string>

namespace numoe {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512vnni = false, avx512bf16 = false;
  bool avx512vbmi = false;  // vpermb (used by the AMX weight decoder)
  bool amx_tile = false, amx_int8 = false, amx_bf16 = false;
  bool amx_os_enabled = false;  // XCR0 tile state + the kernel granted XTILEDATA to this process

  // e.g. "avx2 fma f16c avx512f avx512bw avx512vl avx512vnni avx512bf16 avx512vbmi" (absent ones omitted).
  std::string ToString() const;
};

// Probed on first use (thread-safe); later calls return the same object.
const CpuFeatures& GetCpuFeatures();

}  // namespace numoe
