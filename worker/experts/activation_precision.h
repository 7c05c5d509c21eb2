// How the fast expert kernels represent activations (the generic kernel always uses fp32). A header of
// its own, free of other includes, because the ISA kernels (compiled with ISA flags) include it.
#pragma once

namespace numoe {

enum class ActivationPrecision {
  kHigh,  // default: two int8 levels per 32 columns (two bf16 terms on AMX); ~1e-4 relative on the output
  kLow,   // one int8 level (one bf16 term on AMX); ~1% relative; cheaper when many rows share an expert
};

}  // namespace numoe
