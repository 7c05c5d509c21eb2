#include "common/config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numbers>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace numoe {
namespace {

using json = nlohmann::json;

constexpr const char* kSliding = "sliding_attention";
constexpr const char* kCsa = "compressed_sparse_attention";
constexpr const char* kHca = "heavily_compressed_attention";

std::string Brief(const json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

// Typed access to one JSON object with errors that name the source file and the key path.
class Reader {
 public:
  Reader(const json& obj, std::string source, std::string prefix = "")
      : obj_(obj), source_(std::move(source)), prefix_(std::move(prefix)) {}

  bool Has(const std::string& key) const { return obj_.contains(key) && !obj_.at(key).is_null(); }
  const json& At(const std::string& key) const { return obj_.at(key); }
  std::string Path(const std::string& key) const { return prefix_ + key; }

  Status Error(const std::string& key, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": ", Path(key), " ", what));
  }
  Status Missing(const std::string& key) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": missing required key '", Path(key), "'"));
  }

  // Integers may be written as 4 or 4.0; anything else is a type error.
  Status Int(const std::string& key, int64_t* out, bool required, int64_t min = std::numeric_limits<int64_t>::min(),
             int64_t max = std::numeric_limits<int64_t>::max()) const {
    if (!Has(key)) return required ? Missing(key) : absl::OkStatus();
    ASSIGN_OR_RETURN(*out, ToInt(key, At(key)));
    if (*out < min || *out > max) {
      if (max == std::numeric_limits<int64_t>::max())
        return Error(key, absl::StrCat("must be >= ", min, " (got ", *out, ")"));
      return Error(key, absl::StrCat("must be in [", min, ", ", max, "] (got ", *out, ")"));
    }
    return absl::OkStatus();
  }
  StatusOr<int64_t> ToInt(const std::string& key, const json& v) const {
    if (v.is_number_integer()) {
      if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        return Error(key, absl::StrCat("is out of range (got ", Brief(v), ")"));
      return v.get<int64_t>();
    }
    if (v.is_number_float()) {
      double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) return static_cast<int64_t>(d);
    }
    return Error(key, absl::StrCat("must be an integer (got ", Brief(v), ")"));
  }
  Status Double(const std::string& key, double* out, bool required) const {
    if (!Has(key)) return required ? Missing(key) : absl::OkStatus();
    const json& v = At(key);
    if (!v.is_number() || !std::isfinite(v.get<double>()))
      return Error(key, absl::StrCat("must be a number (got ", Brief(v), ")"));
    *out = v.get<double>();
    return absl::OkStatus();
  }
  Status Bool(const std::string& key, bool* out) const {
    if (!Has(key)) return absl::OkStatus();
    if (!At(key).is_boolean()) return Error(key, absl::StrCat("must be true or false (got ", Brief(At(key)), ")"));
    *out = At(key).get<bool>();
    return absl::OkStatus();
  }
  Status String(const std::string& key, std::string* out) const {
    if (!Has(key)) return absl::OkStatus();
    if (!At(key).is_string()) return Error(key, absl::StrCat("must be a string (got ", Brief(At(key)), ")"));
    *out = At(key).get<std::string>();
    return absl::OkStatus();
  }
  Status IntList(const std::string& key, std::vector<int64_t>* out) const {
    if (!Has(key)) return absl::OkStatus();
    const json& v = At(key);
    if (!v.is_array()) return Error(key, absl::StrCat("must be a list of integers (got ", Brief(v), ")"));
    out->clear();
    for (const json& e : v) {
      ASSIGN_OR_RETURN(int64_t x, ToInt(key, e));
      out->push_back(x);
    }
    return absl::OkStatus();
  }
  Status StringList(const std::string& key, std::vector<std::string>* out) const {
    if (!Has(key)) return absl::OkStatus();
    const json& v = At(key);
    if (!v.is_array()) return Error(key, absl::StrCat("must be a list of strings (got ", Brief(v), ")"));
    out->clear();
    for (const json& e : v) {
      if (!e.is_string()) return Error(key, absl::StrCat("entries must be strings (got ", Brief(e), ")"));
      out->push_back(e.get<std::string>());
    }
    return absl::OkStatus();
  }
  StatusOr<Reader> Object(const std::string& key) const {
    if (!At(key).is_object()) return Error(key, absl::StrCat("must be an object (got ", Brief(At(key)), ")"));
    return Reader(At(key), source_, Path(key) + ".");
  }
  const std::string& source() const { return source_; }

 private:
  const json& obj_;
  std::string source_;
  std::string prefix_;
};

// One rope table: rope_theta (falls back to `theta_default`), rope_type/type default|yarn and the
// YaRN fields. `partial_rotary_factor` is reported when present.
Status ParseRope(const Reader& r, double theta_default, int64_t max_pos, RopeConfig* rope, double* prf,
                 bool* has_prf) {
  rope->theta = theta_default;
  RETURN_IF_ERROR(r.Double("rope_theta", &rope->theta, false));
  if (!(rope->theta > 1.0)) return r.Error("rope_theta", absl::StrCat("must be > 1 (got ", rope->theta, ")"));
  std::string type = "default";
  RETURN_IF_ERROR(r.String("type", &type));
  RETURN_IF_ERROR(r.String("rope_type", &type));
  if (type == "default") {
    rope->yarn = false;
  } else if (type == "yarn") {
    rope->yarn = true;
    RETURN_IF_ERROR(r.Double("factor", &rope->factor, true));
    if (!(rope->factor >= 1.0)) return r.Error("factor", absl::StrCat("must be >= 1 (got ", rope->factor, ")"));
    // Older transformers fall back to max_position_embeddings when the original length is absent.
    rope->original_max_position_embeddings = max_pos;
    RETURN_IF_ERROR(r.Int("original_max_position_embeddings", &rope->original_max_position_embeddings, false, 1));
    if (rope->original_max_position_embeddings <= 0)
      return r.Missing("original_max_position_embeddings");
    RETURN_IF_ERROR(r.Double("beta_fast", &rope->beta_fast, false));
    RETURN_IF_ERROR(r.Double("beta_slow", &rope->beta_slow, false));
    if (!(rope->beta_fast > 0) || !(rope->beta_slow > 0))
      return r.Error("beta_fast", "and beta_slow must be > 0");
  } else {
    return r.Error("rope_type", absl::StrCat("'", type, "' is not supported (default or yarn)"));
  }
  // DeepSeek-V4 never scales cos/sin (transformers forces attention_factor = 1.0).
  rope->attention_factor = 1.0;
  if (r.Has("partial_rotary_factor")) {
    RETURN_IF_ERROR(r.Double("partial_rotary_factor", prf, false));
    *has_prf = true;
  }
  return absl::OkStatus();
}

StatusOr<AttnType> AttnTypeFromName(const Reader& r, const std::string& key, const std::string& name) {
  if (name == kSliding) return AttnType::kSliding;
  if (name == kCsa) return AttnType::kCSA;
  if (name == kHca) return AttnType::kHCA;
  return r.Error(key, absl::StrCat("entry '", name, "' is not one of ", kSliding, ", ", kCsa, ", ", kHca));
}

}  // namespace

const char* AttnTypeName(AttnType t) {
  switch (t) {
    case AttnType::kSliding:
      return "sliding";
    case AttnType::kCSA:
      return "csa";
    case AttnType::kHCA:
      return "hca";
  }
  return "?";
}

const char* MoeTypeName(MoeType t) { return t == MoeType::kHash ? "hash" : "scored"; }

int64_t ModelConfig::CompressRate(int64_t layer) const {
  if (layer < 0 || layer >= static_cast<int64_t>(layer_types.size())) return 0;
  switch (layer_types[layer]) {
    case AttnType::kSliding:
      return 0;
    case AttnType::kCSA:
      return csa_rate;
    case AttnType::kHCA:
      return hca_rate;
  }
  return 0;
}

int64_t ModelConfig::DefaultMtpStages() const {
  if (dspark_block_size > 0) {
    return extra_compress_ratios.empty() ? std::max<int64_t>(num_nextn_predict_layers, 1)
                                         : static_cast<int64_t>(extra_compress_ratios.size());
  }
  return num_nextn_predict_layers;
}

int64_t ModelConfig::NumLayersOf(AttnType t) const {
  int64_t n = 0;
  for (AttnType a : layer_types) n += a == t;
  return n;
}

int64_t ModelConfig::NumLayersOf(MoeType t) const {
  int64_t n = 0;
  for (MoeType m : mlp_layer_types) n += m == t;
  return n;
}

StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text, const std::string& source) {
  json root = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(source, ": not valid JSON"));
  if (!root.is_object()) return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  Reader r(root, source);
  ModelConfig c;
  constexpr int64_t kMaxDim = int64_t{1} << 24;  // keeps every shape product far from overflow

  if (r.Has("model_type")) {
    std::string mt;
    RETURN_IF_ERROR(r.String("model_type", &mt));
    if (mt != "deepseek_v4")
      return r.Error("model_type", absl::StrCat("is '", mt, "'; only deepseek_v4 is supported"));
  }
  RETURN_IF_ERROR(r.Int("vocab_size", &c.vocab_size, true, 1, int64_t{1} << 26));
  RETURN_IF_ERROR(r.Int("hidden_size", &c.hidden_size, true, 1, kMaxDim));
  RETURN_IF_ERROR(r.Int("num_hidden_layers", &c.num_hidden_layers, true, 1, 4096));
  RETURN_IF_ERROR(r.Int("num_attention_heads", &c.num_attention_heads, true, 1, 65536));
  RETURN_IF_ERROR(r.Int("head_dim", &c.head_dim, true, 1, kMaxDim));
  RETURN_IF_ERROR(r.Int("q_lora_rank", &c.q_lora_rank, true, 1, kMaxDim));
  RETURN_IF_ERROR(r.Int("o_groups", &c.o_groups, true, 1, 65536));
  RETURN_IF_ERROR(r.Int("o_lora_rank", &c.o_lora_rank, true, 1, kMaxDim));
  c.sliding_window = 128;
  RETURN_IF_ERROR(r.Int("sliding_window", &c.sliding_window, false, 1));
  int64_t kv_heads = 1;
  RETURN_IF_ERROR(r.Int("num_key_value_heads", &kv_heads, false));
  if (kv_heads != 1) return r.Error("num_key_value_heads", absl::StrCat("must be 1 (got ", kv_heads, ")"));

  // Experts (transformers' attribute_map aliases accepted).
  const std::string experts_key = r.Has("n_routed_experts") ? "n_routed_experts" : "num_local_experts";
  if (!r.Has(experts_key)) return r.Missing("n_routed_experts");
  RETURN_IF_ERROR(r.Int(experts_key, &c.n_routed_experts, true, 1, 1 << 16));
  RETURN_IF_ERROR(r.Int("num_experts_per_tok", &c.num_experts_per_tok, true, 1));
  if (c.num_experts_per_tok > c.n_routed_experts)
    return r.Error("num_experts_per_tok", absl::StrCat("(", c.num_experts_per_tok, ") must not exceed ", experts_key,
                                                       " (", c.n_routed_experts, ")"));
  RETURN_IF_ERROR(r.Int("n_shared_experts", &c.n_shared_experts, false));
  if (c.n_shared_experts != 1)
    return r.Error("n_shared_experts", absl::StrCat("must be 1 (got ", c.n_shared_experts, ")"));
  const std::string inter_key = r.Has("moe_intermediate_size") ? "moe_intermediate_size" : "intermediate_size";
  if (!r.Has(inter_key)) return r.Missing("moe_intermediate_size");
  RETURN_IF_ERROR(r.Int(inter_key, &c.moe_intermediate_size, true, 1, kMaxDim));

  std::string scoring = "sqrtsoftplus";
  RETURN_IF_ERROR(r.String("scoring_func", &scoring));
  if (scoring == "sqrtsoftplus") {
    c.scoring_func = ScoringFunc::kSqrtSoftplus;
  } else if (scoring == "softmax") {
    c.scoring_func = ScoringFunc::kSoftmax;
  } else if (scoring == "sigmoid") {
    c.scoring_func = ScoringFunc::kSigmoid;
  } else {
    return r.Error("scoring_func", absl::StrCat("'", scoring, "' is not one of sqrtsoftplus, softmax, sigmoid"));
  }
  c.routed_scaling_factor = 1.5;
  RETURN_IF_ERROR(r.Double("routed_scaling_factor", &c.routed_scaling_factor, false));
  c.swiglu_limit = 10.0;
  RETURN_IF_ERROR(r.Double("swiglu_limit", &c.swiglu_limit, false));
  if (c.swiglu_limit < 0) return r.Error("swiglu_limit", "must be >= 0 (0 = no clamp)");

  // Indexer.
  RETURN_IF_ERROR(r.Int("index_n_heads", &c.index_n_heads, true, 1, 65536));
  RETURN_IF_ERROR(r.Int("index_head_dim", &c.index_head_dim, true, 1, kMaxDim));
  RETURN_IF_ERROR(r.Int("index_topk", &c.index_topk, true, 1));

  // mHC and norms.
  RETURN_IF_ERROR(r.Int("hc_mult", &c.hc_mult, false, 1, 64));
  RETURN_IF_ERROR(r.Int("hc_sinkhorn_iters", &c.hc_sinkhorn_iters, false, 1, 10000));
  RETURN_IF_ERROR(r.Double("hc_eps", &c.hc_eps, false));
  RETURN_IF_ERROR(r.Double("rms_norm_eps", &c.rms_norm_eps, false));
  if (!(c.hc_eps >= 0)) return r.Error("hc_eps", "must be >= 0");
  if (!(c.rms_norm_eps > 0)) return r.Error("rms_norm_eps", "must be > 0");

  // Compress rates: compress_rates dict > legacy compress_rate_csa/hca > {4, 128}.
  RETURN_IF_ERROR(r.Int("compress_rate_csa", &c.csa_rate, false, 1));
  RETURN_IF_ERROR(r.Int("compress_rate_hca", &c.hca_rate, false, 1));
  if (r.Has("compress_rates")) {
    ASSIGN_OR_RETURN(Reader cr, r.Object("compress_rates"));
    for (auto it = r.At("compress_rates").begin(); it != r.At("compress_rates").end(); ++it)
      if (it.key() != kCsa && it.key() != kHca)
        return cr.Error(it.key(), absl::StrCat("is not an attention type with a rate (", kCsa, ", ", kHca, ")"));
    RETURN_IF_ERROR(cr.Int(kCsa, &c.csa_rate, false, 1, 1 << 20));
    RETURN_IF_ERROR(cr.Int(kHca, &c.hca_rate, false, 1, 1 << 20));
  }
  if (c.csa_rate == c.hca_rate)
    return r.Error("compress_rates", absl::StrCat("CSA and HCA rates must differ (both ", c.csa_rate, ")"));

  // Layer schedule: layer_types > compress_ratios > the V4-Pro default.
  const int64_t n = c.num_hidden_layers;
  if (r.Has("layer_types")) {
    std::vector<std::string> names;
    RETURN_IF_ERROR(r.StringList("layer_types", &names));
    if (static_cast<int64_t>(names.size()) != n)
      return r.Error("layer_types", absl::StrCat("has ", names.size(), " entries but num_hidden_layers is ", n));
    for (const auto& name : names) {
      ASSIGN_OR_RETURN(AttnType t, AttnTypeFromName(r, "layer_types", name));
      c.layer_types.push_back(t);
    }
  }
  if (r.Has("compress_ratios")) {
    std::vector<int64_t> ratios;
    RETURN_IF_ERROR(r.IntList("compress_ratios", &ratios));
    const bool use_for_layers = c.layer_types.empty();
    if (use_for_layers && static_cast<int64_t>(ratios.size()) < n)
      return r.Error("compress_ratios", absl::StrCat("has ", ratios.size(), " entries, fewer than num_hidden_layers (",
                                                     n, ")"));
    for (size_t i = 0; i < ratios.size(); ++i) {
      const int64_t v = ratios[i];
      if (v != 0 && v != c.csa_rate && v != c.hca_rate)
        return r.Error("compress_ratios", absl::StrCat("entry ", i, " is ", v, "; only 0, ", c.csa_rate, " (CSA) and ",
                                                       c.hca_rate, " (HCA) are accepted"));
      if (static_cast<int64_t>(i) < n) {
        if (use_for_layers)
          c.layer_types.push_back(v == 0 ? AttnType::kSliding : v == c.csa_rate ? AttnType::kCSA : AttnType::kHCA);
      } else {
        c.extra_compress_ratios.push_back(v);
      }
    }
  }
  if (c.layer_types.empty()) {
    for (int64_t i = 0; i < n; ++i)
      c.layer_types.push_back(i < 2 ? AttnType::kHCA : ((i - 2) % 2 ? AttnType::kCSA : AttnType::kHCA));
  }

  // MoE schedule: mlp_layer_types > num_hash_layers > 3 hash layers.
  if (r.Has("mlp_layer_types")) {
    std::vector<std::string> names;
    RETURN_IF_ERROR(r.StringList("mlp_layer_types", &names));
    if (static_cast<int64_t>(names.size()) != n)
      return r.Error("mlp_layer_types", absl::StrCat("has ", names.size(), " entries but num_hidden_layers is ", n));
    for (const auto& name : names) {
      if (name == "hash_moe") {
        c.mlp_layer_types.push_back(MoeType::kHash);
      } else if (name == "moe") {
        c.mlp_layer_types.push_back(MoeType::kScored);
      } else {
        return r.Error("mlp_layer_types", absl::StrCat("entry '", name, "' is not one of hash_moe, moe"));
      }
    }
  } else {
    int64_t hash = 3;
    RETURN_IF_ERROR(r.Int("num_hash_layers", &hash, false, 0));
    for (int64_t i = 0; i < n; ++i) c.mlp_layer_types.push_back(i < hash ? MoeType::kHash : MoeType::kScored);
  }

  // Rope dims: qk_rope_head_dim > partial_rotary_factor (top level or inside rope_parameters) > head_dim/8.
  c.max_position_embeddings = 1048576;
  RETURN_IF_ERROR(r.Int("max_position_embeddings", &c.max_position_embeddings, false, 1));
  double theta_main = 10000.0, theta_compress = 160000.0;
  RETURN_IF_ERROR(r.Double("rope_theta", &theta_main, false));
  RETURN_IF_ERROR(r.Double("compress_rope_theta", &theta_compress, false));
  double prf = 0.125;
  bool has_prf = false;
  std::string prf_key = "partial_rotary_factor";
  if (r.Has("partial_rotary_factor")) {
    RETURN_IF_ERROR(r.Double("partial_rotary_factor", &prf, false));
    has_prf = true;
  }
  // rope_parameters: nested {main, compress}, or a flat dict / legacy rope_scaling for the compress table.
  const std::string rope_key = r.Has("rope_parameters") ? "rope_parameters" : "rope_scaling";
  bool nested = false;
  if (r.Has(rope_key)) {
    ASSIGN_OR_RETURN(Reader rp, r.Object(rope_key));
    nested = rp.Has("main") || rp.Has("compress");
    if (nested) {
      if (!rp.Has("main") || !rp.Has("compress"))
        return r.Error(rope_key, "must hold both 'main' and 'compress' when nested");
      ASSIGN_OR_RETURN(Reader main, rp.Object("main"));
      ASSIGN_OR_RETURN(Reader comp, rp.Object("compress"));
      double p1 = prf, p2 = prf;
      bool h1 = false, h2 = false;
      RETURN_IF_ERROR(ParseRope(main, theta_main, c.max_position_embeddings, &c.rope_main, &p1, &h1));
      RETURN_IF_ERROR(ParseRope(comp, theta_compress, c.max_position_embeddings, &c.rope_compress, &p2, &h2));
      if (h1 && h2 && p1 != p2)
        return r.Error(rope_key, "main and compress partial_rotary_factor differ");
      if (!has_prf && (h1 || h2)) {
        prf = h1 ? p1 : p2;
        has_prf = true;
        prf_key = rope_key + (h1 ? ".main" : ".compress") + ".partial_rotary_factor";
      }
    } else {
      double unused = 0;
      bool unused_has = false;
      RETURN_IF_ERROR(ParseRope(rp, theta_compress, c.max_position_embeddings, &c.rope_compress, &unused, &unused_has));
      // A flat dict never carries the compress base; the top-level key does.
      c.rope_compress.theta = theta_compress;
    }
  }
  if (!nested) {
    c.rope_main = RopeConfig{};
    c.rope_main.theta = theta_main;
    if (!r.Has(rope_key)) {
      c.rope_compress = RopeConfig{};
    }
    c.rope_compress.theta = theta_compress;
  }
  if (!(c.rope_main.theta > 1.0)) return r.Error("rope_theta", "must be > 1");
  if (!(c.rope_compress.theta > 1.0)) return r.Error("compress_rope_theta", "must be > 1");
  if (r.Has("qk_rope_head_dim")) {
    RETURN_IF_ERROR(r.Int("qk_rope_head_dim", &c.rope_dim, true, 1));
    if (c.rope_dim > c.head_dim)
      return r.Error("qk_rope_head_dim", absl::StrCat("(", c.rope_dim, ") must not exceed head_dim (", c.head_dim, ")"));
    if (has_prf && std::fabs(prf * static_cast<double>(c.head_dim) - static_cast<double>(c.rope_dim)) > 1e-6)
      return r.Error("qk_rope_head_dim", absl::StrCat("(", c.rope_dim, ") disagrees with ", prf_key, " (", prf,
                                                      " x head_dim ", c.head_dim, ")"));
  } else {
    if (!(prf > 0.0 && prf <= 1.0))
      return absl::InvalidArgumentError(absl::StrCat(source, ": ", prf_key, " must be in (0, 1] (got ", prf, ")"));
    const double dims = prf * static_cast<double>(c.head_dim);
    if (std::fabs(dims - std::round(dims)) > 1e-6)
      return absl::InvalidArgumentError(absl::StrCat(source, ": head_dim (", c.head_dim, ") x ", prf_key, " (", prf,
                                                     ") is not a whole number of rope channels"));
    c.rope_dim = static_cast<int64_t>(std::llround(dims));
    prf_key = has_prf ? prf_key : "head_dim";
  }
  const std::string rope_dim_key = r.Has("qk_rope_head_dim") ? "qk_rope_head_dim" : prf_key;
  if (c.rope_dim <= 0 || c.rope_dim % 2 != 0)
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", rope_dim_key, " gives ", c.rope_dim,
                                                   " rope channels; it must be even and > 0"));
  if (c.index_head_dim < c.rope_dim)
    return r.Error("index_head_dim", absl::StrCat("(", c.index_head_dim, ") must be >= the rope dim (", c.rope_dim,
                                                  ") because the indexer ropes its last rope-dim channels"));
  if (c.num_attention_heads % c.o_groups != 0)
    return r.Error("o_groups", absl::StrCat("(", c.o_groups, ") must divide num_attention_heads (",
                                            c.num_attention_heads, ")"));

  RETURN_IF_ERROR(r.Bool("tie_word_embeddings", &c.tie_word_embeddings));
  RETURN_IF_ERROR(r.Int("bos_token_id", &c.bos_token_id, false, 0, c.vocab_size - 1));
  if (r.Has("eos_token_id") && r.At("eos_token_id").is_array()) {
    std::vector<int64_t> ids;
    RETURN_IF_ERROR(r.IntList("eos_token_id", &ids));
    if (ids.empty()) return r.Error("eos_token_id", "must not be an empty list");
    c.eos_token_id = ids[0];
    if (c.eos_token_id < 0 || c.eos_token_id >= c.vocab_size)
      return r.Error("eos_token_id", absl::StrCat("must be in [0, ", c.vocab_size - 1, "]"));
  } else {
    RETURN_IF_ERROR(r.Int("eos_token_id", &c.eos_token_id, false, 0, c.vocab_size - 1));
  }

  // Quantization: FP8 blocks for dense weights, expert_dtype side channel for the routed experts.
  if (r.Has("quantization_config")) {
    ASSIGN_OR_RETURN(Reader q, r.Object("quantization_config"));
    std::string method;
    RETURN_IF_ERROR(q.String("quant_method", &method));
    if (method != "fp8")
      return q.Error("quant_method", absl::StrCat("'", method, "' is not supported (only fp8)"));
    std::string fmt = "e4m3";
    RETURN_IF_ERROR(q.String("fmt", &fmt));
    if (fmt != "e4m3") return q.Error("fmt", absl::StrCat("'", fmt, "' is not supported (only e4m3)"));
    c.fp8_dense = true;
    std::string scale_fmt = "ue8m0";
    RETURN_IF_ERROR(q.String("scale_fmt", &scale_fmt));
    if (scale_fmt == "ue8m0") {
      c.fp8_scale_fmt = "ue8m0";
    } else if (scale_fmt == "fp32" || scale_fmt == "float32") {
      c.fp8_scale_fmt = "fp32";
    } else {
      return q.Error("scale_fmt", absl::StrCat("'", scale_fmt, "' is not supported (ue8m0 or fp32)"));
    }
    if (q.Has("weight_block_size")) {
      std::vector<int64_t> block;
      RETURN_IF_ERROR(q.IntList("weight_block_size", &block));
      if (block.size() != 2 || block[0] <= 0 || block[1] <= 0)
        return q.Error("weight_block_size", "must be two positive integers [out, in]");
      c.fp8_block_out = block[0];
      c.fp8_block_in = block[1];
    }
  }
  c.expert_dtype = c.fp8_dense ? "fp8" : "bf16";
  RETURN_IF_ERROR(r.String("expert_dtype", &c.expert_dtype));
  if (c.expert_dtype != "fp4" && c.expert_dtype != "fp8" && c.expert_dtype != "bf16")
    return r.Error("expert_dtype", absl::StrCat("'", c.expert_dtype, "' is not one of fp4, fp8, bf16"));
  if (c.expert_dtype == "fp4" && (c.hidden_size % 2 != 0 || c.moe_intermediate_size % 2 != 0))
    return r.Error("expert_dtype", absl::StrCat("fp4 packs two columns per byte: hidden_size (", c.hidden_size,
                                                ") and moe_intermediate_size (", c.moe_intermediate_size,
                                                ") must be even"));

  // MTP / DSpark.
  RETURN_IF_ERROR(r.Int("num_nextn_predict_layers", &c.num_nextn_predict_layers, false, 0, 64));
  RETURN_IF_ERROR(r.Int("dspark_block_size", &c.dspark_block_size, false, 0, 1024));
  RETURN_IF_ERROR(r.Int("dspark_noise_token_id", &c.dspark_noise_token_id, false, 0, c.vocab_size - 1));
  RETURN_IF_ERROR(r.Int("dspark_markov_rank", &c.dspark_markov_rank, false, 0, kMaxDim));
  RETURN_IF_ERROR(r.IntList("dspark_target_layer_ids", &c.dspark_target_layer_ids));
  for (int64_t id : c.dspark_target_layer_ids)
    if (id < 0 || id >= n)
      return r.Error("dspark_target_layer_ids", absl::StrCat("entry ", id, " is not a layer in [0, ", n - 1, "]"));
  if (c.dspark_block_size > 0 && c.dspark_target_layer_ids.empty())
    return r.Error("dspark_target_layer_ids", "must list the target layers when dspark_block_size > 0");
  // The drafter feeds this token after the first of each block; a DSpark config without it is no DSpark config.
  if (c.dspark_block_size > 0 && c.dspark_noise_token_id < 0)
    return r.Error("dspark_noise_token_id", "must be set (a token id) when dspark_block_size > 0");
  return c;
}

StatusOr<ModelConfig> LoadModelConfig(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::string file = path;
  if (fs::is_directory(path, ec)) file = (fs::path(path) / "config.json").string();
  if (!fs::exists(file, ec)) return absl::NotFoundError(absl::StrCat(file, ": no such file"));
  auto size = fs::file_size(file, ec);
  if (ec) return absl::NotFoundError(absl::StrCat(file, ": cannot read: ", ec.message()));
  if (size > (16u << 20)) return absl::InvalidArgumentError(absl::StrCat(file, ": ", size, " bytes is too large"));
  std::ifstream in(file, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(file, ": cannot open"));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ParseModelConfig(ss.str(), file);
}

std::string ModelConfigToJson(const ModelConfig& c) {
  json j = json::object();
  j["architectures"] = {"DeepseekV4ForCausalLM"};
  j["model_type"] = "deepseek_v4";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = 1;
  j["head_dim"] = c.head_dim;
  j["qk_rope_head_dim"] = c.rope_dim;
  j["q_lora_rank"] = c.q_lora_rank;
  j["o_groups"] = c.o_groups;
  j["o_lora_rank"] = c.o_lora_rank;
  j["sliding_window"] = c.sliding_window;
  std::vector<int64_t> ratios;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) ratios.push_back(c.CompressRate(i));
  for (int64_t v : c.extra_compress_ratios) ratios.push_back(v);
  j["compress_ratios"] = ratios;
  if (c.csa_rate != 4 || c.hca_rate != 128) j["compress_rates"] = {{kCsa, c.csa_rate}, {kHca, c.hca_rate}};
  j["compress_rope_theta"] = c.rope_compress.theta;
  j["rope_theta"] = c.rope_main.theta;
  if (c.rope_compress.yarn) {
    j["rope_scaling"] = {{"type", "yarn"},
                         {"factor", c.rope_compress.factor},
                         {"original_max_position_embeddings", c.rope_compress.original_max_position_embeddings},
                         {"beta_fast", c.rope_compress.beta_fast},
                         {"beta_slow", c.rope_compress.beta_slow}};
  }
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["index_n_heads"] = c.index_n_heads;
  j["index_head_dim"] = c.index_head_dim;
  j["index_topk"] = c.index_topk;
  j["n_routed_experts"] = c.n_routed_experts;
  j["n_shared_experts"] = c.n_shared_experts;
  j["num_experts_per_tok"] = c.num_experts_per_tok;
  j["moe_intermediate_size"] = c.moe_intermediate_size;
  j["scoring_func"] = c.scoring_func == ScoringFunc::kSqrtSoftplus ? "sqrtsoftplus"
                      : c.scoring_func == ScoringFunc::kSoftmax    ? "softmax"
                                                                   : "sigmoid";
  j["topk_method"] = "noaux_tc";
  j["routed_scaling_factor"] = c.routed_scaling_factor;
  j["norm_topk_prob"] = true;
  // num_hash_layers when the hash layers are a prefix (the official form), else the explicit list.
  int64_t hash_prefix = 0;
  while (hash_prefix < static_cast<int64_t>(c.mlp_layer_types.size()) &&
         c.mlp_layer_types[hash_prefix] == MoeType::kHash)
    ++hash_prefix;
  if (c.NumLayersOf(MoeType::kHash) == hash_prefix) {
    j["num_hash_layers"] = hash_prefix;
  } else {
    std::vector<std::string> names;
    for (MoeType m : c.mlp_layer_types) names.push_back(m == MoeType::kHash ? "hash_moe" : "moe");
    j["mlp_layer_types"] = names;
  }
  j["first_k_dense_replace"] = 0;
  j["swiglu_limit"] = c.swiglu_limit;
  j["hidden_act"] = "silu";
  j["hc_mult"] = c.hc_mult;
  j["hc_sinkhorn_iters"] = c.hc_sinkhorn_iters;
  j["hc_eps"] = c.hc_eps;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["bos_token_id"] = c.bos_token_id;
  j["eos_token_id"] = c.eos_token_id;
  j["torch_dtype"] = "bfloat16";
  if (c.fp8_dense) {
    j["quantization_config"] = {{"quant_method", "fp8"},
                                {"fmt", "e4m3"},
                                {"scale_fmt", c.fp8_scale_fmt},
                                {"weight_block_size", {c.fp8_block_out, c.fp8_block_in}},
                                {"activation_scheme", "dynamic"}};
  }
  j["expert_dtype"] = c.expert_dtype;
  j["num_nextn_predict_layers"] = c.num_nextn_predict_layers;
  if (c.dspark_block_size > 0) {
    j["dspark_block_size"] = c.dspark_block_size;
    j["dspark_noise_token_id"] = c.dspark_noise_token_id;
    j["dspark_markov_rank"] = c.dspark_markov_rank;
    j["dspark_target_layer_ids"] = c.dspark_target_layer_ids;
  }
  return j.dump(2);
}

std::vector<float> RopeInvFreq(const RopeConfig& rope, int64_t rope_dim) {
  const int64_t half = rope_dim / 2;
  std::vector<float> inv(static_cast<size_t>(std::max<int64_t>(half, 0)));
  if (half <= 0) return inv;
  const double dim = static_cast<double>(rope_dim);
  double low = 0, high = 0;
  if (rope.yarn) {
    const double L0 = static_cast<double>(rope.original_max_position_embeddings);
    const double two_ln_base = 2.0 * std::log(rope.theta);
    auto correction_dim = [&](double rotations) {
      return dim * std::log(L0 / (rotations * 2.0 * std::numbers::pi)) / two_ln_base;
    };
    low = std::max(std::floor(correction_dim(rope.beta_fast)), 0.0);
    high = std::min(std::ceil(correction_dim(rope.beta_slow)), dim - 1.0);
    if (high == low) high += 0.001;
  }
  for (int64_t i = 0; i < half; ++i) {
    const double f = 1.0 / std::pow(rope.theta, static_cast<double>(2 * i) / dim);
    if (!rope.yarn) {
      inv[i] = static_cast<float>(f);
      continue;
    }
    // ramp = 0 keeps the original frequency (extrapolation), ramp = 1 divides it by factor.
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    inv[i] = static_cast<float>(f / rope.factor * ramp + f * (1.0 - ramp));
  }
  return inv;
}

const char* SpecMethodName(SpecMethod m) {
  switch (m) {
    case SpecMethod::kNone: return "none";
    case SpecMethod::kDspark: return "dspark";
    case SpecMethod::kMtp: return "mtp";
    case SpecMethod::kNgram: return "ngram";
  }
  return "?";
}

}  // namespace numoe
