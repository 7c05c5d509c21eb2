#include "common/testing/synthetic.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numbers>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checkpoint.h"
#include "common/log.h"
#include "common/quant.h"
#include "nlohmann/json.hpp"

namespace numoe::testing {
namespace {

namespace fs = std::filesystem;

// The tiny-v4 fixture's config.json (tests/data/tiny-v4/config.json).
constexpr const char* kTinyConfigJson = R"({
  "model_type": "deepseek_v4", "vocab_size": 1024, "hidden_size": 128, "num_hidden_layers": 5,
  "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 16,
  "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32, "sliding_window": 8,
  "compress_ratios": [0, 4, 128, 4, 128, 0, 0, 0], "compress_rope_theta": 160000.0, "rope_theta": 10000.0,
  "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 256,
                   "beta_fast": 32, "beta_slow": 1},
  "max_position_embeddings": 1024, "index_n_heads": 8, "index_head_dim": 32, "index_topk": 3,
  "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
  "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "num_hash_layers": 2, "swiglu_limit": 1.0,
  "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-06, "rms_norm_eps": 1e-06, "tie_word_embeddings": false,
  "bos_token_id": 0, "eos_token_id": 1,
  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                          "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
  "expert_dtype": "fp4", "num_nextn_predict_layers": 1, "dspark_block_size": 5, "dspark_noise_token_id": 6,
  "dspark_markov_rank": 16, "dspark_target_layer_ids": [2, 3, 4]
})";

// splitmix64: a tiny, portable generator so the same seed gives the same weights everywhere.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t Next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double Normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    double u1 = Uniform(), u2 = Uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    const double r = std::sqrt(-2.0 * std::log(u1)), t = 2.0 * std::numbers::pi * u2;
    spare_ = r * std::sin(t);
    has_spare_ = true;
    return r * std::cos(t);
  }

 private:
  uint64_t s_;
  bool has_spare_ = false;
  double spare_ = 0;
};

uint64_t HashName(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull ^ (seed * 0x9E3779B97F4A7C15ull);
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  return h;
}

bool EndsWith(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Logical fp32 values of one tensor, by its role (see the header).
std::vector<float> Values(const ExpectedTensor& e, const SyntheticOptions& o, Rng& rng) {
  std::vector<float> v(static_cast<size_t>(e.params()));
  auto normal = [&](double mean, double std) {
    for (float& x : v) x = static_cast<float>(mean + std * rng.Normal());
  };
  const std::string& n = e.name;
  if (n == "embed.weight") {
    normal(0, o.embed_std);
  } else if (e.matrix) {
    const double in = static_cast<double>(e.shape[1]);
    normal(0, std::min<double>(o.dense_std, 1.0 / std::sqrt(in)));
  } else if (EndsWith(n, "norm.weight")) {
    normal(1.0, 0.05);
  } else if (EndsWith(n, "_fn")) {
    normal(0, 0.04);
  } else if (EndsWith(n, "_base")) {
    normal(0, 0.4);
  } else if (EndsWith(n, "_scale")) {
    for (float& x : v) x = static_cast<float>(0.5 + rng.Uniform());
  } else if (EndsWith(n, "gate.bias")) {
    normal(0, 0.05);
  } else {  // attn_sink, ape
    normal(0, 0.5);
  }
  return v;
}

void Put(std::vector<uint8_t>* out, const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  out->insert(out->end(), b, b + n);
}

void EncodePlain(const std::vector<float>& v, DType dtype, std::vector<uint8_t>* out) {
  out->reserve(v.size() * DTypeSize(dtype));
  for (float x : v) {
    if (dtype == DType::kF32) {
      Put(out, &x, 4);
    } else {
      const uint16_t b = FloatToBf16(x);
      Put(out, &b, 2);
    }
  }
}

// FP8 E4M3 with one scale per (bo x bi) block: E8M0 power of two, or F32 amax/448.
void EncodeFp8(const std::vector<float>& v, const ExpectedTensor& e, std::vector<uint8_t>* q,
               std::vector<uint8_t>* s) {
  const int64_t rows = e.shape[0], cols = e.shape[1];
  const int64_t gr = e.scale_shape[0], gc = e.scale_shape[1];
  const int64_t bo = (rows + gr - 1) / gr, bi = (cols + gc - 1) / gc;
  q->assign(static_cast<size_t>(rows * cols), 0);
  s->clear();
  for (int64_t br = 0; br < gr; ++br) {
    for (int64_t bc = 0; bc < gc; ++bc) {
      const int64_t r0 = br * bo, r1 = std::min(rows, r0 + bo), c0 = bc * bi, c1 = std::min(cols, c0 + bi);
      float amax = 0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(v[r * cols + c]));
      float scale;
      if (e.scale_dtype == DType::kF8_E8M0) {
        const uint8_t code = E8M0ScaleFor(amax, 448.0f);
        scale = E8M0ToFloat(code);
        s->push_back(code);
      } else {
        scale = amax > 0 ? amax / 448.0f : 1.0f;
        Put(s, &scale, 4);
      }
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) (*q)[r * cols + c] = FloatToFp8E4M3(v[r * cols + c] / scale);
    }
  }
}

// MXFP4: two E2M1 codes per byte (low nibble = even column), E8M0 scale per 32 inputs.
void EncodeMxfp4(const std::vector<float>& v, const ExpectedTensor& e, std::vector<uint8_t>* q,
                 std::vector<uint8_t>* s) {
  const int64_t rows = e.shape[0], cols = e.shape[1], nb = e.scale_shape[1];
  q->assign(static_cast<size_t>(rows * cols / 2), 0);
  s->assign(static_cast<size_t>(rows * nb), 0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t c0 = b * 32, c1 = std::min(cols, c0 + 32);
      float amax = 0;
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(v[r * cols + c]));
      const uint8_t code = E8M0ScaleFor(amax, 6.0f);
      (*s)[r * nb + b] = code;
      const float scale = E8M0ToFloat(code);
      for (int64_t c = c0; c < c1; ++c) {
        const uint8_t nib = FloatToFp4E2M1(v[r * cols + c] / scale);
        (*q)[r * (cols / 2) + c / 2] |= static_cast<uint8_t>((c % 2) ? nib << 4 : nib);
      }
    }
  }
}

struct Encoded {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// The stored tensors (1 or 2: weight and scale) for one expected tensor.
std::vector<Encoded> Encode(const ExpectedTensor& e, const ModelConfig& c, const SyntheticOptions& o) {
  Rng rng(HashName(o.seed, e.name));
  std::vector<Encoded> out;
  if (e.dtype == DType::kI32 || e.dtype == DType::kI64) {
    Encoded t{e.name, o.tid2eid_dtype, e.shape, {}};
    for (int64_t i = 0; i < e.params(); ++i) {
      const int64_t id = static_cast<int64_t>(rng.Next() % static_cast<uint64_t>(c.n_routed_experts));
      if (o.tid2eid_dtype == DType::kI32) {
        const int32_t v = static_cast<int32_t>(id);
        Put(&t.bytes, &v, 4);
      } else {
        Put(&t.bytes, &id, 8);
      }
    }
    out.push_back(std::move(t));
    return out;
  }
  const std::vector<float> v = Values(e, o, rng);
  switch (e.format) {
    case WeightFormat::kPlain: {
      Encoded t{e.name, e.dtype, e.shape, {}};
      EncodePlain(v, e.dtype, &t.bytes);
      out.push_back(std::move(t));
      break;
    }
    case WeightFormat::kFp8Block:
    case WeightFormat::kMxfp4: {
      Encoded w{e.name, e.dtype, e.stored_shape, {}};
      Encoded s{ScaleNameOf(e.name), e.scale_dtype, e.scale_shape, {}};
      if (e.format == WeightFormat::kFp8Block) {
        EncodeFp8(v, e, &w.bytes, &s.bytes);
      } else {
        EncodeMxfp4(v, e, &w.bytes, &s.bytes);
      }
      out.push_back(std::move(w));
      out.push_back(std::move(s));
      break;
    }
  }
  return out;
}

Status WriteText(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat(path.string(), ": cannot create"));
  out << text;
  out.flush();
  if (!out) return absl::DataLossError(absl::StrCat(path.string(), ": write failed"));
  return absl::OkStatus();
}

}  // namespace

ModelConfig TinyConfig() {
  StatusOr<ModelConfig> c = ParseModelConfig(kTinyConfigJson, "TinyConfig");
  NCHECK(c.ok()) << c.status();
  return *std::move(c);
}

void SetSchedule(ModelConfig* config, const std::vector<AttnType>& attn, int64_t num_hash_layers) {
  const int64_t n = static_cast<int64_t>(attn.size());
  config->num_hidden_layers = n;
  config->layer_types = attn;
  config->mlp_layer_types.clear();
  for (int64_t i = 0; i < n; ++i)
    config->mlp_layer_types.push_back(i < num_hash_layers ? MoeType::kHash : MoeType::kScored);
  for (int64_t& id : config->dspark_target_layer_ids) id = std::min(id, n - 1);
}

Status MakeSyntheticCheckpoint(const ModelConfig& config, const std::string& dir, const SyntheticOptions& o) {
  if (o.num_shards < 1) return absl::InvalidArgumentError("MakeSyntheticCheckpoint: num_shards must be >= 1");
  if (o.tid2eid_dtype != DType::kI32 && o.tid2eid_dtype != DType::kI64)
    return absl::InvalidArgumentError("MakeSyntheticCheckpoint: tid2eid_dtype must be I32 or I64");
  if (!o.write_index && o.num_shards != 1)
    return absl::InvalidArgumentError("MakeSyntheticCheckpoint: write_index = false needs num_shards = 1");
  // Round-trip through the official JSON so the config is validated exactly as a loaded one would be.
  const std::string json_text = ModelConfigToJson(config);
  ASSIGN_OR_RETURN(ModelConfig c, ParseModelConfig(json_text, "synthetic config.json"));
  const int64_t stages = o.mtp_stages >= 0 ? o.mtp_stages : c.DefaultMtpStages();

  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat(dir, ": cannot create: ", ec.message()));
  RETURN_IF_ERROR(WriteText(fs::path(dir) / "config.json", json_text + "\n"));

  const std::vector<ExpectedTensor> expected = ExpectedTensors(c, stages);
  int64_t total = 0;
  for (const auto& e : expected) total += e.stored_bytes;
  // Each shard takes tensors until it holds its share of the bytes (the last one takes the rest).
  const int64_t share = (total + o.num_shards - 1) / o.num_shards;
  nlohmann::json weight_map = nlohmann::json::object();
  int64_t written = 0;
  size_t next = 0;
  for (int shard = 0; shard < o.num_shards; ++shard) {
    const std::string file =
        o.write_index ? absl::StrFormat("model-%05d-of-%05d.safetensors", shard + 1, o.num_shards) : "model.safetensors";
    std::vector<Encoded> tensors;
    int64_t bytes = 0;
    while (next < expected.size() && (shard == o.num_shards - 1 || bytes < share)) {
      for (Encoded& t : Encode(expected[next], c, o)) {
        bytes += static_cast<int64_t>(t.bytes.size());
        tensors.push_back(std::move(t));
      }
      ++next;
    }
    std::vector<TensorToWrite> to_write;
    for (const Encoded& t : tensors) {
      to_write.push_back({t.name, t.dtype, t.shape, t.bytes.data()});
      weight_map[t.name] = file;
    }
    RETURN_IF_ERROR(WriteSafetensors((fs::path(dir) / file).string(), to_write, {{"format", "pt"}}));
    written += bytes;
  }
  if (o.write_index) {
    nlohmann::json index = {{"metadata", {{"total_size", written}}}, {"weight_map", weight_map}};
    RETURN_IF_ERROR(WriteText(fs::path(dir) / "model.safetensors.index.json", index.dump(2) + "\n"));
  }
  return absl::OkStatus();
}

}  // namespace numoe::testing
