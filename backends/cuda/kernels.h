// Host-callable launchers of the CUDA backend's kernels (gemm.cu, gemv.cu, gemm_stream.cu, sm80_gemm_mma.cu,
// ops.cu, attention.cu, moe_experts.cu, packed_moe.cu).
//
// Conventions: row-major; a weight is [out, in] as in the checkpoint, so a linear layer is
// y[n, out] = x[n, in] · Wᵀ. Activations are fp32 in device memory; caches (window ring, compressed
// entries, indexer keys) are `CacheT` = float (fp32 mode) or bf16. Launchers enqueue on `stream` and never
// synchronise; the caller checks cudaGetLastError() once per segment.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#ifdef __CUDACC__
#define NUMOE_HOST_DEVICE __host__ __device__
#else
#define NUMOE_HOST_DEVICE
#endif

namespace numoe::cuda {

// ---- weights -------------------------------------------------------------------------------------------

enum class WType : int32_t { kF32 = 0, kBF16 = 1, kFP8 = 2 };
const char* WTypeName(WType t);
int64_t WTypeBytes(WType t);  // per element (FP8: 1, scales not counted)

// A weight matrix [out, in] in device memory, `in` contiguous. FP8 (E4M3) weights carry the fp32 block-scale
// grid of the WHOLE checkpoint tensor ([ceil(rows/bo), scale_cols]); (row_base, col_base) place this matrix
// (possibly a tensor-parallel slice) inside that grid: W[r, c] = fp8(data[r, c]) · scale[(row_base + r) / bo,
// (col_base + c) / bi].
struct DevW {
  WType type = WType::kF32;
  const void* data = nullptr;
  const float* scale = nullptr;
  int64_t out = 0, in = 0;
  int64_t row_base = 0, col_base = 0;
  int32_t bo = 128, bi = 128;
  int64_t scale_cols = 0;
  int64_t data_bytes() const { return out * in * WTypeBytes(type); }
  // Rows [r0, r0 + count) as a matrix of their own (same scale grid).
  DevW Rows(int64_t r0, int64_t count) const;
};

// y = x · Wᵀ for `groups` independent groups: group g reads x columns [g·x_group_cols, ...), weight rows
// [g·w.out, (g+1)·w.out) of the underlying storage (w describes ONE group: w.out rows) and writes y columns
// [g·y_group_cols, ...). `tensor_cores`: bf16 mma with fp32 accumulation (BF16/FP8 weights only), else fp32
// SIMT. `sms` = multiprocessor count (for split-K sizing).
struct GemmCall {
  const DevW* w = nullptr;
  const float* x = nullptr;
  int64_t ldx = 0;
  int64_t n = 0;
  float* y = nullptr;
  int64_t ldy = 0;
  int groups = 1;
  int64_t x_group_cols = 0;
  int64_t y_group_cols = 0;
  // Tensor-core path: multiply x as a bf16 (hi, lo) pair, two products per step (~16 mantissa bits of x
  // instead of 8; the weights are exact in bf16: BF16, and FP8 codes times power-of-two block scales).
  bool split_x = true;
};
void Gemm(const GemmCall& c, bool tensor_cores, int sms, cudaStream_t stream);
// Passes of up to kGemvMaxRows rows on FP8/BF16 weights of at least kGemvMinRows rows (all groups), aligned for
// 16-byte loads: a weight-streaming GEMV on CUDA cores (gemv.cu) that Gemm takes when GemvApplies.
inline constexpr int64_t kGemvMaxRows = 1;  // at 2 rows the mma kernel was faster (H200)
inline constexpr int64_t kGemvMinRows = 1024;
// min_out: the fewest weight rows (one warp each) for which the GEMV beats the split-K mma kernel; a
// call that would otherwise take the fp32 SIMT kernel (tensor_cores off) passes 1.
bool GemvApplies(const GemmCall& c, int64_t min_out = kGemvMinRows);
// How it is launched: weight rows per warp (1 or 4), warps of a block that split k (1, 2, 4, 8; a block holds
// 8 / k_warps * rows_per_warp weight rows), k steps in flight per warp (2 or 4). NUMOE_GEMV_SPLIT=0 keeps one
// warp per row group; NUMOE_GEMV_BLOCKS_PER_SM (default 4) is the block count per SM that k warps are doubled
// until; NUMOE_GEMV_UNROLL=4 puts 4 steps in flight; NUMOE_GEMV_MIN_BLOCKS=3 takes the 4-rows-per-warp kernel
// compiled for 3 blocks per SM (registers capped at 85; the default's 4-row FP8 kernel needs 114 on sm_90, so
// 2 blocks fit). Variants for a device run to compare.
struct GemvPlan {
  int rows_per_warp = 4;
  int k_warps = 1;
  int unroll = 2;
  int min_blocks = 1;  // 1 or 3 (rows_per_warp 4 only)
};
GemvPlan PlanGemv(const GemmCall& c, int sms);
void Gemv(const GemmCall& c, const GemvPlan& plan, cudaStream_t stream);
// The tensor-core path (sm80_gemm_mma.cu); `ksplit` > 1 accumulates with atomics into a zeroed y.
void GemmMma(const GemmCall& c, int ksplit, cudaStream_t stream);
// Its tiling, for split-K sizing: up to kMmaNarrowRows rows of x, blocks of 64 weight rows x 8/16 rows of x;
// above that (verify, prefill), blocks of kMmaWideOutTile weight rows x MmaWideRowTile(n) rows of x sharing x
// through shared memory, and 2 of those blocks per SM are enough to stream the weights.
inline constexpr int64_t kMmaNarrowRows = 16;
inline constexpr int64_t kMmaWideOutTile = 128;
inline constexpr int64_t MmaWideRowTile(int64_t n) { return n <= 32 ? 32 : 64; }

// Decode-sized passes (kStreamMinRows..kStreamMaxRows rows) on FP8/BF16 weights: the weight-streaming
// tensor-core GEMM (gemm_stream.cu; weights as the mma's A operand, a cp.async ring of weight tiles, x in
// shared memory once per block, split-K to fill the GPU). PlanGemmStream says whether it applies (whole
// 128-k FP8 / 64-k BF16 chunks, 16-byte aligned weights, FP8 scale blocks that hold a chunk and a 16-row
// tile; NUMOE_GEMM_STREAM=0 turns it off) and how it is launched; with plan.ksplit > 1, y must be zeroed first.
inline constexpr int64_t kStreamMinRows = 2;
inline constexpr int64_t kStreamMaxRows = 64;
struct StreamPlan {
  int blocks = 0;  // per k range and group (each walks tiles blocks apart)
  int ksplit = 1;
  int64_t kspan = 0;
  int groups = 1;
  int tiles = 0;   // output tiles per group
  int frags = 1;   // 8-row fragments of x: 1, 2, 4 or 8
  int stages = 0;  // weight buffers in the ring
  bool split = false;  // x as a bf16 hi/lo pair (GemmCall::split_x)
  int blocks_per_sm = 1;  // 2: planned for two blocks per SM (NUMOE_GEMM_STREAM_BLOCKS_PER_SM=2, up to 8 rows)
  int smem_bytes = 0;
};
bool PlanGemmStream(const GemmCall& c, int sms, StreamPlan* plan);
cudaError_t GemmStream(const GemmCall& c, const StreamPlan& plan, cudaStream_t stream);

// ---- step metadata ---------------------------------------------------------------------------------------

// One sequence's part of a device pass: rows [begin, end) hold its new tokens at positions start_pos...
struct StepSeq {
  int32_t slot;
  int32_t begin;
  int32_t end;
  int32_t start_pos;
};

struct StepDev {
  const int32_t* token = nullptr;  // [n]
  const int32_t* pos = nullptr;    // [n]
  const int32_t* seq = nullptr;    // [n] index into seqs
  const StepSeq* seqs = nullptr;   // [num_seqs]
  int32_t n = 0;
  int32_t num_seqs = 0;
};

// Where a sequence's state lives. Fixed state: slot s at fixed + s·slot_bytes (window rings, pending
// compressor windows, overlap halves). Compressed entries: pages of `page_tokens` tokens shared by all
// layers; page k of slot s is pages[table[s·max_pages + k]], `page_elems` CacheT values each.
struct CacheDev {
  char* fixed = nullptr;
  int64_t slot_bytes = 0;
  void* pages = nullptr;
  int64_t page_elems = 0;
  const int32_t* table = nullptr;
  int32_t max_pages = 0;
};

// ---- row kernels (ops.cu) -------------------------------------------------------------------------------

// X[r, j, :] = table[token[r], :] for j < hc.
void Embed(const DevW& table, const int32_t* token, int64_t n, int hc, float* X, cudaStream_t stream);
// inv[r] = 1 / sqrt(mean(x[r, :len]²) + eps).
void RowInvRms(const float* x, int64_t n, int64_t len, float eps, float* inv, cudaStream_t stream);

// mHC pre-step from mixraw = X·fnᵀ (unnormalised) and inv (RowInvRms of X): pre/post/Sinkhorn comb, the
// collapsed u = Σ pre_j X_j and xn = RMSNorm_w(u). head_mode: hc_head (pre only; post/comb unused).
struct HcPreArgs {
  const float* mixraw = nullptr;  // [n, m]
  const float* inv = nullptr;     // [n]
  // Instead of mixraw and inv: HcMix's partial sums [n, kHcMixSplits, m + 1], reduced here in a fixed order.
  const float* part = nullptr;
  const float* base = nullptr;    // [m]
  const float* scale = nullptr;   // [3] ([1] in head mode)
  const float* X = nullptr;       // [n, hc, D]
  const float* norm_w = nullptr;  // [D]
  float* post = nullptr;          // [n, hc]
  float* comb = nullptr;          // [n, hc, hc]
  float* xn = nullptr;            // [n, D]
  int64_t n = 0, D = 0;
  int hc = 4, iters = 20;
  float hc_eps = 1e-6f, rms_eps = 1e-6f;
  bool head_mode = false;
  float* u_out = nullptr;  // optional [n, D]: the collapsed u before the norm (DSpark confidence)
};
void HcPre(const HcPreArgs& a, cudaStream_t stream);
// The mHC mixing projection fused with the row's sum of squares, for decode-sized passes (rows <=
// kHcMixMaxRows): part[(r·kHcMixSplits + s)·(m + 1) + o] = Σ_{k in chunk s} X[r, k]·W[o, k] for o < m, and
// Σ_{k in chunk s} X[r, k]² for o = m; HcPre (HcPreArgs::part) adds the chunks. One launch instead of a row
// norm and a split-K fp32 GEMM whose blocks were mostly empty (24 outputs). Needs HcMixFits.
constexpr int kHcMixSplits = 128;   // K chunks (blocks per row group): 128 floats each at hc·D = 16384
constexpr int kHcMixMaxRows = 64;   // larger passes take the GEMM
bool HcMixFits(const DevW& w, int64_t n);
void HcMix(const float* X, const DevW& w, int64_t n, float* part, cudaStream_t stream);
// HcPost (below) and then HcMix of the updated X in one launch (hc = 4, m = 24; needs HcPostMixFits): the
// partial sums are over other chunks of K than HcMix's, and HcPre adds them the same way.
struct HcPostMixArgs {
  const float* y = nullptr;     // [n, D]
  const float* y2 = nullptr;    // optional [n, D]: y + y2 is the block's output (the shared + routed experts)
  const float* post = nullptr;  // [n, 4]
  const float* comb = nullptr;  // [n, 4, 4]
  float* X = nullptr;           // [n, 4, D], updated in place
  const float* W = nullptr;     // [24, 4·D] (the next mix's fn)
  float* part = nullptr;        // [n, kHcMixSplits, 25]
  int64_t n = 0, D = 0;
  int rows_per_block = 0;       // set by HcPostMix
};
bool HcPostMixFits(const DevW& w, int64_t n, int hc, int64_t D);
void HcPostMix(const HcPostMixArgs& a, cudaStream_t stream);
// X[r, k] = post[r, k]·y[r] + Σ_j comb[r, j, k]·X[r, j].
void HcPost(const float* y, const float* post, const float* comb, float* X, int64_t n, int hc, int64_t D,
            cudaStream_t stream);

// In place on x[r, h·hd ...] (row stride ld): optional RMSNorm (weighted when w != nullptr), optional rope on
// the trailing rope_dim channels at pos[r] (inv_freq != nullptr), optional copy of the result to
// copy_out[r, h·hd ...] (CacheT, row stride heads·hd). hd and rope_dim even, hd <= 8192.
template <typename CacheT>
struct NormRopeArgs {
  float* x = nullptr;
  int heads = 1, hd = 0;
  int64_t ld = 0;
  const float* w = nullptr;
  bool norm = true;
  float eps = 1e-6f;
  int rope_dim = 0;
  const float* inv_freq = nullptr;
  CacheT* copy_out = nullptr;
};
// One or two of them (independent buffers) in one launch, over the same n rows and positions.
template <typename CacheT>
struct NormRopeJobs {
  NormRopeArgs<CacheT> j[2];
  int count = 0;
};
template <typename CacheT>
void NormRope(const NormRopeJobs<CacheT>& jobs, int64_t n, const int32_t* pos, cudaStream_t stream);

// Router: scores from logits [n, E] (scoring 0 sqrtsoftplus, 1 softmax, 2 sigmoid); ids from tid2eid[token]
// (hash layers, tid2eid != nullptr) or top-k of score + bias; weights = renormalised scores · route_scale.
void MoeGate(const float* logits, int64_t n, int E, int K, int scoring, const float* bias, const int32_t* tid2eid,
             const int32_t* token, float route_scale, int32_t* ids, float* weights, cudaStream_t stream);
// h = silu(min(g, lim)) · clamp(u, -lim, lim) (no clamp when lim <= 0); g, u, h [n, I] with row strides.
void SwiGlu(const float* g, const float* u, int64_t ldgu, float* h, int64_t n, int64_t I, float lim,
            cudaStream_t stream);
void AddInPlace(float* y, const float* a, int64_t count, cudaStream_t stream);
void GatherRows(const float* src, int64_t d, const int32_t* rows, int64_t m, float* dst, cudaStream_t stream);
// out[r, :D] (row stride ldo) = mean over the hc streams of X[r] (DSpark target features).
void StreamMean(const float* X, int64_t n, int hc, int64_t D, float* out, int64_t ldo, cudaStream_t stream);
// In place: x[r] = RMSNorm_w(x[r]) over D.
void RmsNormRows(float* x, int64_t n, int64_t D, const float* w, float eps, cudaStream_t stream);
// out[i, :d] = float(table[ids[i], :d]) for a BF16 table [rows, d].
void GatherBf16Rows(const __nv_bfloat16* table, int64_t d, const int32_t* ids, int64_t m, float* out,
                    cudaStream_t stream);
// The reverse of SaveSpecRows: for each row r < n, dst + r·dst_ld gets `width` bytes from
// src + slot·slot_stride + t·row_bytes with map[r] = slot·T + t (row_bytes = width).
void LoadSpecRows(const void* src, int64_t slot_stride, int64_t width, int32_t T, const int32_t* map, int64_t n,
                  void* dst, int64_t dst_ld, cudaStream_t stream);
// Speculative log: for each row r < n with map[r] >= 0 (= slot·T + t), copies `width` bytes from
// src + r·src_ld to dst + slot·slot_stride + t·row_bytes. Byte counts and addresses are multiples of 4.
void SaveSpecRows(const void* src, int64_t src_ld, int64_t width, int64_t n, const int32_t* map, int32_t T,
                  void* dst, int64_t slot_stride, int64_t row_bytes, cudaStream_t stream);
// packed[r] = (order key of max(logits[r, :V]) << 32) | ~argmax; ArgmaxOf(packed[r]) is the id (ties -> lowest).
void ArgmaxRows(const float* logits, int64_t m, int64_t V, unsigned long long* packed, cudaStream_t stream);
inline int32_t ArgmaxOf(unsigned long long packed) { return static_cast<int32_t>(~static_cast<uint32_t>(packed)); }

// Deterministic pseudo-random fills (synthetic weights and benchmark caches).
void FillUniformF32(float* p, int64_t count, float lo, float hi, uint64_t seed, cudaStream_t stream);
void FillUniformBf16(__nv_bfloat16* p, int64_t count, float amp, uint64_t seed, cudaStream_t stream);
// FP8 E4M3 codes of magnitude in [1/64, 1.875] with random signs (never NaN).
void FillFp8(uint8_t* p, int64_t count, uint64_t seed, cudaStream_t stream);
void FillInt32Mod(int32_t* p, int64_t count, int32_t mod, uint64_t seed, cudaStream_t stream);
void ConvertF32ToBf16(const float* src, __nv_bfloat16* dst, int64_t count, cudaStream_t stream);

// ---- compressors, indexer, attention (attention.cu) --------------------------------------------------------

// One compressor (CSA / HCA main, or the CSA indexer's) of one layer. Projections of the step's rows:
// kv at ckv[r·ld + c], gate at cg[r·ld + c], c < coff·dim.
struct CompArgs {
  int rate = 0, dim = 0;
  bool overlap = false;
  const float* ckv = nullptr;
  const float* cg = nullptr;
  int64_t ld = 0;
  const float* ape = nullptr;     // [rate, coff·dim]
  const float* norm_w = nullptr;  // [dim]
  float eps = 1e-6f;
  int rope_dim = 0;
  const float* inv_freq = nullptr;
  int64_t pend_kv_off = 0, pend_gate_off = 0;  // bytes in the slot: fp32 [rate, coff·dim]
  int64_t prev_kv_off = 0, prev_gate_off = 0;  // overlap only: fp32 [rate, dim]
  int64_t page_off = 0;  // CacheT offset of this store inside a page
  int32_t epp = 0;       // entries per page
  NUMOE_HOST_DEVICE int coff() const { return overlap ? 2 : 1; }
};
// A layer's compressors (CSA: the main one and the indexer's; HCA: one), run by the same launches.
inline constexpr int kMaxCompressors = 2;
struct CompJobs {
  CompArgs c[kMaxCompressors];
  int count = 0;
};
// Emits every window that closes in this pass and then updates the pending and overlap state of each
// compressor in `j`. max_windows (windows closing per sequence, at most) <= 1 (decode): one launch, a block
// per (sequence, compressor) that emits and then updates; else a launch of (sequence, window, compressor)
// blocks and one of updates. Must run before attention reads the entries.
template <typename CacheT>
void CompressStep(const CompJobs& j, const StepDev& s, const CacheDev& cache, int max_windows, cudaStream_t stream);

struct IndexArgs {
  const float* iq = nullptr;  // [n, ih·id] roped
  int64_t ldq = 0;
  const float* iw = nullptr;  // [n, ih] (unscaled weights_proj output)
  int64_t ldw = 0;
  int ih = 0, id = 0, rate = 0, topk = 0;
  int64_t page_off = 0;
  int32_t epp = 0;
};
// Scores rows [r0, r0 + rows) against their visible indexer keys (scores [rows, lds]; max_vis bounds the
// grid) and selects the top-k entry ids into sel[r, :topk] (count = min(topk, visible)).
template <typename CacheT>
void IndexTopK(const IndexArgs& a, const StepDev& s, const CacheDev& cache, int64_t r0, int64_t rows,
               int64_t max_vis, float* scores, int64_t lds, int32_t* sel, cudaStream_t stream);

struct AttnArgs {
  const float* q = nullptr;  // [n, heads·hd] (local heads)
  int64_t ldq = 0;
  // Optional: q rounded to CacheT, [n, heads·hd] contiguous (NormRope's copy_out). The tensor-core kernel then
  // copies it as is instead of reading and rounding q.
  const void* q16 = nullptr;
  int heads = 0, hd = 0;
  const void* kv_new = nullptr;  // CacheT [n, hd]: this pass's keys (= values)
  int64_t ring_off = 0;          // bytes in the slot: CacheT [window, hd]
  int window = 0;
  int type = 0;  // 0 sliding, 1 CSA, 2 HCA
  int rate = 0;
  int64_t page_off = 0;
  int32_t epp = 0;
  const int32_t* sel = nullptr;  // CSA: [n, topk]
  int topk = 0;
  const float* sink = nullptr;  // [heads]
  float scale = 0;
  int rope_dim = 0;
  const float* inv_freq = nullptr;
  float* out = nullptr;  // [n, heads·hd], de-roped
  int64_t ldo = 0;
  // Key splits per (row, head group), at most kAttnMaxSplits: > 1 spreads few rows over many blocks (decode;
  // AttentionSplits sizes it); `part` holds [n, heads, splits, hd + 2] floats of partial results.
  int splits = 1;
  float* part = nullptr;
  // DSpark draft blocks (type 0, splits 1): each row sees the ring entries before its sequence's first row
  // (positions start_pos - window .. start_pos - 1) and every row of its sequence in this pass, in both
  // directions; nothing is written to the ring.
  bool bidir = false;
};
// The combine merges at most this many key splits of a (row, head).
inline constexpr int64_t kAttnMaxSplits = 64;
// Which kernel Attention<CacheT> runs for these arguments and a pass of `rows` rows (chosen here, in one
// place): the tensor-core one (mma) for bf16 caches of head_dim 512 with heads a multiple of 32, 16-byte
// aligned rows and at least kAttnMmaMinRows rows, a block per 64 (or 32) heads; else the fp32 SIMT kernel, a
// block per up to 8 heads. blocks_per_sm: how many of its blocks one multiprocessor holds at once.
// Measured on the H200 (V4-Flash, 4K context, per decode step): 1 row 722 + 222 us (fp32 kernel + combine)
// against 1000 + 222 (tensor cores), 32 rows 6862 against 1855; the tensor-core block's fixed cost
// (~20 us) does not pay at one row.
inline constexpr int64_t kAttnMmaMinRows = 4;
struct AttnPlan {
  bool mma = false;
  int heads_per_block = 1;
  int blocks_per_sm = 1;
};
template <typename CacheT>
AttnPlan PlanAttention(const AttnArgs& a, const CacheDev& cache, int64_t rows);
// Key splits for a pass of n rows on `sms` multiprocessors under that plan: enough blocks to fill the GPU,
// at most max_splits per row and n·splits <= max_row_splits (the capacity of AttnArgs::part).
template <typename CacheT>
int AttentionSplits(const AttnArgs& a, const CacheDev& cache, int64_t n, int sms, int max_splits,
                    int64_t max_row_splits);
template <typename CacheT>
void Attention(const AttnArgs& a, const StepDev& s, const CacheDev& cache, cudaStream_t stream);
// ring[pos % window] = kv_new[r] for each sequence's last `window` rows.
template <typename CacheT>
void RingUpdate(const CacheT* kv_new, int hd, int window, int64_t ring_off, const StepDev& s, const CacheDev& cache,
                cudaStream_t stream);

// ---- routed experts (moe_experts.cu) --------------------------------------------------------------------

// One MoE block's routed experts in the checkpoint's MXFP4 format, [experts] x (w1 [inter, hidden], w3 [inter,
// hidden], w2 [hidden, inter]) stacked per matrix: codes [experts, out, in / 2] (byte k of a row = columns 2k
// (low nibble) and 2k + 1), E8M0 scales [experts, out, in / 32]. hidden and inter must be multiples of 32;
// every array 16-byte aligned.
struct Mxfp4Experts {
  const uint8_t *w1 = nullptr, *s1 = nullptr, *w3 = nullptr, *s3 = nullptr, *w2 = nullptr, *s2 = nullptr;
  int64_t experts = 0, hidden = 0, inter = 0;
};
// Device scratch for up to max_rows rows (K slots each) per launch group: offs [2·experts + 2], list
// [max_rows·K] int32, h [max_rows·K, inter] and y [max_rows·K, hidden] fp32.
struct Mxfp4Scratch {
  int32_t *offs = nullptr, *list = nullptr;
  float *h = nullptr, *y = nullptr;
  int64_t max_rows = 0;
};
// out[r] = sum_k wts[r,k] · w2_e · (silu(min(w1_e·x_r, L)) ⊙ clamp(w3_e·x_r, -L, L)), e = ids[r,k] (L = 0: no
// clamp), like worker/experts/moe_compute.h; x, out [n, hidden], ids, wts [n, K] on the device. Each expert's
// weights are read once per 8 pairs routed to it; rows beyond max_rows run as further groups.
void RoutedExpertsMxfp4(const Mxfp4Experts& w, const float* x, const int32_t* ids, const float* wts, int64_t n,
                        int64_t K, float swiglu_limit, const Mxfp4Scratch& s, float* out, cudaStream_t stream);

// ---- routed experts of a prefill step, on the worker's packed layout (packed_moe.cu) ------------------------

// Routed MoE of n rows from one layer's experts in the worker's packed layout
// (common/packed_layout.h), already on the device: expert e at layer + e * stride.
//   out[r] = sum over slots j in order, ids[r, j] in [0, num_experts), of
//            weights[r, j] · w2_e · (silu(min(w1_e·x_r, L)) ⊙ clamp(w3_e·x_r, -L, L))
// (L = swiglu_limit; 0: none)
// as worker/experts/moe_compute.cc computes it; the routing weights already carry the routed scaling factor
// (MoeGate). Ids outside [0, num_experts) (-1 = slot unused) contribute nothing. Tensor cores (bf16 mma.sync,
// sm_80+): weights decoded FP4 x E8M0 -> bf16 exactly; activations x and h as a bf16 (hi, lo) pair, two
// products per step (split_activations, ~16 mantissa bits), or one bf16 (false: ~8 bits, half the mma work).
// Deterministic: the (row, slot) pairs are bucketed by expert in pair order, and the combine adds the slots
// of a row in order (no atomics on the output).
struct PackedMoeArgs {
  const uint8_t* layer = nullptr;   // device: num_experts x stride bytes (16-byte aligned)
  int64_t num_experts = 0, hidden = 0, inter = 0, stride = 0;
  const float* x = nullptr;         // device [n, hidden] fp32 activations (the MoE input)
  const int32_t* ids = nullptr;     // device [n, k] expert ids (-1 = slot unused)
  const float* weights = nullptr;   // device [n, k] routing weights
  int64_t n = 0, k = 0;
  float swiglu_limit = 0;           // as the CPU experts use it (0 = none)
  float* out = nullptr;             // device [n, hidden] fp32: the weighted sum over the k slots
  void* scratch = nullptr;          // device scratch of PackedMoeScratchBytes(...) bytes (256-byte aligned)
  bool split_activations = true;
};
// The limits PackedMoe accepts: rows, slots per row, experts.
inline constexpr int64_t kPackedMoeMaxRows = 1 << 20;
inline constexpr int64_t kPackedMoeMaxK = 16;
inline constexpr int64_t kPackedMoeMaxExperts = 4096;
int64_t PackedMoeScratchBytes(int64_t n, int64_t k, int64_t hidden, int64_t inter);
// Empty when `a` is valid, else a message naming the bad field (checked on the host: shapes, pointers,
// alignment, stride; the ids themselves stay on the device).
std::string PackedMoeCheck(const PackedMoeArgs& a);
// Enqueues the whole computation on `stream` (no host round trip, no synchronisation). cudaErrorInvalidValue
// when PackedMoeCheck fails, else the launches' error.
cudaError_t PackedMoe(const PackedMoeArgs& a, cudaStream_t stream);
// Random experts in the packed layout for benchmarks: every nibble random, scale bytes in [scale_lo, scale_lo + 3]
// (E8M0), padding zeros.
void FillPackedExperts(uint8_t* layer, int64_t num_experts, int64_t hidden, int64_t inter, int64_t stride,
                       int scale_lo, uint64_t seed, cudaStream_t stream);
// Register-resident loop of the bf16 mma.sync PackedMoe uses (m16n8k16, fp32 accumulation) on every SM, for
// about `ms` milliseconds of the current device: its flop/s (2 per multiply-add), the peak PackedMoe is
// measured against.
double MmaBf16PeakFlops(double ms);

}  // namespace numoe::cuda
