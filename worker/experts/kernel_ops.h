// The contract between MoeCompute and the per-ISA kernels in worker/kernels/{generic,avx2,avx512,amx}/.
//
// A kernel computes, for m activation rows and a run of consecutive packed row tiles (packed_layout.h),
//   out[i * ldo + 16 * tile + j] = sum_k W[16 * tile + j, k] * x_i[k]      (fp32 result)
// from activations it prepared itself (each ISA has its own activation format: fp32, int8 + per-block
// scales, bf16). The ops are plain function pointers, defined in translation units compiled with their
// ISA's flags and sharing no inline code with the rest of the program, so no AVX-512 instruction can
// leak into code that runs on a machine without it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "worker/experts/activation_precision.h"

namespace numoe::experts {

// Bytes [begin, end) that a kernel call reads ahead for the caller's next call (MoeComputeOptions::read_ahead).
struct ByteRange {
  const uint8_t* begin = nullptr;
  const uint8_t* end = nullptr;
};

// The read-ahead state of one thread, advanced by the kernel calls that read its bytes: the range being
// read is [p, end), then the ranges [next, last) in order.
struct ReadAhead {
  const uint8_t* p = nullptr;
  const uint8_t* end = nullptr;
  const ByteRange* next = nullptr;
  const ByteRange* last = nullptr;
  int mode = 1;  // MoeComputeOptions::read_ahead
};

struct TileArgs {
  const uint8_t* tiles = nullptr;  // first packed tile (64-byte aligned)
  int64_t num_tiles = 0;           // consecutive tiles, tile_stride bytes apart
  int64_t tile_stride = 0;
  int64_t supers = 0;              // super-blocks per tile = Kp / 128
  const uint8_t* acts = nullptr;   // prepare_acts output for these m rows and Kp = 128 * supers
  int64_t m = 0;                   // activation rows, >= 1
  float* out = nullptr;            // [m][ldo]; tile n of this call fills columns [16n, 16n + 16)
  int64_t ldo = 0;
  uint8_t* scratch = nullptr;      // scratch_bytes(Kp) bytes, 64-byte aligned, private to the caller's thread
  // Software prefetch of the int8 kernels (MoeComputeOptions::prefetch_bytes): bytes ahead of the super-block
  // being read, within this call's tiles (0: none).
  int64_t prefetch_bytes = 0;
  // The int8 kernels' tiles read at once (MoeComputeOptions::max_streams; 0: as many as the registers hold).
  int64_t max_streams = 0;
  // > 0: prefetch only the first this many lines of each 4 KiB page, prefetch_bytes ahead, instead of every
  // line (MoeComputeOptions::prefetch_page_lines).
  int64_t prefetch_page_lines = 0;
  // Non-null: the int8 streaming kernel also loads the lines of *read_ahead (MoeComputeOptions::read_ahead),
  // one per 64 bytes of tiles it reads, and advances it. Other kernels leave it alone.
  ReadAhead* read_ahead = nullptr;
  // The software prefetch goes into L1 (prefetcht0) instead of L2 (MoeComputeOptions::prefetch_l1).
  bool prefetch_l1 = false;
  // The tiles were read ahead by the previous call (they are in L2): the int8 kernels skip their software
  // prefetch into L2 (not one into L1).
  bool tiles_read_ahead = false;
  // The tiles of the caller's next kernel call on this thread, [next_tiles, next_tiles_end) (null: unknown).
  // The prefill kernels (int8 prefill path, AMX) prefetch its first run of tiles into L2 while their own
  // last run computes, so that the next call does not start from DRAM; the streaming kernels ignore it.
  const uint8_t* next_tiles = nullptr;
  const uint8_t* next_tiles_end = nullptr;
  // The int8 prefill path splits the call's tiles into runs as even as possible (false: full runs and a
  // shorter last one). MoeComputeOptions::prefill_even_runs; the results are the same either way.
  bool even_runs = true;
  // The int8 streaming kernel takes both halves of a tile in one pass where a register holds half of one
  // (AVX2; MoeComputeOptions::wide_passes); the results are the same either way.
  bool wide_passes = true;
};

struct KernelOps {
  const char* name;
  // Bytes of prepared activations for m rows padded to kp columns (a multiple of 128).
  size_t (*act_bytes)(int64_t m, int64_t kp);
  // rows[i] points at k floats (k <= kp); columns [k, kp) are taken as zeros. `acts` is 64-byte aligned.
  void (*prepare_acts)(const float* const* rows, int64_t m, int64_t k, int64_t kp, uint8_t* acts);
  size_t (*scratch_bytes)(int64_t kp);
  void (*tiles)(const TileArgs& args);
};

// Defined in worker/kernels/<isa>/. Only call an ISA's ops when IsaAvailable() says so.
const KernelOps& GenericKernelOps();
const KernelOps& Avx2KernelOps(ActivationPrecision precision);
const KernelOps& Avx512KernelOps(ActivationPrecision precision);
// The same kernel with the VBMI nibble decode (same results, fewer uops); needs AVX-512 VBMI as well.
const KernelOps& Avx512VbmiKernelOps(ActivationPrecision precision);
// The AVX-512 int8 kernels' prefill path (worker/kernels/int8_tiles.h): weight tiles decoded once per call
// and shared by all rows; the same results bit for bit as the kernels above. Without / with the VBMI decode.
const KernelOps& Avx512PrefillKernelOps(ActivationPrecision precision);
const KernelOps& Avx512VbmiPrefillKernelOps(ActivationPrecision precision);
const KernelOps& AmxKernelOps(ActivationPrecision precision);
// The AMX kernel with its tile instructions replaced by scalar code (same decode, same data layout);
// needs only AVX-512 BW/VBMI/BF16. For tests on machines without AMX.
const KernelOps& AmxEmulatedKernelOps(ActivationPrecision precision);

// Register-resident loops of the kernels' multiply instruction (no memory traffic), for numoe-bench's
// peak figures; run on the calling thread for about `seconds`. Return flop/s (2 per multiply-add).
double Avx512VnniPeakFlops(double seconds);  // VPDPBUSD, int8 (needs IsaAvailable(kAvx512))
double AmxBf16PeakFlops(double seconds);     // TDPBF16PS (needs IsaAvailable(kAmx))

}  // namespace numoe::experts
