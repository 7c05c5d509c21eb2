// splitmix64 (Steele, Lea and Flood's SplittableRandom finalizer): the one integer mixer numoe uses, for
// reproducible generators (synthetic weights, sampling seeds, benchmark prompts) and for spreading similar keys
// (the router's balancer). Header-only; the same input gives the same bits on every machine.
#pragma once

#include <cstdint>
#include <span>

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

// A hash chain over token ids: `h` (the hash of the ids before, or a seed) extended by `ids`, so the hash of
// a prefix extends to the hash of any longer prompt without rereading it (the router's prefix affinity, the
// prefix cache's pages).
inline uint64_t HashTokens(uint64_t h, std::span<const int32_t> ids) {
  for (int32_t id : ids) h = SplitMix64(h ^ static_cast<uint32_t>(id));
  return h;
}

}  // namespace numoe
