// The checked-in fixtures of tests/data: the transformers goldens of a model directory, and a tiny model
// (checkpoint, fp32 CPU model, reference experts) loaded once per test process; plus the one synthetic
// fixture tests/data does not hold, the tiny MTP-only checkpoint (kTinyMtp).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace numoe {
class Checkpoint;
class TensorStore;
namespace cpu {
class CpuModel;
class ReferenceExperts;
}  // namespace cpu
}  // namespace numoe

namespace numoe::test {

// tests/data (NUMOE_TEST_DATA), its tiny-v4 model directory (random weights, DSpark stages) and its demo-v4
// one (small trained model, no drafter).
std::string TestDataDir();
std::string TinyDir();
std::string DemoDir();

// The bytes of a safetensors file: 8-byte little-endian header length, header, data; `header_len` other than
// header.size() makes a corrupt one.
std::string SafetensorsBytes(const std::string& header, const std::string& data, uint64_t header_len);
inline std::string SafetensorsBytes(const std::string& header, const std::string& data) {
  return SafetensorsBytes(header, data, header.size());
}

// One golden prompt of DIR/golden.safetensors (tests/data/README.md says how they were made).
struct GoldenPrompt {
  std::string name;                   // "p0", "p1", ...
  std::vector<int32_t> input_ids;     // the prompt
  std::vector<int32_t> greedy;        // transformers' greedy continuation, EOS ignored (32 tokens for tiny-v4)
  std::vector<float> prefill_logits;  // the logits after the prompt
  std::vector<float> step_logits;     // the logits of each greedy step
};

// The goldens of one model directory: every prompt pK of DIR/golden.safetensors, in order p0, p1, ...
class Goldens {
 public:
  static absl::StatusOr<Goldens> Load(const std::string& dir);

  size_t size() const { return prompts_.size(); }
  const GoldenPrompt& operator[](size_t i) const { return prompts_[i]; }
  std::vector<GoldenPrompt>::const_iterator begin() const { return prompts_.begin(); }
  std::vector<GoldenPrompt>::const_iterator end() const { return prompts_.end(); }
  const std::vector<GoldenPrompt>& prompts() const { return prompts_; }
  // The prompt named `name` ("p2"); NotFound naming the file when absent.
  absl::StatusOr<const GoldenPrompt*> Find(std::string_view name) const;
  // Any other tensor of the file as floats (e.g. "p0.hidden.3", p0's residual stream after layer 3).
  absl::StatusOr<std::vector<float>> Floats(std::string_view tensor) const;

 private:
  std::string path_;
  std::shared_ptr<const TensorStore> store_;
  std::vector<GoldenPrompt> prompts_;
};

// TinyModelOptions::model for the synthetic tiny checkpoint with one preview-Flash MTP block and no DSpark
// config (numoe mkmodel --preset tiny --drafter mtp, seed 11): written to a scratch directory on first use,
// loaded, and the directory removed (the loaded objects keep what they need). It has no goldens.
inline constexpr char kTinyMtp[] = "tiny-mtp";

struct TinyModelOptions {
  // A model directory of tests/data ("tiny-v4", "demo-v4"), kTinyMtp, or an absolute path (a checkpoint a
  // test wrote).
  std::string model = "tiny-v4";
  // Load the checkpoint's drafter into the CPU model and its routed experts into the reference experts.
  bool drafter = false;
};

// A checkpoint with the fp32 CPU model (single-threaded), the reference experts on it and its goldens,
// loaded on first use and kept for the rest of the process (one per model and drafter choice), so the tests
// of one binary share one load. The objects keep per-sequence state: a test releases the sequences it creates.
struct TinyModel {
  std::unique_ptr<Checkpoint> ckpt;
  std::unique_ptr<cpu::CpuModel> model;
  std::unique_ptr<cpu::ReferenceExperts> experts;
  Goldens goldens;  // the directory's golden.safetensors; none for a checkpoint without one

  // The loaded model, or the error that stopped the load (the next call tries again).
  static absl::StatusOr<TinyModel*> Get(const TinyModelOptions& options = {});

  TinyModel();
  ~TinyModel();
  TinyModel(TinyModel&&) noexcept;
  TinyModel& operator=(TinyModel&&) noexcept;
};

}  // namespace numoe::test
