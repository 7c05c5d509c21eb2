// CUDA backend: sequences, steps and the per-layer schedule.
//
// A step is cut into device passes of at most max_step_tokens rows. A pass runs L + 1 segments; segment s
// ends with layer s's MoE input copied to the host, where the ExpertBackend runs, and segment s + 1 begins
// with the shared expert, the routed sum coming back, and the residual update:
//   seg 0:      embed; attention(0); ffn-pre(0) -> host
//   seg l:      shared(l-1) + routed(l-1); ffn-post(l-1); attention(l); ffn-pre(l) -> host
//   seg L:      shared(L-1) + routed(L-1); ffn-post(L-1); head
// With tensor parallelism the attention output and the MoE output are all-reduced across ranks. With one GPU,
// decode passes (one token per sequence) replay each segment as a CUDA graph captured once per batch size.
// GPU prefill (cuda_prefill.cc): a pass of at least HostExperts::min_rows rows computes the routed experts of
// each layer on the device instead, from the worker's packed layers streamed in over PCIe, and never waits for
// the host between segments.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "common/log.h"
#include "backends/cuda/cuda_model_internal.h"

namespace numoe::cuda {

StepDev CudaModel::StepOf(const Rank& r, const PassDims& d) const {
  StepDev s;
  const StepMeta m = StepMeta::At(r.sc.meta, rows_cap_);
  s.token = m.token;
  s.pos = m.pos;
  s.seq = m.seq;
  s.seqs = reinterpret_cast<const StepSeq*>(m.seqs);
  s.n = static_cast<int32_t>(d.n);
  s.num_seqs = static_cast<int32_t>(d.num_seqs);
  return s;
}

CacheDev CudaModel::CacheOf(const Rank& r) const {
  CacheDev c;
  c.fixed = static_cast<char*>(r.fixed.get());
  c.slot_bytes = slot_bytes_;
  c.pages = r.pages.get();
  c.page_elems = page_elems_;
  c.table = r.table.as<int32_t>();
  c.max_pages = static_cast<int32_t>(max_pages_);
  return c;
}

void CudaModel::Gemm(Rank& r, const DevW& w, const float* x, int64_t ldx, int64_t n, float* y, int64_t ldy,
                     bool tensor_cores) {
  GemmCall c;
  c.w = &w;
  c.x = x;
  c.ldx = ldx;
  c.n = n;
  c.y = y;
  c.ldy = ldy;
  c.split_x = opt_.split_activations;
  ::numoe::cuda::Gemm(c, tensor_cores && !opt_.fp32, r.sms, r.stream);
}

// ---- phases ----------------------------------------------------------------------------------------------

// The compressor arguments of layer L, reading its projections from comp (row stride ld): the forward pass
// and Rollback's replay must agree on every field.
CompArgs CudaModel::MainCompArgs(const Rank& r, const LayerDev& L, const float* comp, int64_t ld) const {
  CompArgs ca;
  ca.rate = L.rate;
  ca.dim = static_cast<int>(hd_);
  ca.overlap = L.type == AttnType::kCSA;
  ca.ckv = comp + L.c_kv_col;
  ca.cg = comp + L.c_gate_col;
  ca.ld = ld;
  ca.ape = L.c_ape;
  ca.norm_w = L.c_norm;
  ca.eps = static_cast<float>(cfg_.rms_norm_eps);
  ca.rope_dim = static_cast<int>(cfg_.rope_dim);
  ca.inv_freq = r.inv_compress;
  ca.pend_kv_off = L.st.c_pend_kv;
  ca.pend_gate_off = L.st.c_pend_gate;
  ca.prev_kv_off = L.st.c_prev_kv;
  ca.prev_gate_off = L.st.c_prev_gate;
  ca.page_off = L.st.c_page_off;
  ca.epp = L.st.epp;
  return ca;
}

CompArgs CudaModel::IndexCompArgs(const Rank& r, const LayerDev& L, const float* comp, int64_t ld) const {
  CompArgs ia = MainCompArgs(r, L, comp, ld);
  ia.dim = static_cast<int>(cfg_.index_head_dim);
  ia.ckv = comp + L.i_kv_col;
  ia.cg = comp + L.i_gate_col;
  ia.ape = L.i_ape;
  ia.norm_w = L.i_norm;
  ia.pend_kv_off = L.st.i_pend_kv;
  ia.pend_gate_off = L.st.i_pend_gate;
  ia.prev_kv_off = L.st.i_prev_kv;
  ia.prev_gate_off = L.st.i_prev_gate;
  ia.page_off = L.st.i_page_off;
  return ia;
}

// Layer L's compressors (the indexer's too for CSA), for one CompressStep.
CompJobs CudaModel::LayerCompJobs(const Rank& r, const LayerDev& L, const float* comp, int64_t ld) const {
  CompJobs j;
  j.c[j.count++] = MainCompArgs(r, L, comp, ld);
  if (L.type == AttnType::kCSA) j.c[j.count++] = IndexCompArgs(r, L, comp, ld);
  return j;
}

template <typename T>
void CudaModel::PhaseAttention(Rank& r, int l, const PassDims& d, float* post_y, const float* post_y2) {
  const LayerDev& L = LayerOf(r, l);
  Scratch& s = r.sc;
  const ModelConfig& c = cfg_;
  const int64_t n = d.n, qr = c.q_lora_rank;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const StepDev step = StepOf(r, d);
  const CacheDev cache = CacheOf(r);
  const int rd = static_cast<int>(c.rope_dim);
  const float* inv = L.type == AttnType::kSliding ? r.inv_main : r.inv_compress;
  const int32_t* pos = step.pos;

  HcPreStep(r, n, L.hc_attn_fn, L.hc_attn_base, L.hc_attn_scale, L.attn_norm, /*head=*/false, nullptr, post_y,
            post_y2);

  // q_a (+ kv when stacked) -> s.qa [n, qr + hd]: q_a in columns [0, qr), kv in [qr, qr + hd).
  if (L.qkv_fused) {
    Gemm(r, L.wq_a, s.xn, D_, n, s.qa, s.qa_ld);
  } else {
    Gemm(r, L.wq_a, s.xn, D_, n, s.qa, s.qa_ld);
    Gemm(r, L.wkv, s.xn, D_, n, s.qa + qr, s.qa_ld);
  }
  // q_a's norm and kv's norm + rope in one launch; then q (and the indexer's queries, CSA) from the normed q_a,
  // their norm/rope in one more.
  NormRopeJobs<T> qkv;
  qkv.j[0] = {s.qa, 1, static_cast<int>(qr), s.qa_ld, L.q_norm, true, eps, 0, nullptr, nullptr};
  qkv.j[1] = {s.qa + qr, 1, static_cast<int>(hd_), s.qa_ld, L.kv_norm, true, eps, rd, inv, static_cast<T*>(s.kvT)};
  qkv.count = 2;
  NormRope<T>(qkv, n, pos, r.stream);
  Gemm(r, L.wq_b, s.qa, s.qa_ld, n, s.q, Hl_ * hd_);
  T* const q16 = std::is_same_v<T, __nv_bfloat16> ? static_cast<T*>(s.q16) : nullptr;
  NormRopeJobs<T> qi;
  qi.j[qi.count++] = {s.q, static_cast<int>(Hl_), static_cast<int>(hd_), Hl_ * hd_, nullptr, true, eps, rd, inv, q16};
  const int64_t ih = c.index_n_heads, id = c.index_head_dim;
  if (L.type == AttnType::kCSA) {
    Gemm(r, L.index_wq_b, s.qa, s.qa_ld, n, s.iq, ih * id);
    qi.j[qi.count++] = {s.iq, static_cast<int>(ih), static_cast<int>(id), ih * id, nullptr, false, eps, rd,
                        r.inv_compress, nullptr};
  }
  NormRope<T>(qi, n, pos, r.stream);

  if (d.spec && !d.draft) {
    // Speculative rows: keep what the window ring is built from (Rollback replays it).
    const int64_t tsize = sizeof(T);
    SaveSpecRows(s.kvT, hd_ * tsize, hd_ * tsize, n, StepMeta::At(s.meta, rows_cap_).spec_map,
                 static_cast<int32_t>(spec_tokens_), static_cast<char*>(r.spec_log.get()) + L.st.log_kv_off, spec_slot_bytes_, hd_ * tsize, r.stream);
  }

  if (L.type != AttnType::kSliding) {
    Gemm(r, L.comp, s.xn, D_, n, s.comp, L.comp_width);
    if (d.spec) {
      // ... and what the compressor states are built from.
      SaveSpecRows(s.comp, L.comp_width * 4, L.st.log_comp_w * 4, n, StepMeta::At(s.meta, rows_cap_).spec_map,
                   static_cast<int32_t>(spec_tokens_), static_cast<char*>(r.spec_log.get()) + L.st.log_comp_off,
                   spec_slot_bytes_, L.st.log_comp_w * 4, r.stream);
    }
    const int windows = L.type == AttnType::kCSA ? d.max_windows_csa : d.max_windows_hca;
    CompressStep<T>(LayerCompJobs(r, L, s.comp, L.comp_width), step, cache, windows, r.stream);
    if (L.type == AttnType::kCSA) {
      IndexArgs xa;
      xa.iq = s.iq;
      xa.ldq = ih * id;
      xa.iw = s.comp + L.iw_col;
      xa.ldw = L.comp_width;
      xa.ih = static_cast<int>(ih);
      xa.id = static_cast<int>(id);
      xa.rate = L.rate;
      xa.topk = static_cast<int>(c.index_topk);
      xa.page_off = L.st.i_page_off;
      xa.epp = L.st.epp;
      for (int64_t r0 = 0; r0 < n; r0 += s.score_rows) {
        IndexTopK<T>(xa, step, cache, r0, std::min(s.score_rows, n - r0), d.max_vis, s.scores, s.score_ld, s.sel,
                     r.stream);
      }
    }
  }

  AttnArgs aa;
  aa.q = s.q;
  aa.ldq = Hl_ * hd_;
  aa.q16 = q16;
  aa.heads = static_cast<int>(Hl_);
  aa.hd = static_cast<int>(hd_);
  aa.kv_new = s.kvT;
  aa.ring_off = L.st.ring_off;
  aa.window = static_cast<int>(c.sliding_window);
  aa.type = L.type == AttnType::kSliding ? 0 : L.type == AttnType::kCSA ? 1 : 2;
  aa.rate = L.rate;
  aa.page_off = L.st.c_page_off;
  aa.epp = L.st.epp;
  aa.sel = s.sel;
  aa.topk = static_cast<int>(c.index_topk);
  aa.sink = L.sink;
  aa.scale = 1.0f / std::sqrt(static_cast<float>(hd_));
  aa.rope_dim = rd;
  aa.inv_freq = inv;
  aa.out = s.o;
  aa.ldo = Hl_ * hd_;
  aa.bidir = d.draft;
  if (!d.draft) {
    // Few rows: split each row's keys so that the blocks fill the GPU (as many as attn_part holds).
    aa.splits = AttentionSplits<T>(aa, cache, n, r.sms, static_cast<int>(kMaxSplits),
                                   std::min(rows_cap_, kSplitRows) * kMaxSplits);
    aa.part = aa.splits > 1 ? s.attn_part : nullptr;
  }
  Attention<T>(aa, step, cache, r.stream);
  if (!d.draft) {
    RingUpdate<T>(static_cast<const T*>(s.kvT), static_cast<int>(hd_), aa.window, L.st.ring_off, step, cache,
                  r.stream);
  }

  // Grouped output projection over this rank's groups, then wo_b over its columns (a partial sum).
  GemmCall g;
  g.w = &L.wo_a;
  g.x = s.o;
  g.ldx = Hl_ * hd_;
  g.n = n;
  g.y = s.z;
  g.ldy = Gl_ * c.o_lora_rank;
  g.groups = static_cast<int>(Gl_);
  g.x_group_cols = Hl_ * hd_ / Gl_;
  g.y_group_cols = c.o_lora_rank;
  g.split_x = opt_.split_activations;
  ::numoe::cuda::Gemm(g, !opt_.fp32, r.sms, r.stream);
  Gemm(r, L.wo_b, s.z, Gl_ * c.o_lora_rank, n, s.y, D_);
}

void CudaModel::PhaseFfnPre(Rank& r, int l, const PassDims& d) {
  const LayerDev& L = LayerOf(r, l);
  Scratch& s = r.sc;
  const ModelConfig& c = cfg_;
  const int64_t n = d.n;
  HcPreStep(r, n, L.hc_ffn_fn, L.hc_ffn_base, L.hc_ffn_scale, L.ffn_norm, /*head=*/false, nullptr, s.y);
  if (r.index != 0) return;  // routing and the expert exchange happen once, on rank 0
  const int E = static_cast<int>(c.n_routed_experts), K = static_cast<int>(c.num_experts_per_tok);
  // Router logits in fp32 (SIMT): top-k decisions must not move with bf16 rounding.
  Gemm(r, L.gate, s.xn, D_, n, s.glog, E, false);
  const int scoring = c.scoring_func == ScoringFunc::kSqrtSoftplus ? 0 : c.scoring_func == ScoringFunc::kSoftmax ? 1 : 2;
  const bool hash = l < c.num_hidden_layers && c.mlp_layer_types[static_cast<size_t>(l)] == MoeType::kHash;
  MoeGate(s.glog, n, E, K, scoring, hash ? nullptr : L.bias, hash ? L.tid2eid : nullptr, StepOf(r, d).token,
          static_cast<float>(c.routed_scaling_factor), s.ids, s.wts, r.stream);
  if (d.host_experts && l < c.num_hidden_layers) {
    EnqueueHostExpertLayer(r, l, d);
    return;
  }
  if (GpuStageExperts(l)) {
    RoutedExpertsMxfp4(r.dx[static_cast<size_t>(l - c.num_hidden_layers)], s.xn, s.ids, s.wts, n, K,
                       static_cast<float>(c.swiglu_limit), r.dx_sc, s.routed, r.stream);
    return;
  }
  cudaMemcpyAsync(y_h_.as<float>(), s.xn, static_cast<size_t>(n * D_) * sizeof(float), cudaMemcpyDeviceToHost, r.stream);
  cudaMemcpyAsync(ids_h_.as<int32_t>(), s.ids, static_cast<size_t>(n * K) * sizeof(int32_t), cudaMemcpyDeviceToHost,
                  r.stream);
  cudaMemcpyAsync(wts_h_.as<float>(), s.wts, static_cast<size_t>(n * K) * sizeof(float), cudaMemcpyDeviceToHost,
                  r.stream);
}

void CudaModel::PhaseSharedAndRouted(Rank& r, int l, const PassDims& d) {
  PhaseShared(r, l, d);
  PhaseAddRouted(r, l, d);
}

void CudaModel::PhaseShared(Rank& r, int l, const PassDims& d) {
  const LayerDev& L = LayerOf(r, l);
  Scratch& s = r.sc;
  const int64_t n = d.n;
  Gemm(r, L.sh_w1, s.xn, D_, n, s.shg, s.shg_ld);
  if (!L.sh_fused) Gemm(r, L.sh_w3, s.xn, D_, n, s.shg + Il_, s.shg_ld);
  SwiGlu(s.shg, s.shg + Il_, s.shg_ld, s.shh, n, Il_, static_cast<float>(cfg_.swiglu_limit), r.stream);
  Gemm(r, L.sh_w2, s.shh, Il_, n, s.sh, D_);
}

const float* CudaModel::PhaseAddRouted(Rank& r, int l, const PassDims& d, bool add) {
  Scratch& s = r.sc;
  const int64_t n = d.n;
  if (r.index != 0) return nullptr;
  // Else PhaseFfnPre computed s.routed on the device (the drafter's stages, or GPU prefill).
  if (!GpuStageExperts(l) && !(d.host_experts && l < cfg_.num_hidden_layers)) {
    cudaMemcpyAsync(s.routed, routed_h_.as<float>(), static_cast<size_t>(n * D_) * sizeof(float),
                    cudaMemcpyHostToDevice, r.stream);
  }
  if (!add) return s.routed;
  AddInPlace(s.sh, s.routed, n * D_, r.stream);
  return nullptr;
}

void CudaModel::PhaseFfnPost(Rank& r, const PassDims& d) {
  HcPost(r.sc.sh, r.sc.post, r.sc.comb, r.sc.X, d.n, static_cast<int>(hc_), D_, r.stream);
}

void CudaModel::HcPreStep(Rank& r, int64_t n, const DevW& fn, const float* base, const float* scale,
                          const float* norm_w, bool head, float* u_out, float* post_y,
                          const float* post_y2) {
  Scratch& s = r.sc;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  HcPreArgs hp;
  if (post_y != nullptr && HcPostMixFits(fn, n, static_cast<int>(hc_), D_)) {
    HcPostMixArgs pm;
    pm.y = post_y;
    pm.y2 = post_y2;
    pm.post = s.post;
    pm.comb = s.comb;
    pm.X = s.X;
    pm.W = static_cast<const float*>(fn.data);
    pm.part = s.hc_part;
    pm.n = n;
    pm.D = D_;
    HcPostMix(pm, r.stream);
    hp.part = s.hc_part;
  } else if (post_y != nullptr) {
    // post_y is the FFN's sc.sh when post_y2 is set: the sum goes there, as PhaseAddRouted would have put it.
    if (post_y2 != nullptr) AddInPlace(post_y, post_y2, n * D_, r.stream);
    HcPost(post_y, s.post, s.comb, s.X, n, static_cast<int>(hc_), D_, r.stream);
  }
  if (hp.part != nullptr) {
    // the post and the mix ran above
  } else if (HcMixFits(fn, n)) {
    HcMix(s.X, fn, n, s.hc_part, r.stream);
    hp.part = s.hc_part;
  } else {
    RowInvRms(s.X, n, hc_ * D_, eps, s.inv, r.stream);
    Gemm(r, fn, s.X, hc_ * D_, n, s.mix, head ? hc_ : (2 + hc_) * hc_, false);
    hp.mixraw = s.mix;
    hp.inv = s.inv;
  }
  hp.base = base;
  hp.scale = scale;
  hp.X = s.X;
  hp.norm_w = norm_w;
  hp.xn = s.xn;
  hp.n = n;
  hp.D = D_;
  hp.hc = static_cast<int>(hc_);
  hp.hc_eps = static_cast<float>(cfg_.hc_eps);
  hp.rms_eps = eps;
  if (head) {
    hp.head_mode = true;
    hp.u_out = u_out;
  } else {
    hp.post = s.post;
    hp.comb = s.comb;
    hp.iters = static_cast<int>(cfg_.hc_sinkhorn_iters);
  }
  HcPre(hp, r.stream);
}

void CudaModel::PhaseHead(Rank& r, const PassDims& d, int64_t row0, int64_t rows) {
  Scratch& s = r.sc;
  const ModelConfig& c = cfg_;
  const int64_t V = c.vocab_size;
  if (row0 == 0) {
    HcPreStep(r, d.n, r.hc_head_fn, r.hc_head_base, r.hc_head_scale, r.norm, /*head=*/true);
    GatherRows(s.xn, D_, StepMeta::At(s.meta, rows_cap_).logit_rows, d.logit_rows, s.hsel, r.stream);
  }
  Gemm(r, r.head, s.hsel + row0 * D_, D_, rows, s.logits, V);
  if (d.greedy) {
    ArgmaxRows(s.logits, rows, V, s.greedy + row0, r.stream);
    cudaMemcpyAsync(greedy_h_.as<unsigned long long>() + row0, s.greedy + row0,
                    static_cast<size_t>(rows) * sizeof(unsigned long long), cudaMemcpyDeviceToHost, r.stream);
  } else {
    cudaMemcpyAsync(logits_h_.as<float>(), s.logits, static_cast<size_t>(rows * V) * sizeof(float),
                    cudaMemcpyDeviceToHost, r.stream);
  }
}

Status CudaModel::AllReduce(float* Scratch::*buf, int64_t count) {
  if (ranks_.size() < 2) return absl::OkStatus();
  NUMOE_NCCL_RETURN_IF_ERROR(ncclGroupStart());
  for (auto& r : ranks_) {
    float* p = r->sc.*buf;
    NUMOE_NCCL_RETURN_IF_ERROR(ncclAllReduce(p, p, static_cast<size_t>(count), ncclFloat, ncclSum, r->comm, r->stream));
  }
  NUMOE_NCCL_RETURN_IF_ERROR(ncclGroupEnd());
  return absl::OkStatus();
}

// ---- segments --------------------------------------------------------------------------------------------

template <typename T>
void CudaModel::EnqueueSegment(Rank& r, int seg, const PassDims& d) {
  const int L = static_cast<int>(cfg_.num_hidden_layers);
  if (seg == 0) {
    Embed(r.embed, StepMeta::At(r.sc.meta, rows_cap_).token, d.n, static_cast<int>(hc_), r.sc.X, r.stream);
  }
  // The previous layer's mHC post goes into this layer's first mix, unless something reads sc.X in between
  // (the hidden hook, DSpark target features of layer seg) or the head comes next.
  const bool features = std::find(target_layers_.begin(), target_layers_.end(), seg) != target_layers_.end();
  const bool defer_post = seg > 0 && seg < L && !hidden_hook_ && !features;
  const float* routed = nullptr;  // the routed experts' sum, when the fused post adds it to sc.sh
  if (seg > 0) {
    // The shared expert ran during the expert hop (EnqueueTail).
    routed = PhaseAddRouted(r, seg - 1, d, /*add=*/!defer_post);
    if (!defer_post) PhaseFfnPost(r, d);
  }
  if (hidden_hook_) EmitHidden(r, seg - 1, d);
  if (seg < L) {
    for (size_t t = 0; t < target_layers_.size(); ++t) {  // DSpark target features: layer seg's input
      if (target_layers_[t] != seg) continue;
      const int64_t TD = static_cast<int64_t>(target_layers_.size()) * D_;
      StreamMean(r.sc.X, d.n, static_cast<int>(hc_), D_, r.features + static_cast<int64_t>(t) * D_, TD, r.stream);
    }
    PhaseAttention<T>(r, seg, d, defer_post ? r.sc.sh : nullptr, routed);
    PhaseFfnPre(r, seg, d);
  } else if (r.index == 0) {
    if (stages_ > 0) PhaseDrafterFeed<T>(r, d);
    PhaseHead(r, d, 0, std::min(d.logit_rows, logit_rows_cap_));
  }
}

void CudaModel::EnqueueTail(Rank& r, int seg, const PassDims& d) { PhaseShared(r, seg, d); }

void CudaModel::EmitHidden(Rank& r, int64_t layer, const PassDims& d) {
  std::vector<float> x(static_cast<size_t>(d.n * hc_ * D_));
  if (cudaMemcpyAsync(x.data(), r.sc.X, x.size() * sizeof(float), cudaMemcpyDeviceToHost, r.stream) != cudaSuccess ||
      cudaStreamSynchronize(r.stream) != cudaSuccess) {
    NLOG(ERROR) << "hidden hook: copy failed";
    return;
  }
  hidden_hook_(layer, x);
}

Status CudaModel::CheckLaunches() {
  for (auto& r : ranks_) {
    NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r->device));
    NUMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  return absl::OkStatus();
}

Status CudaModel::RunSegment(int seg, const PassDims& d, bool use_graph) {
  Rank& r0 = *ranks_[0];
  const int L = static_cast<int>(cfg_.num_hidden_layers);
  NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r0.device));
  if (collect_stats_) NUMOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(r0.ev_begin[static_cast<size_t>(seg)], r0.stream));
  // Layer seg's MoE rows are on the host once ev_hop fires; the tail (the shared expert) runs on the GPU
  // while the worker computes the routed experts.
  const bool tail = seg < L;
  if (use_graph) {
    const auto& execs = graphs_.at({d.n, d.greedy});
    NUMOE_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(execs[static_cast<size_t>(seg)], r0.stream));
    if (tail) {
      NUMOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(r0.ev_hop, r0.stream));
      NUMOE_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(execs[static_cast<size_t>(L + 1 + seg)], r0.stream));
    }
  } else if (ranks_.size() == 1) {
    if (bf16_cache_) {
      EnqueueSegment<__nv_bfloat16>(r0, seg, d);
    } else {
      EnqueueSegment<float>(r0, seg, d);
    }
    if (tail) {
      NUMOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(r0.ev_hop, r0.stream));
      EnqueueTail(r0, seg, d);
    }
  } else {
    // Tensor parallel: the same phases on every rank, all-reduces in between.
    auto each = [&](auto&& fn) {
      for (auto& r : ranks_) {
        (void)cudaSetDevice(r->device);
        fn(*r);
      }
    };
    if (seg == 0) {
      each([&](Rank& r) {
        Embed(r.embed, StepMeta::At(r.sc.meta, rows_cap_).token, d.n, static_cast<int>(hc_), r.sc.X, r.stream);
      });
    } else {
      each([&](Rank& r) { PhaseAddRouted(r, seg - 1, d); });
      RETURN_IF_ERROR(AllReduce(&Scratch::sh, d.n * D_));
      each([&](Rank& r) { PhaseFfnPost(r, d); });
    }
    if (seg < L) {
      each([&](Rank& r) {
        if (bf16_cache_) {
          PhaseAttention<__nv_bfloat16>(r, seg, d);
        } else {
          PhaseAttention<float>(r, seg, d);
        }
      });
      RETURN_IF_ERROR(AllReduce(&Scratch::y, d.n * D_));
      each([&](Rank& r) { PhaseFfnPre(r, seg, d); });
      NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r0.device));
      NUMOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(r0.ev_hop, r0.stream));
      each([&](Rank& r) { EnqueueTail(r, seg, d); });
    } else {
      (void)cudaSetDevice(r0.device);
      PhaseHead(r0, d, 0, std::min(d.logit_rows, logit_rows_cap_));
    }
    NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r0.device));
  }
  if (collect_stats_) NUMOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(r0.ev_end[static_cast<size_t>(seg)], r0.stream));
  return CheckLaunches();
}

// ---- steps -----------------------------------------------------------------------------------------------

Status CudaModel::ValidateSteps(std::span<const SequenceStep> steps, std::vector<Seq*>* seqs) const {
  RETURN_IF_ERROR(ValidateSequenceSteps(steps, cfg_, [&](SequenceId seq) -> StatusOr<int64_t> {
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " does not exist"));
    return it->second.position;
  }));
  for (const SequenceStep& st : steps) {
    auto it = seqs_.find(st.seq);
    if (st.speculative && spec_tokens_ == 0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "sequence ", st.seq, ": speculative steps are off on this device (CudaOptions::max_spec_tokens = 0)"));
    }
    if (st.speculative && static_cast<int64_t>(st.tokens.size()) > spec_tokens_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "sequence ", st.seq, ": a speculative step of ", st.tokens.size(), " tokens exceeds the device's ",
          spec_tokens_, " (CudaOptions::max_spec_tokens: the last token + drafts)"));
    }
    const int64_t end = it->second.position + static_cast<int64_t>(st.tokens.size());
    if (end > max_context_) {
      return absl::ResourceExhaustedError(absl::StrCat("sequence ", st.seq, ": ", end,
                                                       " tokens exceed the device cache's per-sequence capacity of ",
                                                       max_context_, " tokens (CudaOptions::max_context)"));
    }
    seqs->push_back(const_cast<Seq*>(&it->second));
  }
  return absl::OkStatus();
}

Status CudaModel::EnsurePages(const std::vector<Seq*>& seqs, const std::vector<int64_t>& new_positions) {
  int64_t need = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    need += std::max<int64_t>(0, PagesFor(new_positions[i]) - static_cast<int64_t>(seqs[i]->pages.size()));
  }
  if (need > static_cast<int64_t>(free_pages_.size())) {
    const int64_t page_bytes = page_elems_ * (bf16_cache_ ? 2 : 4);
    return absl::ResourceExhaustedError(absl::StrCat(
        "device KV cache full: this step needs ", need, " more pages of ", page_tokens_, " tokens but ",
        free_pages_.size(), " of ", num_pages_, " are free (pool ", (num_pages_ * page_bytes) >> 20,
        " MiB per GPU, CudaOptions::cache_mb); finish or release sequences, or raise cache_mb"));
  }
  int32_t* table = table_h_.as<int32_t>();
  for (size_t i = 0; i < seqs.size(); ++i) {
    Seq* s = seqs[i];
    const int64_t want = PagesFor(new_positions[i]);
    if (static_cast<int64_t>(s->pages.size()) >= want) continue;
    while (static_cast<int64_t>(s->pages.size()) < want) {
      s->pages.push_back(free_pages_.back());
      free_pages_.pop_back();
      table[s->slot * max_pages_ + static_cast<int64_t>(s->pages.size()) - 1] = s->pages.back();
    }
    for (auto& r : ranks_) {
      NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r->device));
      NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r->table.as<int32_t>() + s->slot * max_pages_,
                                                 table + s->slot * max_pages_,
                                                 static_cast<size_t>(max_pages_) * sizeof(int32_t),
                                                 cudaMemcpyHostToDevice, r->stream));
    }
  }
  return absl::OkStatus();
}

Status CudaModel::Forward(std::span<const SequenceStep> steps, ExpertBackend* experts,
                          std::vector<SequenceLogits>* out) {
  return RunSteps(steps, experts, out, nullptr);
}

Status CudaModel::ForwardGreedy(std::span<const SequenceStep> steps, ExpertBackend* experts,
                                std::vector<int32_t>* tokens) {
  return RunSteps(steps, experts, nullptr, tokens);
}

Status CudaModel::RunSteps(std::span<const SequenceStep> steps, ExpertBackend* experts,
                           std::vector<SequenceLogits>* out, std::vector<int32_t>* greedy) {
  if (experts == nullptr) return absl::InvalidArgumentError("Forward: no expert backend");
  RETURN_IF_ERROR(UseLane(experts->lane(), experts->background()));
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<Seq*> seqs;
  RETURN_IF_ERROR(ValidateSteps(steps, &seqs));
  std::vector<int64_t> ends;
  for (size_t i = 0; i < steps.size(); ++i) ends.push_back(seqs[i]->position + static_cast<int64_t>(steps[i].tokens.size()));
  RETURN_IF_ERROR(EnsurePages(seqs, ends));
  if (out != nullptr) {
    out->assign(steps.size(), SequenceLogits{});
    for (size_t i = 0; i < steps.size(); ++i) {
      (*out)[i].seq = steps[i].seq;
      (*out)[i].rows = steps[i].all_logits ? static_cast<int64_t>(steps[i].tokens.size()) : 1;
      (*out)[i].logits.resize(static_cast<size_t>((*out)[i].rows * cfg_.vocab_size));
    }
  }
  if (greedy != nullptr) greedy->assign(steps.size(), 0);
  RETURN_IF_ERROR(FlushRollbacks());
  // Speculative sequences: copy their fixed state aside before anything of this step runs (same stream).
  for (size_t i = 0; i < steps.size(); ++i) {
    Seq* s = seqs[i];
    s->spec = steps[i].speculative;
    s->spec_start = s->position;
    if (!s->spec) continue;
    for (auto& r : ranks_) {
      NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r->device));
      NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r->snap.as<char>() + s->slot * slot_bytes_,
                                                 r->fixed.as<char>() + s->slot * slot_bytes_,
                                                 static_cast<size_t>(slot_bytes_), cudaMemcpyDeviceToDevice,
                                                 r->stream));
    }
  }
  stats_ = CudaStepStats{};
  // Cut the step into passes of at most rows_cap_ rows, each sequence's tokens in order.
  std::vector<int64_t> cursor(steps.size(), 0);
  for (;;) {
    std::vector<PassSeq> pass;
    int64_t cap = rows_cap_;
    for (size_t i = 0; i < steps.size() && cap > 0; ++i) {
      const int64_t len = static_cast<int64_t>(steps[i].tokens.size());
      if (cursor[i] >= len) continue;
      const int64_t take = std::min(cap, len - cursor[i]);
      PassSeq ps;
      ps.seq = seqs[i];
      ps.id = steps[i].seq;
      ps.step = i;
      ps.tokens = steps[i].tokens.data() + cursor[i];
      ps.count = take;
      ps.logits_all = out != nullptr && steps[i].all_logits;
      ps.logits_last = cursor[i] + take == len;
      ps.offset = cursor[i];
      ps.spec = steps[i].speculative;
      pass.push_back(ps);
      cursor[i] += take;
      cap -= take;
    }
    if (pass.empty()) break;
    RETURN_IF_ERROR(RunPass(pass, experts, greedy != nullptr, out, greedy));
  }
  stats_.wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return absl::OkStatus();
}

Status CudaModel::RunPass(const std::vector<PassSeq>& pass, ExpertBackend* experts, bool greedy,
                          std::vector<SequenceLogits>* out, std::vector<int32_t>* tokens) {
  const ModelConfig& c = cfg_;
  const int L = static_cast<int>(c.num_hidden_layers);
  const int64_t NR = rows_cap_, V = c.vocab_size;
  int32_t* meta = meta_h_.as<int32_t>();
  const StepMeta m = StepMeta::At(meta, NR);
  // Logit row j of this pass goes to (step, row within the step's logits).
  std::vector<std::pair<size_t, int64_t>> dest;
  PassDims d;
  int64_t row = 0;
  bool decode = true;
  for (size_t i = 0; i < pass.size(); ++i) {
    const PassSeq& ps = pass[i];
    const int64_t start = ps.seq->position;
    for (int64_t t = 0; t < ps.count; ++t) {
      m.token[row + t] = ps.tokens[t];
      m.pos[row + t] = static_cast<int32_t>(start + t);
      m.seq[row + t] = static_cast<int32_t>(i);
      m.spec_map[row + t] = ps.spec ? static_cast<int32_t>(ps.seq->slot * spec_tokens_ + ps.offset + t) : -1;
    }
    d.spec = d.spec || ps.spec;
    m.SetSeq(static_cast<int64_t>(i), ps.seq->slot, row, row + ps.count, start);
    const int64_t end = start + ps.count;
    if (c.csa_rate > 0) {
      d.max_windows_csa = std::max<int>(d.max_windows_csa, static_cast<int>(end / c.csa_rate - start / c.csa_rate));
      d.max_vis = std::max<int64_t>(d.max_vis, end / c.csa_rate);
    }
    if (c.hca_rate > 0) {
      d.max_windows_hca = std::max<int>(d.max_windows_hca, static_cast<int>(end / c.hca_rate - start / c.hca_rate));
    }
    if (ps.logits_all) {
      for (int64_t t = 0; t < ps.count; ++t) {
        m.logit_rows[d.logit_rows++] = static_cast<int32_t>(row + t);
        dest.push_back({ps.step, ps.offset + t});
      }
    } else if (ps.logits_last) {
      m.logit_rows[d.logit_rows++] = static_cast<int32_t>(row + ps.count - 1);
      dest.push_back({ps.step, 0});
    }
    decode = decode && ps.count == 1 && ps.logits_last && !ps.logits_all;
    row += ps.count;
  }
  d.n = row;
  d.num_seqs = static_cast<int64_t>(pass.size());
  d.greedy = greedy;
  d.host_experts = UseHostExperts(experts, d.n);

  // Decode passes replay captured graphs; their grids are sized for capacity, not for this pass.
  bool use_graph =
      opt_.graphs && !graphs_broken_ && !hidden_hook_ && ranks_.size() == 1 && decode && !d.spec &&
      !d.host_experts && d.n <= logit_rows_cap_;
  if (use_graph) {
    d.max_windows_csa = d.max_windows_hca = 1;
    d.max_vis = ranks_[0]->sc.score_ld;
  }
  for (auto& r : ranks_) {
    NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r->device));
    NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r->sc.meta, meta, StepMeta::Bytes(NR),
                                               cudaMemcpyHostToDevice, r->stream));
  }
  if (use_graph && graphs_.find({d.n, d.greedy}) == graphs_.end()) {
    Rank& r0 = *ranks_[0];
    NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r0.device));
    std::vector<cudaGraphExec_t> execs;
    Status st = absl::OkStatus();
    // Segments 0..L, then the tails of segments 0..L-1 (RunSegment launches tail L + 1 + seg after seg).
    for (int g = 0; g <= 2 * L && st.ok(); ++g) {
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      cudaError_t e = cudaStreamBeginCapture(r0.stream, cudaStreamCaptureModeThreadLocal);
      if (e == cudaSuccess) {
        if (g > L) {
          EnqueueTail(r0, g - L - 1, d);
        } else if (bf16_cache_) {
          EnqueueSegment<__nv_bfloat16>(r0, g, d);
        } else {
          EnqueueSegment<float>(r0, g, d);
        }
        e = cudaStreamEndCapture(r0.stream, &graph);
      }
      if (e == cudaSuccess) e = cudaGraphInstantiate(&exec, graph, 0);
      if (graph != nullptr) (void)cudaGraphDestroy(graph);
      if (e != cudaSuccess) {
        st = CudaError(e, "CUDA graph capture", __FILE__, __LINE__);
        (void)cudaGetLastError();
      } else {
        execs.push_back(exec);
      }
    }
    if (!st.ok()) {
      for (cudaGraphExec_t e : execs) (void)cudaGraphExecDestroy(e);
      NLOG(WARNING) << "CUDA graphs disabled, running decode passes eagerly: " << st;
      graphs_broken_ = true;
      use_graph = false;
      d.max_vis = 0;
      for (const PassSeq& ps : pass) {
        if (c.csa_rate > 0) d.max_vis = std::max<int64_t>(d.max_vis, (ps.seq->position + ps.count) / c.csa_rate);
      }
    } else {
      graphs_[{d.n, d.greedy}] = std::move(execs);
    }
  }

  Rank& r0 = *ranks_[0];
  std::vector<int64_t> row_seqs;  // MoeRequest::seqs
  row_seqs.reserve(static_cast<size_t>(d.n));
  for (const PassSeq& ps : pass) row_seqs.insert(row_seqs.end(), static_cast<size_t>(ps.count), ps.id);
  MoeRequest req;
  req.seqs = row_seqs.data();
  req.rows = d.n;
  req.top_k = c.num_experts_per_tok;
  req.x = y_h_.as<float>();
  req.expert_ids = ids_h_.as<int32_t>();
  req.expert_weights = wts_h_.as<float>();
  req.out = routed_h_.as<float>();
  struct HostPass {
    bool* active;
    ~HostPass() {
      if (active != nullptr) *active = false;
    }
  } host_pass{d.host_experts ? &host_pass_active_ : nullptr};
  if (d.host_experts) {
    host_pass_active_ = true;
    RETURN_IF_ERROR(BeginHostExpertPass(experts->host_experts()));
  }
  for (int seg = 0; seg <= L; ++seg) {
    RETURN_IF_ERROR(RunSegment(seg, d, use_graph));
    if (d.host_experts && prefill_error_ != cudaSuccess) {
      return CudaError(prefill_error_, "PackedMoe (GPU prefill)", __FILE__, __LINE__);
    }
    if (seg < L && !d.host_experts) {
      NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r0.device));
      NUMOE_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(r0.ev_hop));  // the rows are on the host
      req.layer = seg;
      RETURN_IF_ERROR(experts->RunRouted(req));
      RETURN_IF_ERROR(UseLane(experts->lane(), experts->background()));
    } else if (seg < L && experts->WantsYield()) {
      // GPU prefill makes no expert call: other lanes (a decode lane's steps) get the model between this pass's
      // layers, while this lane's layer runs on its stream. The streams are read before the model is given up
      // (another lane swaps its own in).
      std::vector<std::pair<int, cudaStream_t>> streams;
      for (const auto& rank : ranks_) streams.emplace_back(rank->device, rank->stream);
      RETURN_IF_ERROR(experts->YieldModel([&streams]() -> Status {
        for (const auto& [device, stream] : streams) {
          NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
          NUMOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
        }
        return absl::OkStatus();
      }));
      RETURN_IF_ERROR(UseLane(experts->lane(), experts->background()));
    }
  }
  for (const PassSeq& ps : pass) ps.seq->position += ps.count;

  // Logits (or greedy ids), LR rows at a time; the first chunk was enqueued by the last segment.
  const int64_t LR = logit_rows_cap_;
  for (int64_t row0 = 0; row0 < d.logit_rows; row0 += LR) {
    const int64_t rows = std::min(LR, d.logit_rows - row0);
    NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r0.device));
    if (row0 > 0) {
      PhaseHead(r0, d, row0, rows);
      RETURN_IF_ERROR(CheckLaunches());
    }
    NUMOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(r0.stream));
    for (int64_t j = 0; j < rows; ++j) {
      const auto [step, srow] = dest[static_cast<size_t>(row0 + j)];
      if (greedy) {
        if (tokens != nullptr) (*tokens)[step] = ArgmaxOf(greedy_h_.as<unsigned long long>()[row0 + j]);
      } else if (out != nullptr) {
        std::memcpy((*out)[step].logits.data() + srow * V, logits_h_.as<float>() + j * V,
                    static_cast<size_t>(V) * sizeof(float));
      }
    }
  }
  for (auto& r : ranks_) {
    NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r->device));
    NUMOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(r->stream));
  }
  stats_.rows += d.n;
  if (collect_stats_) {
    for (int seg = 0; seg <= L; ++seg) {
      float ms = 0;
      NUMOE_CUDA_RETURN_IF_ERROR(
          cudaEventElapsedTime(&ms, r0.ev_begin[static_cast<size_t>(seg)], r0.ev_end[static_cast<size_t>(seg)]));
      stats_.gpu_ms += ms;
    }
  }
  return absl::OkStatus();
}

// ---- sequences -------------------------------------------------------------------------------------------

StatusOr<SequenceId> CudaModel::CreateSequence() {
  if (free_slots_.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat("all ", opt_.max_sequences,
                                                     " sequence slots are in use (CudaOptions::max_sequences)"));
  }
  const SequenceId id = next_id_++;
  Seq s;
  s.slot = free_slots_.back();
  free_slots_.pop_back();
  seqs_[id] = std::move(s);
  return id;
}

StatusOr<SequenceId> CudaModel::ForkSequence(SequenceId parent) {
  auto it = seqs_.find(parent);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", parent, " does not exist"));
  const Seq& from = it->second;
  if (from.spec || from.replay) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", parent, ": cannot fork right after a speculative step"));
  }
  if (free_slots_.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat("all ", opt_.max_sequences,
                                                     " sequence slots are in use (CudaOptions::max_sequences)"));
  }
  if (from.pages.size() > free_pages_.size()) {
    return absl::ResourceExhaustedError(absl::StrCat("device KV cache full: forking sequence ", parent, " needs ",
                                                     from.pages.size(), " pages but ", free_pages_.size(),
                                                     " are free (CudaOptions::cache_mb)"));
  }
  Seq s;
  s.slot = free_slots_.back();
  free_slots_.pop_back();
  s.position = from.position;
  int32_t* table = table_h_.as<int32_t>();
  for (size_t i = 0; i < from.pages.size(); ++i) {
    s.pages.push_back(free_pages_.back());
    free_pages_.pop_back();
    table[s.slot * max_pages_ + static_cast<int64_t>(i)] = s.pages.back();
  }
  const size_t page_bytes = static_cast<size_t>(page_elems_) * (bf16_cache_ ? 2 : 4);
  for (auto& r : ranks_) {
    NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r->device));
    NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r->fixed.as<char>() + s.slot * slot_bytes_,
                                               r->fixed.as<char>() + from.slot * slot_bytes_,
                                               static_cast<size_t>(slot_bytes_), cudaMemcpyDeviceToDevice, r->stream));
    for (size_t i = 0; i < from.pages.size(); ++i) {
      NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r->pages.as<char>() + s.pages[i] * page_bytes,
                                                 r->pages.as<char>() + from.pages[i] * page_bytes, page_bytes,
                                                 cudaMemcpyDeviceToDevice, r->stream));
    }
    if (!s.pages.empty()) {
      NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r->table.as<int32_t>() + s.slot * max_pages_,
                                                 table + s.slot * max_pages_,
                                                 static_cast<size_t>(max_pages_) * sizeof(int32_t),
                                                 cudaMemcpyHostToDevice, r->stream));
    }
    // Done before the fork's first step, whichever lane (stream) runs it.
    NUMOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(r->stream));
  }
  const SequenceId id = next_id_++;
  seqs_[id] = std::move(s);
  return id;
}

namespace {

// `n` bytes of pinned host memory (portable: every rank's device copies from it at full speed).
StatusOr<HostBytes> PinnedHostBytes(int64_t n) {
  void* p = nullptr;
  NUMOE_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, static_cast<size_t>(std::max<int64_t>(n, 1)), cudaHostAllocPortable));
  HostBytes b;
  b.data = std::shared_ptr<uint8_t[]>(static_cast<uint8_t*>(p), [](uint8_t* q) { (void)cudaFreeHost(q); });
  b.size = n;
  return b;
}

constexpr int64_t kHostStateMagic = 0x4e4d4f4543554431;  // "NMOECUD1"
constexpr int64_t kHostHeaderWords = 6;  // magic, position, ranks, slot bytes, page bytes, tail pages

}  // namespace

StatusOr<HostState> CudaModel::ExportSequence(SequenceId seq, int64_t page_tokens, int64_t first_page) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " does not exist"));
  const Seq& s = it->second;
  if (s.spec || s.replay) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", seq, ": cannot export right after a speculative step"));
  }
  if (page_tokens <= 0 || page_tokens % page_tokens_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat("ExportSequence: page_tokens ", page_tokens,
                                                   " is not a positive multiple of ", page_tokens_));
  }
  const int64_t m = page_tokens / page_tokens_, whole = s.position / page_tokens;
  const int64_t used = PagesFor(s.position), tail = used - whole * m;
  if (tail < 0 || used > static_cast<int64_t>(s.pages.size())) {
    return absl::InternalError(absl::StrCat("sequence ", seq, ": ", s.pages.size(), " pages for position ", s.position));
  }
  const int64_t tp = static_cast<int64_t>(ranks_.size());
  const int64_t page_bytes = page_elems_ * (bf16_cache_ ? 2 : 4);
  HostState hs;
  hs.position = s.position;
  hs.page_tokens = page_tokens;
  hs.pages.resize(static_cast<size_t>(whole));
  for (int64_t k = std::max<int64_t>(first_page, 0); k < whole; ++k) {
    ASSIGN_OR_RETURN(hs.pages[static_cast<size_t>(k)], PinnedHostBytes(tp * m * page_bytes));
  }
  const int64_t header = kHostHeaderWords * static_cast<int64_t>(sizeof(int64_t));
  ASSIGN_OR_RETURN(hs.rest, PinnedHostBytes(header + tp * (slot_bytes_ + tail * page_bytes)));
  int64_t* head = reinterpret_cast<int64_t*>(hs.rest.data.get());
  const int64_t words[kHostHeaderWords] = {kHostStateMagic, s.position, tp, slot_bytes_, page_bytes, tail};
  std::copy(words, words + kHostHeaderWords, head);
  for (int64_t ri = 0; ri < tp; ++ri) {
    Rank& r = *ranks_[static_cast<size_t>(ri)];
    NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r.device));
    auto d2h = [&](uint8_t* to, int64_t page) {
      return cudaMemcpyAsync(to, r.pages.as<char>() + page * page_bytes, static_cast<size_t>(page_bytes),
                             cudaMemcpyDeviceToHost, r.stream);
    };
    for (int64_t k = std::max<int64_t>(first_page, 0); k < whole; ++k) {
      uint8_t* to = hs.pages[static_cast<size_t>(k)].data.get() + ri * m * page_bytes;
      for (int64_t j = 0; j < m; ++j) {
        NUMOE_CUDA_RETURN_IF_ERROR(d2h(to + j * page_bytes, s.pages[static_cast<size_t>(k * m + j)]));
      }
    }
    uint8_t* rest = hs.rest.data.get() + header + ri * (slot_bytes_ + tail * page_bytes);
    NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(rest, r.fixed.as<char>() + s.slot * slot_bytes_,
                                               static_cast<size_t>(slot_bytes_), cudaMemcpyDeviceToHost, r.stream));
    for (int64_t j = 0; j < tail; ++j) {
      NUMOE_CUDA_RETURN_IF_ERROR(d2h(rest + slot_bytes_ + j * page_bytes, s.pages[static_cast<size_t>(whole * m + j)]));
    }
    NUMOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(r.stream));
  }
  return hs;
}

StatusOr<SequenceId> CudaModel::ImportSequence(const HostState& hs) {
  auto bad = [](const std::string& what) { return absl::InvalidArgumentError(absl::StrCat("ImportSequence: ", what)); };
  if (hs.page_tokens <= 0 || hs.page_tokens % page_tokens_ != 0) {
    return bad(absl::StrCat("page_tokens ", hs.page_tokens, " is not a positive multiple of ", page_tokens_));
  }
  if (hs.position < 0 || hs.position > max_context_ ||
      static_cast<int64_t>(hs.pages.size()) != hs.position / hs.page_tokens) {
    return bad(absl::StrCat(hs.pages.size(), " pages do not fit position ", hs.position));
  }
  const int64_t m = hs.page_tokens / page_tokens_, whole = hs.position / hs.page_tokens;
  const int64_t used = PagesFor(hs.position), tail = used - whole * m;
  const int64_t tp = static_cast<int64_t>(ranks_.size());
  const int64_t page_bytes = page_elems_ * (bf16_cache_ ? 2 : 4);
  const int64_t header = kHostHeaderWords * static_cast<int64_t>(sizeof(int64_t));
  if (tail < 0 || hs.rest.get() == nullptr || hs.rest.size != header + tp * (slot_bytes_ + tail * page_bytes)) {
    return bad("the rest of the state does not fit this model's layout");
  }
  const int64_t* head = reinterpret_cast<const int64_t*>(hs.rest.get());
  const int64_t want[kHostHeaderWords] = {kHostStateMagic, hs.position, tp, slot_bytes_, page_bytes, tail};
  if (!std::equal(want, want + kHostHeaderWords, head)) {
    return bad("the state was not exported by this backend with these options");
  }
  for (size_t k = 0; k < hs.pages.size(); ++k) {
    if (hs.pages[k].get() == nullptr || hs.pages[k].size != tp * m * page_bytes) {
      return bad(absl::StrCat("page ", k, " is missing or does not fit this model's layout"));
    }
  }
  if (free_slots_.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat("all ", opt_.max_sequences,
                                                     " sequence slots are in use (CudaOptions::max_sequences)"));
  }
  if (used > static_cast<int64_t>(free_pages_.size())) {
    return absl::ResourceExhaustedError(absl::StrCat("device KV cache full: importing a sequence needs ", used,
                                                     " pages but ", free_pages_.size(),
                                                     " are free (CudaOptions::cache_mb)"));
  }
  Seq s;
  s.slot = free_slots_.back();
  free_slots_.pop_back();
  s.position = hs.position;
  int32_t* table = table_h_.as<int32_t>();
  for (int64_t i = 0; i < used; ++i) {
    s.pages.push_back(free_pages_.back());
    free_pages_.pop_back();
    table[s.slot * max_pages_ + i] = s.pages.back();
  }
  const SequenceId id = next_id_++;
  seqs_[id] = s;
  auto copy = [&]() -> Status {
    for (int64_t ri = 0; ri < tp; ++ri) {
      Rank& r = *ranks_[static_cast<size_t>(ri)];
      NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r.device));
      auto h2d = [&](int64_t page, const uint8_t* from) {
        return cudaMemcpyAsync(r.pages.as<char>() + page * page_bytes, from, static_cast<size_t>(page_bytes),
                               cudaMemcpyHostToDevice, r.stream);
      };
      for (int64_t k = 0; k < whole; ++k) {
        const uint8_t* from = hs.pages[static_cast<size_t>(k)].get() + ri * m * page_bytes;
        for (int64_t j = 0; j < m; ++j) {
          NUMOE_CUDA_RETURN_IF_ERROR(h2d(s.pages[static_cast<size_t>(k * m + j)], from + j * page_bytes));
        }
      }
      const uint8_t* rest = hs.rest.get() + header + ri * (slot_bytes_ + tail * page_bytes);
      NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r.fixed.as<char>() + s.slot * slot_bytes_, rest,
                                                 static_cast<size_t>(slot_bytes_), cudaMemcpyHostToDevice, r.stream));
      for (int64_t j = 0; j < tail; ++j) {
        NUMOE_CUDA_RETURN_IF_ERROR(h2d(s.pages[static_cast<size_t>(whole * m + j)], rest + slot_bytes_ + j * page_bytes));
      }
      if (!s.pages.empty()) {
        NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r.table.as<int32_t>() + s.slot * max_pages_,
                                                   table + s.slot * max_pages_,
                                                   static_cast<size_t>(max_pages_) * sizeof(int32_t),
                                                   cudaMemcpyHostToDevice, r.stream));
      }
      // Done before the sequence's first step, whichever lane (stream) runs it.
      NUMOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(r.stream));
    }
    return absl::OkStatus();
  };
  if (Status st = copy(); !st.ok()) {
    (void)ReleaseSequence(id);  // the slot and pages go back
    return st;
  }
  return id;
}

Status CudaModel::ReleaseSequence(SequenceId seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " does not exist"));
  for (int32_t p : it->second.pages) free_pages_.push_back(p);
  free_slots_.push_back(it->second.slot);
  seqs_.erase(it);
  return absl::OkStatus();
}

Status CudaModel::Rollback(SequenceId seq, int64_t num_tokens) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " does not exist"));
  Seq& s = it->second;
  if (num_tokens < 0) return absl::InvalidArgumentError("Rollback: num_tokens must be >= 0");
  if (num_tokens == 0) return absl::OkStatus();
  if (!s.spec || s.position - num_tokens < s.spec_start) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", seq, ": can only roll back tokens of its last step, and only when it was speculative"));
  }
  // The device work (restore + replay) waits for the next Forward or Draft, where the rollbacks of all
  // sequences run together: a handful of launches per layer instead of per sequence.
  s.position -= num_tokens;
  s.replay = true;
  // Pages that only held entries past the new end go back to the pool (the table's stale tail is never read).
  while (static_cast<int64_t>(s.pages.size()) > PagesFor(s.position)) {
    free_pages_.push_back(s.pages.back());
    s.pages.pop_back();
  }
  return absl::OkStatus();
}

Status CudaModel::Settle(SequenceId seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " does not exist"));
  Seq& s = it->second;
  if (!s.spec) return absl::OkStatus();
  // The rollback's device work runs now (it would at the next Forward) and is waited for: the slot then holds
  // the state at `position` and its pre-step copy is no longer needed, so the sequence may be forked/exported.
  RETURN_IF_ERROR(FlushRollbacks(&s));
  for (auto& r : ranks_) {
    NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r->device));
    NUMOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(r->stream));
  }
  s.spec = false;
  return absl::OkStatus();
}

Status CudaModel::FlushRollbacks(const Seq* only) {
  std::vector<Seq*> pending;
  for (auto& [id, s] : seqs_) {
    if (s.replay && (only == nullptr || &s == only)) pending.push_back(&s);
  }
  if (pending.empty()) return absl::OkStatus();
  for (auto& r : ranks_) {
    NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r->device));
    for (Seq* s : pending) {
      NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r->fixed.as<char>() + s->slot * slot_bytes_,
                                                 r->snap.as<char>() + s->slot * slot_bytes_,
                                                 static_cast<size_t>(slot_bytes_), cudaMemcpyDeviceToDevice,
                                                 r->stream));
    }
    Status st = bf16_cache_ ? EnqueueReplay<__nv_bfloat16>(*r, pending) : EnqueueReplay<float>(*r, pending);
    RETURN_IF_ERROR(st);
  }
  for (Seq* s : pending) s->replay = false;
  return absl::OkStatus();
}

// On the restored copies of the states at spec_start: the window ring and compressor updates of the kept rows
// (spec_start .. position) of every pending sequence, from the log, as passes of at most rows_cap_ rows
// (a sequence longer than that is cut into consecutive pieces, like a chunked step).
template <typename T>
Status CudaModel::EnqueueReplay(Rank& r, const std::vector<Seq*>& pending) {
  const int64_t NR = rows_cap_;
  struct Piece {
    const Seq* s;
    int64_t t0, n;
  };
  std::vector<std::vector<Piece>> chunks(1);
  int64_t rows = 0;
  for (const Seq* s : pending) {
    for (int64_t t0 = 0; t0 < s->position - s->spec_start; t0 += NR) {
      const int64_t n = std::min(NR, s->position - s->spec_start - t0);
      if (rows + n > NR) {
        chunks.emplace_back();
        rows = 0;
      }
      chunks.back().push_back(Piece{s, t0, n});
      rows += n;
    }
  }
  int32_t* meta = meta_h_.as<int32_t>();
  const CacheDev cache = CacheOf(r);
  char* log = r.spec_log.as<char>();
  const int32_t spec_t = static_cast<int32_t>(spec_tokens_);
  for (const auto& chunk : chunks) {
    if (chunk.empty()) continue;
    PassDims d;
    const StepMeta m = StepMeta::At(meta, NR);
    int csa_windows = 0, hca_windows = 0;
    for (size_t i = 0; i < chunk.size(); ++i) {
      const Piece& p = chunk[i];
      const int64_t start = p.s->spec_start + p.t0, end = start + p.n;
      for (int64_t t = 0; t < p.n; ++t) {
        m.pos[d.n + t] = static_cast<int32_t>(start + t);
        m.seq[d.n + t] = static_cast<int32_t>(i);
        m.spec_map[d.n + t] = static_cast<int32_t>(p.s->slot * spec_tokens_ + p.t0 + t);
      }
      m.SetSeq(static_cast<int64_t>(i), p.s->slot, d.n, d.n + p.n, start);
      auto closing = [&](int64_t rate) { return rate > 0 ? static_cast<int>(end / rate - start / rate) : 0; };
      csa_windows = std::max(csa_windows, closing(cfg_.csa_rate));
      hca_windows = std::max(hca_windows, closing(cfg_.hca_rate));
      d.n += p.n;
    }
    d.num_seqs = static_cast<int64_t>(chunk.size());
    NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r.sc.meta, meta, StepMeta::Bytes(NR),
                                               cudaMemcpyHostToDevice, r.stream));
    const StepDev step = StepOf(r, d);
    const int32_t* map = StepMeta::At(r.sc.meta, NR).spec_map;
    T* kv = static_cast<T*>(r.sc.kvT);
    const int64_t kv_bytes = hd_ * static_cast<int64_t>(sizeof(T));
    auto ring = [&](const LayerDev& L) {
      LoadSpecRows(log + L.st.log_kv_off, spec_slot_bytes_, kv_bytes, spec_t, map, d.n, kv, kv_bytes, r.stream);
      RingUpdate<T>(kv, static_cast<int>(hd_), static_cast<int>(cfg_.sliding_window), L.st.ring_off, step, cache,
                    r.stream);
    };
    for (const LayerDev& L : r.layers) {
      ring(L);
      if (L.type == AttnType::kSliding) continue;
      const int64_t w = L.st.log_comp_w;
      LoadSpecRows(log + L.st.log_comp_off, spec_slot_bytes_, w * 4, spec_t, map, d.n, r.sc.comp, w * 4, r.stream);
      const int windows = L.type == AttnType::kCSA ? csa_windows : hca_windows;
      CompressStep<T>(LayerCompJobs(r, L, r.sc.comp, w), step, cache, windows, r.stream);
    }
    for (const LayerDev& S : r.stages) ring(S);
    NUMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    // The staging buffer is rewritten by the next chunk, rank or pass: wait for this copy first.
    NUMOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(r.stream));
  }
  return absl::OkStatus();
}

StatusOr<SequenceMemory> CudaModel::Memory(SequenceId seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " does not exist"));
  const int64_t tsize = bf16_cache_ ? 2 : 4, tp = static_cast<int64_t>(ranks_.size());
  const int64_t P = it->second.position;
  SequenceMemory m;
  m.position = P;
  m.fixed_bytes = slot_bytes_ * tp;
  for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l) {
    const AttnType t = cfg_.layer_types[static_cast<size_t>(l)];
    if (t == AttnType::kCSA) m.growing_bytes += P / cfg_.csa_rate * (hd_ + cfg_.index_head_dim) * tsize * tp;
    if (t == AttnType::kHCA) m.growing_bytes += P / cfg_.hca_rate * hd_ * tsize * tp;
  }
  m.capacity_bytes = static_cast<int64_t>(it->second.pages.size()) * page_elems_ * tsize * tp + m.fixed_bytes;
  return m;
}

Status CudaModel::FillRandomContext(SequenceId seq, int64_t position, uint64_t seed) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " does not exist"));
  Seq& s = it->second;
  if (s.position != 0) return absl::FailedPreconditionError("FillRandomContext: the sequence must be new");
  if (position < 0 || position > max_context_) {
    return absl::ResourceExhaustedError(absl::StrCat("FillRandomContext: ", position, " tokens exceed max_context ",
                                                     max_context_));
  }
  RETURN_IF_ERROR(EnsurePages({&s}, {position}));
  for (auto& r : ranks_) {
    NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r->device));
    char* slot = static_cast<char*>(r->fixed.get()) + s.slot * slot_bytes_;
    for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l) {
      const int64_t ring = cfg_.sliding_window * hd_;
      void* p = slot + layout_[static_cast<size_t>(l)].ring_off;
      if (bf16_cache_) {
        FillUniformBf16(static_cast<__nv_bfloat16*>(p), ring, 1.0f, seed + l, r->stream);
      } else {
        FillUniformF32(static_cast<float*>(p), ring, -1.0f, 1.0f, seed + l, r->stream);
      }
    }
    for (int32_t page : s.pages) {
      void* p = static_cast<char*>(r->pages.get()) + page * page_elems_ * (bf16_cache_ ? 2 : 4);
      if (bf16_cache_) {
        FillUniformBf16(static_cast<__nv_bfloat16*>(p), page_elems_, 1.0f, seed + 7919 * page, r->stream);
      } else {
        FillUniformF32(static_cast<float*>(p), page_elems_, -1.0f, 1.0f, seed + 7919 * page, r->stream);
      }
    }
    NUMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    NUMOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(r->stream));
  }
  s.position = position;
  s.spec = false;
  return absl::OkStatus();
}

// The DSpark draft pass (cuda_dspark.cc) runs the stages through the same attention phase.
template void CudaModel::PhaseAttention<float>(Rank&, int, const PassDims&, float*, const float*);
template void CudaModel::PhaseAttention<__nv_bfloat16>(Rank&, int, const PassDims&, float*, const float*);

}  // namespace numoe::cuda
