#include "backends/cpu/cpu_model.h"

#include "backends/cpu/cpu_model_state.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>

#include "absl/strings/str_format.h"
#include "common/log.h"

namespace numoe::cpu {
namespace {

StatusOr<std::vector<float>> LoadVec(const Checkpoint& ck, const std::string& name, int64_t numel) {
  ASSIGN_OR_RETURN(F32Tensor t, ck.LoadF32(name));
  if (t.numel() != numel) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected ", numel, " values, got ", t.numel()));
  }
  return std::move(t.data);
}

std::string ShapeStr(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) absl::StrAppend(&s, i ? ", " : "", shape[i]);
  return s + "]";
}

// A BF16 tensor is kept as stored (its values are exactly representable either way, at half the bytes);
// any other format (FP8 block-scaled, F32, F16) is dequantized to fp32: narrowing those to BF16 would
// round them.
StatusOr<Linear> LoadLinear(const Checkpoint& ck, const std::string& name, int64_t out, int64_t in) {
  ASSIGN_OR_RETURN(const TensorView* raw, ck.Raw(name));
  Linear l;
  l.out = out;
  l.in = in;
  if (raw->dtype == DType::kBF16) {
    if (raw->shape.size() != 2 || raw->shape[0] != out || raw->shape[1] != in) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected shape [", out, ", ", in, "], got BF16 ", ShapeStr(raw->shape)));
    }
    const size_t count = static_cast<size_t>(out * in);
    if (raw->data == nullptr || raw->nbytes != count * sizeof(uint16_t)) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": BF16 ", ShapeStr(raw->shape), " needs ",
                                                     count * sizeof(uint16_t), " bytes, the file holds ", raw->nbytes));
    }
    l.w_bf16.resize(count);
    std::memcpy(l.w_bf16.data(), raw->data, count * sizeof(uint16_t));
    return l;
  }
  ASSIGN_OR_RETURN(F32Tensor t, ck.LoadF32(name));
  if (t.shape.size() != 2 || t.shape[0] != out || t.shape[1] != in) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected logical shape [", out, ", ", in, "], got ", ShapeStr(t.shape)));
  }
  if (t.data.size() != static_cast<size_t>(out * in)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected ", out * in, " values, got ", t.data.size()));
  }
  l.w = std::move(t.data);
  return l;
}

StatusOr<HyperConnW> LoadHyper(const Checkpoint& ck, const std::string& prefix, int64_t rows, int64_t cols,
                               int64_t nscale) {
  HyperConnW h;
  ASSIGN_OR_RETURN(h.fn, LoadVec(ck, prefix + "fn", rows * cols));
  ASSIGN_OR_RETURN(h.base, LoadVec(ck, prefix + "base", rows));
  ASSIGN_OR_RETURN(h.scale, LoadVec(ck, prefix + "scale", nscale));
  return h;
}

StatusOr<CompressorW> LoadCompressor(const Checkpoint& ck, const std::string& p, int64_t rate, int64_t dim,
                                     int64_t coff, int64_t d) {
  CompressorW c;
  ASSIGN_OR_RETURN(c.wkv, LoadLinear(ck, p + "wkv.weight", coff * dim, d));
  ASSIGN_OR_RETURN(c.wgate, LoadLinear(ck, p + "wgate.weight", coff * dim, d));
  ASSIGN_OR_RETURN(c.ape, LoadVec(ck, p + "ape", rate * coff * dim));
  ASSIGN_OR_RETURN(c.norm, LoadVec(ck, p + "norm.weight", dim));
  return c;
}

}  // namespace

namespace {

// One decoder block (a main layer or an MTP/DSpark stage) under `p` ("layers.3." / "mtp.0.").
StatusOr<LayerW> LoadLayer(const Checkpoint& ck, const std::string& p, AttnType type, int64_t rate, MoeType moe) {
  const ModelConfig& c = ck.config();
  const int64_t D = c.hidden_size, H = c.num_attention_heads, hd = c.head_dim, hc = c.hc_mult;
  const int64_t I = c.moe_intermediate_size;
  LayerW L;
  ASSIGN_OR_RETURN(L.attn_norm, LoadVec(ck, p + "attn_norm.weight", D));
  ASSIGN_OR_RETURN(L.ffn_norm, LoadVec(ck, p + "ffn_norm.weight", D));
  ASSIGN_OR_RETURN(L.hc_attn, LoadHyper(ck, p + "hc_attn_", (2 + hc) * hc, hc * D, 3));
  ASSIGN_OR_RETURN(L.hc_ffn, LoadHyper(ck, p + "hc_ffn_", (2 + hc) * hc, hc * D, 3));
  AttentionW& a = L.attn;
  a.type = type;
  a.rate = rate;
  const std::string ap = p + "attn.";
  ASSIGN_OR_RETURN(a.wq_a, LoadLinear(ck, ap + "wq_a.weight", c.q_lora_rank, D));
  ASSIGN_OR_RETURN(a.q_norm, LoadVec(ck, ap + "q_norm.weight", c.q_lora_rank));
  ASSIGN_OR_RETURN(a.wq_b, LoadLinear(ck, ap + "wq_b.weight", H * hd, c.q_lora_rank));
  ASSIGN_OR_RETURN(a.wkv, LoadLinear(ck, ap + "wkv.weight", hd, D));
  ASSIGN_OR_RETURN(a.kv_norm, LoadVec(ck, ap + "kv_norm.weight", hd));
  ASSIGN_OR_RETURN(a.wo_a, LoadLinear(ck, ap + "wo_a.weight", c.o_groups * c.o_lora_rank, H * hd / c.o_groups));
  ASSIGN_OR_RETURN(a.wo_b, LoadLinear(ck, ap + "wo_b.weight", D, c.o_groups * c.o_lora_rank));
  ASSIGN_OR_RETURN(a.sink, LoadVec(ck, ap + "attn_sink", H));
  if (a.type != AttnType::kSliding) {
    const int64_t coff = a.type == AttnType::kCSA ? 2 : 1;
    ASSIGN_OR_RETURN(a.comp, LoadCompressor(ck, ap + "compressor.", a.rate, hd, coff, D));
  }
  if (a.type == AttnType::kCSA) {
    const int64_t ih = c.index_n_heads, id = c.index_head_dim;
    ASSIGN_OR_RETURN(a.index_comp, LoadCompressor(ck, ap + "indexer.compressor.", a.rate, id, 2, D));
    ASSIGN_OR_RETURN(a.index_wq_b, LoadLinear(ck, ap + "indexer.wq_b.weight", ih * id, c.q_lora_rank));
    ASSIGN_OR_RETURN(a.index_weights, LoadLinear(ck, ap + "indexer.weights_proj.weight", ih, D));
  }
  FfnW& f = L.ffn;
  f.type = moe;
  const std::string fp = p + "ffn.";
  ASSIGN_OR_RETURN(f.gate, LoadLinear(ck, fp + "gate.weight", c.n_routed_experts, D));
  if (f.type == MoeType::kHash) {
    ASSIGN_OR_RETURN(F32Tensor t, ck.LoadF32(fp + "gate.tid2eid"));
    if (t.numel() != c.vocab_size * c.num_experts_per_tok) {
      return absl::InvalidArgumentError(absl::StrCat(fp, "gate.tid2eid: expected [", c.vocab_size, ", ",
                                                     c.num_experts_per_tok, "]"));
    }
    f.tid2eid.resize(t.data.size());
    for (size_t k = 0; k < t.data.size(); ++k) {
      const float e = t.data[k];
      if (!(e >= 0 && e < static_cast<float>(c.n_routed_experts))) {
        return absl::InvalidArgumentError(absl::StrCat(fp, "gate.tid2eid: expert id ", e, " out of range"));
      }
      f.tid2eid[k] = static_cast<int32_t>(e);
    }
  } else if (ck.store().Find(fp + "gate.bias") != nullptr) {
    ASSIGN_OR_RETURN(f.bias, LoadVec(ck, fp + "gate.bias", c.n_routed_experts));
  } else {
    f.bias.assign(static_cast<size_t>(c.n_routed_experts), 0.0f);
  }
  ASSIGN_OR_RETURN(f.shared_w1, LoadLinear(ck, fp + "shared_experts.w1.weight", I, D));
  ASSIGN_OR_RETURN(f.shared_w3, LoadLinear(ck, fp + "shared_experts.w3.weight", I, D));
  ASSIGN_OR_RETURN(f.shared_w2, LoadLinear(ck, fp + "shared_experts.w2.weight", D, I));
  return L;
}

}  // namespace

StatusOr<std::unique_ptr<ModelW>> LoadDenseWeights(const Checkpoint& ck) {
  const ModelConfig& c = ck.config();
  const int64_t D = c.hidden_size, hc = c.hc_mult;
  auto w = std::make_unique<ModelW>();
  ASSIGN_OR_RETURN(w->embed, LoadLinear(ck, "embed.weight", c.vocab_size, D));
  w->tied_head = c.tie_word_embeddings;
  if (!w->tied_head) {
    ASSIGN_OR_RETURN(w->head, LoadLinear(ck, "head.weight", c.vocab_size, D));
  }
  ASSIGN_OR_RETURN(w->norm, LoadVec(ck, "norm.weight", D));
  ASSIGN_OR_RETURN(w->hc_head, LoadHyper(ck, "hc_head_", hc, hc * D, 1));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    ASSIGN_OR_RETURN(LayerW L, LoadLayer(ck, absl::StrCat("layers.", i, "."), c.layer_types[static_cast<size_t>(i)],
                                         c.CompressRate(i), c.mlp_layer_types[static_cast<size_t>(i)]));
    w->layers.push_back(std::move(L));
  }
  return w;
}

StatusOr<std::unique_ptr<DsparkW>> LoadDsparkWeights(const Checkpoint& ck) {
  const ModelConfig& c = ck.config();
  const int64_t S = ck.mtp_stages(), D = c.hidden_size, hc = c.hc_mult, r = c.dspark_markov_rank;
  if (S == 0 || c.dspark_block_size <= 0 || ck.store().Find("mtp.0.main_proj.weight") == nullptr) {
    return absl::NotFoundError("this checkpoint has no DSpark drafter (mtp.0.main_proj and dspark_* config keys)");
  }
  auto w = std::make_unique<DsparkW>();
  w->target_layers = c.dspark_target_layer_ids;
  for (int64_t t : w->target_layers) {
    if (t < 0 || t >= c.num_hidden_layers) {
      return absl::InvalidArgumentError(absl::StrCat("dspark_target_layer_ids: layer ", t, " is out of range"));
    }
  }
  if (c.dspark_noise_token_id < 0 || c.dspark_noise_token_id >= c.vocab_size) {
    return absl::InvalidArgumentError("dspark_noise_token_id is out of the vocabulary");
  }
  w->noise_token = static_cast<int32_t>(c.dspark_noise_token_id);
  const int64_t T = static_cast<int64_t>(w->target_layers.size());
  ASSIGN_OR_RETURN(w->main_proj, LoadLinear(ck, "mtp.0.main_proj.weight", D, T * D));
  ASSIGN_OR_RETURN(w->main_norm, LoadVec(ck, "mtp.0.main_norm.weight", D));
  for (int64_t s = 0; s < S; ++s) {
    ASSIGN_OR_RETURN(LayerW L, LoadLayer(ck, absl::StrCat("mtp.", s, "."), AttnType::kSliding, 0, MoeType::kScored));
    w->stages.push_back(std::move(L));
  }
  const std::string last = absl::StrCat("mtp.", S - 1, ".");
  ASSIGN_OR_RETURN(w->norm, LoadVec(ck, last + "norm.weight", D));
  ASSIGN_OR_RETURN(w->hc_head, LoadHyper(ck, last + "hc_head_", hc, hc * D, 1));
  ASSIGN_OR_RETURN(w->markov_w1, LoadLinear(ck, last + "markov_head.markov_w1.weight", c.vocab_size, r));
  ASSIGN_OR_RETURN(w->markov_w2, LoadLinear(ck, last + "markov_head.markov_w2.weight", c.vocab_size, r));
  ASSIGN_OR_RETURN(w->confidence, LoadLinear(ck, last + "confidence_head.proj.weight", 1, D + r));
  return w;
}

StatusOr<std::unique_ptr<MtpW>> LoadMtpWeights(const Checkpoint& ck) {
  const ModelConfig& c = ck.config();
  const int64_t D = c.hidden_size, hc = c.hc_mult;
  if (ck.mtp_stages() == 0 || c.dspark_block_size > 0 || ck.store().Find("mtp.0.e_proj.weight") == nullptr) {
    return absl::NotFoundError("this checkpoint has no MTP block (mtp.0.e_proj and no dspark_* config keys)");
  }
  if (ck.mtp_stages() > 1) {
    NLOG(INFO) << "the checkpoint has " << ck.mtp_stages() << " MTP stages; drafting uses mtp.0 recursively";
  }
  auto w = std::make_unique<MtpW>();
  ASSIGN_OR_RETURN(w->block, LoadLayer(ck, "mtp.0.", AttnType::kSliding, 0, MoeType::kScored));
  ASSIGN_OR_RETURN(w->e_proj, LoadLinear(ck, "mtp.0.e_proj.weight", D, D));
  ASSIGN_OR_RETURN(w->h_proj, LoadLinear(ck, "mtp.0.h_proj.weight", D, D));
  ASSIGN_OR_RETURN(w->enorm, LoadVec(ck, "mtp.0.enorm.weight", D));
  ASSIGN_OR_RETURN(w->hnorm, LoadVec(ck, "mtp.0.hnorm.weight", D));
  ASSIGN_OR_RETURN(w->norm, LoadVec(ck, "mtp.0.norm.weight", D));
  ASSIGN_OR_RETURN(w->hc_head, LoadHyper(ck, "mtp.0.hc_head_", hc, hc * D, 1));
  return w;
}

CpuModel::CpuModel(ModelConfig cfg, std::unique_ptr<ModelW> w, std::unique_ptr<DsparkW> dspark,
                   std::unique_ptr<MtpW> mtp, ThreadPool* pool)
    : cfg_(std::move(cfg)), w_(std::move(w)), dspark_(std::move(dspark)), mtp_(std::move(mtp)), pool_(pool) {
  inv_freq_main_ = RopeInvFreq(cfg_.rope_main, cfg_.rope_dim);
  inv_freq_compress_ = RopeInvFreq(cfg_.rope_compress, cfg_.rope_dim);
  for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l) {
    if (cfg_.CompressRate(l) > 0) export_align_ = std::lcm(export_align_, cfg_.CompressRate(l));
  }
}

CpuModel::~CpuModel() = default;

namespace {

struct ByteCounter {
  CpuModel::WeightBytes b;
  void Add(const std::vector<float>& v) { b.total += static_cast<int64_t>(v.size() * sizeof(float)); }
  void Add(const std::vector<int32_t>& v) { b.total += static_cast<int64_t>(v.size() * sizeof(int32_t)); }
  void Add(const Linear& l) {
    b.total += l.bytes();
    if (l.is_bf16()) b.bf16 += l.bytes();
  }
  void Add(const HyperConnW& h) {
    Add(h.fn);
    Add(h.base);
    Add(h.scale);
  }
  void Add(const CompressorW& c) {
    Add(c.wkv);
    Add(c.wgate);
    Add(c.ape);
    Add(c.norm);
  }
  void Add(const LayerW& L) {
    Add(L.attn_norm);
    Add(L.ffn_norm);
    Add(L.hc_attn);
    Add(L.hc_ffn);
    const AttentionW& a = L.attn;
    for (const Linear* l : {&a.wq_a, &a.wq_b, &a.wkv, &a.wo_a, &a.wo_b, &a.index_wq_b, &a.index_weights}) Add(*l);
    Add(a.q_norm);
    Add(a.kv_norm);
    Add(a.sink);
    Add(a.comp);
    Add(a.index_comp);
    const FfnW& f = L.ffn;
    for (const Linear* l : {&f.gate, &f.shared_w1, &f.shared_w3, &f.shared_w2}) Add(*l);
    Add(f.bias);
    Add(f.tid2eid);
  }
};

}  // namespace

CpuModel::WeightBytes CpuModel::weight_bytes() const {
  ByteCounter c;
  c.Add(w_->embed);
  c.Add(w_->head);
  c.Add(w_->norm);
  c.Add(w_->hc_head);
  for (const LayerW& L : w_->layers) c.Add(L);
  if (dspark_) {
    c.Add(dspark_->main_proj);
    c.Add(dspark_->main_norm);
    for (const LayerW& L : dspark_->stages) c.Add(L);
    c.Add(dspark_->norm);
    c.Add(dspark_->hc_head);
    c.Add(dspark_->markov_w1);
    c.Add(dspark_->markov_w2);
    c.Add(dspark_->confidence);
  }
  if (mtp_) {
    c.Add(mtp_->block);
    c.Add(mtp_->e_proj);
    c.Add(mtp_->h_proj);
    c.Add(mtp_->enorm);
    c.Add(mtp_->hnorm);
    c.Add(mtp_->norm);
    c.Add(mtp_->hc_head);
  }
  return c.b;
}

StatusOr<std::unique_ptr<CpuModel>> CpuModel::Create(const Checkpoint& ckpt, ThreadPool* pool,
                                                      const CpuModelOptions& options) {
  if (ckpt.config().hc_mult > 16) {
    return absl::InvalidArgumentError(absl::StrCat("hc_mult ", ckpt.config().hc_mult, " > 16 is not supported"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<ModelW> w, LoadDenseWeights(ckpt));
  std::unique_ptr<DsparkW> dspark;
  std::unique_ptr<MtpW> mtp;
  if (options.drafter) {
    if (ckpt.config().dspark_block_size > 0) {
      ASSIGN_OR_RETURN(dspark, LoadDsparkWeights(ckpt));
    } else if (ckpt.mtp_stages() > 0) {
      ASSIGN_OR_RETURN(mtp, LoadMtpWeights(ckpt));
    } else {
      return absl::NotFoundError("this checkpoint has no drafter (no mtp.* stages): load it without the drafter");
    }
  }
  std::unique_ptr<CpuModel> model(new CpuModel(ckpt.config(), std::move(w), std::move(dspark), std::move(mtp), pool));
  const WeightBytes b = model->weight_bytes();
  auto mib = [](int64_t bytes) { return absl::StrFormat("%.1f MiB", static_cast<double>(bytes) / (1 << 20)); };
  NLOG(INFO) << "CPU backend: " << mib(b.total) << " of dense weights (" << mib(b.bf16) << " BF16, "
             << mib(b.total - b.bf16) << " fp32); BF16 matmuls " << (Bf16MatMulUsesAvx512() ? "AVX-512" : "scalar");
  return model;
}

std::unique_ptr<CpuModel::SeqState> CpuModel::NewState() const {
  auto st = std::make_unique<SeqState>();
  st->layers.resize(static_cast<size_t>(cfg_.num_hidden_layers));
  for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l) {
    auto& L = st->layers[static_cast<size_t>(l)];
    const AttentionW& a = w_->layers[static_cast<size_t>(l)].attn;
    L.ring.assign(static_cast<size_t>(cfg_.sliding_window * cfg_.head_dim), 0.0f);
    if (a.type != AttnType::kSliding) {
      CompressorParams p;
      p.rate = a.rate;
      p.dim = cfg_.head_dim;
      p.overlap = a.type == AttnType::kCSA;
      p.ape = a.comp.ape.data();
      p.norm = a.comp.norm.data();
      p.eps = static_cast<float>(cfg_.rms_norm_eps);
      p.rope_dim = cfg_.rope_dim;
      p.inv_freq = inv_freq_compress_.data();
      L.comp = std::make_unique<CompressorState>(p);
      if (a.type == AttnType::kCSA) {
        p.dim = cfg_.index_head_dim;
        p.ape = a.index_comp.ape.data();
        p.norm = a.index_comp.norm.data();
        L.index_comp = std::make_unique<CompressorState>(p);
      }
    }
  }
  if (dspark_) {
    st->drafter_rings.assign(dspark_->stages.size(),
                             std::vector<float>(static_cast<size_t>(cfg_.sliding_window * cfg_.head_dim), 0.0f));
    st->drafter_undo.resize(dspark_->stages.size());
  }
  if (mtp_) st->mtp_ring.assign(static_cast<size_t>(cfg_.sliding_window * cfg_.head_dim), 0.0f);
  return st;
}

StatusOr<SequenceId> CpuModel::CreateSequence() {
  const SequenceId id = next_id_++;
  seqs_[id] = NewState();
  return id;
}

StatusOr<SequenceId> CpuModel::ForkSequence(SequenceId parent) {
  auto it = seqs_.find(parent);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", parent, " does not exist"));
  const SeqState& from = *it->second;
  if (from.undo_from >= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", parent, ": cannot fork right after a speculative step"));
  }
  auto st = std::make_unique<SeqState>();
  st->position = from.position;
  st->layers.resize(from.layers.size());
  for (size_t l = 0; l < from.layers.size(); ++l) {
    const SeqState::Layer& a = from.layers[l];
    SeqState::Layer& b = st->layers[l];
    b.ring = a.ring;
    if (a.comp) b.comp = std::make_unique<CompressorState>(*a.comp);
    if (a.index_comp) b.index_comp = std::make_unique<CompressorState>(*a.index_comp);
  }
  st->drafter_rings = from.drafter_rings;
  st->drafter_undo.resize(from.drafter_undo.size());
  st->mtp_ring = from.mtp_ring;
  st->mtp_x = from.mtp_x;
  st->mtp_x_from = from.mtp_x_from;
  const SequenceId id = next_id_++;
  seqs_[id] = std::move(st);
  return id;
}

namespace {

// Host export helpers: raw bytes appended to a buffer / read from one with a bounds check.
void Put(std::vector<uint8_t>* out, const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  out->insert(out->end(), b, b + n);
}
void PutI64(std::vector<uint8_t>* out, int64_t v) { Put(out, &v, sizeof(v)); }
void PutFloats(std::vector<uint8_t>* out, const std::vector<float>& v) {
  PutI64(out, static_cast<int64_t>(v.size()));
  Put(out, v.data(), v.size() * sizeof(float));
}

struct Reader {
  const uint8_t* p;
  const uint8_t* end;
  bool ok = true;
  void Take(void* to, size_t n) {
    if (!ok || static_cast<size_t>(end - p) < n) {
      ok = false;
      return;
    }
    std::memcpy(to, p, n);
    p += n;
  }
  int64_t I64() {
    int64_t v = 0;
    Take(&v, sizeof(v));
    return v;
  }
  // A float vector of exactly `want` elements (or any size when want < 0, up to what is left).
  void Floats(std::vector<float>* v, int64_t want) {
    const int64_t n = I64();
    if (!ok || n < 0 || (want >= 0 && n != want) || n > (end - p) / static_cast<int64_t>(sizeof(float))) {
      ok = false;
      return;
    }
    v->resize(static_cast<size_t>(n));
    Take(v->data(), v->size() * sizeof(float));
  }
};

// Wraps a filled buffer as HostBytes without copying it.
HostBytes Own(std::vector<uint8_t> v) {
  auto owner = std::make_shared<std::vector<uint8_t>>(std::move(v));
  HostBytes b;
  b.size = static_cast<int64_t>(owner->size());
  b.data = std::shared_ptr<uint8_t[]>(owner, owner->data());
  return b;
}

constexpr int64_t kHostStateMagic = 0x4e4d4f4543505531;  // "NMOECPU1"

}  // namespace

StatusOr<HostState> CpuModel::ExportSequence(SequenceId seq, int64_t page_tokens, int64_t first_page) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " does not exist"));
  const SeqState& st = *it->second;
  if (st.undo_from >= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", seq, ": cannot export right after a speculative step"));
  }
  if (page_tokens <= 0 || page_tokens % export_align_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat("ExportSequence: page_tokens ", page_tokens,
                                                   " is not a positive multiple of ", export_align_));
  }
  std::vector<const CompressorState*> comps;
  for (const auto& L : st.layers) {
    for (const CompressorState* c : {L.comp.get(), L.index_comp.get()}) {
      if (c != nullptr) comps.push_back(c);
    }
  }
  HostState hs;
  hs.position = st.position;
  hs.page_tokens = page_tokens;
  const int64_t whole = st.position / page_tokens;
  hs.pages.resize(static_cast<size_t>(whole));
  auto put_rows = [](std::vector<uint8_t>* out, const CompressorState& c, int64_t from, int64_t to) {
    for (int64_t r = from; r < to; ++r) {
      Put(out, c.entries().Row(r), static_cast<size_t>(c.entries().width()) * sizeof(float));
    }
  };
  for (int64_t k = std::max<int64_t>(first_page, 0); k < whole; ++k) {
    std::vector<uint8_t> page;
    for (const CompressorState* c : comps) put_rows(&page, *c, k * page_tokens / c->rate(), (k + 1) * page_tokens / c->rate());
    hs.pages[static_cast<size_t>(k)] = Own(std::move(page));
  }
  std::vector<uint8_t> rest;
  PutI64(&rest, kHostStateMagic);
  PutI64(&rest, st.position);
  PutI64(&rest, static_cast<int64_t>(st.layers.size()));
  for (const auto& L : st.layers) PutFloats(&rest, L.ring);
  for (const CompressorState* c : comps) {
    c->SaveFixed(&rest);
    const int64_t from = whole * page_tokens / c->rate();
    PutI64(&rest, c->entries().rows() - from);
    put_rows(&rest, *c, from, c->entries().rows());
  }
  PutI64(&rest, static_cast<int64_t>(st.drafter_rings.size()));
  for (const auto& r : st.drafter_rings) PutFloats(&rest, r);
  PutFloats(&rest, st.mtp_ring);
  PutFloats(&rest, st.mtp_x);
  PutI64(&rest, st.mtp_x_from);
  hs.rest = Own(std::move(rest));
  return hs;
}

StatusOr<SequenceId> CpuModel::ImportSequence(const HostState& hs) {
  auto bad = [](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("ImportSequence: ", what));
  };
  if (hs.page_tokens <= 0 || hs.page_tokens % export_align_ != 0) {
    return bad(absl::StrCat("page_tokens ", hs.page_tokens, " is not a positive multiple of ", export_align_));
  }
  if (hs.position < 0 || static_cast<int64_t>(hs.pages.size()) != hs.position / hs.page_tokens) {
    return bad(absl::StrCat(hs.pages.size(), " pages do not fit position ", hs.position));
  }
  std::unique_ptr<SeqState> st = NewState();
  st->position = hs.position;
  std::vector<CompressorState*> comps;
  for (auto& L : st->layers) {
    for (CompressorState* c : {L.comp.get(), L.index_comp.get()}) {
      if (c != nullptr) comps.push_back(c);
    }
  }
  auto take_rows = [](Reader* in, CompressorState* c, int64_t n) {
    const size_t w = static_cast<size_t>(c->entries().width()) * sizeof(float);
    for (int64_t r = 0; r < n && in->ok; ++r) in->Take(c->AppendEntry(), w);
  };
  for (size_t k = 0; k < hs.pages.size(); ++k) {
    const HostBytes& page = hs.pages[k];
    if (page.get() == nullptr) return bad(absl::StrCat("page ", k, " is missing"));
    Reader in{page.get(), page.get() + page.size};
    for (CompressorState* c : comps) take_rows(&in, c, hs.page_tokens / c->rate());
    if (!in.ok || in.p != in.end) return bad(absl::StrCat("page ", k, " does not fit this model's layout"));
  }
  if (hs.rest.get() == nullptr) return bad("the rest of the state is missing");
  Reader in{hs.rest.get(), hs.rest.get() + hs.rest.size};
  if (in.I64() != kHostStateMagic || in.I64() != hs.position ||
      in.I64() != static_cast<int64_t>(st->layers.size())) {
    return bad("the state was not exported by this backend for this model");
  }
  for (auto& L : st->layers) in.Floats(&L.ring, static_cast<int64_t>(L.ring.size()));
  const int64_t whole = hs.position / hs.page_tokens;
  for (CompressorState* c : comps) {
    if (!in.ok || !c->LoadFixed(&in.p, in.end) || c->next_position() != hs.position) return bad("compressor state");
    const int64_t tail = in.I64();
    if (!in.ok || tail != hs.position / c->rate() - whole * hs.page_tokens / c->rate()) return bad("compressed entries");
    take_rows(&in, c, tail);
  }
  if (in.I64() != static_cast<int64_t>(st->drafter_rings.size())) return bad("drafter rings");
  for (auto& r : st->drafter_rings) in.Floats(&r, static_cast<int64_t>(r.size()));
  in.Floats(&st->mtp_ring, static_cast<int64_t>(st->mtp_ring.size()));
  in.Floats(&st->mtp_x, -1);
  st->mtp_x_from = in.I64();
  if (!in.ok || in.p != in.end) return bad("the rest of the state does not fit this model's layout");
  const SequenceId id = next_id_++;
  seqs_[id] = std::move(st);
  return id;
}

Status CpuModel::ReleaseSequence(SequenceId seq) {
  if (seqs_.erase(seq) == 0) return absl::NotFoundError(absl::StrCat("sequence ", seq, " does not exist"));
  return absl::OkStatus();
}

StatusOr<SequenceMemory> CpuModel::Memory(SequenceId seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " does not exist"));
  SequenceMemory m;
  m.position = it->second->position;
  for (const auto& L : it->second->layers) {
    m.fixed_bytes += static_cast<int64_t>(L.ring.size() * sizeof(float));
    for (const CompressorState* c : {L.comp.get(), L.index_comp.get()}) {
      if (c == nullptr) continue;
      m.fixed_bytes += c->fixed_bytes();
      m.growing_bytes += c->entries().rows() * c->entries().width() * static_cast<int64_t>(sizeof(float));
      m.capacity_bytes += c->entries().capacity_bytes();
    }
  }
  for (const auto& r : it->second->drafter_rings) m.fixed_bytes += static_cast<int64_t>(r.size() * sizeof(float));
  m.fixed_bytes += static_cast<int64_t>((it->second->mtp_ring.size() + it->second->mtp_x.size()) * sizeof(float));
  m.capacity_bytes += m.fixed_bytes;
  return m;
}

Status CpuModel::Rollback(SequenceId seq, int64_t num_tokens) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " does not exist"));
  SeqState& st = *it->second;
  if (num_tokens < 0) return absl::InvalidArgumentError("Rollback: num_tokens must be >= 0");
  if (num_tokens == 0) return absl::OkStatus();
  if (st.undo_from < 0 || st.position - num_tokens < st.undo_from) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", seq, ": can only roll back tokens of its last step, and only when it was speculative"));
  }
  const int64_t to = st.position - num_tokens;
  const int64_t hd = cfg_.head_dim, W = cfg_.sliding_window;
  for (auto& L : st.layers) {
    while (!L.ring_undo.empty() && L.ring_undo.back().first >= to) {
      auto& [pos, old] = L.ring_undo.back();
      std::memcpy(&L.ring[(pos % W) * hd], old.data(), static_cast<size_t>(hd) * sizeof(float));
      L.ring_undo.pop_back();
    }
    if (L.comp) L.comp->RewindTo(to);
    if (L.index_comp) L.index_comp->RewindTo(to);
  }
  for (size_t s = 0; s < st.drafter_rings.size(); ++s) {
    auto& log = st.drafter_undo[s];
    while (!log.empty() && log.back().first >= to) {
      std::memcpy(&st.drafter_rings[s][(log.back().first % W) * hd], log.back().second.data(),
                  static_cast<size_t>(hd) * sizeof(float));
      log.pop_back();
    }
  }
  while (!st.mtp_undo.empty() && st.mtp_undo.back().first >= to) {
    std::memcpy(&st.mtp_ring[(st.mtp_undo.back().first % W) * hd], st.mtp_undo.back().second.data(),
                static_cast<size_t>(hd) * sizeof(float));
    st.mtp_undo.pop_back();
  }
  if (mtp_) {  // X of the new last position (to - 1) becomes the last kept row
    const size_t kd = static_cast<size_t>(cfg_.hc_mult * cfg_.hidden_size);
    st.mtp_x.resize(static_cast<size_t>(std::max<int64_t>(0, to - st.mtp_x_from)) * kd);
  }
  st.position = to;
  return absl::OkStatus();
}

Status CpuModel::Settle(SequenceId seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " does not exist"));
  SeqState& st = *it->second;
  if (st.undo_from < 0) return absl::OkStatus();
  st.undo_from = -1;
  for (auto& log : st.drafter_undo) log.clear();
  st.mtp_undo.clear();
  for (auto& L : st.layers) {
    L.ring_undo.clear();
    for (CompressorState* c : {L.comp.get(), L.index_comp.get()}) {
      if (c != nullptr) c->EndUndo();
    }
  }
  return absl::OkStatus();
}

// ---- mHC ---------------------------------------------------------------------------------------------

void CpuModel::HyperPre(const HyperConnW& hc, const float* x, int64_t n, float* u, float* post, float* comb) const {
  const int64_t k = cfg_.hc_mult, D = cfg_.hidden_size, kd = k * D, m = (2 + k) * k;
  const float eps = static_cast<float>(cfg_.hc_eps);
  std::vector<float> flat(static_cast<size_t>(kd)), mix(static_cast<size_t>(m));
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + r * kd;
    RmsNorm(xr, nullptr, kd, static_cast<float>(cfg_.rms_norm_eps), flat.data());
    for (int64_t j = 0; j < m; ++j) mix[j] = Dot(flat.data(), hc.fn.data() + j * kd, kd);
    float pre[16];
    for (int64_t j = 0; j < k; ++j) {
      pre[j] = Sigmoid(mix[j] * hc.scale[0] + hc.base[j]) + eps;
      post[r * k + j] = 2.0f * Sigmoid(mix[k + j] * hc.scale[1] + hc.base[k + j]);
    }
    float* C = comb + r * k * k;
    for (int64_t j = 0; j < k; ++j) {
      for (int64_t i = 0; i < k; ++i) C[j * k + i] = mix[2 * k + j * k + i] * hc.scale[2] + hc.base[2 * k + j * k + i];
      SoftmaxInPlace(C + j * k, k);
      for (int64_t i = 0; i < k; ++i) C[j * k + i] += eps;
    }
    auto col_norm = [&] {
      for (int64_t i = 0; i < k; ++i) {
        float s = 0;
        for (int64_t j = 0; j < k; ++j) s += C[j * k + i];
        for (int64_t j = 0; j < k; ++j) C[j * k + i] /= (s + eps);
      }
    };
    auto row_norm = [&] {
      for (int64_t j = 0; j < k; ++j) {
        float s = 0;
        for (int64_t i = 0; i < k; ++i) s += C[j * k + i];
        for (int64_t i = 0; i < k; ++i) C[j * k + i] /= (s + eps);
      }
    };
    col_norm();
    for (int64_t it = 1; it < cfg_.hc_sinkhorn_iters; ++it) {
      row_norm();
      col_norm();
    }
    float* ur = u + r * D;
    for (int64_t d = 0; d < D; ++d) {
      float s = 0;
      for (int64_t j = 0; j < k; ++j) s += pre[j] * xr[j * D + d];
      ur[d] = s;
    }
  }
}

void CpuModel::HyperPost(const float* y, const float* post, const float* comb, int64_t n, float* x) const {
  const int64_t k = cfg_.hc_mult, D = cfg_.hidden_size;
  std::vector<float> old(static_cast<size_t>(k * D));
  for (int64_t r = 0; r < n; ++r) {
    float* xr = x + r * k * D;
    std::memcpy(old.data(), xr, old.size() * sizeof(float));
    const float* C = comb + r * k * k;
    for (int64_t i = 0; i < k; ++i) {
      const float p = post[r * k + i];
      for (int64_t d = 0; d < D; ++d) {
        float s = p * y[r * D + d];
        for (int64_t j = 0; j < k; ++j) s += C[j * k + i] * old[j * D + d];
        xr[i * D + d] = s;
      }
    }
  }
}

void CpuModel::CollapseStreams(const HyperConnW& hh, const float* x, float* h) const {
  const int64_t k = cfg_.hc_mult, D = cfg_.hidden_size;
  std::vector<float> flat(static_cast<size_t>(k * D));
  RmsNorm(x, nullptr, k * D, static_cast<float>(cfg_.rms_norm_eps), flat.data());
  float pre[16];
  for (int64_t j = 0; j < k; ++j) {
    pre[j] = Sigmoid(Dot(flat.data(), &hh.fn[j * k * D], k * D) * hh.scale[0] + hh.base[j]) +
             static_cast<float>(cfg_.hc_eps);
  }
  for (int64_t d = 0; d < D; ++d) {
    float s = 0;
    for (int64_t j = 0; j < k; ++j) s += pre[j] * x[j * D + d];
    h[d] = s;
  }
}

// ---- attention ---------------------------------------------------------------------------------------

// q (rms-normed per head, roped), the normalised q_lora activations (the indexer's input) and kv (normed,
// roped) of n rows at `pos`.
void CpuModel::ProjectQueryKv(const AttentionW& a, const float* x, int64_t n, const int64_t* pos, const float* inv,
                              float* qa, float* q, float* kv) const {
  const int64_t H = cfg_.num_attention_heads, hd = cfg_.head_dim, rd = cfg_.rope_dim, qr = cfg_.q_lora_rank;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  MatMul(x, n, a.wq_a, qa, pool_);
  for (int64_t r = 0; r < n; ++r) RmsNorm(qa + r * qr, a.q_norm.data(), qr, eps, qa + r * qr);
  MatMul(qa, n, a.wq_b, q, pool_);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t h = 0; h < H; ++h) {
      float* qh = q + (r * H + h) * hd;
      RmsNorm(qh, nullptr, hd, eps, qh);
      ApplyRope(qh, hd, rd, inv, pos[r]);
    }
  }
  MatMul(x, n, a.wkv, kv, pool_);
  for (int64_t r = 0; r < n; ++r) {
    RmsNorm(kv + r * hd, a.kv_norm.data(), hd, eps, kv + r * hd);
    ApplyRope(kv + r * hd, hd, rd, inv, pos[r]);
  }
}

// Grouped output projection: group g = heads [g·H/G, (g+1)·H/G) through rows [g·R, (g+1)·R) of wo_a,
// then wo_b over the concatenated groups.
void CpuModel::OutputProjection(const AttentionW& a, const float* o, int64_t n, float* out) const {
  const int64_t H = cfg_.num_attention_heads, hd = cfg_.head_dim;
  const int64_t G = cfg_.o_groups, R = cfg_.o_lora_rank, gw = H * hd / G;
  std::vector<float> z(static_cast<size_t>(n * G * R));
  for (int64_t g = 0; g < G; ++g) {
    MatMulRows(o + g * gw, n, a.wo_a, g * R, R, z.data() + g * R, pool_, H * hd, G * R);
  }
  MatMul(z.data(), n, a.wo_b, out, pool_);
}

Status CpuModel::Attention(int64_t layer, const Rows& rows, const float* x, float* out) {
  const AttentionW& a = w_->layers[static_cast<size_t>(layer)].attn;
  const int64_t n = rows.n, H = cfg_.num_attention_heads, hd = cfg_.head_dim;
  const int64_t rd = cfg_.rope_dim, W = cfg_.sliding_window, qr = cfg_.q_lora_rank;
  const float* inv = a.type == AttnType::kSliding ? inv_freq_main_.data() : inv_freq_compress_.data();
  const size_t L = static_cast<size_t>(layer);

  std::vector<float> qa(static_cast<size_t>(n * qr)), q(static_cast<size_t>(n * H * hd)), kv(static_cast<size_t>(n * hd));
  ProjectQueryKv(a, x, n, rows.pos.data(), inv, qa.data(), q.data(), kv.data());

  // Compressor projections (CSA / HCA) and the indexer's (CSA).
  const int64_t coff = a.type == AttnType::kCSA ? 2 : 1;
  std::vector<float> ckv, cg, ikv, ig, iq, iw;
  const int64_t ih = cfg_.index_n_heads, id = cfg_.index_head_dim;
  if (a.type != AttnType::kSliding) {
    ckv.resize(static_cast<size_t>(n * coff * hd));
    cg.resize(ckv.size());
    MatMul(x, n, a.comp.wkv, ckv.data(), pool_);
    MatMul(x, n, a.comp.wgate, cg.data(), pool_);
  }
  if (a.type == AttnType::kCSA) {
    ikv.resize(static_cast<size_t>(n * 2 * id));
    ig.resize(ikv.size());
    iq.resize(static_cast<size_t>(n * ih * id));
    iw.resize(static_cast<size_t>(n * ih));
    MatMul(x, n, a.index_comp.wkv, ikv.data(), pool_);
    MatMul(x, n, a.index_comp.wgate, ig.data(), pool_);
    MatMul(qa.data(), n, a.index_wq_b, iq.data(), pool_);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t h = 0; h < ih; ++h) ApplyRope(&iq[(r * ih + h) * id], id, rd, inv, rows.pos[r]);
    }
    MatMul(x, n, a.index_weights, iw.data(), pool_);
    const float s = 1.0f / std::sqrt(static_cast<float>(ih));
    for (float& v : iw) v *= s;
  }

  std::vector<float> o(static_cast<size_t>(n * H * hd));
  const float iscale = 1.0f / std::sqrt(static_cast<float>(id));
  std::vector<const float*> keys;
  std::vector<float> logits, scores;
  std::vector<int64_t> order;
  for (const Rows::Seq& s : rows.seqs) {
    SeqState::Layer& st = s.state->layers[L];
    for (int64_t r = s.begin; r < s.end; ++r) {
      if (st.comp) st.comp->Append(rows.pos[r], &ckv[r * coff * hd], &cg[r * coff * hd]);
      if (st.index_comp) st.index_comp->Append(rows.pos[r], &ikv[r * 2 * id], &ig[r * 2 * id]);
    }
    for (int64_t r = s.begin; r < s.end; ++r) {
      const int64_t p = rows.pos[r];
      keys.clear();
      for (int64_t k = std::max<int64_t>(0, p - W + 1); k <= p; ++k) {
        keys.push_back(k < s.start_pos ? &st.ring[(k % W) * hd] : &kv[(s.begin + k - s.start_pos) * hd]);
      }
      if (a.type == AttnType::kHCA) {
        const int64_t vis = std::min((p + 1) / a.rate, st.comp->entries().rows());
        for (int64_t e = 0; e < vis; ++e) keys.push_back(st.comp->entries().Row(e));
      } else if (a.type == AttnType::kCSA) {
        const ChunkedRows& ik = st.index_comp->entries();
        const int64_t vis = std::min((p + 1) / a.rate, ik.rows());
        scores.assign(static_cast<size_t>(vis), 0.0f);
        for (int64_t e = 0; e < vis; ++e) {
          float sc = 0.0f;
          for (int64_t h = 0; h < ih; ++h) {
            const float d = Dot(&iq[(r * ih + h) * id], ik.Row(e), id);
            sc += iw[r * ih + h] * std::max(d, 0.0f);
          }
          scores[e] = sc * iscale;
        }
        order.resize(static_cast<size_t>(vis));
        std::iota(order.begin(), order.end(), 0);
        const int64_t top = std::min(cfg_.index_topk, vis);
        std::partial_sort(order.begin(), order.begin() + top, order.end(), [&](int64_t i, int64_t j) {
          return scores[i] > scores[j] || (scores[i] == scores[j] && i < j);
        });
        for (int64_t t = 0; t < top; ++t) keys.push_back(st.comp->entries().Row(order[t]));
      }
      AttendRow(&q[r * H * hd], keys, a.sink.data(), H, hd, rd, inv, p, &o[r * H * hd], &logits);
    }
    // Only the last W rows survive in the ring; a speculative step writes (and logs) every row so that
    // undoing its tail restores the rows it had overwritten in order.
    const bool spec = s.state->undo_from >= 0;
    for (int64_t r = spec ? s.begin : std::max(s.begin, s.end - W); r < s.end; ++r) {
      float* slot = &st.ring[(rows.pos[r] % W) * hd];
      if (spec) st.ring_undo.emplace_back(rows.pos[r], std::vector<float>(slot, slot + hd));
      std::memcpy(slot, &kv[r * hd], static_cast<size_t>(hd) * sizeof(float));
    }
  }

  OutputProjection(a, o.data(), n, out);
  return absl::OkStatus();
}

// ---- MoE ---------------------------------------------------------------------------------------------

Status CpuModel::Moe(const FfnW& f, int64_t expert_layer, int64_t n, const int32_t* tokens, const int64_t* seqs,
                     const float* y, float* out, ExpertBackend* experts) {
  const int64_t D = cfg_.hidden_size, E = cfg_.n_routed_experts, K = cfg_.num_experts_per_tok;
  const int64_t I = cfg_.moe_intermediate_size;
  std::vector<float> logits(static_cast<size_t>(n * E));
  MatMul(y, n, f.gate, logits.data(), pool_);
  std::vector<int32_t> ids(static_cast<size_t>(n * K));
  std::vector<float> wts(static_cast<size_t>(n * K));
  std::vector<float> sel(static_cast<size_t>(E));
  std::vector<int32_t> order(static_cast<size_t>(E));
  for (int64_t r = 0; r < n; ++r) {
    float* s = &logits[r * E];
    switch (cfg_.scoring_func) {
      case ScoringFunc::kSqrtSoftplus:
        for (int64_t e = 0; e < E; ++e) s[e] = std::sqrt(Softplus(s[e]));
        break;
      case ScoringFunc::kSigmoid:
        for (int64_t e = 0; e < E; ++e) s[e] = Sigmoid(s[e]);
        break;
      case ScoringFunc::kSoftmax:
        SoftmaxInPlace(s, E);
        break;
    }
    int32_t* idr = &ids[r * K];
    if (f.type == MoeType::kHash) {
      std::memcpy(idr, &f.tid2eid[static_cast<size_t>(tokens[r]) * K], static_cast<size_t>(K) * sizeof(int32_t));
    } else {
      for (int64_t e = 0; e < E; ++e) sel[e] = s[e] + f.bias[e];
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + K, order.end(),
                        [&](int32_t i, int32_t j) { return sel[i] > sel[j] || (sel[i] == sel[j] && i < j); });
      std::copy(order.begin(), order.begin() + K, idr);
    }
    float sum = 0.0f;
    for (int64_t k = 0; k < K; ++k) sum += s[idr[k]];
    const float mul = static_cast<float>(cfg_.routed_scaling_factor) / (sum + 1e-20f);
    for (int64_t k = 0; k < K; ++k) wts[r * K + k] = s[idr[k]] * mul;
  }
  MoeRequest req;
  req.layer = expert_layer;
  req.rows = n;
  req.top_k = K;
  req.x = y;
  req.expert_ids = ids.data();
  req.expert_weights = wts.data();
  req.out = out;
  req.seqs = seqs;
  RETURN_IF_ERROR(experts->RunRouted(req));

  // Shared expert: SwiGLU with the same clamps as the routed experts.
  std::vector<float> g(static_cast<size_t>(n * I)), u(static_cast<size_t>(n * I));
  std::vector<float> sh(static_cast<size_t>(n * D));
  MatMul(y, n, f.shared_w1, g.data(), pool_);
  MatMul(y, n, f.shared_w3, u.data(), pool_);
  const float lim = static_cast<float>(cfg_.swiglu_limit);
  for (size_t i = 0; i < g.size(); ++i) {
    float gv = g[i], uv = u[i];
    if (lim > 0) {
      gv = std::min(gv, lim);
      uv = std::clamp(uv, -lim, lim);
    }
    g[i] = Silu(gv) * uv;
  }
  MatMul(g.data(), n, f.shared_w2, sh.data(), pool_);
  for (size_t i = 0; i < sh.size(); ++i) out[i] += sh[i];
  return absl::OkStatus();
}

// ---- the step ----------------------------------------------------------------------------------------

Status CpuModel::Forward(std::span<const SequenceStep> steps, ExpertBackend* experts,
                         std::vector<SequenceLogits>* out) {
  if (experts == nullptr) return absl::InvalidArgumentError("Forward: no expert backend");
  RETURN_IF_ERROR(ValidateSequenceSteps(steps, cfg_, [&](SequenceId seq) -> StatusOr<int64_t> {
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " does not exist"));
    return it->second->position;
  }));
  Rows rows;
  for (const SequenceStep& st : steps) {
    SeqState* state = seqs_.at(st.seq).get();
    Rows::Seq s{state, rows.n, rows.n + static_cast<int64_t>(st.tokens.size()), state->position};
    for (size_t i = 0; i < st.tokens.size(); ++i) {
      rows.pos.push_back(state->position + static_cast<int64_t>(i));
      rows.token.push_back(st.tokens[i]);
      rows.seq.push_back(st.seq);
    }
    rows.n = s.end;
    rows.seqs.push_back(s);
  }

  // Validation passed: from here on the step mutates the sequences.
  for (size_t i = 0; i < steps.size(); ++i) {
    const SequenceStep& st = steps[i];
    SeqState* state = rows.seqs[i].state;
    state->undo_from = st.speculative ? state->position : -1;
    for (auto& log : state->drafter_undo) log.clear();
    state->mtp_undo.clear();
    for (auto& L : state->layers) {
      L.ring_undo.clear();
      for (CompressorState* c : {L.comp.get(), L.index_comp.get()}) {
        if (c == nullptr) continue;
        if (st.speculative) {
          c->BeginUndo();
        } else {
          c->EndUndo();
        }
      }
    }
  }
  const int64_t n = rows.n, D = cfg_.hidden_size, k = cfg_.hc_mult;
  std::vector<float> X(static_cast<size_t>(n * k * D));
  for (int64_t r = 0; r < n; ++r) {
    float* e = &X[r * k * D];
    w_->embed.Row(rows.token[r], e);
    for (int64_t j = 1; j < k; ++j) std::memcpy(e + j * D, e, static_cast<size_t>(D) * sizeof(float));
  }
  if (hidden_hook_) hidden_hook_(-1, X);

  std::vector<float> u(static_cast<size_t>(n * D)), xn(u.size()), y(u.size());
  std::vector<float> post(static_cast<size_t>(n * k)), comb(static_cast<size_t>(n * k * k));
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  std::vector<float> features;  // DSpark target features [n, T·D]
  const int64_t T = dspark_ ? static_cast<int64_t>(dspark_->target_layers.size()) : 0;
  if (T > 0) features.assign(static_cast<size_t>(n * T * D), 0.0f);
  for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l) {
    const LayerW& L = w_->layers[static_cast<size_t>(l)];
    for (int64_t t = 0; t < T; ++t) {
      if (dspark_->target_layers[static_cast<size_t>(t)] != l) continue;
      for (int64_t r = 0; r < n; ++r) {  // mean over the streams of the layer's input
        float* f = &features[(r * T + t) * D];
        for (int64_t j = 0; j < k; ++j) {
          for (int64_t d = 0; d < D; ++d) f[d] += X[(r * k + j) * D + d];
        }
        for (int64_t d = 0; d < D; ++d) f[d] /= static_cast<float>(k);
      }
    }
    HyperPre(L.hc_attn, X.data(), n, u.data(), post.data(), comb.data());
    for (int64_t r = 0; r < n; ++r) RmsNorm(&u[r * D], L.attn_norm.data(), D, eps, &xn[r * D]);
    RETURN_IF_ERROR(Attention(l, rows, xn.data(), y.data()));
    HyperPost(y.data(), post.data(), comb.data(), n, X.data());

    HyperPre(L.hc_ffn, X.data(), n, u.data(), post.data(), comb.data());
    for (int64_t r = 0; r < n; ++r) RmsNorm(&u[r * D], L.ffn_norm.data(), D, eps, &xn[r * D]);
    RETURN_IF_ERROR(Moe(L.ffn, l, n, rows.token.data(), rows.seq.data(), xn.data(), y.data(), experts));
    HyperPost(y.data(), post.data(), comb.data(), n, X.data());
    if (hidden_hook_) hidden_hook_(l, X);
  }
  if (T > 0) FeedDrafter(rows, features);
  if (mtp_) FeedMtp(rows, X);
  for (const Rows::Seq& s : rows.seqs) s.state->position += s.end - s.begin;

  // Head: collapse the streams with hc_head, final norm, logits for the rows asked for.
  std::vector<char> need(static_cast<size_t>(n), hidden_hook_ ? 1 : 0);
  for (size_t i = 0; i < steps.size(); ++i) {
    const Rows::Seq& s = rows.seqs[i];
    for (int64_t r = steps[i].all_logits ? s.begin : s.end - 1; r < s.end; ++r) need[r] = 1;
  }
  std::vector<float> h(static_cast<size_t>(n * D), 0.0f);
  for (int64_t r = 0; r < n; ++r) {
    if (!need[r]) continue;
    float* hr = &h[r * D];
    CollapseStreams(w_->hc_head, &X[r * k * D], hr);
    RmsNorm(hr, w_->norm.data(), D, eps, hr);
  }
  if (hidden_hook_) hidden_hook_(cfg_.num_hidden_layers, h);

  out->clear();
  for (size_t i = 0; i < steps.size(); ++i) {
    const Rows::Seq& s = rows.seqs[i];
    const int64_t r0 = steps[i].all_logits ? s.begin : s.end - 1;
    SequenceLogits sl;
    sl.seq = steps[i].seq;
    sl.rows = s.end - r0;
    sl.logits.resize(static_cast<size_t>(sl.rows * cfg_.vocab_size));
    MatMul(&h[r0 * D], sl.rows, w_->Head(), sl.logits.data(), pool_);
    out->push_back(std::move(sl));
  }
  return absl::OkStatus();
}

}  // namespace numoe::cpu
