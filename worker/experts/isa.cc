#include "worker/experts/isa.h"

#include <cstdlib>
#include <mutex>
#include <string>

#include "common/log.h"

namespace numoe {

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kGeneric: return "generic";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAmx: return "amx";
  }
  return "?";
}

StatusOr<Isa> ParseIsa(std::string_view name) {
  for (Isa isa : {Isa::kGeneric, Isa::kAvx2, Isa::kAvx512, Isa::kAmx}) {
    if (name == IsaName(isa)) return isa;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown ISA '", std::string(name), "' (expected generic, avx2, avx512 or amx)"));
}

bool IsaAvailable(Isa isa, const CpuFeatures& f) {
  const bool avx2 = f.avx2 && f.fma;
  const bool avx512 = avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni;
  switch (isa) {
    case Isa::kGeneric: return true;
    case Isa::kAvx2: return avx2;
    case Isa::kAvx512: return avx512;
    case Isa::kAmx:
      return avx512 && f.avx512bf16 && f.avx512vbmi && f.amx_os_enabled && f.amx_tile && f.amx_bf16;
  }
  return false;
}

bool IsaAvailable(Isa isa) { return IsaAvailable(isa, GetCpuFeatures()); }

StatusOr<Isa> SelectIsa() {
  const CpuFeatures& f = GetCpuFeatures();
  Isa isa = Isa::kGeneric;
  std::string why;
  if (const char* env = std::getenv("NUMOE_ISA"); env != nullptr && *env != '\0') {
    ASSIGN_OR_RETURN(isa, ParseIsa(env));
    if (!IsaAvailable(isa, f)) {
      return absl::FailedPreconditionError(absl::StrCat("NUMOE_ISA=", env, " is not available on this CPU/OS (has: ",
                                                        f.ToString(), ")"));
    }
    why = "forced by NUMOE_ISA";
  } else {
    for (Isa candidate : {Isa::kAmx, Isa::kAvx512, Isa::kAvx2}) {
      if (IsaAvailable(candidate, f)) {
        isa = candidate;
        break;
      }
    }
    why = "best available";
  }
  static std::mutex mu;
  static bool logged[4] = {};
  std::lock_guard<std::mutex> lock(mu);
  if (!logged[static_cast<int>(isa)]) {
    logged[static_cast<int>(isa)] = true;
    NLOG(INFO) << "expert kernels: ISA " << IsaName(isa) << " (" << why << "; cpu: " << f.ToString() << ")";
  }
  return isa;
}

}  // namespace numoe
