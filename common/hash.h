// splitmix64 (Steele, Lea and Flood's SplittableRandom finalizer): the one integer mixer numoe uses, for
// reproducible generators (synthetic weights, sampling seeds, benchmark prompts) and for spreading similar keys
// (the router's balancer). Header-only; the same input gives the same bits on every machine.
#pragma once

#include <cstdint>

namespace numoe {

inline constexpr uint64_t kSplitMix64Gamma = 0x9E3779B97F4A7C15ull;

// The output function: a bijection of 64-bit words with good avalanche.
inline constexpr uint64_t SplitMix64Finalize(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// One step of the generator from state x: the finalizer of x + gamma.
inline constexpr uint64_t SplitMix64(uint64_t x) { return SplitMix64Finalize(x + kSplitMix64Gamma); }

}  // namespace numoe
