// The DSpark drafter on the CUDA backend (docs/dsv4-architecture.md §4.2; backends/cpu/dspark.cc is the
// reference). Forward feeds each stage's ring with rope(kv_norm(main_x · Wkvᵀ)) of every step's rows, where
// main_x = RMSNorm(features · main_projᵀ) and the features are the stream means of the target layers' inputs
// (collected by EnqueueSegment). Draft runs the stages over [next token, noise × (depth - 1)] as one device
// pass per stage (bidirectional block attention over the ring, the routed experts through the ExpertBackend
// as layer num_hidden_layers + stage, or on the device with CudaOptions::drafter_experts = "gpu"), the last stage's head, then the sequential Markov correction: one
// small device GEMM per draft position for all sequences, sampled on the host with each sequence's sampler.
#include <algorithm>
#include <cstring>
#include <set>

#include "backends/cuda/cuda_model_internal.h"
#include "model/sampling.h"

namespace numoe::cuda {

template <typename T>
void CudaModel::PhaseDrafterFeed(Rank& r, const PassDims& d) {
  const ModelConfig& c = cfg_;
  const int64_t n = d.n, T_ = static_cast<int64_t>(target_layers_.size());
  const float eps = static_cast<float>(c.rms_norm_eps);
  Scratch& s = r.sc;
  const StepDev step = StepOf(r, d);
  const CacheDev cache = CacheOf(r);
  Gemm(r, r.main_proj, r.features, T_ * D_, n, r.main_x, D_);
  RmsNormRows(r.main_x, n, D_, r.main_norm, eps, r.stream);
  for (const LayerDev& S : r.stages) {
    const DevW wkv = S.qkv_fused ? S.wq_a.Rows(c.q_lora_rank, hd_) : S.wkv;
    Gemm(r, wkv, r.main_x, D_, n, s.o, hd_);
    NormRopeJobs<T> kv;
    kv.j[kv.count++] = {s.o, 1, static_cast<int>(hd_), hd_, S.kv_norm, true, eps, static_cast<int>(c.rope_dim),
                        r.inv_main, static_cast<T*>(s.kvT)};
    NormRope<T>(kv, n, step.pos, r.stream);
    if (d.spec) {
      const int64_t tsize = sizeof(T);
      SaveSpecRows(s.kvT, hd_ * tsize, hd_ * tsize, n, StepMeta::At(s.meta, rows_cap_).spec_map,
                   static_cast<int32_t>(spec_tokens_), static_cast<char*>(r.spec_log.get()) + S.st.log_kv_off,
                   spec_slot_bytes_, hd_ * tsize, r.stream);
    }
    RingUpdate<T>(static_cast<const T*>(s.kvT), static_cast<int>(hd_), static_cast<int>(c.sliding_window),
                  S.st.ring_off, step, cache, r.stream);
  }
}

template void CudaModel::PhaseDrafterFeed<float>(Rank&, const PassDims&);
template void CudaModel::PhaseDrafterFeed<__nv_bfloat16>(Rank&, const PassDims&);

Status CudaModel::Draft(std::span<const DraftRequest> requests, ExpertBackend* experts,
                        std::vector<DraftResult>* out) {
  if (stages_ == 0) return absl::UnimplementedError("this CUDA backend has no DSpark drafter loaded");
  if (experts == nullptr && !gpu_dx_) return absl::InvalidArgumentError("Draft: no expert backend");
  RETURN_IF_ERROR(UseLane(experts != nullptr ? experts->lane() : 0));
  RETURN_IF_ERROR(FlushRollbacks());  // the stages' rings of rolled-back sequences
  return bf16_cache_ ? RunDraft<__nv_bfloat16>(requests, experts, out) : RunDraft<float>(requests, experts, out);
}

template <typename T>
Status CudaModel::RunDraft(std::span<const DraftRequest> requests, ExpertBackend* experts,
                           std::vector<DraftResult>* out) {
  const ModelConfig& c = cfg_;
  const int64_t V = c.vocab_size, mr = markov_rank_, NR = rows_cap_, LR = logit_rows_cap_;
  const int L = static_cast<int>(c.num_hidden_layers);
  // Rows: each request's block [next_token, noise...] at positions position .. position + depth - 1.
  int32_t* meta = meta_h_.as<int32_t>();
  const StepMeta rows = StepMeta::At(meta, NR);
  std::vector<int64_t> begin(requests.size());
  int64_t n = 0, max_depth = 0;
  std::vector<int64_t> row_seqs;  // MoeRequest::seqs
  std::set<SequenceId> seen;
  for (size_t i = 0; i < requests.size(); ++i) {
    const DraftRequest& q = requests[i];
    auto it = seqs_.find(q.seq);
    if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", q.seq, " does not exist"));
    if (!seen.insert(q.seq).second) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", q.seq, " appears twice in one Draft call"));
    }
    RETURN_IF_ERROR(ValidateDraftRequest(q, V));
    const int64_t p0 = it->second.position;
    if (p0 < 1) return absl::FailedPreconditionError("Draft: the sequence has consumed no token");
    if (n + q.depth > NR) {
      return absl::ResourceExhaustedError(absl::StrCat("Draft: ", n + q.depth, " draft rows exceed the ", NR,
                                                       " rows of one device pass (CudaOptions::max_step_tokens)"));
    }
    if (q.depth > LR) {
      return absl::ResourceExhaustedError(absl::StrCat("Draft: depth ", q.depth, " exceeds ", LR, " logit rows"));
    }
    begin[i] = n;
    for (int64_t t = 0; t < q.depth; ++t) {
      rows.token[n + t] = t == 0 ? q.next_token : noise_token_;
      rows.pos[n + t] = static_cast<int32_t>(p0 + t);
      rows.seq[n + t] = static_cast<int32_t>(i);
      rows.logit_rows[n + t] = static_cast<int32_t>(n + t);
      rows.spec_map[n + t] = -1;
    }
    rows.SetSeq(static_cast<int64_t>(i), it->second.slot, n, n + q.depth, p0);
    row_seqs.insert(row_seqs.end(), static_cast<size_t>(q.depth), q.seq);
    n += q.depth;
    max_depth = std::max(max_depth, q.depth);
  }
  out->clear();
  if (n == 0) return absl::OkStatus();
  PassDims d;
  d.n = n;
  d.num_seqs = static_cast<int64_t>(requests.size());
  d.logit_rows = n;
  d.draft = true;
  Rank& r = *ranks_[0];
  Scratch& s = r.sc;
  NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r.device));
  NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.meta, meta, StepMeta::Bytes(NR),
                                             cudaMemcpyHostToDevice, r.stream));
  Embed(r.embed, StepMeta::At(s.meta, rows_cap_).token, n, static_cast<int>(hc_), s.X, r.stream);
  MoeRequest req;
  req.seqs = row_seqs.data();
  req.rows = n;
  req.top_k = c.num_experts_per_tok;
  req.x = y_h_.as<float>();
  req.expert_ids = ids_h_.as<int32_t>();
  req.expert_weights = wts_h_.as<float>();
  req.out = routed_h_.as<float>();
  for (int64_t st = 0; st < stages_; ++st) {
    const int l = L + static_cast<int>(st);
    PhaseAttention<T>(r, l, d);
    PhaseFfnPre(r, l, d);
    NUMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    if (!GpuStageExperts(l)) {  // else PhaseFfnPre ran the stage's routed experts on the device
      NUMOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(r.stream));
      req.layer = l;
      RETURN_IF_ERROR(experts->RunRouted(req));
    }
    PhaseSharedAndRouted(r, l, d);
    PhaseFfnPost(r, d);
  }
  // The last stage's head: hc_head collapse (u kept for the confidence), norm, the shared head.
  HcPreStep(r, n, r.d_hc_head_fn, r.d_hc_head_base, r.d_hc_head_scale, r.d_norm, /*head=*/true, r.h_pre);
  std::vector<float> logits(static_cast<size_t>(n * V)), h_pre(static_cast<size_t>(n * D_));
  NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(h_pre.data(), r.h_pre, h_pre.size() * sizeof(float),
                                             cudaMemcpyDeviceToHost, r.stream));
  for (int64_t row0 = 0; row0 < n; row0 += LR) {
    const int64_t rows = std::min(LR, n - row0);
    Gemm(r, r.head, s.xn + row0 * D_, D_, rows, s.logits, V);
    NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(logits.data() + row0 * V, s.logits,
                                               static_cast<size_t>(rows * V) * sizeof(float), cudaMemcpyDeviceToHost,
                                               r.stream));
    NUMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    NUMOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(r.stream));
  }

  // Markov correction, position by position: bias_b = markov_w2 · markov_w1[prev_b] for every sequence still
  // drafting, then each sequence samples its draft and it becomes the next prev.
  out->resize(requests.size());
  std::vector<int32_t> prev(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    (*out)[i].seq = requests[i].seq;
    prev[i] = requests[i].next_token;
  }
  std::vector<float> bias, m;
  for (int64_t t = 0; t < max_depth; ++t) {
    std::vector<size_t> act;
    for (size_t i = 0; i < requests.size(); ++i) {
      if (requests[i].depth > t) act.push_back(i);
    }
    for (size_t a0 = 0; a0 < act.size(); a0 += static_cast<size_t>(LR)) {
      const size_t B = std::min(act.size() - a0, static_cast<size_t>(LR));
      std::vector<int32_t> ids(B);
      for (size_t b = 0; b < B; ++b) ids[b] = prev[act[a0 + b]];
      NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r.mids, ids.data(), B * sizeof(int32_t), cudaMemcpyHostToDevice,
                                                 r.stream));
      if (r.markov_w1.type == WType::kBF16) {
        GatherBf16Rows(static_cast<const __nv_bfloat16*>(r.markov_w1.data), mr, r.mids, static_cast<int64_t>(B),
                       r.mrows, r.stream);
      } else {
        GatherRows(static_cast<const float*>(r.markov_w1.data), mr, r.mids, static_cast<int64_t>(B), r.mrows,
                   r.stream);
      }
      // fp32 SIMT: the drafts' distributions feed the rejection test, keep them close to the reference.
      Gemm(r, r.markov_w2, r.mrows, mr, static_cast<int64_t>(B), s.logits, V, false);
      bias.resize(B * static_cast<size_t>(V));
      m.resize(B * static_cast<size_t>(mr));
      NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(bias.data(), s.logits, bias.size() * sizeof(float),
                                                 cudaMemcpyDeviceToHost, r.stream));
      NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(m.data(), r.mrows, m.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                                 r.stream));
      NUMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      NUMOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(r.stream));
      for (size_t b = 0; b < B; ++b) {
        const size_t i = act[a0 + b];
        const int64_t row = begin[i] + t;
        float* lr = logits.data() + row * V;
        const float* br = bias.data() + b * static_cast<size_t>(V);
        for (int64_t v = 0; v < V; ++v) lr[v] += br[v];
        Sampler* sampler = requests[i].sampler;
        const int32_t dtok = sampler != nullptr ? sampler->SampleDraft(lr, V) : Argmax(lr, V);
        DraftResult& res = (*out)[i];
        res.tokens.push_back(dtok);
        res.logits.insert(res.logits.end(), lr, lr + V);
        float conf = 0.0f;
        const float* h = h_pre.data() + row * D_;
        for (int64_t k = 0; k < D_; ++k) conf += confidence_[static_cast<size_t>(k)] * h[k];
        for (int64_t k = 0; k < mr; ++k) {
          conf += confidence_[static_cast<size_t>(D_ + k)] * m[b * static_cast<size_t>(mr) + static_cast<size_t>(k)];
        }
        res.confidence.push_back(conf);
        prev[i] = dtok;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace numoe::cuda
