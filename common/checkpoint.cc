#include "common/checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace numoe {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t Numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string ShapeStr(const std::vector<int64_t>& s) { return "[" + absl::StrJoin(s, ", ") + "]"; }

bool IsFloat(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

// Builds the expected list for one config; `Add*` pick the official storage of each tensor kind.
class Builder {
 public:
  explicit Builder(const ModelConfig& c) : c_(c) {}

  // A plain float tensor (norm weights, mHC params, sinks, ape, biases).
  void Plain(const std::string& name, std::vector<int64_t> shape, DType dtype) {
    ExpectedTensor e = Base(name, std::move(shape));
    e.dtype = dtype;
    Finish(&e);
  }
  // A matrix stored BF16 in the official layout (embed, head, compressor, gate, indexer weights_proj).
  void Bf16Matrix(const std::string& name, int64_t out, int64_t in) {
    ExpectedTensor e = Base(name, {out, in});
    e.matrix = true;
    e.dtype = DType::kBF16;
    Finish(&e);
  }
  // A dense projection: FP8 blocks when the config has quantization_config, else BF16.
  void Dense(const std::string& name, int64_t out, int64_t in) {
    ExpectedTensor e = Base(name, {out, in});
    e.matrix = true;
    if (c_.fp8_dense) {
      SetFp8(&e, c_.fp8_scale_fmt == "ue8m0" ? DType::kF8_E8M0 : DType::kF32);
    } else {
      e.dtype = DType::kBF16;
    }
    Finish(&e);
  }
  // A routed expert matrix in expert_dtype.
  void Expert(const std::string& name, int64_t out, int64_t in) {
    ExpectedTensor e = Base(name, {out, in});
    e.matrix = true;
    e.routed_expert = true;
    if (c_.expert_dtype == "fp4") {
      e.format = WeightFormat::kMxfp4;
      e.dtype = DType::kI8;
      e.stored_shape = {out, in / 2};
      e.scale_dtype = DType::kF8_E8M0;
      e.scale_shape = {out, CeilDiv(in, 32)};
    } else if (c_.expert_dtype == "fp8") {
      SetFp8(&e, DType::kF32);
    } else {
      e.dtype = DType::kBF16;
    }
    Finish(&e);
  }
  void Index(const std::string& name, std::vector<int64_t> shape) {
    ExpectedTensor e = Base(name, std::move(shape));
    e.dtype = DType::kI32;  // int32 in DS-ref; I64 is accepted too
    Finish(&e);
  }

  void SetScope(int64_t layer, int64_t stage) {
    layer_ = layer;
    stage_ = stage;
  }
  std::vector<ExpectedTensor> Take() { return std::move(out_); }

 private:
  ExpectedTensor Base(const std::string& name, std::vector<int64_t> shape) {
    ExpectedTensor e;
    e.name = name;
    e.shape = std::move(shape);
    e.stored_shape = e.shape;
    e.layer = layer_;
    e.mtp_stage = stage_;
    return e;
  }
  void SetFp8(ExpectedTensor* e, DType scale) {
    e->format = WeightFormat::kFp8Block;
    e->dtype = DType::kF8_E4M3;
    e->scale_dtype = scale;
    e->scale_shape = {CeilDiv(e->shape[0], c_.fp8_block_out), CeilDiv(e->shape[1], c_.fp8_block_in)};
  }
  void Finish(ExpectedTensor* e) {
    e->stored_bytes = Numel(e->stored_shape) * static_cast<int64_t>(DTypeSize(e->dtype));
    if (e->format != WeightFormat::kPlain)
      e->stored_bytes += Numel(e->scale_shape) * static_cast<int64_t>(DTypeSize(e->scale_dtype));
    out_.push_back(std::move(*e));
  }

  const ModelConfig& c_;
  int64_t layer_ = -1, stage_ = -1;
  std::vector<ExpectedTensor> out_;
};

// One decoder block (a main layer or an MTP/DSpark stage) under `p` ("layers.3." / "mtp.0.").
void AddBlock(Builder& b, const ModelConfig& c, const std::string& p, AttnType attn, MoeType moe) {
  const int64_t D = c.hidden_size, hd = c.head_dim, H = c.num_attention_heads, hc = c.hc_mult;
  const int64_t mix = (2 + hc) * hc;
  b.Plain(p + "attn_norm.weight", {D}, DType::kBF16);
  b.Plain(p + "ffn_norm.weight", {D}, DType::kBF16);
  for (const char* site : {"hc_attn_", "hc_ffn_"}) {
    b.Plain(p + site + "fn", {mix, hc * D}, DType::kF32);
    b.Plain(p + site + "base", {mix}, DType::kF32);
    b.Plain(p + site + "scale", {3}, DType::kF32);
  }
  const std::string a = p + "attn.";
  b.Dense(a + "wq_a.weight", c.q_lora_rank, D);
  b.Plain(a + "q_norm.weight", {c.q_lora_rank}, DType::kBF16);
  b.Dense(a + "wq_b.weight", H * hd, c.q_lora_rank);
  b.Dense(a + "wkv.weight", hd, D);
  b.Plain(a + "kv_norm.weight", {hd}, DType::kBF16);
  b.Dense(a + "wo_a.weight", c.o_groups * c.o_lora_rank, H * hd / c.o_groups);
  b.Dense(a + "wo_b.weight", D, c.o_groups * c.o_lora_rank);
  b.Plain(a + "attn_sink", {H}, DType::kF32);
  if (attn != AttnType::kSliding) {
    const int64_t coff = attn == AttnType::kCSA ? 2 : 1;
    const int64_t m = attn == AttnType::kCSA ? c.csa_rate : c.hca_rate;
    b.Bf16Matrix(a + "compressor.wkv.weight", coff * hd, D);
    b.Bf16Matrix(a + "compressor.wgate.weight", coff * hd, D);
    b.Plain(a + "compressor.ape", {m, coff * hd}, DType::kF32);
    b.Plain(a + "compressor.norm.weight", {hd}, DType::kBF16);
  }
  if (attn == AttnType::kCSA) {
    const int64_t nI = c.index_n_heads, dI = c.index_head_dim;
    b.Dense(a + "indexer.wq_b.weight", nI * dI, c.q_lora_rank);
    b.Bf16Matrix(a + "indexer.weights_proj.weight", nI, D);
    b.Bf16Matrix(a + "indexer.compressor.wkv.weight", 2 * dI, D);
    b.Bf16Matrix(a + "indexer.compressor.wgate.weight", 2 * dI, D);
    b.Plain(a + "indexer.compressor.ape", {c.csa_rate, 2 * dI}, DType::kF32);
    b.Plain(a + "indexer.compressor.norm.weight", {dI}, DType::kBF16);
  }
  const std::string f = p + "ffn.";
  const int64_t E = c.n_routed_experts, I = c.moe_intermediate_size;
  b.Bf16Matrix(f + "gate.weight", E, D);
  if (moe == MoeType::kHash) {
    b.Index(f + "gate.tid2eid", {c.vocab_size, c.num_experts_per_tok});
  } else {
    b.Plain(f + "gate.bias", {E}, DType::kF32);
  }
  b.Dense(f + "shared_experts.w1.weight", I, D);
  b.Dense(f + "shared_experts.w2.weight", D, I);
  b.Dense(f + "shared_experts.w3.weight", I, D);
  for (int64_t j = 0; j < E; ++j) {
    const std::string e = absl::StrCat(f, "experts.", j, ".");
    b.Expert(e + "w1.weight", I, D);
    b.Expert(e + "w2.weight", D, I);
    b.Expert(e + "w3.weight", I, D);
  }
}

void AddHcHead(Builder& b, const ModelConfig& c, const std::string& p) {
  b.Plain(p + "hc_head_fn", {c.hc_mult, c.hc_mult * c.hidden_size}, DType::kF32);
  b.Plain(p + "hc_head_base", {c.hc_mult}, DType::kF32);
  b.Plain(p + "hc_head_scale", {1}, DType::kF32);
}

// "mtp.12.foo" -> 12; -1 when the name is not an MTP tensor or the index is absurd.
int64_t MtpStageOf(const std::string& name) {
  if (name.rfind("mtp.", 0) != 0) return -1;
  size_t i = 4;
  int64_t v = 0;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9' && i < 8) v = v * 10 + (name[i++] - '0');
  if (i == 4 || i >= name.size() || name[i] != '.') return -1;
  return v;
}

constexpr int64_t kMaxMtpStages = 64;
constexpr size_t kMaxListed = 20;

std::string Where(const TensorView& t) {
  return t.file ? std::filesystem::path(*t.file).filename().string() : std::string("?");
}

std::string DescribeExpected(const ExpectedTensor& e) {
  switch (e.format) {
    case WeightFormat::kFp8Block:
      return absl::StrCat(ShapeStr(e.shape), " (official: F8_E4M3 + .scale ", ShapeStr(e.scale_shape), ")");
    case WeightFormat::kMxfp4:
      return absl::StrCat(ShapeStr(e.shape), " (official: MXFP4 as I8 ", ShapeStr(e.stored_shape), " + .scale ",
                          ShapeStr(e.scale_shape), ")");
    case WeightFormat::kPlain:
      break;
  }
  return absl::StrCat(std::string(DTypeName(e.dtype)), " ", ShapeStr(e.shape));
}

}  // namespace

int64_t ExpectedTensor::params() const { return Numel(shape); }

std::string ScaleNameOf(const std::string& weight_name) {
  constexpr std::string_view kSuffix = ".weight";
  if (weight_name.size() >= kSuffix.size() &&
      weight_name.compare(weight_name.size() - kSuffix.size(), kSuffix.size(), kSuffix) == 0)
    return weight_name.substr(0, weight_name.size() - kSuffix.size()) + ".scale";
  return weight_name + ".scale";
}

std::vector<ExpectedTensor> ExpectedTensors(const ModelConfig& c, int64_t mtp_stages) {
  Builder b(c);
  const int64_t D = c.hidden_size, V = c.vocab_size;
  b.Bf16Matrix("embed.weight", V, D);
  if (!c.tie_word_embeddings) b.Bf16Matrix("head.weight", V, D);
  b.Plain("norm.weight", {D}, DType::kBF16);
  AddHcHead(b, c, "");
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    b.SetScope(i, -1);
    const AttnType attn = i < static_cast<int64_t>(c.layer_types.size()) ? c.layer_types[i] : AttnType::kSliding;
    const MoeType moe = i < static_cast<int64_t>(c.mlp_layer_types.size()) ? c.mlp_layer_types[i] : MoeType::kScored;
    AddBlock(b, c, absl::StrCat("layers.", i, "."), attn, moe);
  }
  const bool dspark = c.dspark_block_size > 0;
  for (int64_t s = 0; s < mtp_stages; ++s) {
    b.SetScope(-1, s);
    const std::string p = absl::StrCat("mtp.", s, ".");
    // Every stage is a sliding-attention block with scored routing (gate bias, no hash).
    AddBlock(b, c, p, AttnType::kSliding, MoeType::kScored);
    if (dspark) {
      if (s == 0) {
        const int64_t targets = std::max<int64_t>(1, static_cast<int64_t>(c.dspark_target_layer_ids.size()));
        b.Dense(p + "main_proj.weight", D, targets * D);
        b.Plain(p + "main_norm.weight", {D}, DType::kBF16);
      }
      if (s == mtp_stages - 1) {
        b.Plain(p + "norm.weight", {D}, DType::kBF16);
        AddHcHead(b, c, p);
        if (c.dspark_markov_rank > 0) {
          b.Bf16Matrix(p + "markov_head.markov_w1.weight", V, c.dspark_markov_rank);
          b.Bf16Matrix(p + "markov_head.markov_w2.weight", V, c.dspark_markov_rank);
          b.Bf16Matrix(p + "confidence_head.proj.weight", 1, D + c.dspark_markov_rank);
        }
      }
    } else {
      // Preview-Flash MTP: each stage has its own input projections, norms and head collapse.
      b.Dense(p + "e_proj.weight", D, D);
      b.Dense(p + "h_proj.weight", D, D);
      b.Plain(p + "enorm.weight", {D}, DType::kBF16);
      b.Plain(p + "hnorm.weight", {D}, DType::kBF16);
      b.Plain(p + "norm.weight", {D}, DType::kBF16);
      AddHcHead(b, c, p);
    }
  }
  return b.Take();
}

std::string RoutedExpertPrefix(const ModelConfig& config, int64_t moe_layer, int64_t expert) {
  const int64_t L = config.num_hidden_layers;
  return moe_layer < L ? absl::StrCat("layers.", moe_layer, ".ffn.experts.", expert, ".")
                       : absl::StrCat("mtp.", moe_layer - L, ".ffn.experts.", expert, ".");
}

ModelFootprint ComputeFootprint(const ModelConfig& config, int64_t mtp_stages) {
  ModelFootprint fp;
  std::vector<int64_t> layer_routed(static_cast<size_t>(config.num_hidden_layers), 0);
  std::vector<int64_t> layer_routed_params(static_cast<size_t>(config.num_hidden_layers), 0);
  int64_t main_other_params = 0;
  for (const ExpectedTensor& e : ExpectedTensors(config, mtp_stages)) {
    fp.total_params += e.params();
    if (e.routed_expert && e.mtp_stage < 0) {
      fp.routed_expert_bytes += e.stored_bytes;
      layer_routed[e.layer] += e.stored_bytes;
      layer_routed_params[e.layer] += e.params();
    } else if (e.routed_expert) {
      fp.mtp_routed_expert_bytes += e.stored_bytes;
    } else {
      fp.other_bytes += e.stored_bytes;
      if (e.mtp_stage < 0) main_other_params += e.params();
    }
  }
  // Every expert of a layer has the same size, so top-k of them is k/E of the layer's routed bytes.
  const int64_t E = config.n_routed_experts, K = config.num_experts_per_tok;
  fp.active_params_per_token = main_other_params;
  for (size_t i = 0; i < layer_routed.size(); ++i) {
    fp.routed_bytes_per_token += layer_routed[i] / E * K;
    fp.active_params_per_token += layer_routed_params[i] / E * K;
  }
  return fp;
}

ModelFootprint StoredFootprint(const Checkpoint& ck) {
  const ModelConfig& c = ck.config();
  ModelFootprint fp = ComputeFootprint(c, ck.mtp_stages());
  fp.routed_expert_bytes = fp.mtp_routed_expert_bytes = fp.other_bytes = fp.routed_bytes_per_token = 0;
  std::vector<int64_t> layer_routed(static_cast<size_t>(c.num_hidden_layers), 0);
  for (const auto& file : ck.store().files()) {
    for (const TensorView& t : file->tensors()) {
      if (ck.store().Find(t.name) != &t) continue;  // not part of the store
      const int64_t bytes = static_cast<int64_t>(t.nbytes);
      int64_t layer = -1;
      const bool main_expert = std::sscanf(t.name.c_str(), "layers.%ld.ffn.experts.", &layer) == 1 &&
                               t.name.find(".ffn.experts.") != std::string::npos;
      if (main_expert && layer >= 0 && layer < c.num_hidden_layers) {
        fp.routed_expert_bytes += bytes;
        layer_routed[layer] += bytes;
      } else if (t.name.rfind("mtp.", 0) == 0 && t.name.find(".ffn.experts.") != std::string::npos) {
        fp.mtp_routed_expert_bytes += bytes;
      } else {
        fp.other_bytes += bytes;
      }
    }
  }
  for (int64_t b : layer_routed) fp.routed_bytes_per_token += b / c.n_routed_experts * c.num_experts_per_tok;
  return fp;
}

// ---- Checkpoint -----------------------------------------------------------

namespace {

struct Problems {
  std::vector<std::string> missing, unexpected, bad;
  size_t total() const { return missing.size() + unexpected.size() + bad.size(); }
};

// Validates one stored tensor (and its scale) against the expectation; returns "" when it fits.
// `consumed` collects the scale name when the scale belongs to this weight.
std::string CheckTensor(const ExpectedTensor& e, const TensorView& t, const TensorStore& store, const ModelConfig& c,
                        std::set<std::string>* consumed) {
  auto got = [&](const TensorView& v) {
    return absl::StrCat(std::string(DTypeName(v.dtype)), " ", v.ShapeString(), " in ", Where(v));
  };
  const std::string expect = DescribeExpected(e);
  if (e.dtype == DType::kI32 || e.dtype == DType::kI64) {
    if (t.dtype != DType::kI32 && t.dtype != DType::kI64)
      return absl::StrCat(e.name, ": expected I32/I64 ", ShapeStr(e.shape), ", got ", got(t));
    if (t.shape != e.shape) return absl::StrCat(e.name, ": expected I32/I64 ", ShapeStr(e.shape), ", got ", got(t));
    // Hash routing indexes the experts with these values: each must be an expert id.
    const int64_t n = t.numel(), E = c.n_routed_experts;
    for (int64_t i = 0; i < n; ++i) {
      int64_t v;
      if (t.dtype == DType::kI32) {
        int32_t x;
        std::memcpy(&x, t.data + 4 * i, 4);
        v = x;
      } else {
        std::memcpy(&v, t.data + 8 * i, 8);
      }
      if (v < 0 || v >= E) {
        const int64_t k = e.shape[1];
        return absl::StrCat(e.name, ": value ", v, " at [", i / k, ", ", i % k, "] is not an expert id in [0, ", E,
                            ") (in ", Where(t), ")");
      }
    }
    return "";
  }
  if (!e.matrix) {
    if (!IsFloat(t.dtype) || t.shape != e.shape)
      return absl::StrCat(e.name, ": expected ", expect, " (F32/BF16/F16), got ", got(t));
    return "";
  }
  const std::string scale_name = ScaleNameOf(e.name);
  const TensorView* s = store.Find(scale_name);
  const int64_t out = e.shape[0], in = e.shape[1];
  if (IsFloat(t.dtype)) {
    if (t.shape != e.shape) return absl::StrCat(e.name, ": expected ", expect, ", got ", got(t));
    return "";
  }
  auto scale_ok = [&](const std::vector<int64_t>& want, bool allow_f32) -> std::string {
    if (s == nullptr) return absl::StrCat(e.name, ": stored as ", got(t), " but its scale '", scale_name, "' is missing");
    consumed->insert(scale_name);
    const bool dtype_ok = s->dtype == DType::kF8_E8M0 || (allow_f32 && (s->dtype == DType::kF32 || IsFloat(s->dtype)));
    if (!dtype_ok || s->shape != want)
      return absl::StrCat(scale_name, ": expected ", allow_f32 ? "F8_E8M0/F32 " : "F8_E8M0 ", ShapeStr(want),
                          " for ", e.name, " ", ShapeStr(e.shape), ", got ", got(*s));
    return "";
  };
  if (t.dtype == DType::kF8_E4M3) {
    if (t.shape != e.shape) return absl::StrCat(e.name, ": expected ", expect, ", got ", got(t));
    return scale_ok({CeilDiv(out, c.fp8_block_out), CeilDiv(in, c.fp8_block_in)}, true);
  }
  if (t.dtype == DType::kI8 || t.dtype == DType::kU8) {
    const std::vector<int64_t> packed = {out, in / 2};
    if (in % 2 != 0 || t.shape != packed)
      return absl::StrCat(e.name, ": expected ", expect, "; as MXFP4 it must be ", std::string(DTypeName(t.dtype)), " ",
                          ShapeStr(packed), ", got ", got(t));
    return scale_ok({out, CeilDiv(in, 32)}, true);
  }
  return absl::StrCat(e.name, ": expected ", expect, ", got unsupported ", got(t));
}

std::string JoinCapped(const std::string& what, const std::vector<std::string>& items, size_t shown) {
  if (items.empty()) return "";
  std::string s = absl::StrCat(items.size(), " ", what, ": ");
  std::vector<std::string> head(items.begin(), items.begin() + static_cast<std::ptrdiff_t>(shown));
  s += absl::StrJoin(head, ", ");
  if (shown < items.size()) absl::StrAppend(&s, shown ? ", " : "", "and ", items.size() - shown, " more");
  return s;
}

// How many names of each category to print: at least 3 of each (so no kind of problem hides behind
// another), then the rest of the kMaxListed budget in order.
std::vector<size_t> ShareBudget(const std::vector<size_t>& sizes) {
  std::vector<size_t> shown(sizes.size());
  size_t used = 0;
  for (size_t i = 0; i < sizes.size(); ++i) used += shown[i] = std::min<size_t>(sizes[i], 3);
  for (size_t i = 0; i < sizes.size(); ++i) {
    const size_t extra = std::min(sizes[i] - shown[i], kMaxListed > used ? kMaxListed - used : 0);
    shown[i] += extra;
    used += extra;
  }
  return shown;
}

}  // namespace

StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  auto ck = std::unique_ptr<Checkpoint>(new Checkpoint());
  ck->dir_ = dir;
  ASSIGN_OR_RETURN(ck->config_, LoadModelConfig(dir));
  ASSIGN_OR_RETURN(ck->store_, TensorStore::Open(dir));
  const TensorStore& store = *ck->store_;

  int64_t stages = 0;
  for (const std::string& name : store.Names()) {
    const int64_t s = MtpStageOf(name);
    if (s >= 0 && s < kMaxMtpStages) stages = std::max(stages, s + 1);
  }
  ck->mtp_stages_ = stages;

  Problems pr;
  std::set<std::string> consumed;
  for (const ExpectedTensor& e : ExpectedTensors(ck->config_, stages)) {
    const TensorView* t = store.Find(e.name);
    if (t == nullptr) {
      pr.missing.push_back(e.name);
      continue;
    }
    consumed.insert(e.name);
    std::string err = CheckTensor(e, *t, store, ck->config_, &consumed);
    if (!err.empty()) pr.bad.push_back(std::move(err));
  }
  for (const std::string& name : store.Names())
    if (!consumed.count(name)) pr.unexpected.push_back(name);

  if (pr.total() > 0) {
    const ModelConfig& c = ck->config_;
    const std::vector<size_t> shown = ShareBudget({pr.missing.size(), pr.unexpected.size(), pr.bad.size()});
    std::vector<std::string> parts;
    for (std::string part : {JoinCapped("missing tensor(s)", pr.missing, shown[0]),
                             JoinCapped("unexpected tensor(s)", pr.unexpected, shown[1]),
                             JoinCapped("mis-shaped or mis-typed tensor(s)", pr.bad, shown[2])})
      if (!part.empty()) parts.push_back(std::move(part));
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint ", dir, " does not match its config.json (", c.num_hidden_layers, " layers, ", c.n_routed_experts,
        " experts, ", stages, " MTP stages): ", absl::StrJoin(parts, "; ")));
  }
  return ck;
}

StatusOr<F32Tensor> Checkpoint::LoadF32(const std::string& name) const {
  ASSIGN_OR_RETURN(const TensorView* t, store_->Get(name));
  if (t->dtype == DType::kF8_E4M3 || t->dtype == DType::kI8 || t->dtype == DType::kU8) {
    const std::string scale_name = ScaleNameOf(name);
    const TensorView* s = store_->Find(scale_name);
    if (s != nullptr) {
      if (t->dtype == DType::kF8_E4M3) return DequantizeFp8Block(*t, *s, config_.fp8_block_out, config_.fp8_block_in);
      return DequantizeMxfp4(*t, *s);
    }
    if (name.size() >= 7 && name.compare(name.size() - 7, 7, ".weight") == 0)
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "' is ", std::string(DTypeName(t->dtype)), " but its scale '", scale_name, "' is missing"));
  }
  return ToF32(*t);
}

StatusOr<std::vector<int64_t>> Checkpoint::LoadIndex(const std::string& name, std::vector<int64_t>* shape) const {
  ASSIGN_OR_RETURN(const TensorView* t, store_->Get(name));
  if (t->dtype != DType::kI32 && t->dtype != DType::kI64)
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "' is ", std::string(DTypeName(t->dtype)), ", not an I32/I64 index tensor"));
  const int64_t n = t->numel();
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    if (t->dtype == DType::kI32) {
      int32_t v;
      std::memcpy(&v, t->data + 4 * i, 4);
      out[i] = v;
    } else {
      std::memcpy(&out[i], t->data + 8 * i, 8);
    }
  }
  if (shape != nullptr) *shape = t->shape;
  return out;
}

StatusOr<const TensorView*> Checkpoint::Raw(const std::string& name) const { return store_->Get(name); }

namespace {

// 64-bit FNV-1a: stable across builds and machines.
uint64_t Fnv1a(uint64_t h, const std::string& bytes) {
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

StatusOr<std::string> ModelFingerprint(const std::string& model_dir) {
  namespace fs = std::filesystem;
  uint64_t h = 14695981039346656037ull;
  bool any = false;
  for (const char* name : {"config.json", "model.safetensors.index.json"}) {
    std::ifstream in(fs::path(model_dir) / name, std::ios::binary);
    if (!in) continue;
    std::stringstream ss;
    ss << in.rdbuf();
    h = Fnv1a(h, std::string(name) + "\n" + ss.str());
    any = true;
  }
  std::error_code ec;
  const auto single = fs::path(model_dir) / "model.safetensors";
  if (fs::exists(single, ec)) h = Fnv1a(h, absl::StrCat("model.safetensors:", fs::file_size(single, ec)));
  if (!any) return absl::NotFoundError(absl::StrCat(model_dir, ": no config.json to fingerprint"));
  return absl::StrCat(absl::Hex(h, absl::kZeroPad16));
}

}  // namespace numoe
