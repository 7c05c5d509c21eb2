#include "common/cpu_features.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace numoe {
namespace {

constexpr int kArchReqXcompPerm = 0x1023;  // <asm/prctl.h> ARCH_REQ_XCOMP_PERM (Linux >= 5.16)
constexpr int kXfeatureXtiledata = 18;

struct Regs {
  uint32_t a = 0, b = 0, c = 0, d = 0;
};

Regs Cpuid(uint32_t leaf, uint32_t subleaf) {
  Regs r;
  __cpuid_count(leaf, subleaf, r.a, r.b, r.c, r.d);
  return r;
}

bool Bit(uint32_t v, int bit) { return (v >> bit) & 1u; }

uint64_t ReadXcr0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

CpuFeatures Probe() {
  CpuFeatures f;
  const uint32_t max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 7) return f;
  const Regs l1 = Cpuid(1, 0);
  const bool osxsave = Bit(l1.c, 27);
  if (!osxsave) return f;
  const uint64_t xcr0 = ReadXcr0();
  const bool os_avx = (xcr0 & 0x6) == 0x6;           // XMM + YMM state
  const bool os_avx512 = os_avx && (xcr0 & 0xE0) == 0xE0;  // opmask + ZMM_Hi256 + Hi16_ZMM
  const bool os_amx_xcr0 = (xcr0 & (3ull << 17)) == (3ull << 17);  // XTILECFG + XTILEDATA
  const Regs l7 = Cpuid(7, 0);
  const Regs l7s1 = Cpuid(7, 1);

  if (os_avx) {
    f.fma = Bit(l1.c, 12);
    f.f16c = Bit(l1.c, 29);
    f.avx2 = Bit(l1.c, 28) && Bit(l7.b, 5);
  }
  if (os_avx512) {
    f.avx512f = Bit(l7.b, 16);
    f.avx512bw = f.avx512f && Bit(l7.b, 30);
    f.avx512vl = f.avx512f && Bit(l7.b, 31);
    f.avx512vnni = f.avx512f && Bit(l7.c, 11);
    f.avx512vbmi = f.avx512f && Bit(l7.c, 1);
    f.avx512bf16 = f.avx512f && Bit(l7s1.a, 5);
  }
  const bool cpu_amx_tile = Bit(l7.d, 24);
  if (cpu_amx_tile && os_amx_xcr0) {
    // The kernel hands out the 8 KB tile state only on request; 0 means granted (or already granted).
    f.amx_os_enabled = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }
  if (f.amx_os_enabled) {
    f.amx_tile = true;
    f.amx_int8 = Bit(l7.d, 25);
    f.amx_bf16 = Bit(l7.d, 22);
  }
  return f;
}

}  // namespace

std::string CpuFeatures::ToString() const {
  std::string s;
  auto add = [&s](bool on, const char* name) {
    if (!on) return;
    if (!s.empty()) s += ' ';
    s += name;
  };
  add(avx2, "avx2");
  add(fma, "fma");
  add(f16c, "f16c");
  add(avx512f, "avx512f");
  add(avx512bw, "avx512bw");
  add(avx512vl, "avx512vl");
  add(avx512vnni, "avx512vnni");
  add(avx512bf16, "avx512bf16");
  add(avx512vbmi, "avx512vbmi");
  add(amx_tile, "amx_tile");
  add(amx_int8, "amx_int8");
  add(amx_bf16, "amx_bf16");
  return s.empty() ? "none" : s;
}

const CpuFeatures& GetCpuFeatures() {
  static const CpuFeatures features = Probe();
  return features;
}

}  // namespace numoe
