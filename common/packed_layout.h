// THE packed layout of routed-expert weights (one layout shared by every ISA's kernel, and by GPU prefill, which
// uploads these bytes as they are: backends/cuda/packed_moe.cu).
//
// A checkpoint matrix W [rows N = outputs, cols K = inputs] is MXFP4: packed[N, K/2] (byte k holds column
// 2k in the LOW nibble and 2k+1 in the high nibble; nibble n = E2M1 value [0,.5,1,1.5,2,3,4,6][n&7],
// negative when n&8) and scales[N, ceil(K/32)] E8M0 (2^(e-127)) per 32 inputs. Pack() repacks it so that
// a kernel streams it front to back, once, with every 64-byte load feeding SIMD lanes directly:
//
//   Np = round_up(N, 16), Kp = round_up(K, 128). Padding rows/columns hold zero nibbles and scale 127.
//   The matrix is Np/16 ROW TILES, back to back; tile t holds rows [16t, 16t+16).
//   A tile is Kp/128 SUPER-BLOCKS of 1088 bytes (17 cache lines); super-block s holds columns
//   [128s, 128s+128) of the tile's 16 rows:
//     bytes [0, 1024): four 32-column MXFP4 blocks b = 0..3 (columns 128s+32b ...), 256 bytes each, made of
//       four 64-byte CHUNKS g = 0..3. In chunk g, byte i (0..63) belongs to row 16t + i/4 and holds
//         low nibble:  column 128s + 32b +      4g + i%4
//         high nibble: column 128s + 32b + 16 + 4g + i%4
//     bytes [1024, 1088): the E8M0 scales, byte 16b + j = scale of row 16t+j for block b.
//   So the low nibbles of one chunk, looked up into bytes, are exactly a VNNI operand: 32-bit lane j holds
//   4 consecutive columns of row j (the int8 kernels' dpbusd and the AMX B-tile order), and a block's 16
//   per-row scales arrive as one 16-byte vector, once per 512 weights.
//
// An expert is [w13][w2]: w13 interleaves gate (w1) and up (w3) tiles, gate tile t then up tile t, so one
// stream yields both halves of SwiGLU for 16 intermediate rows; w2 (down, [hidden, inter]) follows.
// Experts are back to back at a 4 KiB-aligned stride; the layer sits in one node-local 2 MB-page buffer.
// Bytes streamed per expert = 3 matrices x (N K / 2 + N K / 32) for aligned shapes: exactly the checkpoint's
// bytes (13.37 MB for a V4-Flash expert), with no expansion.
#pragma once

#include <cstdint>

namespace numoe::experts {

inline constexpr int64_t kTileRows = 16;        // rows per tile (one 512-bit lane per row)
inline constexpr int64_t kBlockCols = 32;       // MXFP4 scale block
inline constexpr int64_t kSuperCols = 128;      // columns per super-block
inline constexpr int64_t kSuperNibbleBytes = 1024;
inline constexpr int64_t kSuperBytes = 1088;    // 1024 nibble bytes + 64 scale bytes
inline constexpr int64_t kExpertAlign = 4096;
inline constexpr int kE8M0Pad = 127;            // scale byte of padding (2^0; its weights are zero)

constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

// Geometry of one packed matrix of logical shape [rows, cols].
struct PackedMatrixShape {
  int64_t rows = 0, cols = 0;
  constexpr int64_t tiles() const { return CeilDiv(rows, kTileRows); }
  constexpr int64_t supers() const { return CeilDiv(cols, kSuperCols); }
  constexpr int64_t padded_cols() const { return supers() * kSuperCols; }
  constexpr int64_t tile_bytes() const { return supers() * kSuperBytes; }
  constexpr int64_t bytes() const { return tiles() * tile_bytes(); }
};

// Geometry of one packed expert (gate/up [inter, hidden], down [hidden, inter]).
struct PackedExpertShape {
  int64_t hidden = 0, inter = 0;
  constexpr PackedMatrixShape gate_up() const { return {inter, hidden}; }  // one of the two
  constexpr PackedMatrixShape down() const { return {hidden, inter}; }
  constexpr int64_t w13_bytes() const { return 2 * gate_up().bytes(); }
  constexpr int64_t w2_offset() const { return w13_bytes(); }
  constexpr int64_t data_bytes() const { return w13_bytes() + down().bytes(); }  // streamed per expert
  constexpr int64_t stride() const { return RoundUp(data_bytes(), kExpertAlign); }
  // Offset of gate tile t inside the expert; the up tile follows at + gate_up().tile_bytes().
  constexpr int64_t gate_tile_offset(int64_t t) const { return 2 * t * gate_up().tile_bytes(); }
  constexpr int64_t down_tile_offset(int64_t t) const { return w2_offset() + t * down().tile_bytes(); }
};

}  // namespace numoe::experts
