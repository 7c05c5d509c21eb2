// The typed view of a DeepSeek-V4 checkpoint: config + tensors, validated against what the config
// implies. Official tensor names (no "model." prefix), per layer:
//   layers.{i}.attn.*  (sliding / CSA with compressor + indexer / HCA with compressor)
//   layers.{i}.ffn.gate.{weight,bias|tid2eid}, ffn.shared_experts.w{1,2,3}, ffn.experts.{j}.w{1,2,3}
//   mtp.{s}.*  (MTP / DSpark stages; counted from the tensor names, not from num_nextn_predict_layers)
// Missing, extra or mis-shaped tensors are reported by name. tid2eid may be I32 or I64.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/quant.h"
#include "common/safetensors.h"
#include "common/status.h"

namespace numoe {

// How a logical weight is stored.
enum class WeightFormat {
  kPlain,     // F32 / BF16 / F16 (or I32/I64 for tid2eid), no scale
  kFp8Block,  // F8_E4M3 + `.scale` block grid
  kMxfp4,     // I8/U8 packed two per byte + `.scale` E8M0 per 32 inputs
};

// One tensor the config implies, with its logical shape ([out, in] for weights).
struct ExpectedTensor {
  std::string name;             // e.g. "layers.3.attn.wq_a.weight" (the scale is name with .weight -> .scale)
  std::vector<int64_t> shape;   // logical shape
  WeightFormat format = WeightFormat::kPlain;
  bool routed_expert = false;   // part of ffn.experts.* (what a CPU worker holds)
  int64_t stored_bytes = 0;     // bytes on disk including the scale tensor
  // --- how the official layout stores it (what `format` implies for this config) ---
  DType dtype = DType::kBF16;          // stored dtype of the tensor itself (I8 for MXFP4, F8_E4M3 for FP8)
  std::vector<int64_t> stored_shape;   // [out, in/2] for MXFP4, else == shape
  DType scale_dtype = DType::kF8_E8M0; // kFp8Block / kMxfp4 only
  std::vector<int64_t> scale_shape;    // [ceil(out/bo), ceil(in/bi)] (FP8) or [out, ceil(in/32)] (MXFP4); else empty
  // A 2-D matrix weight: a checkpoint may store it plain (F32/BF16/F16), FP8-block or MXFP4, whatever
  // `format` says; the loader accepts all three. Other tensors (norms, mHC params, sinks, ape, biases) are
  // plain floats, and tid2eid is I32/I64.
  bool matrix = false;
  int64_t layer = -1;      // main layer index, or -1
  int64_t mtp_stage = -1;  // MTP/DSpark stage, or -1
  int64_t params() const;  // logical element count
};

// "a.b.weight" -> "a.b.scale" (the name of a quantized weight's scale tensor).
std::string ScaleNameOf(const std::string& weight_name);

// Every tensor a checkpoint with this config (and `mtp_stages` MTP/DSpark stages) should hold.
std::vector<ExpectedTensor> ExpectedTensors(const ModelConfig& config, int64_t mtp_stages);

// The routed-expert tensor prefix "<block>.ffn.experts.<expert>." of an expert of MoE layer `moe_layer`,
// numbered as MoeRequest::layer does: main layers 0..L-1 are "layers.<i>.", the MTP/DSpark stages L+s
// are "mtp.<s>." (L = config.num_hidden_layers).
std::string RoutedExpertPrefix(const ModelConfig& config, int64_t moe_layer, int64_t expert);

// Shape-only arithmetic (no weights needed): what inspect and the deploy planner print.
struct ModelFootprint {
  int64_t routed_expert_bytes = 0;        // all main-layer routed experts (one CPU worker's copy)
  int64_t mtp_routed_expert_bytes = 0;    // routed experts of the MTP/DSpark stages
  int64_t other_bytes = 0;                // everything else (the GPU service's share)
  int64_t routed_bytes_per_token = 0;     // routed expert bytes read per decoded token (top-k per layer)
  int64_t total_params = 0;
  int64_t active_params_per_token = 0;
};
// active_params_per_token: every non-routed parameter of the main model (embedding and head included; MTP
// stages excluded) plus top-k of each layer's routed experts. Bytes are stored bytes incl. scales.
ModelFootprint ComputeFootprint(const ModelConfig& config, int64_t mtp_stages);

class Checkpoint;
// The same numbers for a loaded checkpoint, with the byte fields measured from the tensors actually stored
// (their dtypes may differ from the official layout, e.g. I64 tid2eid or BF16 dense weights).
ModelFootprint StoredFootprint(const Checkpoint& checkpoint);

// A stable hex digest of DIR/config.json and DIR/model.safetensors.index.json (or the single
// model.safetensors' size): equal for two processes that loaded the same checkpoint (numoe-gpu and
// numoe-worker compare it at registration).
StatusOr<std::string> ModelFingerprint(const std::string& model_dir);

class Checkpoint {
 public:
  // Loads DIR/config.json and the tensors, and validates them against ExpectedTensors: every missing,
  // unexpected and mis-shaped/mis-typed tensor is named in one error (up to 20 names, then "and N more");
  // tid2eid values must be expert ids. MTP/DSpark stages = highest N of the `mtp.N.` prefixes + 1.
  static StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  const ModelConfig& config() const { return config_; }
  const TensorStore& store() const { return *store_; }
  int64_t mtp_stages() const { return mtp_stages_; }
  const std::string& dir() const { return dir_; }
  // The checkpoint's own drafter, the default of --spec everywhere: kDspark (mtp.* stages and dspark_*
  // config keys), kMtp (mtp.* stages without DSpark config) or kNone.
  SpecMethod drafter() const {
    if (mtp_stages_ == 0) return SpecMethod::kNone;
    return config_.dspark_block_size > 0 ? SpecMethod::kDspark : SpecMethod::kMtp;
  }

  // The fp32 value of a logical weight, dequantized from whatever format it is stored in; the returned
  // shape is the logical one. NotFound / InvalidArgument name the tensor.
  StatusOr<F32Tensor> LoadF32(const std::string& name) const;
  // An integer tensor (tid2eid, stored I32 or I64) widened to int64, row-major; `shape` gets its shape.
  StatusOr<std::vector<int64_t>> LoadIndex(const std::string& name, std::vector<int64_t>* shape = nullptr) const;
  // Raw views for kernels that consume the stored format (MXFP4 experts): weight and its scale.
  StatusOr<const TensorView*> Raw(const std::string& name) const;

 private:
  std::string dir_;
  ModelConfig config_;
  std::unique_ptr<TensorStore> store_;
  int64_t mtp_stages_ = 0;
};

}  // namespace numoe
