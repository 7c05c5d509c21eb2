// The int8 tile kernel shared by AVX2 and AVX-512: one source, written against a small SIMD value type
// `S` (worker/kernels/avx2/simd_avx2.h, worker/kernels/avx512/simd_avx512.h).
//
// Include ONLY from a translation unit compiled with that ISA's flags. Everything here has internal
// linkage (anonymous namespace) on purpose: the AVX-512 and AVX2 copies must never be merged by the
// linker with each other or with generic code.
//
// Math. Weights: a nibble n is looked up (vpshufb) to the byte 2*fp4(n) + 12 in [0, 24] (unsigned, as
// dpbusd's first operand wants). Activations: each row is quantised per 32-column block,
//   s_b = max|x_b| / 127,   q_c = round_half_even(x_c / s_b) in [-127, 127],
// and, in the two-level ("high precision") form, the remainder once more:
//   l_c = clamp(round_half_even(256 (x_c / s_b - q_c)), -127, 127),   x_c ~ s_b (q_c + l_c / 256).
// Each level has its own int32 accumulator; a block's sum 256 * sum (2 fp4 + 12) q + sum (2 fp4 + 12) l
// starts from -12 (256 sum q + sum l) (the "corr" term), so it is exactly 2 sum_c fp4_c (256 q_c + l_c)
// (|.| < 2^25, no overflow), and y = sum_b 2^(e_b - 127) * (s_b / 512) * that.
// Error bound (per output, against exact weights and fp32 activations):
//   one level:  |y - y_exact| <= sum_b max|x_b| / 254   * sum_{c in b} |W_c|   (~1% relative in practice)
//   two levels: |y - y_exact| <= sum_b max|x_b| / 32512 * sum_{c in b} |W_c|   (~1e-4 relative)
// plus fp32 rounding (~1e-6 relative). MoeCompute applies it twice (x, then the SwiGLU output h);
// tests/kernels/ asserts the composed bound. Two levels cost a second dpbusd per weight register and
// token, which is free while the kernel waits for DRAM (T <= ~6 rows per expert on this machine).
#pragma once

#include <cstdint>
#include <cstring>

#include "worker/experts/kernel_ops.h"
#include "common/packed_layout.h"

namespace numoe::experts {
namespace {  // NOLINT(build/namespaces): see the header comment

// Activation layout (for an ISA with group size G and L levels): rows go in groups of G; group g has rows
// [gG, min(m, gG + G)), gs of them, and is contiguous:
//   q    int32[Kp/4][gs]   four int8 columns per int32, the group's rows side by side, so one 4-byte
//                          broadcast feeds a dpbusd
//   l    int32[Kp/4][gs]   the second level (two-level form only), same layout
//   xs   float[Kp/32][gs]  s_b / 2 (one level) or s_b / 512 (two levels): the looked-up weights are 2 fp4
//   corr int32[Kp/32][gs]  -12 * sum of the block's q (one level) or of 256 q + l (two levels)
// Bytes of `rows` rows' activations; also the offset of the group starting at row `rows` (groups before
// it are full).
template <int kLevels>
constexpr int64_t GroupBytes(int64_t rows, int64_t kp) {
  return kLevels * rows * kp + rows * (kp / 32) * 8;
}

template <int kLevels>
size_t Int8ActBytes(int64_t m, int64_t kp) {
  return static_cast<size_t>(GroupBytes<kLevels>(m, kp));
}

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline int32_t RoundToInt(float v) {  // nearest, ties to even, for |v| < 2^22: adding 1.5 * 2^23 rounds
  return static_cast<int32_t>(FloatBits(v + 12582912.0f)) - 0x4B400000;
}

// Quantises one row (k valid columns, kp padded) into slot `r` of a group of gs rows.
template <int kLevels>
inline void QuantizeRow(const float* x, int64_t k, int64_t kp, int r, int gs, int32_t* q, int32_t* l, float* xs,
                        int32_t* corr) {
  int8_t* qb = reinterpret_cast<int8_t*>(q);
  int8_t* lb = reinterpret_cast<int8_t*>(l);
  for (int64_t b = 0; b < kp / 32; ++b) {
    float v[32];
    const int64_t c0 = 32 * b;
    const int64_t n = c0 >= k ? 0 : (k - c0 < 32 ? k - c0 : 32);
    for (int c = 0; c < 32; ++c) v[c] = c < n ? x[c0 + c] : 0.0f;
    uint32_t amax_bits = 0;  // max |v| on the bit patterns: an integer max, which vectorises
    for (int c = 0; c < 32; ++c) {
      const uint32_t a = FloatBits(v[c]) & 0x7fffffffu;
      amax_bits = a > amax_bits ? a : amax_bits;
    }
    const float amax = BitsFloat(amax_bits);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    // The block's levels into contiguous arrays first (a loop the compiler vectorises), then four bytes
    // at a time to their interleaved places.
    int8_t qv[32], lv[32];
    int32_t sum = 0;
    for (int c = 0; c < 32; ++c) {
      const float t = v[c] * inv;  // |t| <= 127 (+ rounding), so the level stays in [-127, 127]
      const int32_t qi = RoundToInt(t);
      qv[c] = static_cast<int8_t>(qi);
      if constexpr (kLevels == 2) {
        int32_t li = RoundToInt((t - static_cast<float>(qi)) * 256.0f);  // t - qi is exact
        li = li > 127 ? 127 : (li < -127 ? -127 : li);
        lv[c] = static_cast<int8_t>(li);
        sum += 256 * qi + li;
      } else {
        sum += qi;
      }
    }
    for (int d = 0; d < 8; ++d) {
      std::memcpy(qb + ((c0 / 4 + d) * gs + r) * 4, qv + 4 * d, 4);
      if constexpr (kLevels == 2) std::memcpy(lb + ((c0 / 4 + d) * gs + r) * 4, lv + 4 * d, 4);
    }
    xs[b * gs + r] = amax / 127.0f * (kLevels == 2 ? 0.5f / 256.0f : 0.5f);
    corr[b * gs + r] = -12 * sum;
  }
}

// Pointers into one group's activations.
template <int kLevels>
struct GroupActs {
  int32_t* q;
  int32_t* l;
  float* xs;
  int32_t* corr;
  GroupActs(uint8_t* base, int64_t gs, int64_t kp)
      : q(reinterpret_cast<int32_t*>(base)),
        l(reinterpret_cast<int32_t*>(base + gs * kp)),
        xs(reinterpret_cast<float*>(base + kLevels * gs * kp)),
        corr(reinterpret_cast<int32_t*>(base + kLevels * gs * kp + gs * (kp / 32) * 4)) {}
};

template <int G, int kLevels>
void Int8PrepareActs(const float* const* rows, int64_t m, int64_t k, int64_t kp, uint8_t* acts) {
  for (int64_t g0 = 0; g0 < m; g0 += G) {
    const int gs = static_cast<int>(m - g0 < G ? m - g0 : G);
    GroupActs<kLevels> ga(acts + GroupBytes<kLevels>(g0, kp), gs, kp);
    for (int r = 0; r < gs; ++r) QuantizeRow<kLevels>(rows[g0 + r], k, kp, r, gs, ga.q, ga.l, ga.xs, ga.corr);
  }
}

// Software prefetch goes to L1 (prefetcht0, TileArgs::prefetch_l1) or L2 (prefetcht1), TileArgs::prefetch_bytes
// ahead: MoeComputeOptions::prefetch_bytes has the measurements. (A function: GCC 12 drops __builtin_prefetch calls made from a lambda in these loops.)
inline void PrefetchL2(const uint8_t* p) { __builtin_prefetch(p, 0, 2); }
// Or into L1 (prefetcht0) where `l1` (TileArgs::prefetch_l1).
inline void PrefetchLine(const uint8_t* p, bool l1) {
  if (l1) {
    __builtin_prefetch(p, 0, 3);
  } else {
    __builtin_prefetch(p, 0, 2);
  }
}

// Read-ahead (TileArgs::read_ahead) of one line: mode 1 a plain load of one byte, which brings the whole
// line in like the read yardstick's loads (its result is not used; nothing waits for it but retirement),
// 2 prefetcht0, 3 prefetcht1.
inline void TouchLine(const uint8_t* p, int mode) {
  if (mode == 1) {
    (void)*reinterpret_cast<const volatile uint8_t*>(p);
  } else if (mode == 2) {
    __builtin_prefetch(p, 0, 3);
  } else {
    __builtin_prefetch(p, 0, 2);
  }
}

// Moves `ra` to its next non-empty range once the current one is read.
inline void NextReadAhead(ReadAhead& ra) {
  while (ra.p >= ra.end && ra.next < ra.last) {
    ra.p = ra.next->begin;
    ra.end = ra.next->end;
    ++ra.next;
  }
}

// One pass (P x S::kLanes rows of 16-row tiles) for one group of NG rows, over the whole K, of KT tiles at
// once (tile k at tile0 + k * tile_stride, its outputs at column 16 k of `out`). Each tile is its own
// sequential stream, read in lock step with the others. One tile alone is two dependent vpdpbusd chains per
// row (each level's block sum), latency-bound; KT tiles are 2 KT independent chains (the measurements are at
// MoeComputeOptions::max_streams). Where a register holds fewer than 16 rows (AVX2: 8), P = 2 takes both
// halves of every 64-byte line in the same pass, so each line is loaded once, while it arrives, instead of
// once per half (the second half's pass reading the whole tile again from L2), and the activation broadcasts
// feed both halves (MoeComputeOptions::wide_passes). Per tile and half the arithmetic and its order are those
// of one tile and half alone, so the result depends on neither KT nor P.
template <class S, int NG, int kLevels, int KT, int P = 1>
inline void TilePassGroup(const uint8_t* tile0, int64_t tile_stride, int64_t supers, int pass,
                          const GroupActs<kLevels>& ga, float* out, int64_t ldo, int64_t prefetch_bytes,
                          int64_t page_lines, const uint8_t* prefetch_end, ReadAhead* ra, bool prefetch,
                          bool l1) {
  using VI = typename S::VI;
  using VF = typename S::VF;
  const VI lut = S::WeightLut();
  VF acc[KT][NG][P];
#pragma GCC unroll 4
  for (int k = 0; k < KT; ++k) {
#pragma GCC unroll 16
    for (int i = 0; i < NG; ++i) {
#pragma GCC unroll 2
      for (int h = 0; h < P; ++h) acc[k][i][h] = S::ZeroF();
    }
  }
  // Half h of this pass is the pass-th group of P x kLanes rows, its h-th kLanes rows.
  const int chunk_off = 4 * S::kLanes * P * pass;
  const int scale_off = S::kLanes * P * pass;
  // Read-ahead: one line of the next call's bytes per line of tiles read here (16 chunks and the scale
  // line per super-block and tile), [rp, re) being the range at hand.
  const uint8_t* rp = nullptr;
  const uint8_t* re = nullptr;
  const int ra_mode = ra != nullptr ? ra->mode : 0;
  if (ra != nullptr) {
    NextReadAhead(*ra);
    rp = ra->p;
    re = ra->end;
  }
  for (int64_t s = 0; s < supers; ++s) {
    if (rp >= re && ra != nullptr) {
      ra->p = rp;
      NextReadAhead(*ra);
      rp = ra->p;
      re = ra->end;
    }
    const uint8_t* p = tile0 + s * kSuperBytes;
    // The super-block prefetch_bytes ahead in each stream, while that is still inside this call's tiles (the
    // next bytes usually belong to another thread's work unit); else this one again, which costs no memory
    // traffic.
    const uint8_t* ahead[KT];
#pragma GCC unroll 4
    for (int k = 0; k < KT; ++k) {
      const uint8_t* pk = p + k * tile_stride;
      ahead[k] = prefetch_bytes > 0 && pk + prefetch_bytes < prefetch_end ? pk + prefetch_bytes : pk;
      if (prefetch && page_lines > 0) {
        // Only the first page_lines lines of a 4 KiB page that starts within the super-block prefetch_bytes
        // ahead: the L2 streamer stops at page boundaries, and this starts it on the next page early.
        const uintptr_t a = reinterpret_cast<uintptr_t>(ahead[k]);
        const uintptr_t page = (a + kSuperBytes - 1) & ~uintptr_t{4095};
        if (ahead[k] != pk && page >= a && page + 64 * page_lines <= reinterpret_cast<uintptr_t>(prefetch_end)) {
          for (int64_t j = 0; j < page_lines; ++j) PrefetchL2(reinterpret_cast<const uint8_t*>(page) + 64 * j);
        }
        ahead[k] = pk;
      }
      asm("" : "+r"(ahead[k]));  // one base register (GCC would otherwise keep 17 addresses in xmm registers)
      if (prefetch) PrefetchLine(ahead[k] + kSuperNibbleBytes, l1);  // the scale line
      if (rp < re) {
        TouchLine(rp, ra_mode);
        rp += 64;
      }
    }
#pragma GCC unroll 4
    for (int b = 0; b < 4; ++b) {
      const int64_t kb = 4 * s + b;
      VI bacc[KT][NG][P], bacc2[KT][kLevels == 2 ? NG : 1][P];
#pragma GCC unroll 4
      for (int k = 0; k < KT; ++k) {
#pragma GCC unroll 16
        for (int i = 0; i < NG; ++i) {
#pragma GCC unroll 2
          for (int h = 0; h < P; ++h) {
            bacc[k][i][h] = S::SetI(kLevels == 2 ? 0 : ga.corr[kb * NG + i]);
            if constexpr (kLevels == 2) bacc2[k][i][h] = S::SetI(ga.corr[kb * NG + i]);
          }
        }
      }
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const int64_t qlo = (8 * kb + g) * NG, qhi = (8 * kb + 4 + g) * NG;
#pragma GCC unroll 4
        for (int k = 0; k < KT; ++k) {
          // One line per chunk, spread over the super-block rather than 17 in a burst at its start, which
          // would take all of the core's fill buffers at once.
          if (prefetch) PrefetchLine(ahead[k] + 256 * b + 64 * g, l1);
          if (rp < re) {
            TouchLine(rp, ra_mode);
            rp += 64;
          }
#pragma GCC unroll 2
          for (int h = 0; h < P; ++h) {
            const VI v = S::LoadChunk(p + k * tile_stride + 256 * b + 64 * g + chunk_off + 4 * S::kLanes * h);
            VI lo, hi;
            S::Decode(lut, v, lo, hi);
#pragma GCC unroll 16
            for (int i = 0; i < NG; ++i) {
              bacc[k][i][h] = S::Dot(bacc[k][i][h], lo, ga.q[qlo + i]);
              bacc[k][i][h] = S::Dot(bacc[k][i][h], hi, ga.q[qhi + i]);
              if constexpr (kLevels == 2) {
                bacc2[k][i][h] = S::Dot(bacc2[k][i][h], lo, ga.l[qlo + i]);
                bacc2[k][i][h] = S::Dot(bacc2[k][i][h], hi, ga.l[qhi + i]);
              }
            }
          }
        }
      }
#pragma GCC unroll 4
      for (int k = 0; k < KT; ++k) {
#pragma GCC unroll 2
        for (int h = 0; h < P; ++h) {
          const VF sv = S::Scales(p + k * tile_stride + kSuperNibbleBytes + 16 * b + scale_off + S::kLanes * h);
#pragma GCC unroll 16
          for (int i = 0; i < NG; ++i) {
            VI total = bacc[k][i][h];
            if constexpr (kLevels == 2) total = S::ShiftAdd8(bacc[k][i][h], bacc2[k][i][h]);
            acc[k][i][h] = S::ScaleAdd(total, S::Mul(sv, S::SetF(ga.xs[kb * NG + i])), acc[k][i][h]);
          }
        }
      }
    }
  }
  if (ra != nullptr) ra->p = rp;
#pragma GCC unroll 4
  for (int k = 0; k < KT; ++k) {
#pragma GCC unroll 16
    for (int i = 0; i < NG; ++i) {
#pragma GCC unroll 2
      for (int h = 0; h < P; ++h) S::StoreF(out + i * ldo + 16 * k + S::kLanes * (P * pass + h), acc[k][i][h]);
    }
  }
}

// Tiles read at once for a group of NG rows and P halves per pass: as many as the vector registers hold
// (accumulators per tile: P x NG fp32 plus P x NG per level, and two decoded weight registers), 1, 2 or 4.
template <class S, int NG, int kLevels, int P = 1>
constexpr int StreamsFor() {
  constexpr int per_tile = P * NG * (kLevels + 1) + 2;
  return 4 * per_tile <= S::kAccRegs ? 4 : (2 * per_tile <= S::kAccRegs ? 2 : 1);
}

// Halves per pass (TilePassGroup's P): 2 where a register holds half a tile and one tile's accumulators for
// both halves fit the registers, else 1.
template <class S, int NG, int kLevels>
constexpr int WidePasses() {
  return S::kLanes * 2 == kTileRows && 2 * NG * (kLevels + 1) + 2 <= S::kAccRegs ? 2 : 1;
}

template <class S, int NG, int kLevels, int KT, int P>
void RunGroup(const TileArgs& a, int64_t g0, const uint8_t* tile, float* out_tile) {
  const int64_t kp = a.supers * kSuperCols;
  const GroupActs<kLevels> ga(const_cast<uint8_t*>(a.acts) + GroupBytes<kLevels>(g0, kp), NG, kp);
  for (int pass = 0; pass < kTileRows / (S::kLanes * P); ++pass) {
    TilePassGroup<S, NG, kLevels, KT, P>(tile, a.tile_stride, a.supers, pass, ga, out_tile + g0 * a.ldo, a.ldo,
                                         a.prefetch_bytes, a.prefetch_page_lines,
                                         a.tiles + a.num_tiles * a.tile_stride, a.read_ahead,
                                         !a.tiles_read_ahead || a.prefetch_l1, a.prefetch_l1);
  }
}

// Runs tiles [t, t + n) (n <= StreamsFor) for the group at g0 of gs rows: KT tiles at a time, KT halving
// for the remainder.
template <class S, int NG, int kLevels, int KT, int P>
void RunGroupTiles(const TileArgs& a, int64_t g0, int64_t t, int64_t n) {
  if constexpr (KT >= 1) {
    for (; n >= KT; n -= KT, t += KT) {
      RunGroup<S, NG, kLevels, KT, P>(a, g0, a.tiles + t * a.tile_stride, a.out + 16 * t);
    }
    if constexpr (KT > 1) RunGroupTiles<S, NG, kLevels, KT / 2, P>(a, g0, t, n);
  }
}

template <class S, int NG, int kLevels>
void RunGroupDispatch(const TileArgs& a, int64_t g0, int gs, int64_t t, int64_t n) {
  if constexpr (NG == 0) {
    (void)a, (void)g0, (void)gs, (void)t, (void)n;
  } else if (gs == NG) {
    constexpr int P = WidePasses<S, NG, kLevels>();
    if (P > 1 && a.wide_passes) {
      RunGroupTiles<S, NG, kLevels, StreamsFor<S, NG, kLevels, P>(), P>(a, g0, t, n);
    } else {
      RunGroupTiles<S, NG, kLevels, StreamsFor<S, NG, kLevels>(), 1>(a, g0, t, n);
    }
  } else {
    RunGroupDispatch<S, NG - 1, kLevels>(a, g0, gs, t, n);
  }
}

template <class S, int kLevels>
void Int8Tiles(const TileArgs& a) {
  constexpr int kGroup = S::template Group<kLevels>();
  // The most of any group size and pass width (chunks of tiles are cut to it; a narrower group runs a chunk
  // in pieces).
  constexpr int kMostStreams = StreamsFor<S, 1, kLevels>();
  const int64_t streams = a.max_streams > 0 && a.max_streams < kMostStreams ? a.max_streams : kMostStreams;
  for (int64_t t = 0; t < a.num_tiles; t += streams) {
    const int64_t n = a.num_tiles - t < streams ? a.num_tiles - t : streams;
    for (int64_t g0 = 0; g0 < a.m; g0 += kGroup) {
      const int gs = static_cast<int>(a.m - g0 < kGroup ? a.m - g0 : kGroup);
      RunGroupDispatch<S, kGroup, kLevels>(a, g0, gs, t, n);
    }
  }
}

template <class S, int kLevels>
void Int8PrepareActsFor(const float* const* rows, int64_t m, int64_t k, int64_t kp, uint8_t* acts) {
  Int8PrepareActs<S::template Group<kLevels>(), kLevels>(rows, m, k, kp, acts);
}

size_t Int8ScratchBytes(int64_t) { return 0; }

// ---- The prefill path: many rows per expert ------------------------------------------------------------
//
// The kernel above decodes each chunk's nibbles again for every group of rows and keeps one tile per
// register set; at prefill sizes (tens to thousands of rows per expert call) that decode and the
// latency-bound chains dominate. Here a run of kPrefillTiles tiles is decoded ONCE into a cache-resident
// buffer of looked-up bytes (the same bytes S::Decode yields) and fp32 block scales, and then every group
// of kPrefillRows rows runs a register-blocked microkernel over it: rows x tiles int32 block accumulators
// (per level), vpdpbusd with the activation broadcast from memory. Per 32-column block and per row and
// tile the same integer sums, and the same fp32 operations in the same order, as TilePassGroup: the result
// is the same bit for bit (tests/kernels asserts it), so the error bound above holds unchanged.
// Activations use the layout above with groups of kPrefillRows rows.
inline constexpr int kPrefillRows = 4;
// Tiles per microkernel: the registers hold rows x tiles x (kLevels + 1) accumulators plus one weight
// vector per tile (32 zmm): 4 x 2 x 3 + 2 = 26 for two levels, 4 x 3 x 2 + 3 = 27 for one.
template <int kLevels>
constexpr int PrefillTiles() {
  return kLevels == 2 ? 2 : 3;
}

// The K range goes in chunks of kPrefillChunkSupers super-blocks: a chunk of the run's tiles is decoded into
// the scratch and every row group runs over it before the next chunk is decoded, so the decoded weights are
// read from L1 (a run's whole decoded K, 72 KB per tile at K = 4096, only fits L2, and streaming it from L2
// for every row group capped the microkernel near L2's bandwidth). The rows' fp32 accumulators go through
// `out` between chunks: stored and loaded exactly, so the sums and their order are unchanged.
inline constexpr int64_t kPrefillChunkSupers = 2;
// One decoded tile chunk: weights [blocks][8 vectors: chunks 0-3 low nibbles, then 0-3 high][64 bytes],
// then the scales [blocks][16] as floats.
constexpr int64_t DecodedChunkBytes(int64_t blocks) { return blocks * (kTileRows * kBlockCols + 64); }

template <int kLevels>
size_t Int8PrefillScratchBytes(int64_t) {
  return static_cast<size_t>(PrefillTiles<kLevels>() * DecodedChunkBytes(4 * kPrefillChunkSupers));
}

// Super-blocks [s0, s1) of a tile into `dst` (DecodedChunkBytes(4 (s1 - s0)) bytes).
template <class S>
inline void DecodeTileChunk(const uint8_t* tile, int64_t s0, int64_t s1, uint8_t* dst) {
  static_assert(S::kLanes == kTileRows, "the prefill path needs one register per 16-row tile");
  using VI = typename S::VI;
  const VI lut = S::WeightLut();
  float* scales = reinterpret_cast<float*>(dst + (s1 - s0) * 4 * 512);
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* p = tile + s * kSuperBytes;
#pragma GCC unroll 4
    for (int b = 0; b < 4; ++b) {
      const int64_t kb = 4 * (s - s0) + b;
      uint8_t* d = dst + kb * 512;
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        VI lo, hi;
        S::Decode(lut, S::LoadChunk(p + 256 * b + 64 * g), lo, hi);
        S::StoreChunk(d + 64 * g, lo);
        S::StoreChunk(d + 256 + 64 * g, hi);
      }
      S::StoreF(scales + kb * 16, S::Scales(p + kSuperNibbleBytes + 16 * b));
    }
  }
}

// R rows (one activation group) x NT decoded tiles over one chunk of K: blocks [kb0, kb0 + nb) of the
// activations, the chunk's decoded tiles `dec_bytes` apart. The accumulators start from zero (`first`) or
// from `out`, and end in `out`. While it runs, it prefetches `pf_per_block` lines per block of the next
// run's packed tiles into L2, from `pf` up to `pf_end`; returns where it got to.
template <class S, int R, int NT, int kLevels>
inline const uint8_t* PrefillMicro(const uint8_t* dec, int64_t dec_bytes, int64_t kb0, int64_t nb, bool first,
                                   const GroupActs<kLevels>& ga, float* out, int64_t ldo, const uint8_t* pf,
                                   int64_t pf_per_block, const uint8_t* pf_end) {
  using VI = typename S::VI;
  using VF = typename S::VF;
  VF acc[R][NT];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) acc[r][t] = first ? S::ZeroF() : S::LoadUF(out + r * ldo + 16 * t);
  }
  const float* scales = reinterpret_cast<const float*>(dec + nb * 512);
  const int64_t scale_stride = dec_bytes / 4;
  for (int64_t i = 0; i < nb; ++i) {
    const int64_t kb = kb0 + i;
    for (int64_t j = 0; j < pf_per_block && pf < pf_end; ++j, pf += 64) PrefetchL2(pf);
    VI bq[R][NT], bl[R][kLevels == 2 ? NT : 1];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      // Each accumulator starts from its own broadcast load of the correction (a load-port uop), not from a
      // register copy of one broadcast: copies compete with vpdpbusd for the vector ports. The barrier keeps
      // GCC from merging the loads.
      const int32_t* corr = ga.corr + kb * R;
      asm("" : "+r"(corr));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        bq[r][t] = kLevels == 2 ? S::ZeroI() : S::SetI(corr[r]);
        if constexpr (kLevels == 2) bl[r][t] = S::SetI(corr[r]);
      }
    }
    const uint8_t* w = dec + i * 512;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      VI v[NT];
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) v[t] = S::LoadChunk(w + t * dec_bytes + 64 * j);
      const int64_t qi = (8 * kb + j) * R;
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) {
          bq[r][t] = S::Dot(bq[r][t], v[t], ga.q[qi + r]);
          if constexpr (kLevels == 2) bl[r][t] = S::Dot(bl[r][t], v[t], ga.l[qi + r]);
        }
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      const VF sv = S::LoadF(scales + t * scale_stride + i * 16);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        VI total = bq[r][t];
        if constexpr (kLevels == 2) total = S::ShiftAdd8(bq[r][t], bl[r][t]);
        acc[r][t] = S::ScaleAdd(total, S::Mul(sv, S::SetF(ga.xs[kb * R + r])), acc[r][t]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) S::StoreF(out + r * ldo + 16 * t, acc[r][t]);
  }
  return pf;
}

template <class S, int R, int NT, int kLevels>
inline const uint8_t* PrefillDispatch(int gs, int nt, const uint8_t* dec, int64_t dec_bytes, int64_t kb0, int64_t nb,
                                      bool first, const GroupActs<kLevels>& ga, float* out, int64_t ldo,
                                      const uint8_t* pf, int64_t pf_per_block, const uint8_t* pf_end) {
  if constexpr (R >= 1 && NT >= 1) {
    if (gs < R) {
      return PrefillDispatch<S, R - 1, NT, kLevels>(gs, nt, dec, dec_bytes, kb0, nb, first, ga, out, ldo, pf,
                                                    pf_per_block, pf_end);
    } else if (nt < NT) {
      return PrefillDispatch<S, R, NT - 1, kLevels>(gs, nt, dec, dec_bytes, kb0, nb, first, ga, out, ldo, pf,
                                                    pf_per_block, pf_end);
    } else {
      return PrefillMicro<S, R, NT, kLevels>(dec, dec_bytes, kb0, nb, first, ga, out, ldo, pf, pf_per_block, pf_end);
    }
  }
  return pf;
}

template <class S, int kLevels>
void Int8PrefillTiles(const TileArgs& a) {
  constexpr int NT = PrefillTiles<kLevels>();
  const int64_t kp = a.supers * kSuperCols, blocks = kp / kBlockCols;
  const uint8_t* end = a.tiles + a.num_tiles * a.tile_stride;
  const int64_t groups = (a.m + kPrefillRows - 1) / kPrefillRows;
  // Runs of at most NT tiles, as even as possible (4 tiles at NT = 3: 2 + 2, not 3 + 1: a one-tile run
  // loads a weight vector per R dot products instead of one per R x NT). Per tile the arithmetic is the same
  // whatever run it is in.
  const int64_t runs = (a.num_tiles + NT - 1) / NT;
  for (int64_t run = 0, t0 = 0; run < runs; ++run) {
    const int64_t left = a.num_tiles - t0;
    const int nt = static_cast<int>(a.even_runs ? (left + (runs - run) - 1) / (runs - run) : (left < NT ? left : NT));
    // The next run's packed bytes (after the last run: the first run of the caller's next call, where it
    // says), spread evenly over all the run's row groups and blocks, so that DRAM streams the next run while
    // the whole of this one computes.
    const bool last = run + 1 == runs;
    const uint8_t* pf = last ? a.next_tiles : a.tiles + (t0 + nt) * a.tile_stride;
    const uint8_t* run_end = last ? a.next_tiles_end : end;
    const uint8_t* pf_end =
        pf == nullptr ? nullptr : (pf + NT * a.tile_stride < run_end ? pf + NT * a.tile_stride : run_end);
    const int64_t lines = pf < pf_end ? (pf_end - pf + 63) / 64 : 0;
    const int64_t pf_per_block = a.prefetch_bytes > 0 ? (lines + groups * blocks - 1) / (groups * blocks) : 0;
    for (int64_t s0 = 0; s0 < a.supers; s0 += kPrefillChunkSupers) {
      const int64_t s1 = s0 + kPrefillChunkSupers < a.supers ? s0 + kPrefillChunkSupers : a.supers;
      const int64_t nb = 4 * (s1 - s0), dec_bytes = DecodedChunkBytes(nb);
      for (int i = 0; i < nt; ++i) DecodeTileChunk<S>(a.tiles + (t0 + i) * a.tile_stride, s0, s1, a.scratch + i * dec_bytes);
      for (int64_t g0 = 0; g0 < a.m; g0 += kPrefillRows) {
        const int gs = static_cast<int>(a.m - g0 < kPrefillRows ? a.m - g0 : kPrefillRows);
        const GroupActs<kLevels> ga(const_cast<uint8_t*>(a.acts) + GroupBytes<kLevels>(g0, kp), gs, kp);
        pf = PrefillDispatch<S, kPrefillRows, NT, kLevels>(gs, nt, a.scratch, dec_bytes, 4 * s0, nb, s0 == 0, ga,
                                                           a.out + g0 * a.ldo + 16 * t0, a.ldo, pf, pf_per_block,
                                                           pf_end);
      }
    }
    t0 += nt;
  }
}

template <int kLevels>
void Int8PrefillPrepareActs(const float* const* rows, int64_t m, int64_t k, int64_t kp, uint8_t* acts) {
  Int8PrepareActs<kPrefillRows, kLevels>(rows, m, k, kp, acts);
}

}  // namespace
}  // namespace numoe::experts
