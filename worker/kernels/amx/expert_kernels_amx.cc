// AMX expert kernel for prefill-sized batches: bf16 tiles (TDPBF16PS), fp32 accumulation.
//
// Why bf16 tiles and not int8 (TDPBSSD): MXFP4 has a scale per 32 columns and row, so int8 tiles would
// have to be rescaled in fp32 every 32 columns (a tile store plus ~16 vector ops per 16x16x32 product),
// which costs more than the tile product itself. In bf16 the scale folds into the weights exactly: an
// E2M1 value has 2 significant bits, so fp4 * 2^(e-127) is exact in bf16 (for e in [2, 252], which
// Pack checks; layers outside that range run on AVX-512 instead), and the tile accumulates over all of K.
//
// Per 16-row tile: decode all of K into B tiles (VNNI pairs: pair-row p holds columns 2p, 2p+1 of the 16
// rows) in a per-thread scratch, then stream 64-row blocks of bf16 activations through 4 accumulator
// tiles. Error (against exact weights, fp32 activations): activations rounded to bf16 (RNE), so per output
//   |y - y_exact| <= 2^-9 * sum_c |W_c| |x_c|   (+ fp32 accumulation rounding)
// which is below the int8 paths' bound (int8_tiles.h).
//
// AmxEmulatedKernelOps() runs the same decode and loops with the tile instructions replaced by scalar
// code, so the layout logic is tested on machines without AMX.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "worker/experts/kernel_ops.h"
#include "worker/experts/packed_layout.h"

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

// Activations: kLevels planes of bf16 [round_up(m, 16)][kp] (x_hi, then x_lo), zero padded.
template <int kLevels>
size_t ActBytes(int64_t m, int64_t kp) {
  return static_cast<size_t>(kLevels * PaddedRows(m) * kp * 2);
}

template <int kLevels>
void PrepareActs(const float* const* rows, int64_t m, int64_t k, int64_t kp, uint8_t* acts) {
  const int64_t mp = PaddedRows(m);
  for (int64_t i = 0; i < mp; ++i) {
    uint8_t* hi_row = acts + i * kp * 2;
    uint8_t* lo_row = hi_row + mp * kp * 2;
    for (int64_t c = 0; c < kp; c += 16) {
      const int64_t valid = i >= m || c >= k ? 0 : (k - c < 16 ? k - c : 16);
      const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
      const __m512 v = _mm512_maskz_loadu_ps(mask, i < m ? rows[i] + c : nullptr);
      const __m256i hi = (__m256i)_mm512_cvtneps_pbh(v);
      _mm256_store_si256(reinterpret_cast<__m256i*>(hi_row + c * 2), hi);
      if constexpr (kLevels == 2) {
        const __m512 hi_f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
        const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hi_f));  // v - hi_f is exact
        _mm256_store_si256(reinterpret_cast<__m256i*>(lo_row + c * 2), lo);
      }
    }
  }
}

size_t ScratchBytes(int64_t kp) { return static_cast<size_t>(kp / 32 * kBTileBytes + 16 * 64 + 64); }

// Expands 32 nibble indices (bytes) to scaled bf16 words and stores one 64-byte B-tile row.
inline void EmitPairRow(__m256i nibbles, __m512i lut, __m512i scale_add, uint8_t* dst) {
  const __m512i idx = _mm512_cvtepu8_epi16(nibbles);
  __m512i w = _mm512_permutexvar_epi16(idx, lut);
  const __mmask32 nonzero = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(7));
  w = _mm512_mask_add_epi16(w, nonzero, w, scale_add);  // adds e-127 to the exponent of non-zero values
  _mm512_store_si512(dst, w);
}

// One packed 16-row tile -> kp/32 B tiles of 16 pair-rows x 64 bytes.
void DecodeTile(const uint8_t* tile, int64_t supers, uint8_t* dst) {
  alignas(64) static constexpr uint8_t kPairOrder[64] = {
      0,  1,  4,  5,  8,  9,  12, 13, 16, 17, 20, 21, 24, 25, 28, 29, 32, 33, 36, 37, 40, 41,
      44, 45, 48, 49, 52, 53, 56, 57, 60, 61, 2,  3,  6,  7,  10, 11, 14, 15, 18, 19, 22, 23,
      26, 27, 30, 31, 34, 35, 38, 39, 42, 43, 46, 47, 50, 51, 54, 55, 58, 59, 62, 63};
  alignas(64) static constexpr uint16_t kLut[32] = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080,
                                                    0x40C0, 0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040,
                                                    0xC080, 0xC0C0};
  alignas(64) static constexpr uint16_t kDup[32] = {0, 0, 1, 1, 2,  2,  3,  3,  4,  4,  5,  5,  6,  6,  7,  7,
                                                    8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};
  const __m512i order = _mm512_load_si512(kPairOrder);
  const __m512i lut = _mm512_load_si512(kLut);
  const __m512i dup = _mm512_load_si512(kDup);
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* p = tile + s * kSuperBytes;
    for (int b = 0; b < 4; ++b) {
      __m256i e = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kSuperNibbleBytes + 16 * b)));
      e = _mm256_slli_epi16(_mm256_sub_epi16(e, _mm256_set1_epi16(127)), 7);
      const __m512i scale_add = _mm512_permutexvar_epi16(dup, _mm512_castsi256_si512(e));
      uint8_t* d = dst + (4 * s + b) * kBTileBytes;
      for (int g = 0; g < 4; ++g) {
        const __m512i v = _mm512_permutexvar_epi8(order, _mm512_load_si512(p + 256 * b + 64 * g));
        const __m512i lo = _mm512_and_si512(v, m4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        EmitPairRow(_mm512_castsi512_si256(lo), lut, scale_add, d + (2 * g) * 64);
        EmitPairRow(_mm512_extracti64x4_epi64(lo, 1), lut, scale_add, d + (2 * g + 1) * 64);
        EmitPairRow(_mm512_castsi512_si256(hi), lut, scale_add, d + (8 + 2 * g) * 64);
        EmitPairRow(_mm512_extracti64x4_epi64(hi, 1), lut, scale_add, d + (9 + 2 * g) * 64);
      }
    }
  }
}

// C[MT] += A rows [16 MT, 16 MT + 16) of this block (both levels) x B tile BT.
template <class T, int kLevels, int MT, int BT>
inline void Step(const uint8_t* a, int64_t lda, int64_t plane) {
  T::template Load<6>(a + MT * 16 * lda, lda);
  T::template Dot<MT, 6, BT>();
  if constexpr (kLevels == 2) {
    T::template Load<7>(a + plane + MT * 16 * lda, lda);
    T::template Dot<MT, 7, BT>();
  }
}

template <class T, int kLevels, int NT, int BT>
inline void Steps(const uint8_t* a, int64_t lda, int64_t plane) {
  Step<T, kLevels, 0, BT>(a, lda, plane);
  if constexpr (NT > 1) Step<T, kLevels, 1, BT>(a, lda, plane);
  if constexpr (NT > 2) Step<T, kLevels, 2, BT>(a, lda, plane);
  if constexpr (NT > 3) Step<T, kLevels, 3, BT>(a, lda, plane);
}

template <class T, int MT>
inline void Flush(float* stage, int64_t rows_left, float* out, int64_t ldo) {
  T::template Store<MT>(stage, 64);
  const int64_t rows = rows_left - 16 * MT < 16 ? rows_left - 16 * MT : 16;
  for (int64_t r = 0; r < rows; ++r) std::memcpy(out + (16 * MT + r) * ldo, stage + 16 * r, 64);
}

// C[0..NT) = activation rows [m0, m0 + 16 NT) x all decoded B tiles; writes the valid rows to out.
// B tiles alternate between registers 4 and 5 so a load never waits for the previous block's products.
template <class T, int kLevels, int NT>
void RowBlock(const uint8_t* bbuf, int64_t nblocks, const uint8_t* a, int64_t lda, int64_t plane,
              int64_t rows_left, float* out, int64_t ldo, float* stage) {
  T::template Zero<0>();
  if constexpr (NT > 1) T::template Zero<1>();
  if constexpr (NT > 2) T::template Zero<2>();
  if constexpr (NT > 3) T::template Zero<3>();
  for (int64_t kb = 0; kb < nblocks; kb += 2) {
    const uint8_t* b0 = bbuf + kb * kBTileBytes;
    T::template Load<4>(b0, 64);
    Steps<T, kLevels, NT, 4>(a + kb * 64, lda, plane);
    if (kb + 1 < nblocks) {
      T::template Load<5>(b0 + kBTileBytes, 64);
      Steps<T, kLevels, NT, 5>(a + kb * 64 + 64, lda, plane);
    }
  }
  Flush<T, 0>(stage, rows_left, out, ldo);
  if constexpr (NT > 1) Flush<T, 1>(stage, rows_left, out, ldo);
  if constexpr (NT > 2) Flush<T, 2>(stage, rows_left, out, ldo);
  if constexpr (NT > 3) Flush<T, 3>(stage, rows_left, out, ldo);
}

template <class T, int kLevels>
void AmxTiles(const TileArgs& a) {
  const int64_t kp = a.supers * kSuperCols;
  const int64_t nblocks = kp / 32;
  const int64_t mp = PaddedRows(a.m);
  const int64_t lda = kp * 2;
  const int64_t plane = mp * lda;  // x_lo follows x_hi
  uint8_t* bbuf = a.scratch;
  float* stage = reinterpret_cast<float*>(a.scratch + nblocks * kBTileBytes);
  TileConfig* cfg = reinterpret_cast<TileConfig*>(a.scratch + nblocks * kBTileBytes + 16 * 64);
  std::memset(cfg, 0, sizeof(*cfg));
  cfg->palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg->rows[t] = 16;
    cfg->colsb[t] = 64;
  }
  T::Configure(cfg);
  for (int64_t t = 0; t < a.num_tiles; ++t) {
    DecodeTile(a.tiles + t * a.tile_stride, a.supers, bbuf);
    for (int64_t m0 = 0; m0 < mp; m0 += 64) {
      const int64_t nt = (mp - m0) / 16 < 4 ? (mp - m0) / 16 : 4;
      const uint8_t* arows = a.acts + m0 * lda;
      float* out = a.out + m0 * a.ldo + 16 * t;
      const int64_t rows_left = a.m - m0;
      switch (nt) {
        case 1: RowBlock<T, kLevels, 1>(bbuf, nblocks, arows, lda, plane, rows_left, out, a.ldo, stage); break;
        case 2: RowBlock<T, kLevels, 2>(bbuf, nblocks, arows, lda, plane, rows_left, out, a.ldo, stage); break;
        case 3: RowBlock<T, kLevels, 3>(bbuf, nblocks, arows, lda, plane, rows_left, out, a.ldo, stage); break;
        default: RowBlock<T, kLevels, 4>(bbuf, nblocks, arows, lda, plane, rows_left, out, a.ldo, stage); break;
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

}  // namespace

const KernelOps& AmxKernelOps(ActivationPrecision precision) {
  return kOps[precision == ActivationPrecision::kHigh ? 0 : 1];
}
const KernelOps& AmxEmulatedKernelOps(ActivationPrecision precision) {
  return kEmulatedOps[precision == ActivationPrecision::kHigh ? 0 : 1];
}

}  // namespace numoe::experts
