#include "common/synthetic/synthetic.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <numbers>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checkpoint.h"
#include "common/hash.h"
#include "common/log.h"
#include "common/quant.h"
#include "nlohmann/json.hpp"

namespace numoe::synthetic {
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

// splitmix64: a tiny, portable generator so the same seed gives the same weights everywhere. Its state
// after k draws is seed + k * gamma, so any point of a stream can be reached in O(1) (Skip), which lets
// the pieces of one tensor be drawn on different threads and still be the same numbers.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t Next() { return SplitMix64Finalize(s_ += kSplitMix64Gamma); }
  // Moves past `draws` calls of Next(). Only valid between Normal() pairs (no spare pending).
  void Skip(uint64_t draws) { s_ += draws * kSplitMix64Gamma; }
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
  uint64_t h = 1469598103934665603ull ^ (seed * kSplitMix64Gamma);
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  return h;
}

bool EndsWith(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Logical fp32 values [begin, begin + v->size()) of one tensor, by its role (see the header). Every value
// role draws exactly one Next() per element on average (a normal pair takes two draws), so element i of a
// tensor is draw i of its stream: `begin` must be even (a pair boundary).
void Values(const ExpectedTensor& e, const SyntheticOptions& o, int64_t begin, std::vector<float>* v) {
  Rng rng(HashName(o.seed, e.name));
  rng.Skip(static_cast<uint64_t>(begin));
  auto normal = [&](double mean, double std) {
    for (float& x : *v) x = static_cast<float>(mean + std * rng.Normal());
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
    for (float& x : *v) x = static_cast<float>(0.5 + rng.Uniform());
  } else if (EndsWith(n, "gate.bias")) {
    normal(0, 0.05);
  } else {  // attn_sink, ape
    normal(0, 0.5);
  }
}

void Put(std::vector<uint8_t>* out, const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  out->insert(out->end(), b, b + n);
}

void EncodePlain(const std::vector<float>& v, DType dtype, std::vector<uint8_t>* out) {
  out->reserve(out->size() + v.size() * DTypeSize(dtype));
  for (float x : v) {
    if (dtype == DType::kF32) {
      Put(out, &x, 4);
    } else {
      const uint16_t b = FloatToBf16(x);
      Put(out, &b, 2);
    }
  }
}

// FP8 E4M3 with one scale per (bo x bi) block: E8M0 power of two, or F32 amax/448. `v` holds rows
// [r0, r0 + v.size()/cols) of the matrix, r0 a multiple of bo; q and s get those rows' codes and scales.
void EncodeFp8(const std::vector<float>& v, const ExpectedTensor& e, int64_t r0, std::vector<uint8_t>* q,
               std::vector<uint8_t>* s) {
  const int64_t rows = e.shape[0], cols = e.shape[1];
  const int64_t gr = e.scale_shape[0], gc = e.scale_shape[1];
  const int64_t bo = (rows + gr - 1) / gr, bi = (cols + gc - 1) / gc;
  const int64_t n_rows = static_cast<int64_t>(v.size()) / cols, r_end = r0 + n_rows;
  q->assign(v.size(), 0);
  for (int64_t br = r0 / bo; br * bo < r_end; ++br) {
    for (int64_t bc = 0; bc < gc; ++bc) {
      const int64_t ra = br * bo - r0, rb = std::min(r_end, br * bo + bo) - r0;
      const int64_t c0 = bc * bi, c1 = std::min(cols, c0 + bi);
      float amax = 0;
      for (int64_t r = ra; r < rb; ++r)
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
      for (int64_t r = ra; r < rb; ++r)
        for (int64_t c = c0; c < c1; ++c) (*q)[r * cols + c] = FloatToFp8E4M3(v[r * cols + c] / scale);
    }
  }
}

// MXFP4: two E2M1 codes per byte (low nibble = even column), E8M0 scale per 32 inputs; `v` holds whole rows.
void EncodeMxfp4(const std::vector<float>& v, const ExpectedTensor& e, std::vector<uint8_t>* q,
                 std::vector<uint8_t>* s) {
  const int64_t cols = e.shape[1], nb = e.scale_shape[1];
  const int64_t rows = static_cast<int64_t>(v.size()) / cols;
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

// One stored tensor of the files: a weight, its scale, a plain tensor or tid2eid.
struct StoredTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  int64_t nbytes = 0;
};

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The stored tensors (1 or 2: weight, then scale) for one expected tensor, in file order.
std::vector<StoredTensor> StoredTensorsOf(const ExpectedTensor& e, const SyntheticOptions& o) {
  auto make = [](const std::string& name, DType dtype, const std::vector<int64_t>& shape) {
    return StoredTensor{name, dtype, shape, Numel(shape) * static_cast<int64_t>(DTypeSize(dtype))};
  };
  if (e.dtype == DType::kI32 || e.dtype == DType::kI64) return {make(e.name, o.tid2eid_dtype, e.shape)};
  if (e.format == WeightFormat::kPlain) return {make(e.name, e.dtype, e.shape)};
  return {make(e.name, e.dtype, e.stored_shape), make(ScaleNameOf(e.name), e.scale_dtype, e.scale_shape)};
}

// A piece of work: rows [row_begin, row_end) of expected tensor `tensor` (a 1-D or index tensor is one
// piece). Pieces of a tensor are consecutive, and their rows start at even elements.
struct Piece {
  size_t tensor = 0;
  int64_t row_begin = 0, row_end = 0;
  bool first = false, last = false;  // of its tensor
};

// About 1M elements per piece: a few MB of fp32 scratch per thread, and enough pieces to spread.
constexpr int64_t kPieceElements = int64_t{1} << 20;

void SplitIntoPieces(size_t index, const ExpectedTensor& e, std::vector<Piece>* pieces) {
  const bool splittable = e.matrix && e.shape.size() == 2 && e.params() > kPieceElements;
  if (!splittable) {
    pieces->push_back({index, 0, e.shape.empty() ? 1 : e.shape[0], true, true});
    return;
  }
  const int64_t rows = e.shape[0], cols = e.shape[1];
  // Rows per piece: whole FP8 block rows; an even count when cols is odd (pieces start at pair boundaries).
  int64_t unit = 1;
  if (e.format == WeightFormat::kFp8Block) unit = (rows + e.scale_shape[0] - 1) / e.scale_shape[0];
  if (cols % 2 != 0 && unit % 2 != 0) unit *= 2;
  const int64_t step = std::max<int64_t>(unit, kPieceElements / cols / unit * unit);
  for (int64_t r = 0; r < rows; r += step)
    pieces->push_back({index, r, std::min(rows, r + step), r == 0, r + step >= rows});
}

// The encoded bytes of one piece: its share of the weight (or plain tensor) and of the scale.
struct EncodedPiece {
  std::vector<uint8_t> data, scale;
};

void EncodePiece(const ExpectedTensor& e, const Piece& p, const ModelConfig& c, const SyntheticOptions& o,
                 std::vector<float>* scratch, EncodedPiece* out) {
  out->data.clear();
  out->scale.clear();
  if (e.dtype == DType::kI32 || e.dtype == DType::kI64) {
    Rng rng(HashName(o.seed, e.name));
    for (int64_t i = 0; i < e.params(); ++i) {
      const int64_t id = static_cast<int64_t>(rng.Next() % static_cast<uint64_t>(c.n_routed_experts));
      if (o.tid2eid_dtype == DType::kI32) {
        const int32_t v = static_cast<int32_t>(id);
        Put(&out->data, &v, 4);
      } else {
        Put(&out->data, &id, 8);
      }
    }
    return;
  }
  const bool whole = p.first && p.last;
  const int64_t cols = whole ? 1 : e.shape[1];
  const int64_t begin = whole ? 0 : p.row_begin * cols;
  const int64_t count = whole ? e.params() : (p.row_end - p.row_begin) * cols;
  scratch->resize(static_cast<size_t>(count));
  Values(e, o, begin, scratch);
  switch (e.format) {
    case WeightFormat::kPlain:
      EncodePlain(*scratch, e.dtype, &out->data);
      break;
    case WeightFormat::kFp8Block:
      EncodeFp8(*scratch, e, p.row_begin, &out->data, &out->scale);
      break;
    case WeightFormat::kMxfp4:
      EncodeMxfp4(*scratch, e, &out->data, &out->scale);
      break;
  }
}

// The safetensors header of one shard, exactly as WriteSafetensors lays it out (keys sorted by the JSON
// object, data in list order, padded with spaces to a multiple of 8), with its 8-byte length prefix.
std::string ShardHeader(const std::vector<StoredTensor>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const StoredTensor& t : tensors) {
    const uint64_t n = static_cast<uint64_t>(t.nbytes);
    header[t.name] = {{"dtype", std::string(DTypeName(t.dtype))}, {"shape", t.shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(len >> (8 * i));
  return out + text;
}

// The whole write, worked out from the shapes before any byte is produced.
struct Plan {
  ModelConfig config;
  std::string config_json;
  std::vector<ExpectedTensor> expected;
  struct Shard {
    std::string file;
    size_t first = 0, end = 0;  // expected tensors [first, end)
    std::string header;         // length prefix + JSON
    int64_t data_bytes = 0;
  };
  std::vector<Shard> shards;
  std::string index_json;  // empty without an index
  int64_t total_bytes = 0;  // everything written: config.json, shards, index
};

StatusOr<Plan> MakePlan(const ModelConfig& config, const SyntheticOptions& o) {
  if (o.num_shards < 1) return absl::InvalidArgumentError("MakeSyntheticCheckpoint: num_shards must be >= 1");
  if (o.tid2eid_dtype != DType::kI32 && o.tid2eid_dtype != DType::kI64)
    return absl::InvalidArgumentError("MakeSyntheticCheckpoint: tid2eid_dtype must be I32 or I64");
  if (!o.write_index && o.num_shards != 1)
    return absl::InvalidArgumentError("MakeSyntheticCheckpoint: write_index = false needs num_shards = 1");
  if (o.threads < 1) return absl::InvalidArgumentError("MakeSyntheticCheckpoint: threads must be >= 1");
  Plan plan;
  // Round-trip through the official JSON so the config is validated exactly as a loaded one would be.
  plan.config_json = ModelConfigToJson(config) + "\n";
  ASSIGN_OR_RETURN(plan.config, ParseModelConfig(plan.config_json, "synthetic config.json"));
  const int64_t stages = o.mtp_stages >= 0 ? o.mtp_stages : plan.config.DefaultMtpStages();
  plan.expected = ExpectedTensors(plan.config, stages);

  int64_t total = 0;
  for (const auto& e : plan.expected) total += e.stored_bytes;
  // Each shard takes tensors until it holds its share of the bytes (the last one takes the rest).
  const int64_t share = (total + o.num_shards - 1) / o.num_shards;
  nlohmann::json weight_map = nlohmann::json::object();
  int64_t data_total = 0;
  size_t next = 0;
  plan.total_bytes = static_cast<int64_t>(plan.config_json.size());
  for (int shard = 0; shard < o.num_shards; ++shard) {
    Plan::Shard s;
    s.file = o.write_index ? absl::StrFormat("model-%05d-of-%05d.safetensors", shard + 1, o.num_shards)
                           : "model.safetensors";
    s.first = next;
    std::vector<StoredTensor> stored;
    while (next < plan.expected.size() && (shard == o.num_shards - 1 || s.data_bytes < share)) {
      for (StoredTensor& t : StoredTensorsOf(plan.expected[next], o)) {
        s.data_bytes += t.nbytes;
        weight_map[t.name] = s.file;
        stored.push_back(std::move(t));
      }
      ++next;
    }
    s.end = next;
    s.header = ShardHeader(stored);
    data_total += s.data_bytes;
    plan.total_bytes += static_cast<int64_t>(s.header.size()) + s.data_bytes;
    plan.shards.push_back(std::move(s));
  }
  if (o.write_index) {
    nlohmann::json index = {{"metadata", {{"total_size", data_total}}}, {"weight_map", weight_map}};
    plan.index_json = index.dump(2) + "\n";
    plan.total_bytes += static_cast<int64_t>(plan.index_json.size());
  }
  return plan;
}

std::string Errno() { return std::strerror(errno); }

// A file written through a `.tmp` name and renamed into place when complete, so that an interrupted or
// failed run never leaves a truncated file under the real name.
class OutFile {
 public:
  ~OutFile() {
    if (fd_ >= 0) {
      ::close(fd_);
      std::remove(tmp_.c_str());
    }
  }
  Status Open(const fs::path& path) {
    path_ = path.string();
    tmp_ = path_ + ".tmp";
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) return absl::PermissionDeniedError(absl::StrCat(tmp_, ": cannot create: ", Errno()));
    return absl::OkStatus();
  }
  Status Write(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, std::min<size_t>(n, size_t{1} << 30));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return absl::DataLossError(absl::StrCat(path_, ": write failed: ", w < 0 ? Errno() : "no progress"));
      p += w;
      n -= static_cast<size_t>(w);
    }
    return absl::OkStatus();
  }
  Status Commit() {
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) {
      const std::string err = Errno();
      std::remove(tmp_.c_str());
      return absl::DataLossError(absl::StrCat(path_, ": write failed: ", err));
    }
    std::error_code ec;
    fs::rename(tmp_, path_, ec);
    if (ec) {
      std::remove(tmp_.c_str());
      return absl::DataLossError(absl::StrCat(path_, ": rename failed: ", ec.message()));
    }
    return absl::OkStatus();
  }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
};

Status WriteText(const fs::path& path, const std::string& text) {
  OutFile f;
  RETURN_IF_ERROR(f.Open(path));
  RETURN_IF_ERROR(f.Write(text.data(), text.size()));
  return f.Commit();
}

// Encodes pieces on `threads` threads, in any order, and hands them to the caller in order through a ring
// of a few slots per thread: memory stays bounded however large the checkpoint is.
class PieceEncoder {
 public:
  PieceEncoder(const Plan& plan, const std::vector<Piece>& pieces, const SyntheticOptions& o)
      : plan_(plan), pieces_(pieces), o_(o), ring_(static_cast<size_t>(4 * o.threads)) {
    for (int t = 0; t < o.threads; ++t) threads_.emplace_back([this] { Work(); });
  }
  ~PieceEncoder() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  // Piece i's bytes (call with i = 0, 1, 2, ...); valid until the next call.
  const EncodedPiece& Get(size_t i) {
    std::unique_lock<std::mutex> lock(mu_);
    if (i > 0) {  // the previous piece's slot is free again
      ring_[(i - 1) % ring_.size()].ready = false;
      consumed_ = i;
      cv_.notify_all();
    }
    Slot& slot = ring_[i % ring_.size()];
    cv_.wait(lock, [&] { return slot.ready; });
    return slot.piece;
  }

 private:
  struct Slot {
    bool ready = false;
    EncodedPiece piece;
  };
  void Work() {
    std::vector<float> scratch;
    while (true) {
      size_t i;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || (claimed_ < pieces_.size() && claimed_ < consumed_ + ring_.size()); });
        if (stop_) return;
        i = claimed_++;
      }
      const Piece& p = pieces_[i];
      EncodedPiece out;
      EncodePiece(plan_.expected[p.tensor], p, plan_.config, o_, &scratch, &out);
      {
        std::lock_guard<std::mutex> lock(mu_);
        Slot& slot = ring_[i % ring_.size()];
        slot.piece = std::move(out);
        slot.ready = true;
      }
      cv_.notify_all();
    }
  }

  const Plan& plan_;
  const std::vector<Piece>& pieces_;
  const SyntheticOptions& o_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Slot> ring_;
  size_t claimed_ = 0, consumed_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

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

StatusOr<int64_t> SyntheticCheckpointBytes(const ModelConfig& config, const SyntheticOptions& options) {
  ASSIGN_OR_RETURN(Plan plan, MakePlan(config, options));
  return plan.total_bytes;
}

Status MakeSyntheticCheckpoint(const ModelConfig& config, const std::string& dir, const SyntheticOptions& o) {
  ASSIGN_OR_RETURN(const Plan plan, MakePlan(config, o));
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat(dir, ": cannot create: ", ec.message()));
  RETURN_IF_ERROR(WriteText(fs::path(dir) / "config.json", plan.config_json));
  int64_t written = static_cast<int64_t>(plan.config_json.size());
  if (o.progress) o.progress(written, plan.total_bytes);

  std::vector<Piece> pieces;
  for (size_t i = 0; i < plan.expected.size(); ++i) SplitIntoPieces(i, plan.expected[i], &pieces);
  PieceEncoder encoder(plan, pieces, o);
  size_t next = 0;
  std::vector<uint8_t> scale;  // a quantized tensor's scale, written after its last weight piece
  for (const Plan::Shard& shard : plan.shards) {
    OutFile out;
    RETURN_IF_ERROR(out.Open(fs::path(dir) / shard.file));
    RETURN_IF_ERROR(out.Write(shard.header.data(), shard.header.size()));
    written += static_cast<int64_t>(shard.header.size());
    while (next < pieces.size() && pieces[next].tensor < shard.end) {
      const Piece& p = pieces[next];
      const EncodedPiece& enc = encoder.Get(next++);
      if (p.first) scale.clear();
      RETURN_IF_ERROR(out.Write(enc.data.data(), enc.data.size()));
      scale.insert(scale.end(), enc.scale.begin(), enc.scale.end());
      written += static_cast<int64_t>(enc.data.size());
      if (p.last && !scale.empty()) {
        RETURN_IF_ERROR(out.Write(scale.data(), scale.size()));
        written += static_cast<int64_t>(scale.size());
      }
      if (o.progress) o.progress(written, plan.total_bytes);
    }
    RETURN_IF_ERROR(out.Commit());
  }
  if (o.write_index) {
    RETURN_IF_ERROR(WriteText(fs::path(dir) / "model.safetensors.index.json", plan.index_json));
    written += static_cast<int64_t>(plan.index_json.size());
  }
  NCHECK(written == plan.total_bytes) << "synthetic checkpoint: wrote " << written << " bytes, planned "
                                      << plan.total_bytes;
  if (o.progress) o.progress(written, plan.total_bytes);
  return absl::OkStatus();
}

}  // namespace numoe::synthetic
