// AMX expert kernel for prefill-sized batches: bf16 tiles (TDPBF16PS), fp32 accumulation.
//
// Why bf16 tiles and not int8 (TDPBSSD): MXFP4 has a scale per 32 columns and row, so int8 tiles would
// have to be rescaled in fp32 every 32 columns (a tile store plus ~16 vector ops per 16x16x32 product),
// which costs more than the tile product itself. In bf16 the scale folds into the weights exactly: an
// E2M1 value has 2 significant bits, so fp4 * 2^(e-127) is exact in bf16 (for e in [2, 252], which
// Pack checks; layers outside that range run on AVX-512 instead), and the tile accumulates over all of K.
//
// Work goes in groups of 4 accumulator tiles: 16 activation rows x 4 weight tiles (64 outputs), or 32 rows
// x 2 weight tiles. The weights go in panels of 4 tiles (B tiles: VNNI pairs, pair-row p holds columns
// 2p, 2p+1 of 16 rows) decoded once per call into a per-thread buffer that holds the panel's whole K
// (128 KB per tile at K = 4096, so it stays in L2): the first row group decodes each block one block ahead
// of its own products, and every other row group of the call runs against the decoded panel, so a weight
// block is decoded once per call rather than once per 16-32 rows. Error (against exact weights, fp32
// activations): activations rounded to bf16 (RNE), so per output
//   |y - y_exact| <= 2^-9 * sum_c |W_c| |x_c|   (+ fp32 accumulation rounding)
// which is below the int8 paths' bound (int8_tiles.h). Each accumulator tile sees the same products in the
// same order (block by block, x_hi then x_lo) whichever row group and panel it is in, so the result does
// not depend on the row count (tests/kernels asserts it bit for bit).
//
// Measured (numoe-bench experts --isa amx --peak, the 2-vCPU Emerald Rapids VM, V4-Flash experts, 2 threads,
// two-level activations): 0.22 / 0.35 TFLOP/s at 512 / 2048 tokens (0.19 / 0.24 when every 16-32 rows
// decoded again). The decode is now under 3% of the kernel's samples; most land on tdpbf16ps right after
// tile loads: ~20 M tile products per second per thread, where a loop with the same loads from L1 issues
// ~100 M, so the tile loads from the L2-resident panel and activations are what bounds it.
//
// AmxEmulatedKernelOps() runs the same decode and loops with the tile instructions replaced by scalar
// code, so the layout logic is tested on machines without AMX.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <ctime>
#include <utility>

#include "worker/experts/kernel_ops.h"
#include "common/packed_layout.h"

namespace numoe::experts {
namespace {

constexpr int64_t kBTileBytes = 1024;  // 16 pair-rows x 16 columns x 2 bf16 = one 32-column block

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64);

// Tile registers: 0-3 accumulators (64 activation rows), 4-5 weights (B), 6-7 activations (A).
// Inline asm instead of the _tile_* macros: those paste their argument into the register name, so they
// cannot take a template parameter. The "memory" clobbers order tile loads/stores with ordinary accesses.
struct HardwareTiles {
  static void Configure(const TileConfig* cfg) { _tile_loadconfig(cfg); }
  static void Release() { _tile_release(); }
  template <int T>
  static void Zero() {
    __asm__ volatile("tilezero %%tmm%c0" ::"i"(T));
  }
  template <int T>
  static void Load(const void* p, int64_t stride) {
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static void Store(void* p, int64_t stride) {
    __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int C, int A, int B>
  static void Dot() {
    __asm__ volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
};

thread_local uint8_t tls_tiles[8][16][64];  // the emulated tile registers

float Bf16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct EmulatedTiles {
  static void Configure(const TileConfig*) {}
  static void Release() {}
  template <int T>
  static void Zero() {
    std::memset(tls_tiles[T], 0, sizeof(tls_tiles[T]));
  }
  template <int T>
  static void Load(const void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r) std::memcpy(tls_tiles[T][r], static_cast<const uint8_t*>(p) + r * stride, 64);
  }
  template <int T>
  static void Store(void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r) std::memcpy(static_cast<uint8_t*>(p) + r * stride, tls_tiles[T][r], 64);
  }
  template <int C, int A, int B>
  static void Dot() {
    for (int m = 0; m < 16; ++m) {
      for (int n = 0; n < 16; ++n) {
        float c;
        std::memcpy(&c, &tls_tiles[C][m][4 * n], 4);
        for (int p = 0; p < 16; ++p) {
          const float a0 = Bf16(&tls_tiles[A][m][4 * p]), a1 = Bf16(&tls_tiles[A][m][4 * p + 2]);
          const float b0 = Bf16(&tls_tiles[B][p][4 * n]), b1 = Bf16(&tls_tiles[B][p][4 * n + 2]);
          c += a0 * b0 + a1 * b1;
        }
        std::memcpy(&tls_tiles[C][m][4 * n], &c, 4);
      }
    }
  }
};

int64_t PaddedRows(int64_t m) { return (m + 15) / 16 * 16; }

// Activations: kLevels planes (x_hi, then x_lo) of bf16, zero padded to round_up(m, 16) rows, each plane
// as A tiles back to back: [row tile mt][block kb][16 rows][32 columns], so that an A tile is one
// contiguous KB (a tile load with a row stride of kp * 2 bytes would put all 16 rows in one L1 set).
template <int kLevels>
size_t ActBytes(int64_t m, int64_t kp) {
  return static_cast<size_t>(kLevels * PaddedRows(m) * kp * 2);
}

template <int kLevels>
void PrepareActs(const float* const* rows, int64_t m, int64_t k, int64_t kp, uint8_t* acts) {
  const int64_t mp = PaddedRows(m);
  for (int64_t i = 0; i < mp; ++i) {
    uint8_t* hi_row = acts + (i / 16) * kp * 32 + (i % 16) * 64;  // + kb * 1024 + (c % 32) * 2
    uint8_t* lo_row = hi_row + mp * kp * 2;
    for (int64_t c = 0; c < kp; c += 16) {
      const int64_t valid = i >= m || c >= k ? 0 : (k - c < 16 ? k - c : 16);
      const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
      const __m512 v = _mm512_maskz_loadu_ps(mask, i < m ? rows[i] + c : nullptr);
      const __m256i hi = (__m256i)_mm512_cvtneps_pbh(v);
      const int64_t at = (c / 32) * kBTileBytes + (c % 32) * 2;
      _mm256_store_si256(reinterpret_cast<__m256i*>(hi_row + at), hi);
      if constexpr (kLevels == 2) {
        const __m512 hi_f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
        const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hi_f));  // v - hi_f is exact
        _mm256_store_si256(reinterpret_cast<__m256i*>(lo_row + at), lo);
      }
    }
  }
}

// Per thread: the decoded panel (kPanelTiles weight tiles over all of K, as B tiles), the C staging tile,
// the tile config. The panel is 4 x 128 KB for V4-Flash's gate/up (K = 4096): L2-resident.
constexpr int64_t kPanelTiles = 4;
int64_t PanelBytes(int64_t kp) { return kPanelTiles * (kp / 32) * kBTileBytes; }
size_t ScratchBytes(int64_t kp) { return static_cast<size_t>(PanelBytes(kp) + 16 * 64 + 64); }

// Looks up the nibbles in the low bits of each 16-bit word (bit 4 is ignored: the table repeats after 16
// entries) to bf16, adds the block's exponent offset to the non-zero ones and stores one 64-byte B-tile row.
inline void EmitPairRow(__m512i idx, __m512i lut, __m512i scale_add, __m512i magnitude_bits, uint8_t* dst) {
  __m512i w = _mm512_permutexvar_epi16(idx, lut);
  const __mmask32 nonzero = _mm512_test_epi16_mask(idx, magnitude_bits);
  w = _mm512_mask_add_epi16(w, nonzero, w, scale_add);  // adds e-127 to the exponent of non-zero values
  _mm512_store_si512(dst, w);
}

// Turns one 32-column block of a packed 16-row tile into a B tile: 16 pair-rows x 64 bytes, pair-row p
// holding columns (2p, 2p+1) of rows 0..15 as scaled bf16.
class Decoder {
 public:
  Decoder() : lut_(_mm512_load_si512(kLut)), dup_(_mm512_load_si512(kDup)) {}

  void Block(const uint8_t* tile, int64_t kb, uint8_t* dst) const {
    const uint8_t* p = tile + (kb / 4) * kSuperBytes;
    const int b = static_cast<int>(kb % 4);
    if (b == 0) {  // weights come from DRAM in prefill too: fetch the super-block after next
      for (int l = 0; l < kSuperBytes / 64; ++l) __builtin_prefetch(p + 2 * kSuperBytes + 64 * l, 0, 3);
    }
    __m256i e = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kSuperNibbleBytes + 16 * b)));
    e = _mm256_slli_epi16(_mm256_sub_epi16(e, _mm256_set1_epi16(127)), 7);
    const __m512i scale_add = _mm512_permutexvar_epi16(dup_, _mm512_castsi256_si512(e));
    const __m512i even_bytes = _mm512_set1_epi32(0x00FF00FF), low3 = _mm512_set1_epi16(7);
    for (int g = 0; g < 4; ++g) {
      // Chunk g: byte 4n + c = row n, low nibble column 4g + c, high nibble column 16 + 4g + c. Word-wise
      // shifts and blends (no cross-lane byte permute) put bytes c = 0, 1 of each row into the row's two
      // words (`pair01`) and bytes 2, 3 into `pair23`: the index words of pair-rows 2g and 2g + 1 (low
      // nibbles, bits 0-3) and, shifted by 4, of pair-rows 8 + 2g and 9 + 2g (high nibbles).
      const __m512i v = _mm512_load_si512(p + 256 * b + 64 * g);
      const __m512i b02 = _mm512_and_si512(v, even_bytes);  // per row (dword): words b0, b2
      const __m512i b13 = _mm512_srli_epi16(v, 8);          // words b1, b3
      const __m512i pair01 = _mm512_mask_blend_epi16(0xAAAAAAAAu, b02, _mm512_slli_epi32(b13, 16));
      const __m512i pair23 = _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(b02, 16), b13);
      EmitPairRow(pair01, lut_, scale_add, low3, dst + (2 * g) * 64);
      EmitPairRow(pair23, lut_, scale_add, low3, dst + (2 * g + 1) * 64);
      EmitPairRow(_mm512_srli_epi16(pair01, 4), lut_, scale_add, low3, dst + (8 + 2 * g) * 64);
      EmitPairRow(_mm512_srli_epi16(pair23, 4), lut_, scale_add, low3, dst + (9 + 2 * g) * 64);
    }
  }

 private:
  // bf16 of the 16 E2M1 values, twice (vpermw reads 5 index bits).
  alignas(64) static constexpr uint16_t kLut[32] = {
      0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0, 0x8000, 0xBF00, 0xBF80,
      0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0, 0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040,
      0x4080, 0x40C0, 0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};
  alignas(64) static constexpr uint16_t kDup[32] = {0, 0, 1, 1, 2,  2,  3,  3,  4,  4,  5,  5,  6,  6,  7,  7,
                                                    8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};
  __m512i lut_, dup_;
};

template <int... Is, class F>
inline void StaticFor(std::integer_sequence<int, Is...>, F&& f) {
  (f(std::integral_constant<int, Is>{}), ...);
}

// One 32-column block for MT activation tiles x NN weight tiles; accumulator of (n, m) is tile n*MT + m.
// Tile registers: 0-3 accumulators, 4/5 activations, 6/7 weights. `a` is the block's first A tile; the next
// row tile's is `mstride` bytes on, x_lo's `plane` bytes on. Two products on one accumulator (x_hi, then
// x_lo) are never issued back to back: a tile product's latency is several times its issue interval.
template <class T, int kLevels, int MT, int NN>
inline void ComputeBlock(const uint8_t* b, const uint8_t* a, int64_t mstride, int64_t plane) {
  if constexpr (MT == 1) {  // up to 4 weight tiles share one activation tile (per level), two at a time
    T::template Load<4>(a, 64);
    if constexpr (kLevels == 2) T::template Load<5>(a + plane, 64);
    StaticFor(std::make_integer_sequence<int, (NN + 1) / 2>{}, [&](auto p) {
      constexpr int kN0 = 2 * decltype(p)::value, kN1 = kN0 + 1;
      T::template Load<6>(b + kN0 * kBTileBytes, 64);
      if constexpr (kN1 < NN) T::template Load<7>(b + kN1 * kBTileBytes, 64);
      T::template Dot<kN0, 4, 6>();
      if constexpr (kN1 < NN) T::template Dot<kN1, 4, 7>();
      if constexpr (kLevels == 2) {
        T::template Dot<kN0, 5, 6>();
        if constexpr (kN1 < NN) T::template Dot<kN1, 5, 7>();
      }
    });
  } else {  // 2 activation tiles x up to 2 weight tiles: x_hi of both row tiles, then x_lo of both
    static_assert(MT == 2 && NN <= 2);
    T::template Load<6>(b, 64);
    if constexpr (NN > 1) T::template Load<7>(b + kBTileBytes, 64);
    StaticFor(std::make_integer_sequence<int, kLevels>{}, [&](auto level) {
      const uint8_t* al = a + decltype(level)::value * plane;
      T::template Load<4>(al, 64);
      T::template Load<5>(al + mstride, 64);
      T::template Dot<0, 4, 6>();
      T::template Dot<1, 5, 6>();
      if constexpr (NN > 1) {
        T::template Dot<2, 4, 7>();
        T::template Dot<3, 5, 7>();
      }
    });
  }
}

// Where one group of tile products finds its weights: the panel (block kb of panel tile j at
// panel + (kb * kPanelTiles + j) * kBTileBytes) and, for the group that decodes, the packed tiles.
struct PanelRef {
  uint8_t* panel;
  int64_t t0;      // global index of panel tile 0
  bool decode;     // this group decodes its tiles' blocks into the panel (one block ahead of its products)
  // L2 prefetch of the next panel's packed bytes [pf, pf_end), spread over this group's blocks.
  const uint8_t* pf;
  const uint8_t* pf_end;
};

// Output rows [m0, m0 + 16 MT) x panel tiles [j0, j0 + NN) over all of K. The products of one accumulator
// are the same, in the same order (block by block, x_hi then x_lo), whichever group and panel it is in,
// so the result does not depend on the blocking.
template <class T, int kLevels, int MT, int NN>
void TileGroup(const Decoder& dec, const TileArgs& a, const PanelRef& pr, int64_t j0, int64_t m0, float* stage) {
  const int64_t kp = a.supers * kSuperCols;
  const int64_t nblocks = kp / 32;
  const int64_t mstride = nblocks * kBTileBytes;           // one row tile's A tiles
  const int64_t plane = PaddedRows(a.m) / 16 * mstride;  // x_lo follows x_hi
  const uint8_t* arows = a.acts + m0 / 16 * mstride;
  StaticFor(std::make_integer_sequence<int, MT * NN>{}, [&](auto c) { T::template Zero<decltype(c)::value>(); });
  const auto decode = [&](int64_t kb) {
    for (int n = 0; n < NN; ++n) {
      dec.Block(a.tiles + (pr.t0 + j0 + n) * a.tile_stride, kb, pr.panel + (kb * kPanelTiles + j0 + n) * kBTileBytes);
    }
  };
  if (pr.decode) decode(0);
  const uint8_t* pf = pr.pf;
  const int64_t pf_lines = pf < pr.pf_end ? (pr.pf_end - pf + 63) / 64 : 0;
  const int64_t pf_per_block = (pf_lines + nblocks - 1) / nblocks;
  for (int64_t kb = 0; kb < nblocks; ++kb) {
    if (pr.decode && kb + 1 < nblocks) decode(kb + 1);
    for (int64_t j = 0; j < pf_per_block && pf < pr.pf_end; ++j, pf += 64) __builtin_prefetch(pf, 0, 2);
    if (kb + 1 < nblocks) {  // the next block's tiles into L1: a tile load alone gets little memory parallelism
      const uint8_t* nb = pr.panel + ((kb + 1) * kPanelTiles + j0) * kBTileBytes;
      for (int64_t l = 0; l < NN * kBTileBytes; l += 64) __builtin_prefetch(nb + l, 0, 3);
      for (int level = 0; level < kLevels; ++level) {
        for (int mt = 0; mt < MT; ++mt) {
          const uint8_t* na = arows + level * plane + mt * mstride + (kb + 1) * kBTileBytes;
          for (int64_t l = 0; l < kBTileBytes; l += 64) __builtin_prefetch(na + l, 0, 3);
        }
      }
    }
    ComputeBlock<T, kLevels, MT, NN>(pr.panel + (kb * kPanelTiles + j0) * kBTileBytes, arows + kb * kBTileBytes,
                                     mstride, plane);
  }
  StaticFor(std::make_integer_sequence<int, MT * NN>{}, [&](auto c) {
    constexpr int kC = decltype(c)::value, kN = kC / MT, kM = kC % MT;
    T::template Store<kC>(stage, 64);
    const int64_t rows = a.m - m0 - 16 * kM < 16 ? a.m - m0 - 16 * kM : 16;
    float* out = a.out + (m0 + 16 * kM) * a.ldo + 16 * (pr.t0 + j0 + kN);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(out + r * a.ldo, stage + 16 * r, 64);
  });
}

// Panel tiles [j0, j0 + n) for rows [m0, m0 + 16 MT): groups of up to 4 (MT = 1) or 2 (MT = 2) tiles.
template <class T, int kLevels, int MT>
void TileGroups(const Decoder& dec, const TileArgs& a, const PanelRef& pr, int64_t n, int64_t m0, float* stage) {
  constexpr int kNN = MT == 1 ? 4 : 2;
  for (int64_t j0 = 0; j0 < n; j0 += kNN) {
    switch (n - j0 < kNN ? n - j0 : kNN) {
      case 1: TileGroup<T, kLevels, MT, 1>(dec, a, pr, j0, m0, stage); break;
      case 2: TileGroup<T, kLevels, MT, 2>(dec, a, pr, j0, m0, stage); break;
      case 3:
        if constexpr (kNN > 2) TileGroup<T, kLevels, MT, 3>(dec, a, pr, j0, m0, stage);
        break;
      default:
        if constexpr (kNN > 3) TileGroup<T, kLevels, MT, 4>(dec, a, pr, j0, m0, stage);
        break;
    }
  }
}

// Panel by panel (kPanelTiles weight tiles): the first row group decodes the panel's tiles, block by block
// one block ahead of its products, and every further row group of the call reuses the decoded panel
// (so a weight tile is decoded once per call, not once per 16 or 32 rows), prefetching the next panel's
// packed bytes into L2 meanwhile.
template <class T, int kLevels>
void AmxTiles(const TileArgs& a) {
  const int64_t kp = a.supers * kSuperCols;
  const int64_t mp = PaddedRows(a.m);
  uint8_t* panel = a.scratch;
  float* stage = reinterpret_cast<float*>(a.scratch + PanelBytes(kp));
  TileConfig* cfg = reinterpret_cast<TileConfig*>(a.scratch + PanelBytes(kp) + 16 * 64);
  std::memset(cfg, 0, sizeof(*cfg));
  cfg->palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg->rows[t] = 16;
    cfg->colsb[t] = 64;
  }
  T::Configure(cfg);
  const Decoder dec;
  const uint8_t* end = a.tiles + a.num_tiles * a.tile_stride;
  for (int64_t t0 = 0; t0 < a.num_tiles; t0 += kPanelTiles) {
    const int64_t n = a.num_tiles - t0 < kPanelTiles ? a.num_tiles - t0 : kPanelTiles;
    // The next panel (after the last one: the first panel of the caller's next call, where it says).
    const bool last = t0 + n >= a.num_tiles;
    const uint8_t* next = last ? a.next_tiles : a.tiles + (t0 + n) * a.tile_stride;
    const uint8_t* limit = last ? a.next_tiles_end : end;
    const uint8_t* next_end = next == nullptr ? nullptr
                              : (next + kPanelTiles * a.tile_stride < limit ? next + kPanelTiles * a.tile_stride : limit);
    // Rows [0, 32) decode; the other row groups prefetch the next panel, a share each (with no other row
    // group, the decoding one prefetches it too).
    const int64_t lines = next < next_end ? (next_end - next + 63) / 64 : 0, groups = (mp - 1) / 32;
    const int64_t share = groups > 0 ? (lines + groups - 1) / groups : 0;
    for (int64_t m0 = 0; m0 < mp; m0 += 32) {
      const int64_t first = groups == 0 ? 0 : (m0 == 0 ? lines : (m0 / 32 - 1) * share);
      const int64_t count = groups == 0 ? lines : share;
      const uint8_t* pf = first < lines ? next + 64 * first : next_end;
      const uint8_t* pf_end = first + count < lines ? next + 64 * (first + count) : next_end;
      const PanelRef pr{panel, t0, m0 == 0, pf, pf_end};
      if (mp - m0 >= 32) {
        TileGroups<T, kLevels, 2>(dec, a, pr, n, m0, stage);
      } else {
        TileGroups<T, kLevels, 1>(dec, a, pr, n, m0, stage);
      }
    }
  }
  T::Release();
}

constexpr KernelOps kOps[2] = {
    {"amx", ActBytes<2>, PrepareActs<2>, ScratchBytes, AmxTiles<HardwareTiles, 2>},
    {"amx-bf16x1", ActBytes<1>, PrepareActs<1>, ScratchBytes, AmxTiles<HardwareTiles, 1>}};
constexpr KernelOps kEmulatedOps[2] = {
    {"amx-emulated", ActBytes<2>, PrepareActs<2>, ScratchBytes, AmxTiles<EmulatedTiles, 2>},
    {"amx-emulated-bf16x1", ActBytes<1>, PrepareActs<1>, ScratchBytes, AmxTiles<EmulatedTiles, 1>}};

double Now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace

double AmxBf16PeakFlops(double seconds) {
  alignas(64) static thread_local uint8_t buf[2][16][64];  // operand tiles: bf16 ones (values do not matter)
  std::memset(buf, 0x3f, sizeof(buf));
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  HardwareTiles::Configure(&cfg);
  HardwareTiles::Load<4>(buf[0], 64);
  HardwareTiles::Load<5>(buf[1], 64);
  HardwareTiles::Load<6>(buf[0], 64);
  HardwareTiles::Load<7>(buf[1], 64);
  HardwareTiles::Zero<0>();
  HardwareTiles::Zero<1>();
  HardwareTiles::Zero<2>();
  HardwareTiles::Zero<3>();
  const double t0 = Now();
  double t = t0;
  int64_t iters = 0;
  while (t - t0 < seconds) {
    for (int r = 0; r < 1000; ++r) {  // four independent accumulators, as in RowBlock
      HardwareTiles::Dot<0, 6, 4>();
      HardwareTiles::Dot<1, 7, 4>();
      HardwareTiles::Dot<2, 6, 5>();
      HardwareTiles::Dot<3, 7, 5>();
    }
    iters += 4000;
    t = Now();
  }
  HardwareTiles::Release();
  return static_cast<double>(iters) * 16 * 16 * 32 * 2 / (t - t0);
}

const KernelOps& AmxKernelOps(ActivationPrecision precision) {
  return kOps[precision == ActivationPrecision::kHigh ? 0 : 1];
}
const KernelOps& AmxEmulatedKernelOps(ActivationPrecision precision) {
  return kEmulatedOps[precision == ActivationPrecision::kHigh ? 0 : 1];
}

}  // namespace numoe::experts
