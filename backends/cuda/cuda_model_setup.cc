// CUDA backend: validation of options, weight upload per rank, state layout, scratch, NCCL, factories.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <sstream>

#include "common/log.h"
#include "backends/cuda/cuda_model_internal.h"

namespace numoe {
namespace cuda {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

DevW F32Matrix(const float* data, int64_t out, int64_t in) {
  DevW w;
  w.type = WType::kF32;
  w.data = data;
  w.out = out;
  w.in = in;
  return w;
}

int64_t MatrixBytes(const DevW& w) {
  int64_t b = w.data_bytes();
  if (w.type == WType::kFP8) b += CeilDiv(w.out, w.bo) * CeilDiv(w.in, w.bi) * 4;
  return b;
}

}  // namespace

Status NcclError(ncclResult_t r, const char* what, const char* file, int line) {
  return absl::InternalError(absl::StrCat("NCCL error ", ncclGetErrorString(r), " in ", what, " at ", file, ":", line));
}

Rank::~Rank() {
  (void)cudaSetDevice(device);
  for (cudaEvent_t e : ev_begin) (void)cudaEventDestroy(e);
  for (cudaEvent_t e : ev_end) (void)cudaEventDestroy(e);
  if (ev_hop != nullptr) (void)cudaEventDestroy(ev_hop);
  if (comm != nullptr) (void)ncclCommDestroy(comm);
  if (stream != nullptr) (void)cudaStreamDestroy(stream);
}

CudaModel::CudaModel(const ModelConfig& cfg, const CudaOptions& opt) : cfg_(cfg), opt_(opt), bf16_cache_(!opt.fp32 && opt.bf16_cache) {}

CudaModel::~CudaModel() {
  ReleaseHostExperts();
  for (auto& [key, execs] : graphs_) {
    for (cudaGraphExec_t e : execs) (void)cudaGraphExecDestroy(e);
  }
  // The inactive lanes' resources (the active lane's are in ranks_[0] and the members).
  if (!ranks_.empty()) (void)cudaSetDevice(ranks_[0]->device);
  for (Lane& l : lanes_) {
    for (auto& [key, execs] : l.graphs) {
      for (cudaGraphExec_t e : execs) (void)cudaGraphExecDestroy(e);
    }
    for (cudaEvent_t e : l.ev_begin) (void)cudaEventDestroy(e);
    for (cudaEvent_t e : l.ev_end) (void)cudaEventDestroy(e);
    if (l.ev_hop != nullptr) (void)cudaEventDestroy(l.ev_hop);
    if (l.stream != nullptr) (void)cudaStreamDestroy(l.stream);
  }
  for (auto& r : ranks_) {
    (void)cudaSetDevice(r->device);
    (void)cudaStreamSynchronize(r->stream);
  }
}

StatusOr<std::unique_ptr<CudaModel>> CudaModel::Create(const Checkpoint* ckpt, const ModelConfig& cfg,
                                                       const CudaOptions& opt, uint64_t seed) {
  // Validate: every limit of the kernels and of tensor parallelism is checked here, by field name.
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    return absl::UnavailableError("no CUDA device (cudaGetDeviceCount found none or the driver is missing)");
  }
  if (opt.tp < 1) return absl::InvalidArgumentError(absl::StrCat("CudaOptions::tp must be >= 1 (got ", opt.tp, ")"));
  if (!opt.devices.empty()) {
    if (static_cast<int>(opt.devices.size()) != opt.tp) {
      return absl::InvalidArgumentError(absl::StrCat("CudaOptions::devices lists ", opt.devices.size(),
                                                     " GPU(s) but CudaOptions::tp = ", opt.tp));
    }
    for (size_t i = 0; i < opt.devices.size(); ++i) {
      const int d = opt.devices[i];
      if (d < 0 || d >= devices) {
        return absl::InvalidArgumentError(
            absl::StrCat("CudaOptions::devices: GPU ", d, " requested but ", devices, " CUDA device(s) are visible"));
      }
      for (size_t j = 0; j < i; ++j) {
        if (opt.devices[j] == d) {
          return absl::InvalidArgumentError(absl::StrCat("CudaOptions::devices: GPU ", d, " listed twice"));
        }
      }
    }
  } else if (opt.device < 0 || opt.device + opt.tp > devices) {
    return absl::InvalidArgumentError(absl::StrCat("CudaOptions::device = ", opt.device, ", CudaOptions::tp = ", opt.tp,
                                                   ": devices ", opt.device, "..", opt.device + opt.tp - 1,
                                                   " requested but ", devices, " CUDA device(s) are visible"));
  }
  if (cfg.num_attention_heads % opt.tp != 0 || cfg.o_groups % opt.tp != 0 || cfg.moe_intermediate_size % opt.tp != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CudaOptions::tp = ", opt.tp, " must divide num_attention_heads (", cfg.num_attention_heads, "), o_groups (",
        cfg.o_groups, ") and moe_intermediate_size (", cfg.moe_intermediate_size, ")"));
  }
  if (opt.max_sequences < 1 || opt.max_step_tokens < 1 || opt.max_context < 0 || opt.cache_mb < 0) {
    return absl::InvalidArgumentError(
        "CudaOptions: max_sequences and max_step_tokens must be >= 1, max_context and cache_mb >= 0");
  }
  if (opt.max_spec_tokens < 0 || opt.max_spec_tokens > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaOptions::max_spec_tokens must be in [0, 4096] (got ", opt.max_spec_tokens, ")"));
  }
  if (opt.drafter_experts != "worker" && opt.drafter_experts != "gpu") {
    return absl::InvalidArgumentError(absl::StrCat("CudaOptions::drafter_experts must be \"worker\" or \"gpu\" (got \"",
                                                   opt.drafter_experts, "\")"));
  }
  if (cfg.head_dim % 2 != 0 || cfg.head_dim > 512 || cfg.rope_dim % 2 != 0 || cfg.rope_dim > cfg.head_dim) {
    return absl::UnimplementedError(absl::StrCat("CUDA attention supports even head_dim <= 512 with an even rope dim (got ",
                                                 cfg.head_dim, ", rope ", cfg.rope_dim, ")"));
  }
  if (cfg.index_n_heads > 64 || cfg.index_head_dim % 4 != 0 || cfg.index_head_dim < cfg.rope_dim ||
      cfg.index_n_heads * cfg.index_head_dim > 11264) {
    return absl::UnimplementedError(absl::StrCat("CUDA indexer supports <= 64 heads, head dim a multiple of 4 and heads x dim <= 11264 (got ",
                                                 cfg.index_n_heads, " x ", cfg.index_head_dim, ")"));
  }
  if (cfg.hc_mult > 8 || cfg.num_experts_per_tok > 16 || cfg.n_routed_experts > 8192) {
    return absl::UnimplementedError("CUDA backend supports hc_mult <= 8, top-k <= 16 and <= 8192 routed experts");
  }
  auto m = std::unique_ptr<CudaModel>(new CudaModel(cfg, opt));
  RETURN_IF_ERROR(m->Setup(ckpt, seed));
  return m;
}

int64_t CudaModel::PagesFor(int64_t position) const {
  if (page_elems_ == 0) return 0;
  int64_t need = 0;
  for (int64_t rate : {cfg_.csa_rate, cfg_.hca_rate}) {
    if (rate <= 0 || position / rate < 1) continue;
    const int64_t e = position / rate - 1;
    need = std::max(need, e * rate / page_tokens_ + 1);
  }
  return need;
}

void CudaModel::ComputeLayout() {
  const int64_t tsize = bf16_cache_ ? 2 : 4;
  const int64_t W = cfg_.sliding_window, id = cfg_.index_head_dim;
  int64_t lcm = 1;
  bool any = false;
  for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l) {
    const int64_t rate = cfg_.CompressRate(l);
    if (rate > 0) {
      lcm = std::lcm(lcm, rate);
      any = true;
    }
  }
  page_tokens_ = lcm * CeilDiv(512, lcm);
  int64_t off = 0, pe = 0;
  layout_.assign(static_cast<size_t>(cfg_.num_hidden_layers), LayerState{});
  for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l) {
    LayerState& st = layout_[static_cast<size_t>(l)];
    const AttnType type = cfg_.layer_types[static_cast<size_t>(l)];
    st.ring_off = off;
    off += RoundUp(W * hd_ * tsize, 256);
    if (type == AttnType::kSliding) continue;
    const int64_t rate = cfg_.CompressRate(l), coff = type == AttnType::kCSA ? 2 : 1;
    st.c_pend_kv = off;
    off += RoundUp(rate * coff * hd_ * 4, 256);
    st.c_pend_gate = off;
    off += RoundUp(rate * coff * hd_ * 4, 256);
    st.epp = static_cast<int32_t>(page_tokens_ / rate);
    st.c_page_off = pe;
    pe += RoundUp(st.epp * hd_, 8);
    if (type == AttnType::kCSA) {
      st.c_prev_kv = off;
      off += RoundUp(rate * hd_ * 4, 256);
      st.c_prev_gate = off;
      off += RoundUp(rate * hd_ * 4, 256);
      st.i_pend_kv = off;
      off += RoundUp(rate * 2 * id * 4, 256);
      st.i_pend_gate = off;
      off += RoundUp(rate * 2 * id * 4, 256);
      st.i_prev_kv = off;
      off += RoundUp(rate * id * 4, 256);
      st.i_prev_gate = off;
      off += RoundUp(rate * id * 4, 256);
      st.i_page_off = pe;
      pe += RoundUp(st.epp * id, 8);
    }
  }
  stage_layout_.assign(static_cast<size_t>(stages_), LayerState{});
  for (LayerState& st : stage_layout_) {  // the DSpark stages' rings of target-feature keys
    st.ring_off = off;
    off += RoundUp(W * hd_ * tsize, 256);
  }
  slot_bytes_ = std::max<int64_t>(off, 256);
  // The speculative log of one slot: per layer the window keys, then the compressor inputs (SetupLayer's
  // column order: main kv, main gate, indexer kv, indexer gate, indexer weights - the last is not state).
  spec_tokens_ = opt_.max_spec_tokens;
  int64_t lo = 0;
  for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l) {
    LayerState& st = layout_[static_cast<size_t>(l)];
    const AttnType type = cfg_.layer_types[static_cast<size_t>(l)];
    st.log_kv_off = lo;
    lo += RoundUp(spec_tokens_ * hd_ * tsize, 256);
    if (type == AttnType::kSliding) continue;
    st.log_comp_w = type == AttnType::kCSA ? 4 * hd_ + 4 * id : 2 * hd_;
    st.log_comp_off = lo;
    lo += RoundUp(spec_tokens_ * st.log_comp_w * 4, 256);
  }
  for (LayerState& st : stage_layout_) {
    st.log_kv_off = lo;
    lo += RoundUp(spec_tokens_ * hd_ * tsize, 256);
  }
  spec_slot_bytes_ = spec_tokens_ > 0 ? lo : 0;
  page_elems_ = any ? RoundUp(pe, 64) : 0;
  max_pages_ = std::max<int64_t>(PagesFor(max_context_), 1);
}

Status CudaModel::Setup(const Checkpoint* ckpt, uint64_t seed) {
  const ModelConfig& c = cfg_;
  hc_ = c.hc_mult;
  D_ = c.hidden_size;
  hd_ = c.head_dim;
  Hl_ = c.num_attention_heads / opt_.tp;
  Gl_ = c.o_groups / opt_.tp;
  Il_ = c.moe_intermediate_size / opt_.tp;
  max_context_ = opt_.max_context > 0 ? opt_.max_context
                                      : std::min<int64_t>(c.max_position_embeddings > 0 ? c.max_position_embeddings : 131072,
                                                          131072);
  rows_cap_ = opt_.max_step_tokens;
  logit_rows_cap_ = std::min<int64_t>(rows_cap_, std::max<int64_t>(opt_.max_sequences, 16));
  if (ckpt != nullptr && opt_.drafter && ckpt->mtp_stages() > 0 && c.dspark_block_size > 0 &&
      ckpt->store().Find("mtp.0.main_proj.weight") != nullptr) {
    if (opt_.tp > 1) {
      NLOG(WARNING) << "CUDA backend: the DSpark drafter is not loaded with tp > 1";
    } else {
      for (int64_t t : c.dspark_target_layer_ids) {
        if (t < 0 || t >= c.num_hidden_layers) {
          return absl::InvalidArgumentError(absl::StrCat("dspark_target_layer_ids: layer ", t, " is out of range"));
        }
      }
      if (c.dspark_noise_token_id < 0 || c.dspark_noise_token_id >= c.vocab_size || c.dspark_markov_rank <= 0 ||
          c.dspark_target_layer_ids.empty()) {
        return absl::InvalidArgumentError(
            "dspark_noise_token_id, dspark_markov_rank or dspark_target_layer_ids: bad DSpark config");
      }
      stages_ = ckpt->mtp_stages();
      target_layers_ = c.dspark_target_layer_ids;
      noise_token_ = static_cast<int32_t>(c.dspark_noise_token_id);
      markov_rank_ = c.dspark_markov_rank;
    }
  }
  ComputeLayout();

  if (opt_.tp > 1) setenv("NCCL_NVLS_ENABLE", "0", 0);  // never NVLink multicast (shared hosts)
  const WeightSource src(ckpt, c, opt_.fp32, opt_.fp8_weights, seed);
  for (int i = 0; i < opt_.tp; ++i) {
    auto r = std::make_unique<Rank>();
    r->index = i;
    r->device = opt_.devices.empty() ? opt_.device + i : opt_.devices[i];
    ranks_.push_back(std::move(r));
  }
  for (auto& r : ranks_) RETURN_IF_ERROR(SetupRank(*r, src, seed));
  if (stages_ > 0 && opt_.drafter_experts == "gpu") RETURN_IF_ERROR(SetupDrafterExperts(*ranks_[0], *ckpt));
  // The page pool: what was asked for, or every slot at max_context capped at half the free memory.
  const int64_t tsize = bf16_cache_ ? 2 : 4;
  const int64_t page_bytes = page_elems_ * tsize;
  if (page_bytes > 0) {
    int64_t want = opt_.cache_mb > 0 ? (opt_.cache_mb << 20) : opt_.max_sequences * max_pages_ * page_bytes;
    if (opt_.cache_mb == 0) {
      for (auto& r : ranks_) {
        NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r->device));
        size_t free_b = 0, total_b = 0;
        NUMOE_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_b, &total_b));
        want = std::min<int64_t>(want, static_cast<int64_t>(free_b) / 2);
      }
    }
    num_pages_ = std::max<int64_t>(want / page_bytes, 1);
  }
  for (auto& r : ranks_) RETURN_IF_ERROR(SetupState(*r));
  for (int64_t p = num_pages_ - 1; p >= 0; --p) free_pages_.push_back(static_cast<int32_t>(p));
  for (int64_t s = opt_.max_sequences - 1; s >= 0; --s) free_slots_.push_back(static_cast<int32_t>(s));

  RETURN_IF_ERROR(AllocStaging());
  // Lane 0's resources are the ones just allocated (Capabilities::lanes); the others come on first use.
  const bool lanes = opt_.lanes > 0 && opt_.tp == 1 && stages_ == 0;
  lanes_.resize(lanes ? static_cast<size_t>(opt_.lanes + 1) : 1);
  lanes_[0].ready = true;
  ASSIGN_OR_RETURN(table_h_, PinnedMem::Alloc(static_cast<size_t>(opt_.max_sequences * max_pages_) * sizeof(int32_t),
                                              "page tables"));

  if (opt_.tp > 1) {
    std::vector<ncclComm_t> comms(static_cast<size_t>(opt_.tp));
    std::vector<int> devs;
    for (auto& r : ranks_) devs.push_back(r->device);
    NUMOE_NCCL_RETURN_IF_ERROR(ncclCommInitAll(comms.data(), opt_.tp, devs.data()));
    for (size_t i = 0; i < comms.size(); ++i) ranks_[i]->comm = comms[i];
  }
  for (auto& r : ranks_) {
    NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r->device));
    NUMOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(r->stream));
  }
  NLOG(INFO) << "CUDA backend ready: " << Describe();
  return absl::OkStatus();
}

Status CudaModel::SetupRank(Rank& r, const WeightSource& src, uint64_t seed) {
  NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r.device));
  NUMOE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  NUMOE_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, r.device));
  if (prop.major < 8) {
    return absl::UnavailableError(absl::StrCat("device ", r.device, " (", prop.name, ") is sm_", prop.major, prop.minor,
                                               "; the CUDA backend needs sm_80 or newer"));
  }
  r.sms = prop.multiProcessorCount;
  const ModelConfig& c = cfg_;
  const int64_t V = c.vocab_size;
  ASSIGN_OR_RETURN(StagedMatrix emb, src.Matrix("embed.weight", V, D_));
  ASSIGN_OR_RETURN(r.embed, Upload(emb, seed, r.stream, &r.keep));
  ASSIGN_OR_RETURN(StagedMatrix head, src.Matrix(c.tie_word_embeddings ? "embed.weight" : "head.weight", V, D_));
  ASSIGN_OR_RETURN(r.head, Upload(head, seed + 1, r.stream, &r.keep));
  r.weight_bytes += MatrixBytes(r.head);
  ASSIGN_OR_RETURN(std::vector<float> v, src.Vector("norm.weight", D_));
  ASSIGN_OR_RETURN(r.norm, UploadF32(v, "norm.weight", r.stream, &r.keep));
  ASSIGN_OR_RETURN(v, src.Vector("hc_head_fn", hc_ * hc_ * D_));
  ASSIGN_OR_RETURN(const float* fn, UploadF32(v, "hc_head_fn", r.stream, &r.keep));
  r.hc_head_fn = F32Matrix(fn, hc_, hc_ * D_);
  r.weight_bytes += MatrixBytes(r.hc_head_fn);
  ASSIGN_OR_RETURN(v, src.Vector("hc_head_base", hc_));
  ASSIGN_OR_RETURN(r.hc_head_base, UploadF32(v, "hc_head_base", r.stream, &r.keep));
  ASSIGN_OR_RETURN(v, src.Vector("hc_head_scale", 1));
  ASSIGN_OR_RETURN(r.hc_head_scale, UploadF32(v, "hc_head_scale", r.stream, &r.keep));
  ASSIGN_OR_RETURN(r.inv_main, UploadF32(RopeInvFreq(c.rope_main, c.rope_dim), "rope", r.stream, &r.keep));
  ASSIGN_OR_RETURN(r.inv_compress, UploadF32(RopeInvFreq(c.rope_compress, c.rope_dim), "rope", r.stream, &r.keep));
  r.layers.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) RETURN_IF_ERROR(SetupLayer(r, src, l, seed));
  if (stages_ > 0) RETURN_IF_ERROR(SetupDrafter(r, src, seed));
  return absl::OkStatus();
}

Status CudaModel::SetupDrafter(Rank& r, const WeightSource& src, uint64_t seed) {
  const ModelConfig& c = cfg_;
  const int64_t T = static_cast<int64_t>(target_layers_.size()), V = c.vocab_size, mr = markov_rank_;
  r.stages.resize(static_cast<size_t>(stages_));
  for (int64_t s = 0; s < stages_; ++s) RETURN_IF_ERROR(SetupLayer(r, src, c.num_hidden_layers + s, seed));
  ASSIGN_OR_RETURN(StagedMatrix mp, src.Matrix("mtp.0.main_proj.weight", D_, T * D_));
  ASSIGN_OR_RETURN(r.main_proj, Upload(mp, seed + 77, r.stream, &r.keep));
  ASSIGN_OR_RETURN(std::vector<float> v, src.Vector("mtp.0.main_norm.weight", D_));
  ASSIGN_OR_RETURN(r.main_norm, UploadF32(v, "mtp.0.main_norm.weight", r.stream, &r.keep));
  const std::string last = absl::StrCat("mtp.", stages_ - 1, ".");
  ASSIGN_OR_RETURN(v, src.Vector(last + "norm.weight", D_));
  ASSIGN_OR_RETURN(r.d_norm, UploadF32(v, last + "norm.weight", r.stream, &r.keep));
  ASSIGN_OR_RETURN(v, src.Vector(last + "hc_head_fn", hc_ * hc_ * D_));
  ASSIGN_OR_RETURN(const float* fn, UploadF32(v, last + "hc_head_fn", r.stream, &r.keep));
  r.d_hc_head_fn = F32Matrix(fn, hc_, hc_ * D_);
  ASSIGN_OR_RETURN(v, src.Vector(last + "hc_head_base", hc_));
  ASSIGN_OR_RETURN(r.d_hc_head_base, UploadF32(v, last + "hc_head_base", r.stream, &r.keep));
  ASSIGN_OR_RETURN(v, src.Vector(last + "hc_head_scale", 1));
  ASSIGN_OR_RETURN(r.d_hc_head_scale, UploadF32(v, last + "hc_head_scale", r.stream, &r.keep));
  for (const char* w : {"markov_w1", "markov_w2"}) {
    const std::string name = absl::StrCat(last, "markov_head.", w, ".weight");
    ASSIGN_OR_RETURN(StagedMatrix m, src.Matrix(name, V, mr));
    ASSIGN_OR_RETURN(DevW dw, Upload(m, seed + 78, r.stream, &r.keep));
    if (dw.type != WType::kBF16 && dw.type != WType::kF32) {
      return absl::UnimplementedError(absl::StrCat(name, ": the CUDA Markov head needs BF16 or F32 storage"));
    }
    (w[8] == '1' ? r.markov_w1 : r.markov_w2) = dw;
  }
  ASSIGN_OR_RETURN(confidence_, src.Vector(last + "confidence_head.proj.weight", D_ + mr));
  return absl::OkStatus();
}

Status CudaModel::SetupDrafterExperts(Rank& r, const Checkpoint& ck) {
  const ModelConfig& c = cfg_;
  const int64_t E = c.n_routed_experts, D = D_, I = c.moe_intermediate_size, K = c.num_experts_per_tok;
  if (c.expert_dtype != "fp4") {
    return absl::UnimplementedError(absl::StrCat("CudaOptions::drafter_experts = \"gpu\": expert_dtype '", c.expert_dtype,
                                                 "' is not supported (MXFP4 experts only)"));
  }
  if (D % 32 != 0 || I % 32 != 0) {
    return absl::UnimplementedError(absl::StrCat("CudaOptions::drafter_experts = \"gpu\" needs hidden_size (", D,
                                                 ") and moe_intermediate_size (", I, ") to be multiples of 32"));
  }
  NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r.device));
  // Per stage: codes w1, w3 [E, I, D/2], w2 [E, D, I/2], then scales s1, s3 [E, I, D/32], s2 [E, D, I/32].
  const int64_t codes = E * I * D / 2, scales = E * I * D / 32;
  const int64_t stage_bytes = 3 * RoundUp(codes, 256) + 3 * RoundUp(scales, 256);
  ASSIGN_OR_RETURN(r.dx_weights, DeviceMem::Alloc(static_cast<size_t>(stages_ * stage_bytes),
                                                  absl::StrCat("DSpark drafter routed experts (", stages_, " stages x ",
                                                               E, " experts, CudaOptions::drafter_experts)")));
  uint8_t* base = r.dx_weights.as<uint8_t>();
  r.dx.clear();
  for (int64_t st = 0; st < stages_; ++st) {
    uint8_t* b = base + st * stage_bytes;
    Mxfp4Experts w;
    uint8_t* part[6];
    for (int k = 0; k < 6; ++k) {
      part[k] = b;
      b += RoundUp(k < 3 ? codes : scales, 256);
    }
    w.w1 = part[0];
    w.w3 = part[1];
    w.w2 = part[2];
    w.s1 = part[3];
    w.s3 = part[4];
    w.s2 = part[5];
    w.experts = E;
    w.hidden = D;
    w.inter = I;
    const char* names[3] = {"w1", "w3", "w2"};
    for (int64_t e = 0; e < E; ++e) {
      for (int m = 0; m < 3; ++m) {
        const int64_t rows = m < 2 ? I : D, cols = m < 2 ? D : I;
        const std::string wn = absl::StrCat("mtp.", st, ".ffn.experts.", e, ".", names[m], ".weight");
        const std::string sn = absl::StrCat("mtp.", st, ".ffn.experts.", e, ".", names[m], ".scale");
        ASSIGN_OR_RETURN(const TensorView* wt, ck.Raw(wn));
        ASSIGN_OR_RETURN(const TensorView* sc, ck.Raw(sn));
        if (wt->dtype != DType::kI8 && wt->dtype != DType::kU8) {
          return absl::InvalidArgumentError(absl::StrCat(wn, ": routed experts must be MXFP4 (I8/U8 packed), got ",
                                                         std::string(DTypeName(wt->dtype))));
        }
        if (sc->dtype != DType::kF8_E8M0) return absl::InvalidArgumentError(absl::StrCat(sn, ": expected F8_E8M0 scales"));
        if (wt->numel() != rows * cols / 2 || sc->numel() != rows * cols / 32) {
          return absl::InvalidArgumentError(absl::StrCat(wn, ": stored shape ", wt->ShapeString(), " (scales ",
                                                         sc->ShapeString(), ") does not hold [", rows, ", ", cols,
                                                         "] MXFP4"));
        }
        NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpy(part[m] + e * rows * cols / 2, wt->data,
                                              static_cast<size_t>(rows * cols / 2), cudaMemcpyHostToDevice));
        NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpy(part[3 + m] + e * rows * cols / 32, sc->data,
                                              static_cast<size_t>(rows * cols / 32), cudaMemcpyHostToDevice));
      }
    }
    r.dx.push_back(w);
  }
  // Scratch for the draft rows of one pass, in groups of at most 512 rows (bigger passes loop).
  const int64_t MR = std::min<int64_t>(rows_cap_, 512);
  const int64_t pieces[4] = {(2 * E + 2) * 4, MR * K * 4, MR * K * I * 4, MR * K * D * 4};
  int64_t sbytes = 0;
  for (int64_t p : pieces) sbytes += RoundUp(p, 256);
  ASSIGN_OR_RETURN(r.dx_scratch, DeviceMem::Alloc(static_cast<size_t>(sbytes), "DSpark drafter expert scratch"));
  char* sb = static_cast<char*>(r.dx_scratch.get());
  r.dx_sc.offs = reinterpret_cast<int32_t*>(sb);
  sb += RoundUp(pieces[0], 256);
  r.dx_sc.list = reinterpret_cast<int32_t*>(sb);
  sb += RoundUp(pieces[1], 256);
  r.dx_sc.h = reinterpret_cast<float*>(sb);
  sb += RoundUp(pieces[2], 256);
  r.dx_sc.y = reinterpret_cast<float*>(sb);
  r.dx_sc.max_rows = MR;
  gpu_dx_ = true;
  NLOG(INFO) << "CUDA backend: DSpark drafter routed experts on the GPU (--drafter-experts gpu): " << stages_
             << " stages x " << E << " experts, " << (r.dx_weights.bytes() >> 20) << " MiB of MXFP4 weights + scales + "
             << (r.dx_scratch.bytes() >> 20) << " MiB scratch = " << (drafter_expert_bytes() >> 20)
             << " MiB of extra GPU memory";
  return absl::OkStatus();
}

int64_t CudaModel::drafter_expert_bytes() const {
  if (ranks_.empty()) return 0;
  return static_cast<int64_t>(ranks_[0]->dx_weights.bytes() + ranks_[0]->dx_scratch.bytes());
}

Status CudaModel::SetupLayer(Rank& r, const WeightSource& src, int64_t l, uint64_t seed) {
  const ModelConfig& c = cfg_;
  // l >= num_hidden_layers: DSpark stage l - num_hidden_layers (sliding attention, scored MoE).
  const int64_t stage = l - c.num_hidden_layers;
  LayerDev& L = stage < 0 ? r.layers[static_cast<size_t>(l)] : r.stages[static_cast<size_t>(stage)];
  L.type = stage < 0 ? c.layer_types[static_cast<size_t>(l)] : AttnType::kSliding;
  L.rate = stage < 0 ? static_cast<int>(c.CompressRate(l)) : 0;
  L.st = stage < 0 ? layout_[static_cast<size_t>(l)] : stage_layout_[static_cast<size_t>(stage)];
  const std::string p = stage < 0 ? absl::StrCat("layers.", l, ".") : absl::StrCat("mtp.", stage, ".");
  const std::string ap = p + "attn.", fp = p + "ffn.";
  const int64_t H = c.num_attention_heads, qr = c.q_lora_rank, G = c.o_groups, R = c.o_lora_rank;
  const int64_t ih = c.index_n_heads, id = c.index_head_dim, E = c.n_routed_experts, I = c.moe_intermediate_size;
  const int64_t m = (2 + hc_) * hc_, rank = r.index;
  const uint64_t ls = seed + 1000 * static_cast<uint64_t>(l + 1);
  auto vec = [&](const std::string& name, int64_t n, const float** out) -> Status {
    ASSIGN_OR_RETURN(std::vector<float> v, src.Vector(name, n));
    ASSIGN_OR_RETURN(const float* d, UploadF32(v, name, r.stream, &r.keep));
    *out = d;
    return absl::OkStatus();
  };
  auto up = [&](const StagedMatrix& s, uint64_t k, DevW* w) -> Status {
    ASSIGN_OR_RETURN(*w, Upload(s, ls + k, r.stream, &r.keep));
    r.weight_bytes += MatrixBytes(*w);
    return absl::OkStatus();
  };
  // mHC and norms.
  for (const char* site : {"attn", "ffn"}) {
    const bool attn = site[0] == 'a';
    const float* fn = nullptr;
    RETURN_IF_ERROR(vec(absl::StrCat(p, "hc_", site, "_fn"), m * hc_ * D_, &fn));
    (attn ? L.hc_attn_fn : L.hc_ffn_fn) = F32Matrix(fn, m, hc_ * D_);
    r.weight_bytes += m * hc_ * D_ * 4;
    RETURN_IF_ERROR(vec(absl::StrCat(p, "hc_", site, "_base"), m, attn ? &L.hc_attn_base : &L.hc_ffn_base));
    RETURN_IF_ERROR(vec(absl::StrCat(p, "hc_", site, "_scale"), 3, attn ? &L.hc_attn_scale : &L.hc_ffn_scale));
  }
  RETURN_IF_ERROR(vec(p + "attn_norm.weight", D_, &L.attn_norm));
  RETURN_IF_ERROR(vec(p + "ffn_norm.weight", D_, &L.ffn_norm));
  // Attention projections: [wq_a; wkv] share their input and are stacked when their formats allow.
  ASSIGN_OR_RETURN(StagedMatrix wq_a, src.Matrix(ap + "wq_a.weight", qr, D_));
  ASSIGN_OR_RETURN(StagedMatrix wkv, src.Matrix(ap + "wkv.weight", hd_, D_));
  StagedMatrix qkv;
  L.qkv_fused = StackRows({wq_a, wkv}, &qkv);
  if (L.qkv_fused) {
    RETURN_IF_ERROR(up(qkv, 1, &L.wq_a));
  } else {
    RETURN_IF_ERROR(up(wq_a, 1, &L.wq_a));
    RETURN_IF_ERROR(up(wkv, 2, &L.wkv));
  }
  RETURN_IF_ERROR(vec(ap + "q_norm.weight", qr, &L.q_norm));
  RETURN_IF_ERROR(vec(ap + "kv_norm.weight", hd_, &L.kv_norm));
  ASSIGN_OR_RETURN(StagedMatrix wq_b, src.Matrix(ap + "wq_b.weight", H * hd_, qr, rank * Hl_ * hd_, Hl_ * hd_, 0, qr));
  RETURN_IF_ERROR(up(wq_b, 3, &L.wq_b));
  const int64_t gw = H * hd_ / G;
  ASSIGN_OR_RETURN(StagedMatrix wo_a, src.Matrix(ap + "wo_a.weight", G * R, gw, rank * Gl_ * R, Gl_ * R, 0, gw));
  DevW wo_a_all;
  RETURN_IF_ERROR(up(wo_a, 4, &wo_a_all));
  L.wo_a = wo_a_all.Rows(0, R);
  ASSIGN_OR_RETURN(StagedMatrix wo_b, src.Matrix(ap + "wo_b.weight", D_, G * R, 0, D_, rank * Gl_ * R, Gl_ * R));
  RETURN_IF_ERROR(up(wo_b, 5, &L.wo_b));
  {
    ASSIGN_OR_RETURN(std::vector<float> sink, src.Vector(ap + "attn_sink", H));
    std::vector<float> local(sink.begin() + rank * Hl_, sink.begin() + (rank + 1) * Hl_);
    ASSIGN_OR_RETURN(L.sink, UploadF32(local, ap + "attn_sink", r.stream, &r.keep));
  }
  // Compressor (+ indexer) projections, all fed by the attention input: one stacked matrix.
  if (L.type != AttnType::kSliding) {
    const int64_t coff = L.type == AttnType::kCSA ? 2 : 1;
    std::vector<std::pair<std::string, int64_t>> parts = {{ap + "compressor.wkv.weight", coff * hd_},
                                                          {ap + "compressor.wgate.weight", coff * hd_}};
    if (L.type == AttnType::kCSA) {
      parts.push_back({ap + "indexer.compressor.wkv.weight", 2 * id});
      parts.push_back({ap + "indexer.compressor.wgate.weight", 2 * id});
      parts.push_back({ap + "indexer.weights_proj.weight", ih});
    }
    StagedMatrix comp;
    bool stacked = false;
    for (bool wide : {false, true}) {
      std::vector<StagedMatrix> staged;
      for (const auto& [name, rows] : parts) {
        ASSIGN_OR_RETURN(StagedMatrix s, src.Matrix(name, rows, D_, wide));
        staged.push_back(std::move(s));
      }
      if ((stacked = StackRows(staged, &comp))) break;
    }
    if (!stacked) return absl::UnimplementedError(absl::StrCat(ap, "compressor: projections of mixed FP8/plain storage"));
    RETURN_IF_ERROR(up(comp, 6, &L.comp));
    L.c_kv_col = 0;
    L.c_gate_col = coff * hd_;
    L.comp_width = 2 * coff * hd_;
    RETURN_IF_ERROR(vec(ap + "compressor.ape", L.rate * coff * hd_, &L.c_ape));
    RETURN_IF_ERROR(vec(ap + "compressor.norm.weight", hd_, &L.c_norm));
    if (L.type == AttnType::kCSA) {
      L.i_kv_col = L.comp_width;
      L.i_gate_col = L.i_kv_col + 2 * id;
      L.iw_col = L.i_gate_col + 2 * id;
      L.comp_width = L.iw_col + ih;
      if (L.st.log_comp_w != L.iw_col) return absl::InternalError(absl::StrCat(ap, ": speculative log width mismatch"));
      RETURN_IF_ERROR(vec(ap + "indexer.compressor.ape", L.rate * 2 * id, &L.i_ape));
      RETURN_IF_ERROR(vec(ap + "indexer.compressor.norm.weight", id, &L.i_norm));
      ASSIGN_OR_RETURN(StagedMatrix iq, src.Matrix(ap + "indexer.wq_b.weight", ih * id, qr));
      RETURN_IF_ERROR(up(iq, 7, &L.index_wq_b));
    }
  }
  // Router and shared expert (the shared expert's width is split across ranks).
  ASSIGN_OR_RETURN(StagedMatrix gate, src.Matrix(fp + "gate.weight", E, D_));
  RETURN_IF_ERROR(up(gate, 8, &L.gate));
  if (stage < 0 && c.mlp_layer_types[static_cast<size_t>(l)] == MoeType::kHash) {
    ASSIGN_OR_RETURN(std::vector<int32_t> t, src.Tid2Eid(fp + "gate.tid2eid", c.vocab_size, c.num_experts_per_tok, E));
    ASSIGN_OR_RETURN(L.tid2eid, UploadI32(t, fp + "gate.tid2eid", r.stream, &r.keep));
  } else {
    std::vector<float> bias(static_cast<size_t>(E), 0.0f);
    if (src.HasTensor(fp + "gate.bias")) {
      ASSIGN_OR_RETURN(bias, src.Vector(fp + "gate.bias", E));
    }
    ASSIGN_OR_RETURN(L.bias, UploadF32(bias, fp + "gate.bias", r.stream, &r.keep));
  }
  ASSIGN_OR_RETURN(StagedMatrix w1, src.Matrix(fp + "shared_experts.w1.weight", I, D_, rank * Il_, Il_, 0, D_));
  ASSIGN_OR_RETURN(StagedMatrix w3, src.Matrix(fp + "shared_experts.w3.weight", I, D_, rank * Il_, Il_, 0, D_));
  StagedMatrix w13;
  L.sh_fused = StackRows({w1, w3}, &w13);
  if (L.sh_fused) {
    RETURN_IF_ERROR(up(w13, 9, &L.sh_w1));
  } else {
    RETURN_IF_ERROR(up(w1, 9, &L.sh_w1));
    RETURN_IF_ERROR(up(w3, 10, &L.sh_w3));
  }
  ASSIGN_OR_RETURN(StagedMatrix w2, src.Matrix(fp + "shared_experts.w2.weight", D_, I, 0, D_, rank * Il_, Il_));
  RETURN_IF_ERROR(up(w2, 11, &L.sh_w2));
  return absl::OkStatus();
}

Status CudaModel::SetupState(Rank& r) {
  NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r.device));
  const int64_t tsize = bf16_cache_ ? 2 : 4;
  ASSIGN_OR_RETURN(r.fixed, DeviceMem::Alloc(static_cast<size_t>(opt_.max_sequences * slot_bytes_),
                                             absl::StrCat("sequence state (", opt_.max_sequences,
                                                          " slots, CudaOptions::max_sequences)")));
  NUMOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(r.fixed.get(), 0, r.fixed.bytes(), r.stream));
  if (num_pages_ > 0) {
    ASSIGN_OR_RETURN(r.pages, DeviceMem::Alloc(static_cast<size_t>(num_pages_ * page_elems_ * tsize),
                                               absl::StrCat("compressed-entry pages (", num_pages_,
                                                            " pages, CudaOptions::cache_mb)")));
  }
  ASSIGN_OR_RETURN(r.table, DeviceMem::Alloc(static_cast<size_t>(opt_.max_sequences * max_pages_) * sizeof(int32_t),
                                             "page tables"));
  NUMOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(r.table.get(), 0, r.table.bytes(), r.stream));
  if (spec_slot_bytes_ > 0) {
    ASSIGN_OR_RETURN(r.snap, DeviceMem::Alloc(static_cast<size_t>(opt_.max_sequences * slot_bytes_),
                                              "speculative state copies (CudaOptions::max_spec_tokens, 0 = none)"));
    ASSIGN_OR_RETURN(r.spec_log, DeviceMem::Alloc(static_cast<size_t>(opt_.max_sequences * spec_slot_bytes_),
                                                  absl::StrCat("speculative step log (", spec_tokens_,
                                                               " tokens per slot, CudaOptions::max_spec_tokens)")));
  }

  if (stages_ > 0) {
    // The DSpark drafter's per-row tensors (one set: there are no lanes with a drafter).
    const int64_t NR = rows_cap_, LR = logit_rows_cap_, f = 4;
    struct Piece {
      void** ptr;
      int64_t bytes;
    };
    const int64_t T = static_cast<int64_t>(target_layers_.size());
    std::vector<Piece> dp = {{reinterpret_cast<void**>(&r.features), NR * T * D_ * f},
                             {reinterpret_cast<void**>(&r.main_x), NR * D_ * f},
                             {reinterpret_cast<void**>(&r.h_pre), NR * D_ * f},
                             {reinterpret_cast<void**>(&r.mrows), LR * markov_rank_ * f},
                             {reinterpret_cast<void**>(&r.mids), LR * 4}};
    int64_t bytes = 0;
    for (const Piece& p : dp) bytes += RoundUp(std::max<int64_t>(p.bytes, 4), 256);
    ASSIGN_OR_RETURN(r.drafter_mem, DeviceMem::Alloc(static_cast<size_t>(bytes), "DSpark drafter scratch"));
    char* b = static_cast<char*>(r.drafter_mem.get());
    for (const Piece& p : dp) {
      *p.ptr = b;
      b += RoundUp(std::max<int64_t>(p.bytes, 4), 256);
    }
  }
  return AllocScratch(r);
}

Status CudaModel::AllocScratch(Rank& r) {
  NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r.device));
  const int64_t tsize = bf16_cache_ ? 2 : 4;
  // Scratch for rows_cap_ rows, carved out of one allocation (256-byte aligned pieces).
  const ModelConfig& c = cfg_;
  const int64_t NR = rows_cap_, LR = logit_rows_cap_, m = (2 + hc_) * hc_;
  int64_t comp_width = 1;
  for (const LayerDev& L : r.layers) comp_width = std::max(comp_width, L.comp_width);
  const int64_t vis_cap = c.csa_rate > 0 ? max_context_ / c.csa_rate + 1 : 1;
  Scratch& s = r.sc;
  s.qa_ld = c.q_lora_rank + hd_;
  s.shg_ld = 2 * Il_;
  s.score_ld = vis_cap;
  s.score_rows = std::clamp<int64_t>((int64_t{64} << 20) / vis_cap, LR, NR);
  struct Piece {
    void** ptr;
    int64_t bytes;
  };
  const int64_t f = 4;
  std::vector<Piece> pieces = {
      {reinterpret_cast<void**>(&s.X), NR * hc_ * D_ * f},
      {reinterpret_cast<void**>(&s.xn), NR * D_ * f},
      {reinterpret_cast<void**>(&s.y), NR * D_ * f},
      {reinterpret_cast<void**>(&s.mix), NR * m * f},
      {reinterpret_cast<void**>(&s.inv), NR * f},
      {reinterpret_cast<void**>(&s.hc_part), std::min<int64_t>(NR, kHcMixMaxRows) * kHcMixSplits * (m + 1) * f},
      {reinterpret_cast<void**>(&s.post), NR * hc_ * f},
      {reinterpret_cast<void**>(&s.comb), NR * hc_ * hc_ * f},
      {reinterpret_cast<void**>(&s.qa), NR * s.qa_ld * f},
      {reinterpret_cast<void**>(&s.q), NR * Hl_ * hd_ * f},
      {reinterpret_cast<void**>(&s.o), NR * Hl_ * hd_ * f},
      {reinterpret_cast<void**>(&s.z), NR * Gl_ * c.o_lora_rank * f},
      {reinterpret_cast<void**>(&s.comp), NR * comp_width * f},
      {reinterpret_cast<void**>(&s.iq), NR * c.index_n_heads * c.index_head_dim * f},
      {reinterpret_cast<void**>(&s.scores), s.score_rows * s.score_ld * f},
      {reinterpret_cast<void**>(&s.glog), NR * c.n_routed_experts * f},
      {reinterpret_cast<void**>(&s.wts), NR * c.num_experts_per_tok * f},
      {reinterpret_cast<void**>(&s.shg), NR * s.shg_ld * f},
      {reinterpret_cast<void**>(&s.shh), NR * Il_ * f},
      {reinterpret_cast<void**>(&s.sh), NR * D_ * f},
      {reinterpret_cast<void**>(&s.routed), NR * D_ * f},
      {reinterpret_cast<void**>(&s.hsel), NR * D_ * f},
      {reinterpret_cast<void**>(&s.logits), LR * c.vocab_size * f},
      {reinterpret_cast<void**>(&s.attn_part), std::min(NR, kSplitRows) * Hl_ * kMaxSplits * (hd_ + 2) * f},
      {&s.kvT, NR * hd_ * tsize},
      {&s.q16, tsize == 2 ? NR * Hl_ * hd_ * tsize : 0},
      {reinterpret_cast<void**>(&s.sel), NR * std::max<int64_t>(c.index_topk, 1) * 4},
      {reinterpret_cast<void**>(&s.ids), NR * c.num_experts_per_tok * 4},
      {reinterpret_cast<void**>(&s.meta), static_cast<int64_t>(StepMeta::Bytes(NR))},
      {reinterpret_cast<void**>(&s.greedy), NR * 8},
  };
  int64_t total = 0;
  for (const Piece& p : pieces) total += RoundUp(std::max<int64_t>(p.bytes, 4), 256);
  ASSIGN_OR_RETURN(r.scratch_mem, DeviceMem::Alloc(static_cast<size_t>(total),
                                                   absl::StrCat("activation scratch for ", NR,
                                                                " rows (CudaOptions::max_step_tokens)")));
  char* base = static_cast<char*>(r.scratch_mem.get());
  for (const Piece& p : pieces) {
    *p.ptr = base;
    base += RoundUp(std::max<int64_t>(p.bytes, 4), 256);
  }
  const size_t segs = static_cast<size_t>(c.num_hidden_layers + 1);
  r.ev_begin.resize(segs);
  r.ev_end.resize(segs);
  for (size_t i = 0; i < segs; ++i) {
    NUMOE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&r.ev_begin[i]));
    NUMOE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&r.ev_end[i]));
  }
  NUMOE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&r.ev_hop, cudaEventDisableTiming));
  return absl::OkStatus();
}

Status CudaModel::AllocStaging() {
  const ModelConfig& c = cfg_;
  const int64_t NR = rows_cap_, K = c.num_experts_per_tok;
  ASSIGN_OR_RETURN(meta_h_, PinnedMem::Alloc(StepMeta::Bytes(NR), "step metadata"));
  ASSIGN_OR_RETURN(y_h_, PinnedMem::Alloc(static_cast<size_t>(NR * D_) * sizeof(float), "MoE input staging"));
  ASSIGN_OR_RETURN(routed_h_, PinnedMem::Alloc(static_cast<size_t>(NR * D_) * sizeof(float), "MoE output staging"));
  ASSIGN_OR_RETURN(ids_h_, PinnedMem::Alloc(static_cast<size_t>(NR * K) * sizeof(int32_t), "expert ids"));
  ASSIGN_OR_RETURN(wts_h_, PinnedMem::Alloc(static_cast<size_t>(NR * K) * sizeof(float), "expert weights"));
  ASSIGN_OR_RETURN(logits_h_,
                   PinnedMem::Alloc(static_cast<size_t>(logit_rows_cap_ * c.vocab_size) * sizeof(float), "logits"));
  ASSIGN_OR_RETURN(greedy_h_, PinnedMem::Alloc(static_cast<size_t>(NR) * sizeof(uint64_t), "greedy tokens"));
  return absl::OkStatus();
}

void CudaModel::SwapLane(Lane& l) {
  Rank& r = *ranks_[0];
  std::swap(r.stream, l.stream);
  std::swap(r.sc, l.sc);
  std::swap(r.scratch_mem, l.scratch_mem);
  std::swap(r.ev_begin, l.ev_begin);
  std::swap(r.ev_end, l.ev_end);
  std::swap(r.ev_hop, l.ev_hop);
  std::swap(meta_h_, l.meta_h);
  std::swap(y_h_, l.y_h);
  std::swap(routed_h_, l.routed_h);
  std::swap(ids_h_, l.ids_h);
  std::swap(wts_h_, l.wts_h);
  std::swap(logits_h_, l.logits_h);
  std::swap(greedy_h_, l.greedy_h);
  std::swap(graphs_, l.graphs);
}

Status CudaModel::UseLane(int lane, bool background) {
  RETURN_IF_ERROR(SwitchLane(lane));
  // Lanes past 0 run decode lanes' kernels first: their streams at the greatest priority, a background
  // (prefill) lane's at the least; a lane taken over by the other kind gets a new stream.
  Lane& l = lanes_[static_cast<size_t>(lane)];
  if (lane == 0 || l.background == background) return absl::OkStatus();
  Rank& r = *ranks_[0];
  NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r.device));
  NUMOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(r.stream));
  NUMOE_CUDA_RETURN_IF_ERROR(cudaStreamDestroy(r.stream));
  r.stream = nullptr;
  int least = 0, greatest = 0;
  NUMOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  NUMOE_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithPriority(&r.stream, cudaStreamNonBlocking, background ? least : greatest));
  l.background = background;
  return absl::OkStatus();
}

Status CudaModel::SwitchLane(int lane) {
  if (lane == active_lane_) return absl::OkStatus();
  if (lane < 0 || lane >= static_cast<int>(lanes_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("ExpertBackend::lane() = ", lane, ", but this backend has ",
                                                   lanes_.size(), " lane(s) (CudaOptions::lanes + 1)"));
  }
  // The active lane's resources live in ranks_[0] and the staging members, its Lane holds nothing.
  SwapLane(lanes_[static_cast<size_t>(active_lane_)]);
  SwapLane(lanes_[static_cast<size_t>(lane)]);
  active_lane_ = lane;
  Lane& l = lanes_[static_cast<size_t>(lane)];
  if (!l.ready) {
    Rank& r = *ranks_[0];
    NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r.device));
    size_t free_before = 0, total = 0;
    NUMOE_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_before, &total));
    int least = 0, greatest = 0;
    NUMOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    NUMOE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&r.stream, cudaStreamNonBlocking, greatest));
    l.background = false;
    RETURN_IF_ERROR(AllocScratch(r));
    RETURN_IF_ERROR(AllocStaging());
    size_t free_after = 0;
    NUMOE_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_after, &total));
    l.ready = true;
    NLOG(INFO) << "CUDA backend: lane " << lane << " ready (its own stream, "
               << (static_cast<int64_t>(free_before) - static_cast<int64_t>(free_after)) / (1 << 20)
               << " MiB of device scratch and " << (meta_h_.bytes() + y_h_.bytes() + routed_h_.bytes() + ids_h_.bytes() +
                                                     wts_h_.bytes() + logits_h_.bytes() + greedy_h_.bytes()) / (1 << 20)
               << " MiB of pinned staging)";
  }
  return absl::OkStatus();
}

int64_t CudaModel::weight_bytes_per_step() const {
  int64_t b = 0;
  for (const auto& r : ranks_) b += r->weight_bytes;
  return b;
}

std::string CudaModel::Describe() const {
  std::ostringstream os;
  cudaDeviceProp prop{};
  (void)cudaGetDeviceProperties(&prop, ranks_.empty() ? 0 : ranks_[0]->device);
  os << opt_.tp << "x " << prop.name << " (sm_" << prop.major << prop.minor << ", " << ranks_[0]->sms << " SMs), "
     << (opt_.fp32 ? "fp32" : "bf16") << " mode, " << (bf16_cache_ ? "bf16" : "fp32") << " caches, dense weights "
     << (opt_.fp8_weights && cfg_.fp8_dense ? "fp8 (weight-only GEMM)" : "dequantized") << ", "
     << (weight_bytes_per_step() >> 20) << " MiB read per decode step; " << opt_.max_sequences << " slots x "
     << (slot_bytes_ >> 10) << " KiB fixed state, " << num_pages_ << " pages x " << page_tokens_ << " tokens ("
     << ((page_elems_ * (bf16_cache_ ? 2 : 4)) >> 10) << " KiB), max_context " << max_context_ << ", "
     << rows_cap_ << " rows per pass, graphs " << (opt_.graphs && opt_.tp == 1 ? "on" : "off")
     << ", DSpark drafter "
     << (stages_ == 0 ? std::string("none")
                      : absl::StrCat(stages_, " stages, routed experts ",
                                     gpu_dx_ ? absl::StrCat("on the GPU (", drafter_expert_bytes() >> 20, " MiB)")
                                             : std::string("on the worker")))
     << ", speculative steps of up to " << spec_tokens_ << " tokens ("
     << ((opt_.max_sequences * (slot_bytes_ + spec_slot_bytes_) * (spec_tokens_ > 0 ? 1 : 0)) >> 20)
     << " MiB per GPU)";
  return os.str();
}

}  // namespace cuda

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

bool CudaCompiledIn() { return true; }

namespace {

// The fastest of `iters` timed cudaMemcpy calls of `bytes` (after one untimed warm-up copy), in ms.
StatusOr<double> BestCopyMs(void* dst, const void* src, int64_t bytes, cudaMemcpyKind kind, int iters) {
  cudaEvent_t e0, e1;
  NUMOE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e0));
  NUMOE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e1));
  float best = 1e30f;
  for (int i = 0; i < iters + 1; ++i) {
    NUMOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(e0));
    NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, static_cast<size_t>(bytes), kind));
    NUMOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(e1));
    NUMOE_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(e1));
    float ms = 0;
    NUMOE_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, e0, e1));
    if (i > 0) best = std::min(best, ms);  // the first copy warms up
  }
  (void)cudaEventDestroy(e0);
  (void)cudaEventDestroy(e1);
  return static_cast<double>(best);
}

}  // namespace

StatusOr<double> MeasureDeviceCopyGBps(int device, int64_t bytes, int iters) {
  NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  ASSIGN_OR_RETURN(cuda::DeviceMem a, cuda::DeviceMem::Alloc(static_cast<size_t>(bytes), "bandwidth probe"));
  ASSIGN_OR_RETURN(cuda::DeviceMem b, cuda::DeviceMem::Alloc(static_cast<size_t>(bytes), "bandwidth probe"));
  NUMOE_CUDA_RETURN_IF_ERROR(cudaMemset(a.get(), 1, static_cast<size_t>(bytes)));
  NUMOE_CUDA_RETURN_IF_ERROR(cudaMemset(b.get(), 0, static_cast<size_t>(bytes)));
  ASSIGN_OR_RETURN(const double ms, BestCopyMs(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice, iters));
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
}

StatusOr<double> MeasureHostToDeviceGBps(int device, int64_t bytes, int iters) {
  NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  ASSIGN_OR_RETURN(cuda::PinnedMem h, cuda::PinnedMem::Alloc(static_cast<size_t>(bytes), "bandwidth probe"));
  ASSIGN_OR_RETURN(cuda::DeviceMem d, cuda::DeviceMem::Alloc(static_cast<size_t>(bytes), "bandwidth probe"));
  std::memset(h.as<uint8_t>(), 1, static_cast<size_t>(bytes));
  ASSIGN_OR_RETURN(const double ms, BestCopyMs(d.get(), h.as<uint8_t>(), bytes, cudaMemcpyHostToDevice, iters));
  return static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
}

StatusOr<std::unique_ptr<CudaBackend>> CreateCudaBackend(const Checkpoint& ckpt, const CudaOptions& options) {
  ASSIGN_OR_RETURN(std::unique_ptr<cuda::CudaModel> m, cuda::CudaModel::Create(&ckpt, ckpt.config(), options, 0));
  return std::unique_ptr<CudaBackend>(std::move(m));
}

StatusOr<std::unique_ptr<ModelBackend>> CreateCudaModel(const Checkpoint& ckpt, const CudaOptions& options) {
  ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> b, CreateCudaBackend(ckpt, options));
  return std::unique_ptr<ModelBackend>(std::move(b));
}

StatusOr<std::unique_ptr<CudaBackend>> CreateSyntheticCudaBackend(const ModelConfig& config, const CudaOptions& options,
                                                                  uint64_t seed) {
  ASSIGN_OR_RETURN(std::unique_ptr<cuda::CudaModel> m, cuda::CudaModel::Create(nullptr, config, options, seed));
  return std::unique_ptr<CudaBackend>(std::move(m));
}

}  // namespace numoe
