// KV compressors, the lightning indexer (scores + exact top-k) and the attention core (window + compressed
// entries + sinks, online softmax; fp32 SIMT, and bf16 tensor cores for bf16 caches of head_dim 512),
// mirroring backends/cpu/{compressor,cpu_model}.cc (docs/dsv4-architecture.md §2.6-2.9).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "backends/cuda/device_util.cuh"
#include "backends/cuda/kernels.h"

namespace numoe::cuda {
namespace {

// ---- compressors -----------------------------------------------------------------------------------------

struct CompState {
  float* pend_kv;
  float* pend_gate;
  float* prev_kv;
  float* prev_gate;
};

__device__ __forceinline__ CompState StateOf(const CompArgs& a, const CacheDev& c, int32_t slot) {
  CompState s;
  s.pend_kv = SlotPtr<float>(c, slot, a.pend_kv_off);
  s.pend_gate = SlotPtr<float>(c, slot, a.pend_gate_off);
  s.prev_kv = a.overlap ? SlotPtr<float>(c, slot, a.prev_kv_off) : nullptr;
  s.prev_gate = a.overlap ? SlotPtr<float>(c, slot, a.prev_gate_off) : nullptr;
  return s;
}

// Where channel `half + c` of the token at position q comes from: kv[c] and gate[c] (+ ape[c] when ape is set):
// this pass's rows, the window that was open when the pass began (pending), or - only for the overlap half of
// the window before that - the saved overlap state. Resolved once per token (32-bit positions), so the channel
// loops are plain loads.
struct TokSrc {
  const float* kv;
  const float* g;
  const float* ape;
};

__device__ __forceinline__ TokSrc SrcOf(const CompArgs& a, const StepSeq& sq, const CompState& st, int q, int half) {
  const int cw = a.coff() * a.dim;
  const int slot = q % a.rate;
  TokSrc t;
  if (q >= sq.start_pos) {
    const int64_t row = sq.begin + (q - sq.start_pos);
    t.kv = a.ckv + row * a.ld + half;
    t.g = a.cg + row * a.ld + half;
    t.ape = a.ape + slot * cw + half;
  } else if (q >= (sq.start_pos / a.rate) * a.rate) {
    t.kv = st.pend_kv + slot * cw + half;
    t.g = st.pend_gate + slot * cw + half;
    t.ape = nullptr;
  } else {
    t.kv = st.prev_kv + slot * a.dim;
    t.g = st.prev_gate + slot * a.dim;
    t.ape = nullptr;
  }
  return t;
}

__device__ __forceinline__ float GateOf(const TokSrc& t, int c) { return t.ape ? t.g[c] + t.ape[c] : t.g[c]; }

// Emits window w of sequence sq (its pooled, normalised, roped entry), the whole block. `src` is shared memory
// for 2·rate token sources, `v` for dim floats. Ends with a barrier.
template <typename CacheT>
__device__ void EmitWindow(const CompArgs& a, const StepSeq& sq, const CompState& st, const CacheDev& cache, int w,
                           TokSrc* src, float* v, float* red) {
  const int cur_half = a.overlap ? a.dim : 0;
  const int nprev = a.overlap && w >= 1 ? a.rate : 0;  // the previous window's overlap half, then this one's
  const int ntok = nprev + a.rate;
  for (int t = threadIdx.x; t < ntok; t += blockDim.x) {
    src[t] = t < nprev ? SrcOf(a, sq, st, (w - 1) * a.rate + t, 0) : SrcOf(a, sq, st, w * a.rate + t - nprev, cur_half);
  }
  __syncthreads();
  float ss = 0.0f;
  for (int c = threadIdx.x; c < a.dim; c += blockDim.x) {
    float m = -INFINITY;
    for (int t = 0; t < ntok; ++t) m = fmaxf(m, GateOf(src[t], c));
    float denom = 0.0f, acc = 0.0f;
    for (int t = 0; t < ntok; ++t) {
      const float e = expf(GateOf(src[t], c) - m);
      denom += e;
      acc += e * src[t].kv[c];
    }
    const float pooled = acc / denom;
    v[c] = pooled;
    ss = fmaf(pooled, pooled, ss);
  }
  ss = BlockSum(ss, red);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(a.dim) + a.eps);
  for (int c = threadIdx.x; c < a.dim; c += blockDim.x) v[c] = v[c] * inv * a.norm_w[c];
  __syncthreads();
  const int base = a.dim - a.rope_dim;
  const float p = static_cast<float>(static_cast<int64_t>(w) * a.rate);
  for (int i = threadIdx.x; i < a.rope_dim / 2; i += blockDim.x) {
    const float ang = p * a.inv_freq[i];
    const float cs = cosf(ang), sn = sinf(ang);
    const float x0 = v[base + 2 * i], x1 = v[base + 2 * i + 1];
    v[base + 2 * i] = x0 * cs - x1 * sn;
    v[base + 2 * i + 1] = x1 * cs + x0 * sn;
  }
  __syncthreads();
  CacheT* entry = EntryPtr<CacheT>(cache, sq.slot, a.page_off, a.epp, a.dim, w);
  for (int c = threadIdx.x; c < a.dim; c += blockDim.x) entry[c] = FromF32<CacheT>(v[c]);
  __syncthreads();
}

// After the emissions: the overlap half of the last window closed in this pass, and the tokens of the window
// left open. Each thread owns (slot, channel) pairs, so reads of the old pending values precede their
// overwrite in the same thread.
__device__ void UpdateState(const CompArgs& a, const StepSeq& sq, const CompState& st) {
  const int start = sq.start_pos, end = start + (sq.end - sq.begin);
  const int cw = a.coff() * a.dim;
  const bool closed = end / a.rate > start / a.rate;
  const int last = end / a.rate - 1;
  const int open_start = (end / a.rate) * a.rate;
  for (int t = 0; t < a.rate; ++t) {  // block-uniform skip of the slots this pass leaves alone
    const int q = open_start + t;
    const bool pend = q < end && q >= start;
    const bool prev = a.overlap && closed;
    if (!pend && !prev) continue;
    const TokSrc ps = prev ? SrcOf(a, sq, st, last * a.rate + t, 0) : TokSrc{};
    const int64_t row = sq.begin + (q - start);
    for (int c = threadIdx.x; c < cw; c += blockDim.x) {
      if (prev && c < a.dim) {
        const float kv = ps.kv[c], g = GateOf(ps, c);
        st.prev_kv[t * a.dim + c] = kv;
        st.prev_gate[t * a.dim + c] = g;
      }
      if (pend) {
        st.pend_kv[t * cw + c] = a.ckv[row * a.ld + c];
        st.pend_gate[t * cw + c] = a.cg[row * a.ld + c] + a.ape[t * cw + c];
      }
    }
  }
}

// Dynamic shared memory of the compressor kernels: 2·rate token sources, then dim floats.
size_t CompSmem(const CompJobs& j) {
  size_t most = 0;
  for (int i = 0; i < j.count; ++i) {
    const CompArgs& a = j.c[i];
    most = std::max(most, static_cast<size_t>(2 * a.rate) * sizeof(TokSrc) + static_cast<size_t>(a.dim) * sizeof(float));
  }
  return most;
}

// Block (sequence, window, compressor).
template <typename CacheT>
__global__ void CompEmitKernel(CompJobs j, StepDev s, CacheDev cache) {
  extern __shared__ float4 comp_smem[];
  __shared__ float red[32];
  const CompArgs& a = j.c[blockIdx.z];
  TokSrc* src = reinterpret_cast<TokSrc*>(comp_smem);
  float* v = reinterpret_cast<float*>(src + 2 * a.rate);
  const StepSeq sq = s.seqs[blockIdx.x];
  const int start = sq.start_pos, end = start + (sq.end - sq.begin);
  const int w = start / a.rate + static_cast<int>(blockIdx.y);
  if (w >= end / a.rate) return;
  EmitWindow<CacheT>(a, sq, StateOf(a, cache, sq.slot), cache, w, src, v, red);
}

// Block (sequence, compressor).
__global__ void CompUpdateKernel(CompJobs j, StepDev s, CacheDev cache) {
  const CompArgs& a = j.c[blockIdx.y];
  const StepSeq sq = s.seqs[blockIdx.x];
  UpdateState(a, sq, StateOf(a, cache, sq.slot));
}

// Passes that close at most one window per sequence (decode): block (sequence, compressor) emits it, if any,
// and then updates the state - one launch for a layer's compressors.
template <typename CacheT>
__global__ void CompStepKernel(CompJobs j, StepDev s, CacheDev cache) {
  extern __shared__ float4 comp_smem[];
  __shared__ float red[32];
  const CompArgs& a = j.c[blockIdx.y];
  TokSrc* src = reinterpret_cast<TokSrc*>(comp_smem);
  float* v = reinterpret_cast<float*>(src + 2 * a.rate);
  const StepSeq sq = s.seqs[blockIdx.x];
  const CompState st = StateOf(a, cache, sq.slot);
  const int start = sq.start_pos, end = start + (sq.end - sq.begin);
  if (end / a.rate > start / a.rate) EmitWindow<CacheT>(a, sq, st, cache, start / a.rate, src, v, red);
  UpdateState(a, sq, st);
}

// ---- indexer ---------------------------------------------------------------------------------------------

constexpr int kMaxIndexHeads = 64;
// One block scores groups of kScoreEntries compressed entries (a warp's lanes) of one row; its kScoreWarps warps
// split the heads (kHeadsPerWarp each) and their partial sums are added in warp order, so a score does not
// depend on the launch. Short rows still spread over many blocks: at 4K context a CSA row has 1024 entries = 32
// groups.
constexpr int kScoreEntries = 32;
constexpr int kScoreWarps = 8;
constexpr int kScoreThreads = kScoreEntries * kScoreWarps;
constexpr int kHeadsPerWarp = kMaxIndexHeads / kScoreWarps;

template <typename CacheT>
__global__ void __launch_bounds__(kScoreThreads, 2) IndexScoreKernel(IndexArgs a, StepDev s, CacheDev cache, int64_t r0,
                                                                  int groups, float* scores, int64_t lds) {
  extern __shared__ float4 smem4[];
  float* qs = reinterpret_cast<float*>(smem4);
  float* ws = qs + a.ih * a.id;
  float* part = ws + a.ih;  // [kScoreWarps][kScoreEntries]
  const int64_t r = r0 + blockIdx.x;
  const int64_t p = s.pos[r];
  const int64_t vis = (p + 1) / a.rate;
  const int64_t g0 = static_cast<int64_t>(blockIdx.y) * groups;  // this block's first group of kScoreEntries
  if (g0 * kScoreEntries >= vis) return;
  const float wscale = 1.0f / sqrtf(static_cast<float>(a.ih));
  {  // 16-byte loads, unrolled: one row's queries (up to 32 KiB) must not be a chain of dependent round trips
    const float4* src = reinterpret_cast<const float4*>(a.iq + r * a.ldq);
    float4* dst = reinterpret_cast<float4*>(qs);
#pragma unroll 8
    for (int i = threadIdx.x; i < a.ih * a.id / 4; i += blockDim.x) dst[i] = src[i];
  }
  for (int h = threadIdx.x; h < a.ih; h += blockDim.x) ws[h] = a.iw[r * a.ldw + h] * wscale;
  const int warp = threadIdx.x / kScoreEntries, lane = threadIdx.x % kScoreEntries;
  const int h0 = warp * kHeadsPerWarp;
  const int32_t slot = s.seqs[s.seq[r]].slot;
  // Several groups per block (many rows): the row's queries are loaded once for all of them.
  for (int64_t g = g0; g < g0 + groups && g * kScoreEntries < vis; ++g) {
    __syncthreads();  // the queries are in; the previous group's partial sums are read
    const int64_t e = g * kScoreEntries + lane;
    float partial = 0.0f;
    if (e < vis && h0 < a.ih) {
      const CacheT* k = EntryPtr<CacheT>(cache, slot, a.page_off, a.epp, a.id, e);
      float acc[kHeadsPerWarp];
#pragma unroll
      for (int j = 0; j < kHeadsPerWarp; ++j) acc[j] = 0.0f;
      // The key in chunks of kKeyChunk channels whose loads are all issued before the first is used (one round
      // trip per chunk instead of one per 4 channels: the loop used to be a chain of dependent memory latencies).
      constexpr int kKeyChunk = 32;
      for (int d0 = 0; d0 < a.id; d0 += kKeyChunk) {
        float4 kv[kKeyChunk / 4];
#pragma unroll
        for (int u = 0; u < kKeyChunk / 4; ++u) {
          kv[u] = d0 + 4 * u < a.id ? Load4(k, d0 + 4 * u) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < kKeyChunk / 4; ++u) {
          const int d = d0 + 4 * u;
          if (d >= a.id) break;
#pragma unroll
          for (int j = 0; j < kHeadsPerWarp; ++j) {
            if (h0 + j < a.ih) {
              const float4 q = *reinterpret_cast<const float4*>(qs + (h0 + j) * a.id + d);
              acc[j] = fmaf(q.x, kv[u].x, fmaf(q.y, kv[u].y, fmaf(q.z, kv[u].z, fmaf(q.w, kv[u].w, acc[j]))));
            }
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kHeadsPerWarp; ++j) {
        if (h0 + j < a.ih) partial += ws[h0 + j] * fmaxf(acc[j], 0.0f);
      }
    }
    part[warp * kScoreEntries + lane] = partial;
    __syncthreads();
    if (warp == 0 && e < vis) {
      float score = 0.0f;
#pragma unroll
      for (int w = 0; w < kScoreWarps; ++w) score += part[w * kScoreEntries + lane];
      scores[blockIdx.x * lds + e] = score * (1.0f / sqrtf(static_cast<float>(a.id)));
    }
  }
}

__device__ __forceinline__ uint32_t OrderKey(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exact top-k per row: a 4-pass radix select finds the k-th largest key; larger keys are taken in any
// order, equal keys in increasing entry order (the CPU's tie-break: lower index first).
constexpr int64_t kTopKSmemEntries = 24576;  // 96 KiB: scores up to ~98K tokens of context stay on chip

__global__ void __launch_bounds__(256) TopKKernel(const float* scores, int64_t lds, StepDev s, int64_t r0, int rate,
                                                  int topk, int32_t* sel, bool use_smem) {
  extern __shared__ float sc_s[];
  __shared__ uint32_t hist[256];
  __shared__ uint32_t s_prefix, s_mask;
  __shared__ int s_krem, s_cnt;
  __shared__ int warp_tot[32];
  const int64_t r = r0 + blockIdx.x;
  const int64_t vis = (s.pos[r] + 1) / rate;
  int32_t* out = sel + r * topk;
  const float* sc = scores + blockIdx.x * lds;
  if (vis <= topk) {
    for (int64_t e = threadIdx.x; e < vis; e += blockDim.x) out[e] = static_cast<int32_t>(e);
    return;
  }
  if (use_smem) {  // the radix passes read the scores six times
#pragma unroll 8
    for (int64_t e = threadIdx.x; e < vis; e += blockDim.x) sc_s[e] = sc[e];
    __syncthreads();
    sc = sc_s;
  }
  if (threadIdx.x == 0) {
    s_prefix = 0;
    s_mask = 0;
    s_krem = topk;
  }
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    const uint32_t prefix = s_prefix, mask = s_mask;
    for (int64_t e = threadIdx.x; e < vis; e += blockDim.x) {
      const uint32_t key = OrderKey(sc[e]);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    {
      // Find the bin holding the k-th largest key: an inclusive scan over the bins in descending order, one
      // bin per thread (blockDim == 256); exactly one thread sees the running count cross s_krem.
      const int b = 255 - static_cast<int>(threadIdx.x);
      const int v = static_cast<int>(hist[b]);
      const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
      int x = v;
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
      }
      if (lane == 31) warp_tot[warp] = x;
      __syncthreads();
      int off = 0;
      for (int i = 0; i < warp; ++i) off += warp_tot[i];
      const int incl = x + off, excl = incl - v;
      const int krem_now = s_krem;
      __syncthreads();
      if (excl < krem_now && incl >= krem_now) {
        s_prefix = prefix | (static_cast<uint32_t>(b) << shift);
        s_mask = mask | (255u << shift);
        s_krem = krem_now - excl;
      }
    }
    __syncthreads();
  }
  const uint32_t kth = s_prefix;
  const int krem = s_krem;
  if (threadIdx.x == 0) s_cnt = 0;
  __syncthreads();
  for (int64_t e = threadIdx.x; e < vis; e += blockDim.x) {
    if (OrderKey(sc[e]) > kth) out[atomicAdd(&s_cnt, 1)] = static_cast<int32_t>(e);
  }
  __syncthreads();
  const int base = s_cnt;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  int taken = 0;
  for (int64_t e0 = 0; e0 < vis && taken < krem; e0 += blockDim.x) {
    const int64_t e = e0 + threadIdx.x;
    const bool flag = e < vis && OrderKey(sc[e]) == kth;
    const uint32_t ballot = __ballot_sync(0xffffffffu, flag);
    const int lpre = __popc(ballot & ((1u << lane) - 1u));
    if (lane == 0) warp_tot[warp] = __popc(ballot);
    __syncthreads();
    int off = 0, total = 0;
    for (int i = 0; i < nw; ++i) {
      if (i < warp) off += warp_tot[i];
      total += warp_tot[i];
    }
    if (flag && taken + off + lpre < krem) out[base + taken + off + lpre] = static_cast<int32_t>(e);
    taken += total;
    __syncthreads();
  }
}

// ---- attention -------------------------------------------------------------------------------------------

// The keys (= values, MQA) row r attends to, in order: the window (ring entries, then this pass's rows; for
// DSpark draft blocks the ring before the sequence and all of its rows) and the compressed entries (all
// visible ones for HCA, the selected ones for CSA). Both attention kernels take their keys from here.
template <typename CacheT>
struct RowKeys {
  const CacheT* ring;
  const CacheT* kv_new;
  StepSeq sq;
  int64_t p, nring, nwin, nk;

  __device__ __forceinline__ RowKeys(const AttnArgs& a, const StepDev& s, const CacheDev& cache, int64_t r) {
    p = s.pos[r];
    sq = s.seqs[s.seq[r]];
    nring = a.bidir ? min(static_cast<int64_t>(a.window), static_cast<int64_t>(sq.start_pos)) : 0;
    nwin = a.bidir ? nring + (sq.end - sq.begin) : min(static_cast<int64_t>(a.window), p + 1);
    int64_t ncomp = 0;
    if (a.type == 2) ncomp = (p + 1) / a.rate;
    if (a.type == 1) ncomp = min(static_cast<int64_t>(a.topk), (p + 1) / a.rate);
    nk = nwin + ncomp;
    ring = SlotPtr<CacheT>(cache, sq.slot, a.ring_off);
    kv_new = static_cast<const CacheT*>(a.kv_new);
  }
  // Key j < nk of row r.
  __device__ __forceinline__ const CacheT* Ptr(const AttnArgs& a, const CacheDev& cache, int64_t r, int64_t j) const {
    const int hd = a.hd;
    if (a.bidir) {
      return j < nring ? ring + ((sq.start_pos - nring + j) % a.window) * hd : kv_new + (sq.begin + j - nring) * hd;
    }
    if (j < nwin) {
      const int64_t kpos = p - nwin + 1 + j;
      return kpos >= sq.start_pos ? kv_new + (sq.begin + (kpos - sq.start_pos)) * hd : ring + (kpos % a.window) * hd;
    }
    const int64_t jj = j - nwin;
    const int64_t e = a.type == 2 ? jj : a.sel[r * a.topk + jj];
    return EntryPtr<CacheT>(cache, sq.slot, a.page_off, a.epp, hd, e);
  }
};

constexpr int kKT = 64;      // keys per tile
constexpr int kMaxHG = 8;    // heads per block
constexpr int kAttnThreads = 256;
static_assert(kMaxHG == 8, "WarpSumScatter8 and LoadProbs hold 8 heads");

// Where the score tile starts after the HG heads' queries [HG][hd] (floats, rounded up to 16 bytes).
__host__ __device__ constexpr int64_t AttnScoreOffset(int HG, int hd) {
  return (static_cast<int64_t>(HG) * hd + 3) / 4 * 4;
}
__device__ __forceinline__ void LoadProbs(const float* p, float (&pv)[kMaxHG]) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  pv[0] = a.x; pv[1] = a.y; pv[2] = a.z; pv[3] = a.w;
  pv[4] = b.x; pv[5] = b.y; pv[6] = b.z; pv[7] = b.w;
}

// Sum of v[0..7] over the warp, scattered: lane l ends with the total of head ((l >> 4) & 1) * 4 +
// ((l >> 3) & 1) * 2 + ((l >> 2) & 1) (9 shuffles instead of 8 x 5). The order of additions is fixed.
__device__ __forceinline__ float WarpSumScatter8(const float (&v)[kMaxHG], int lane) {
  const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
  float w[4], x[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float send = b4 ? v[i] : v[i + 4], keep = b4 ? v[i + 4] : v[i];
    w[i] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float send = b3 ? w[i] : w[i + 2], keep = b3 ? w[i + 2] : w[i];
    x[i] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
  }
  float y = (b2 ? x[1] : x[0]) + __shfl_xor_sync(0xffffffffu, b2 ? x[0] : x[1], 4);
  y += __shfl_xor_sync(0xffffffffu, y, 2);
  return y + __shfl_xor_sync(0xffffffffu, y, 1);
}

// One block per (row, group of HG heads, key split). Keys (= values) are shared by all heads (MQA), so each
// key is read once per block for HG heads. Online softmax over tiles of kKT keys; the tile's scores and
// probabilities live in shared memory key-major (ps[key * kMaxHG + head]), so the value pass reads a key's
// eight probabilities as two broadcast float4s. With splits == 1 the block folds in the sink, normalises,
// de-ropes and writes the output; with splits > 1 it writes (max, sum, unnormalised accumulator) for
// AttnCombineKernel, which spreads decode rows over the whole GPU.
template <typename CacheT>
__global__ void __launch_bounds__(kAttnThreads) AttnKernel(AttnArgs a, StepDev s, CacheDev cache, int HG, int splits,
                                                           float* part) {
  extern __shared__ float4 smem4[];
  float* qs = reinterpret_cast<float*>(smem4);
  float* ps = qs + AttnScoreOffset(HG, a.hd);  // [kKT][kMaxHG], 16-byte aligned
  __shared__ const CacheT* kp[kKT];
  __shared__ float m_s[kMaxHG], l_s[kMaxHG], al_s[kMaxHG];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t r = blockIdx.x;
  const int h0 = blockIdx.y * HG;
  const int z = blockIdx.z;
  const RowKeys<CacheT> rk(a, s, cache, r);
  const int64_t p = rk.p, nk = rk.nk;
  const int64_t per = (nk + splits - 1) / splits;
  const int64_t jb = min(nk, z * per), je = min(nk, jb + per);
  const int hd = a.hd;
  {
    const float* src = a.q + r * a.ldq + static_cast<int64_t>(h0) * hd;
    if ((HG * hd) % 4 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0) {  // 16-byte loads, all in flight
      const float4* src4 = reinterpret_cast<const float4*>(src);
      float4* qs4 = reinterpret_cast<float4*>(qs);
#pragma unroll 8
      for (int i = tid; i < HG * hd / 4; i += blockDim.x) qs4[i] = __ldg(src4 + i);
    } else {
#pragma unroll 4
      for (int i = tid; i < HG * hd; i += blockDim.x) qs[i] = src[i];
    }
  }
  if (tid < HG) {
    // Without splits the sink is folded in up front: exp(sink - m) = 1 with m = sink.
    m_s[tid] = splits == 1 ? a.sink[h0 + tid] : -INFINITY;
    l_s[tid] = splits == 1 ? 1.0f : 0.0f;
  }
  float acc[kMaxHG][2];
#pragma unroll
  for (int h = 0; h < kMaxHG; ++h) acc[h][0] = acc[h][1] = 0.0f;
  __syncthreads();
  for (int64_t j0 = jb; j0 < je; j0 += kKT) {
    if (tid < kKT) {
      const int64_t j = j0 + tid;
      const CacheT* kj = j < je ? rk.Ptr(a, cache, r, j) : nullptr;
      kp[tid] = kj;
      // Every key of the tile on its way into L2 at once, so that the warps' dot products (a key at a time)
      // do not each wait for memory.
      if (kj != nullptr) {
        for (int64_t b = 0; b < static_cast<int64_t>(hd) * sizeof(CacheT); b += 128) {
          asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(kj) + b));
        }
      }
    }
    __syncthreads();
    const int jn = static_cast<int>(min(static_cast<int64_t>(kKT), je - j0));
    // A warp takes two keys at a time (jj and jj + 8: both loads in flight), each summed as on its own.
    constexpr int kWarps = kAttnThreads / 32;
    static_assert(kKT % (2 * kWarps) == 0, "two keys per warp and pass");
    for (int jj = warp; jj < kKT; jj += 2 * kWarps) {
      const int jb2 = jj + kWarps;
      if (jj < jn) {
        const bool second = jb2 < jn;
        float dot[2][kMaxHG];
#pragma unroll
        for (int h = 0; h < kMaxHG; ++h) dot[0][h] = dot[1][h] = 0.0f;
        const CacheT* k = kp[jj];
        const CacheT* k_b = second ? kp[jb2] : k;  // (without a second key: the first again, its sums unused)
#pragma unroll 4
        for (int d = 2 * lane; d < hd; d += 64) {
          const float2 k2 = Load2(k, d), kb2 = Load2(k_b, d);
#pragma unroll
          for (int h = 0; h < kMaxHG; ++h) {
            if (h < HG) {
              const float2 q2 = *reinterpret_cast<const float2*>(qs + h * hd + d);
              dot[0][h] = fmaf(q2.x, k2.x, fmaf(q2.y, k2.y, dot[0][h]));
              dot[1][h] = fmaf(q2.x, kb2.x, fmaf(q2.y, kb2.y, dot[1][h]));
            }
          }
        }
        const float total = WarpSumScatter8(dot[0], lane), total_b = WarpSumScatter8(dot[1], lane);
        const int h = ((lane >> 4) & 1) * 4 + ((lane >> 3) & 1) * 2 + ((lane >> 2) & 1);
        if ((lane & 3) == 0 && h < HG) {
          ps[jj * kMaxHG + h] = total * a.scale;
          if (second) ps[jb2 * kMaxHG + h] = total_b * a.scale;
        }
        if (!second && lane < HG) ps[jb2 * kMaxHG + lane] = -INFINITY;
      } else if (lane < HG) {
        ps[jj * kMaxHG + lane] = -INFINITY;
        ps[jb2 * kMaxHG + lane] = -INFINITY;
      }
    }
    __syncthreads();
    if (warp < HG) {
      const int h = warp;
      const float v0 = ps[lane * kMaxHG + h], v1 = ps[(lane + 32) * kMaxHG + h];
      const float m_old = m_s[h];
      const float m_new = fmaxf(m_old, WarpMax(fmaxf(v0, v1)));
      const float ms = m_new == -INFINITY ? 0.0f : m_new;  // no (-inf) - (-inf) when nothing is visible yet
      const float e0 = expf(v0 - ms), e1 = expf(v1 - ms);
      ps[lane * kMaxHG + h] = e0;
      ps[(lane + 32) * kMaxHG + h] = e1;
      const float sum = WarpSum(e0 + e1);
      if (lane == 0) {
        const float alpha = expf(m_old - ms);
        al_s[h] = alpha;
        l_s[h] = l_s[h] * alpha + sum;
        m_s[h] = m_new;
      }
    }
    __syncthreads();
    if (2 * tid < hd) {
#pragma unroll
      for (int h = 0; h < kMaxHG; ++h) {
        if (h < HG) {
          acc[h][0] *= al_s[h];
          acc[h][1] *= al_s[h];
        }
      }
      int jj = 0;
      for (; jj + 4 <= jn; jj += 4) {  // four independent loads in flight
        float2 k2[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) k2[u] = Load2(kp[jj + u], 2 * tid);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          float pv[kMaxHG];
          LoadProbs(ps + (jj + u) * kMaxHG, pv);
#pragma unroll
          for (int h = 0; h < kMaxHG; ++h) {
            if (h < HG) {
              acc[h][0] = fmaf(pv[h], k2[u].x, acc[h][0]);
              acc[h][1] = fmaf(pv[h], k2[u].y, acc[h][1]);
            }
          }
        }
      }
      for (; jj < jn; ++jj) {
        const float2 k2 = Load2(kp[jj], 2 * tid);
        float pv[kMaxHG];
        LoadProbs(ps + jj * kMaxHG, pv);
#pragma unroll
        for (int h = 0; h < kMaxHG; ++h) {
          if (h < HG) {
            acc[h][0] = fmaf(pv[h], k2.x, acc[h][0]);
            acc[h][1] = fmaf(pv[h], k2.y, acc[h][1]);
          }
        }
      }
    }
    __syncthreads();
  }
  if (splits > 1) {
    const int64_t stride = hd + 2;
    for (int h = 0; h < HG; ++h) {
      float* dst = part + ((r * a.heads + h0 + h) * splits + z) * stride;
      if (tid == 0) {
        dst[0] = m_s[h];
        dst[1] = l_s[h];
      }
      if (2 * tid < hd) {
        dst[2 + 2 * tid] = acc[h][0];
        dst[3 + 2 * tid] = acc[h][1];
      }
    }
    return;
  }
  if (2 * tid < hd) {
    const int d = 2 * tid, base = hd - a.rope_dim;
    float cs = 1.0f, sn = 0.0f;
    if (d >= base) {
      const float ang = static_cast<float>(p) * a.inv_freq[(d - base) / 2];
      cs = cosf(ang);
      sn = sinf(ang);
    }
#pragma unroll
    for (int h = 0; h < kMaxHG; ++h) {
      if (h < HG) {
        const float o0 = acc[h][0] / l_s[h], o1 = acc[h][1] / l_s[h];
        float* dst = a.out + r * a.ldo + static_cast<int64_t>(h0 + h) * hd + d;
        if (d >= base) {  // de-rotate by the query position: angle -> -angle
          dst[0] = o0 * cs + o1 * sn;
          dst[1] = o1 * cs - o0 * sn;
        } else {
          dst[0] = o0;
          dst[1] = o1;
        }
      }
    }
  }
}

// Merges the key splits of one (row, head) with the sink, normalises and de-ropes. Block (r, h, c) writes dims
// [c·kCombineDims, ...): at one row the 64 heads x 4 dim slices fill the GPU instead of 64 blocks.
constexpr int kCombineThreads = 64;
constexpr int kCombineDims = 2 * kCombineThreads;
__global__ void __launch_bounds__(kCombineThreads) AttnCombineKernel(AttnArgs a, StepDev s, int splits,
                                                                      const float* part) {
  const int64_t r = blockIdx.x;
  const int h = blockIdx.y;
  const int hd = a.hd;
  const int64_t stride = hd + 2;
  const float* base_p = part + (r * a.heads + h) * splits * stride;
  __shared__ float w_s[64];
  __shared__ float L_s;
  if (threadIdx.x < 32) {  // one warp folds the splits' (max, sum) pairs with the sink
    const int z = threadIdx.x;
    float mz = -INFINITY, lz = 0.0f, mz2 = -INFINITY, lz2 = 0.0f;
    if (z < splits) {
      mz = base_p[z * stride];
      lz = base_p[z * stride + 1];
    }
    if (z + 32 < splits) {
      mz2 = base_p[(z + 32) * stride];
      lz2 = base_p[(z + 32) * stride + 1];
    }
    const float M = fmaxf(a.sink[h], WarpMax(fmaxf(mz, mz2)));
    const float w1 = expf(mz - M), w2 = expf(mz2 - M);
    if (z < splits) w_s[z] = w1;
    if (z + 32 < splits) w_s[z + 32] = w2;
    const float L = WarpSum(lz * w1 + lz2 * w2) + expf(a.sink[h] - M);
    if (z == 0) L_s = L;
  }
  __syncthreads();
  const float L = L_s;
  const int64_t p = s.pos[r];
  const int rbase = hd - a.rope_dim;
  for (int d = blockIdx.z * kCombineDims + 2 * threadIdx.x; d < hd; d += kCombineDims * gridDim.z) {
    float o0 = 0.0f, o1 = 0.0f;
    int z = 0;
    for (; z + 4 <= splits; z += 4) {  // four splits' loads in flight
      float2 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        // exp(-inf) = 0 for empty splits: nothing to add, and nothing read (the tensor-core kernel leaves
        // empty splits' sums unwritten)
        v[u] = w_s[z + u] != 0.0f ? *reinterpret_cast<const float2*>(base_p + (z + u) * stride + 2 + d)
                                  : make_float2(0.0f, 0.0f);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        o0 = fmaf(w_s[z + u], v[u].x, o0);
        o1 = fmaf(w_s[z + u], v[u].y, o1);
      }
    }
    for (; z < splits; ++z) {
      const float w = w_s[z];
      if (w == 0.0f) continue;
      o0 = fmaf(w, base_p[z * stride + 2 + d], o0);
      o1 = fmaf(w, base_p[z * stride + 3 + d], o1);
    }
    o0 /= L;
    o1 /= L;
    float* dst = a.out + r * a.ldo + static_cast<int64_t>(h) * hd + d;
    if (d >= rbase) {
      const float ang = static_cast<float>(p) * a.inv_freq[(d - rbase) / 2];
      const float cs = cosf(ang), sn = sinf(ang);
      dst[0] = o0 * cs + o1 * sn;
      dst[1] = o1 * cs - o0 * sn;
    } else {
      dst[0] = o0;
      dst[1] = o1;
    }
  }
}

// ---- attention on tensor cores (bf16 caches, head_dim 512) ------------------------------------------------
//
// One block per (row, group of HB = 64 or 32 heads, key split), 8 warps: each key tile is read from memory
// once per HB heads (once per row at 64 local heads). Per tile of KT keys, double-buffered with cp.async:
//   scores  S[HB, KT] = Q·Kᵀ · scale   (mma m16n8k16: Q rounded to bf16 once, K bf16 as cached, fp32 sums)
//   online softmax per head, the probabilities rounded to bf16 (their sum is taken of the rounded values)
//   output  O[HB, 512] += P·V          (V = K: the same shared tile, read transposed by ldmatrix)
// Warp (wm, wn) owns heads wm·16.. in both passes, keys wn·16.. of the score tile and output dims wn·DW...
// The shared tiles are [rows][512] bf16 with the 16-byte chunk index XOR (row & 7), so the 8 row addresses
// of an ldmatrix fall in distinct banks. Splits and the sink follow AttnKernel (AttnCombineKernel merges).
constexpr int kMmaHd = 512;
constexpr int kMmaThreads = 256;
constexpr int kMmaChunks = kMmaHd / 8;  // 16-byte chunks per bf16 row
constexpr int kMmaGroupTiles = 8;        // key tiles whose addresses are looked up together

template <int HB>
struct MmaAttnShape {
  static constexpr int WM = HB / 16;             // warps along the heads
  static constexpr int WN = kMmaThreads / 32 / WM;  // warps along the tile's keys (scores) and dims (output)
  static constexpr int KT = 16 * WN;             // keys per tile: 16 per warp in the score pass
  static constexpr int DW = kMmaHd / WN;         // output dims per warp
  static constexpr int NT = DW / 8;              // mma n-tiles per warp in the value pass
  static constexpr int SLD = KT + 4;             // fp32 stride of the score tile
  static constexpr int PLD = KT + 8;             // bf16 stride of the probability tile (80 or 144 bytes)
  static constexpr int TPH = kMmaThreads / HB;   // softmax threads per head (one warp's consecutive lanes)
  static constexpr int KPT = KT / TPH;           // keys per softmax thread
  static constexpr size_t kQ = static_cast<size_t>(HB) * kMmaHd * 2;
  static constexpr size_t kK = static_cast<size_t>(KT) * kMmaHd * 2;
  static constexpr size_t kS = static_cast<size_t>(HB) * SLD * 4;
  static constexpr size_t kP = static_cast<size_t>(HB) * PLD * 2;
  static constexpr size_t kSmem = kQ + 2 * kK + kS + kP;  // dynamic
  static constexpr size_t kStatic = 2 * kMmaGroupTiles * KT * sizeof(void*) + 3 * HB * sizeof(float);
  static_assert(HB == 32 || HB == 64, "16 heads per warp row, 8 warps");
  static_assert(KPT == 8, "a softmax thread writes its probabilities as one 16-byte store");
  static_assert(NT % 2 == 0, "value fragments are loaded for two n-tiles at a time");
};

// Element offset of (row, 16-byte chunk) in a swizzled [rows][512] bf16 tile.
__device__ __forceinline__ int Swz(int row, int chunk) { return row * kMmaHd + ((chunk ^ (row & 7)) << 3); }

template <int HB>
__global__ void __launch_bounds__(kMmaThreads, 1) AttnMmaKernel(AttnArgs a, StepDev s, CacheDev cache, int splits,
                                                                float* part) {
  using Sh = MmaAttnShape<HB>;
  constexpr int KT = Sh::KT;
  extern __shared__ float4 smem4[];
  char* smem = reinterpret_cast<char*>(smem4);
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* ks = reinterpret_cast<__nv_bfloat16*>(smem + Sh::kQ);  // [2][KT][512]
  float* ss = reinterpret_cast<float*>(smem + Sh::kQ + 2 * Sh::kK);
  __nv_bfloat16* ps = reinterpret_cast<__nv_bfloat16*>(smem + Sh::kQ + 2 * Sh::kK + Sh::kS);
  // Key addresses, a group of kMmaGroupTiles tiles at a time, double-buffered: every thread looks up its
  // share of a group at once (the selection and page-table reads of 256 or 512 keys in flight together, a
  // group ahead), instead of one warp stalling the block on them every tile.
  constexpr int GK = kMmaGroupTiles * KT;
  __shared__ const __nv_bfloat16* kp[2][GK];
  __shared__ float m_s[HB], l_s[HB], al_s[HB];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp % Sh::WM, wn = warp / Sh::WM;
  const int g = lane >> 2, tq = lane & 3;   // mma fragment row / column pair
  const int mi = lane >> 3, mr = lane & 7;  // ldmatrix: which matrix this lane addresses, and its row
  const int64_t r = blockIdx.x;
  const int h0 = blockIdx.y * HB;
  const int z = blockIdx.z;
  const RowKeys<__nv_bfloat16> rk(a, s, cache, r);
  const int64_t nk = rk.nk;
  const int64_t per = ((nk + splits - 1) / splits + KT - 1) / KT * KT;  // whole tiles per split
  const int64_t jb = min(nk, z * per), je = min(nk, jb + per);
  const int ntiles = static_cast<int>((je - jb + KT - 1) / KT);
  if (ntiles == 0) {  // an empty split (short rows): weight 0 in the combine, which then skips its accumulator
    if (tid < HB) {
      float* dst = part + ((r * a.heads + h0 + tid) * splits + z) * (kMmaHd + 2);
      dst[0] = -INFINITY;
      dst[1] = 0.0f;
    }
    return;
  }
  auto lookup = [&](int group) {
#pragma unroll
    for (int i = tid; i < GK; i += kMmaThreads) {
      const int64_t j = jb + static_cast<int64_t>(group) * GK + i;
      kp[group & 1][i] = j < je ? rk.Ptr(a, cache, r, j) : nullptr;
    }
  };
  lookup(0);
  if (tid < HB) {
    m_s[tid] = splits == 1 ? a.sink[h0 + tid] : -INFINITY;  // unsplit: the sink folded in up front
    l_s[tid] = splits == 1 ? 1.0f : 0.0f;
  }
  __syncthreads();
  const __nv_bfloat16* zsrc = rk.kv_new;  // a valid address for the zero-filled copies past the last key
  auto load_tile = [&](int t) {
    __nv_bfloat16* dst = ks + (t & 1) * KT * kMmaHd;
    const __nv_bfloat16* const* ptrs = kp[(t / kMmaGroupTiles) & 1] + (t % kMmaGroupTiles) * KT;
#pragma unroll
    for (int i = tid; i < KT * kMmaChunks; i += kMmaThreads) {
      const int key = i / kMmaChunks, c = i % kMmaChunks;
      const __nv_bfloat16* src = ptrs[key];
      CpAsync16(dst + Swz(key, c), src != nullptr ? src + c * 8 : zsrc, src != nullptr);
    }
  };
  // Commit groups: tile 0, tile 1, then one per iteration t (tile t + 2, or empty); waiting for all but the
  // newest leaves tile t complete at iteration t.
  const bool q16 = a.q16 != nullptr;
  if (q16) {  // the queries already in bf16: copied with tile 0
    const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(a.q16) + r * a.heads * kMmaHd +
                               static_cast<int64_t>(h0) * kMmaHd;
#pragma unroll
    for (int i = tid; i < HB * kMmaChunks; i += kMmaThreads) {
      const int h = i / kMmaChunks, c = i % kMmaChunks;
      CpAsync16(qs + Swz(h, c), src + h * kMmaHd + c * 8, true);
    }
  }
  load_tile(0);
  CpAsyncCommit();
  if (ntiles > 1) load_tile(1);
  CpAsyncCommit();
  if (!q16) {  // this block's queries, rounded to bf16 once, while the first tiles are in flight (8 rows of
               // 16-byte loads per thread in flight)
    const float* src = a.q + r * a.ldq + static_cast<int64_t>(h0) * kMmaHd;
    constexpr int kPer = HB * kMmaChunks / kMmaThreads;  // chunks per thread: 16 or 8
    constexpr int kBatch = kPer < 8 ? kPer : 8;
#pragma unroll
    for (int b0 = 0; b0 < kPer; b0 += kBatch) {
      float4 x[kBatch][2];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int i = tid + (b0 + b) * kMmaThreads, h = i / kMmaChunks, c = i % kMmaChunks;
        x[b][0] = *reinterpret_cast<const float4*>(src + h * kMmaHd + c * 8);
        x[b][1] = *reinterpret_cast<const float4*>(src + h * kMmaHd + c * 8 + 4);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int i = tid + (b0 + b) * kMmaThreads, h = i / kMmaChunks, c = i % kMmaChunks;
        *reinterpret_cast<uint4*>(qs + Swz(h, c)) =
            make_uint4(PackBf16(x[b][0].x, x[b][0].y), PackBf16(x[b][0].z, x[b][0].w), PackBf16(x[b][1].x, x[b][1].y),
                       PackBf16(x[b][1].z, x[b][1].w));
      }
    }
  }
  float acc[Sh::NT][4];
#pragma unroll
  for (int nt = 0; nt < Sh::NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
  const int hrow = wm * 16;  // this warp's first head (in the block)
  for (int t = 0; t < ntiles; ++t) {
    // The next group's addresses: its first tile is issued at the end of iteration t + kMmaGroupTiles - 2;
    // the buffer's previous group was last read at the end of iteration t - 3.
    if (t % kMmaGroupTiles == 0 && (t / kMmaGroupTiles + 1) * kMmaGroupTiles < ntiles) {
      lookup(t / kMmaGroupTiles + 1);
    }
    CpAsyncWait<1>();
    __syncthreads();  // tile t (and, the first time, the queries) visible to every warp
    const __nv_bfloat16* kt = ks + (t & 1) * KT * kMmaHd;
    const int jn = static_cast<int>(min(static_cast<int64_t>(KT), je - (jb + static_cast<int64_t>(t) * KT)));
    {  // scores of heads hrow.. x keys wn·16..
      // Two sets of accumulators (even and odd k-steps, added at the end): four independent mma chains per
      // warp instead of two, the score pass being a chain of 32 dependent k-steps otherwise.
      float sc[2][4], sd[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
        sd[nt][0] = sd[nt][1] = sd[nt][2] = sd[nt][3] = 0.0f;
      }
      const int arow = hrow + (mi & 1) * 8 + mr, brow = wn * 16 + (mi >> 1) * 8 + mr;
#pragma unroll 4
      for (int kk = 0; kk < kMmaHd / 16; kk += 2) {
        uint32_t af[4], bf[4], ag[4], bg[4];
        Ldmatrix4(af, qs + Swz(arow, 2 * kk + (mi >> 1)));
        Ldmatrix4(bf, kt + Swz(brow, 2 * kk + (mi & 1)));
        Ldmatrix4(ag, qs + Swz(arow, 2 * kk + 2 + (mi >> 1)));
        Ldmatrix4(bg, kt + Swz(brow, 2 * kk + 2 + (mi & 1)));
        Mma(sc[0], af[0], af[1], af[2], af[3], bf[0], bf[1]);
        Mma(sc[1], af[0], af[1], af[2], af[3], bf[2], bf[3]);
        Mma(sd[0], ag[0], ag[1], ag[2], ag[3], bg[0], bg[1]);
        Mma(sd[1], ag[0], ag[1], ag[2], ag[3], bg[2], bg[3]);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[nt][e] += sd[nt][e];
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col = wn * 16 + nt * 8 + 2 * tq;
        float* s0 = ss + (hrow + g) * Sh::SLD + col;
        float* s1 = s0 + 8 * Sh::SLD;
        s0[0] = col < jn ? sc[nt][0] * a.scale : -INFINITY;
        s0[1] = col + 1 < jn ? sc[nt][1] * a.scale : -INFINITY;
        s1[0] = col < jn ? sc[nt][2] * a.scale : -INFINITY;
        s1[1] = col + 1 < jn ? sc[nt][3] * a.scale : -INFINITY;
      }
    }
    __syncthreads();
    {  // online softmax: Sh::TPH threads per head, Sh::KPT keys each
      const int hh = tid / Sh::TPH, q = tid % Sh::TPH;
      const float* srow = ss + hh * Sh::SLD + q * Sh::KPT;
      float v[Sh::KPT];
      float mx = -INFINITY;
#pragma unroll
      for (int k = 0; k < Sh::KPT; ++k) {
        v[k] = srow[k];
        mx = fmaxf(mx, v[k]);
      }
#pragma unroll
      for (int o = 1; o < Sh::TPH; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_old = m_s[hh];
      const float m_new = fmaxf(m_old, mx);
      const float ms = m_new == -INFINITY ? 0.0f : m_new;  // no (-inf) - (-inf) when nothing is visible yet
      uint32_t pk[Sh::KPT / 2];
      float sum = 0.0f;
#pragma unroll
      for (int k = 0; k < Sh::KPT / 2; ++k) {
        pk[k] = PackBf16(expf(v[2 * k] - ms), expf(v[2 * k + 1] - ms));
        const float2 pr = Bf16PairToF32(pk[k]);
        sum += pr.x + pr.y;
      }
      *reinterpret_cast<uint4*>(ps + hh * Sh::PLD + q * Sh::KPT) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
#pragma unroll
      for (int o = 1; o < Sh::TPH; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (q == 0) {
        const float alpha = expf(m_old - ms);
        al_s[hh] = alpha;
        l_s[hh] = l_s[hh] * alpha + sum;
        m_s[hh] = m_new;
      }
    }
    __syncthreads();
    {  // O[heads hrow.., dims wn·DW..] = alpha · O + P · V
      const float al0 = al_s[hrow + g], al1 = al_s[hrow + g + 8];
#pragma unroll
      for (int nt = 0; nt < Sh::NT; ++nt) {
        acc[nt][0] *= al0;
        acc[nt][1] *= al0;
        acc[nt][2] *= al1;
        acc[nt][3] *= al1;
      }
#pragma unroll
      for (int kk = 0; kk < KT / 16; ++kk) {
        uint32_t pf[4];
        Ldmatrix4(pf, ps + (hrow + (mi & 1) * 8 + mr) * Sh::PLD + kk * 16 + (mi >> 1) * 8);
        const int vrow = kk * 16 + (mi & 1) * 8 + mr;
#pragma unroll
        for (int np = 0; np < Sh::NT / 2; ++np) {
          uint32_t vf[4];
          Ldmatrix4Trans(vf, kt + Swz(vrow, (wn * Sh::DW + np * 16) / 8 + (mi >> 1)));
          Mma(acc[2 * np], pf[0], pf[1], pf[2], pf[3], vf[0], vf[1]);
          Mma(acc[2 * np + 1], pf[0], pf[1], pf[2], pf[3], vf[2], vf[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with tile t's buffer and the score tile
    if (t + 2 < ntiles) load_tile(t + 2);
    CpAsyncCommit();
  }
  const int ha = hrow + g, hb = ha + 8;  // this thread's two heads (in the block)
  if (splits > 1) {
    const int64_t stride = kMmaHd + 2;
    float* da = part + ((r * a.heads + h0 + ha) * splits + z) * stride + 2;
    float* db = part + ((r * a.heads + h0 + hb) * splits + z) * stride + 2;
#pragma unroll
    for (int nt = 0; nt < Sh::NT; ++nt) {
      const int d = wn * Sh::DW + nt * 8 + 2 * tq;
      da[d] = acc[nt][0];
      da[d + 1] = acc[nt][1];
      db[d] = acc[nt][2];
      db[d + 1] = acc[nt][3];
    }
    if (tid < HB) {
      float* dst = part + ((r * a.heads + h0 + tid) * splits + z) * stride;
      dst[0] = m_s[tid];
      dst[1] = l_s[tid];
    }
    return;
  }
  const float inva = 1.0f / l_s[ha], invb = 1.0f / l_s[hb];
  const int base = kMmaHd - a.rope_dim;
  float* oa = a.out + r * a.ldo + static_cast<int64_t>(h0 + ha) * kMmaHd;
  float* ob = a.out + r * a.ldo + static_cast<int64_t>(h0 + hb) * kMmaHd;
#pragma unroll
  for (int nt = 0; nt < Sh::NT; ++nt) {
    const int d = wn * Sh::DW + nt * 8 + 2 * tq;
    float a0 = acc[nt][0] * inva, a1 = acc[nt][1] * inva, b0 = acc[nt][2] * invb, b1 = acc[nt][3] * invb;
    if (d >= base) {  // de-rotate by the query position: angle -> -angle
      const float ang = static_cast<float>(rk.p) * a.inv_freq[(d - base) / 2];
      const float cs = cosf(ang), sn = sinf(ang);
      const float ta0 = a0 * cs + a1 * sn, ta1 = a1 * cs - a0 * sn;
      const float tb0 = b0 * cs + b1 * sn, tb1 = b1 * cs - b0 * sn;
      a0 = ta0, a1 = ta1, b0 = tb0, b1 = tb1;
    }
    oa[d] = a0;
    oa[d + 1] = a1;
    ob[d] = b0;
    ob[d + 1] = b1;
  }
}

template <typename CacheT>
__global__ void RingUpdateKernel(const CacheT* kv_new, int hd, int window, int64_t ring_off, StepDev s,
                                 CacheDev cache) {
  const int64_t r = blockIdx.x;
  const StepSeq sq = s.seqs[s.seq[r]];
  if (r < sq.end - window) return;
  CacheT* dst = SlotPtr<CacheT>(cache, sq.slot, ring_off) + (s.pos[r] % window) * hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) dst[d] = kv_new[r * hd + d];
}

constexpr int64_t kSimtMaxSplits = 16;  // the fp32 kernel's key splits per row at most

int HeadsPerBlock(int heads) {
  for (int hg = kMaxHG; hg > 1; hg /= 2) {
    if (heads % hg == 0) return hg;
  }
  return 1;
}

}  // namespace

template <typename CacheT>
void CompressStep(const CompJobs& j, const StepDev& s, const CacheDev& cache, int max_windows, cudaStream_t stream) {
  if (s.num_seqs <= 0 || j.count <= 0) return;
  const size_t smem = CompSmem(j);
  const unsigned seqs = static_cast<unsigned>(s.num_seqs), comps = static_cast<unsigned>(j.count);
  // 512 threads: a channel of V4's 512-wide entries each (the channel loops are chains of memory round trips).
  constexpr int kThreads = 512;
  if (max_windows <= 1) {
    CompStepKernel<CacheT><<<dim3(seqs, comps), kThreads, smem, stream>>>(j, s, cache);
    return;
  }
  CompEmitKernel<CacheT><<<dim3(seqs, static_cast<unsigned>(max_windows), comps), kThreads, smem, stream>>>(j, s,
                                                                                                          cache);
  CompUpdateKernel<<<dim3(seqs, comps), kThreads, 0, stream>>>(j, s, cache);
}

template <typename CacheT>
void IndexTopK(const IndexArgs& a, const StepDev& s, const CacheDev& cache, int64_t r0, int64_t rows, int64_t max_vis,
               float* scores, int64_t lds, int32_t* sel, cudaStream_t stream) {
  if (rows <= 0 || max_vis <= 0) return;
  // Groups of kScoreEntries entries per block: one at few rows (the blocks must fill the GPU), two from 32 rows
  // on (at 4K context still ~4 blocks per SM; a block loads its row's queries, up to 32 KiB, once for both).
  const int64_t total = (max_vis + kScoreEntries - 1) / kScoreEntries;
  const int groups = rows >= 32 ? 2 : 1;
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>((total + groups - 1) / groups));
  const size_t smem = static_cast<size_t>(a.ih * a.id + a.ih + kScoreThreads) * sizeof(float);
  IndexScoreKernel<CacheT><<<grid, kScoreThreads, smem, stream>>>(a, s, cache, r0, groups, scores, lds);
  const bool use_smem = max_vis <= kTopKSmemEntries;
  const size_t tk_smem = use_smem ? static_cast<size_t>(max_vis) * sizeof(float) : 0;
  if (tk_smem > 48 * 1024) {
    cudaFuncSetAttribute(TopKKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(tk_smem));
  }
  TopKKernel<<<static_cast<unsigned>(rows), 256, tk_smem, stream>>>(scores, lds, s, r0, a.rate, a.topk, sel,
                                                                   use_smem);
}

namespace {

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Shared memory one block of the current device may opt into (bytes; 0 when the query fails).
size_t BlockSmemOptin() {
  int dev = 0, bytes = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    return 0;
  }
  return static_cast<size_t>(bytes);
}

template <int HB>
void LaunchMma(const AttnArgs& a, const StepDev& s, const CacheDev& cache, int splits, cudaStream_t stream) {
  constexpr size_t smem = MmaAttnShape<HB>::kSmem;
  cudaFuncSetAttribute(AttnMmaKernel<HB>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  const dim3 grid(static_cast<unsigned>(s.n), static_cast<unsigned>(a.heads / HB), static_cast<unsigned>(splits));
  AttnMmaKernel<HB><<<grid, kMmaThreads, smem, stream>>>(a, s, cache, splits, a.part);
}

}  // namespace

template <typename CacheT>
AttnPlan PlanAttention(const AttnArgs& a, const CacheDev& cache, int64_t rows) {
  AttnPlan p;
  // The tensor-core kernel: bf16 caches of head_dim 512, whole groups of 32 heads, every row it copies with
  // 16-byte accesses aligned, and its tiles (147 KiB at 64 heads, 181 KiB at 32) in the block's shared memory
  // (sm_90: 227 KiB; sm_80: 163 KiB; sm_86: 99 KiB, so the fp32 kernel there). fp32 caches keep the fp32 kernel
  // (bf16 queries would lose their exactness).
  const int hb = a.heads % 64 == 0 ? 64 : 32;
  const size_t smem = hb == 64 ? MmaAttnShape<64>::kSmem + MmaAttnShape<64>::kStatic
                               : MmaAttnShape<32>::kSmem + MmaAttnShape<32>::kStatic;
  const bool mma = std::is_same_v<CacheT, __nv_bfloat16> && a.hd == kMmaHd && a.heads % 32 == 0 &&
                   Aligned16(a.q) && a.ldq % 4 == 0 && Aligned16(a.q16) && Aligned16(a.kv_new) &&
                   a.ring_off % 16 == 0 &&
                   Aligned16(cache.fixed) && cache.slot_bytes % 16 == 0 && Aligned16(cache.pages) &&
                   cache.page_elems % 8 == 0 && a.page_off % 8 == 0 && rows >= kAttnMmaMinRows &&
                   smem <= BlockSmemOptin();
  if (mma) {
    p.mma = true;
    p.heads_per_block = hb;
    p.blocks_per_sm = 1;
  } else {
    p.mma = false;
    p.heads_per_block = HeadsPerBlock(a.heads);
    p.blocks_per_sm = 2;
  }
  return p;
}

template <typename CacheT>
int AttentionSplits(const AttnArgs& a, const CacheDev& cache, int64_t n, int sms, int max_splits,
                    int64_t max_row_splits) {
  if (n <= 0) return 1;
  const AttnPlan p = PlanAttention<CacheT>(a, cache, n);
  const int64_t blocks = n * (a.heads / p.heads_per_block);
  if (!p.mma) {
    // The fp32 kernel: passes of up to max_row_splits / kSimtMaxSplits rows (decode), enough blocks to fill the
    // GPU about twice over, at most kSimtMaxSplits ways.
    if (n * kSimtMaxSplits > max_row_splits) return 1;
    const int64_t want = (static_cast<int64_t>(sms) * p.blocks_per_sm + blocks - 1) / blocks;
    return static_cast<int>(std::clamp<int64_t>(want, 1, std::min<int64_t>(max_splits, kSimtMaxSplits)));
  }
  // The tensor-core kernel: one wave (rounding down: a second, nearly empty wave costs a whole block's time).
  // A split takes whole tiles, so at few rows the later splits are empty (they exit at once and the combine
  // skips them).
  const int64_t want = (static_cast<int64_t>(sms) * p.blocks_per_sm) / blocks;
  const int64_t cap = std::min<int64_t>({static_cast<int64_t>(max_splits), kAttnMaxSplits, max_row_splits / n});
  return static_cast<int>(std::max<int64_t>(1, std::min(want, cap)));
}

template <typename CacheT>
void Attention(const AttnArgs& a, const StepDev& s, const CacheDev& cache, cudaStream_t stream) {
  if (s.n <= 0) return;
  const int splits = a.part != nullptr ? std::clamp(a.splits, 1, static_cast<int>(kAttnMaxSplits)) : 1;
  const AttnPlan plan = PlanAttention<CacheT>(a, cache, s.n);
  if (plan.mma) {
    if (plan.heads_per_block == 64) {
      LaunchMma<64>(a, s, cache, splits, stream);
    } else {
      LaunchMma<32>(a, s, cache, splits, stream);
    }
  } else {
    const int hg = plan.heads_per_block;
    const dim3 grid(static_cast<unsigned>(s.n), static_cast<unsigned>(a.heads / hg), static_cast<unsigned>(splits));
    const size_t smem = static_cast<size_t>(AttnScoreOffset(hg, a.hd) + kMaxHG * kKT) * sizeof(float);
    AttnKernel<CacheT><<<grid, kAttnThreads, smem, stream>>>(a, s, cache, hg, splits, a.part);
  }
  if (splits > 1) {
    const dim3 cgrid(static_cast<unsigned>(s.n), static_cast<unsigned>(a.heads),
                     static_cast<unsigned>((a.hd + kCombineDims - 1) / kCombineDims));
    AttnCombineKernel<<<cgrid, kCombineThreads, 0, stream>>>(a, s, splits, a.part);
  }
}

template <typename CacheT>
void RingUpdate(const CacheT* kv_new, int hd, int window, int64_t ring_off, const StepDev& s, const CacheDev& cache,
                cudaStream_t stream) {
  if (s.n <= 0) return;
  RingUpdateKernel<CacheT><<<static_cast<unsigned>(s.n), 128, 0, stream>>>(kv_new, hd, window, ring_off, s, cache);
}

#define NUMOE_INSTANTIATE(T)                                                                                   \
  template AttnPlan PlanAttention<T>(const AttnArgs&, const CacheDev&, int64_t);                              \
  template int AttentionSplits<T>(const AttnArgs&, const CacheDev&, int64_t, int, int, int64_t);             \
  template void CompressStep<T>(const CompJobs&, const StepDev&, const CacheDev&, int, cudaStream_t);         \
  template void IndexTopK<T>(const IndexArgs&, const StepDev&, const CacheDev&, int64_t, int64_t, int64_t,     \
                             float*, int64_t, int32_t*, cudaStream_t);                                         \
  template void Attention<T>(const AttnArgs&, const StepDev&, const CacheDev&, cudaStream_t);                 \
  template void RingUpdate<T>(const T*, int, int, int64_t, const StepDev&, const CacheDev&, cudaStream_t);
NUMOE_INSTANTIATE(float)
NUMOE_INSTANTIATE(__nv_bfloat16)
#undef NUMOE_INSTANTIATE

}  // namespace numoe::cuda
