// Staging of dense weights for the device: read from a checkpoint (or synthesised for benchmarks), sliced for
// tensor parallelism, converted to the device format, uploaded.
//
// Device formats: a matrix stored FP8-block in the checkpoint stays FP8 (codes + fp32 block-scale grid) when
// fp8_weights, else it is dequantized (to F32 in fp32 mode, BF16 otherwise). Plain matrices go to BF16 except
// in fp32 mode, where F32/F16 stay F32 (BF16 stays BF16: exact either way).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/checkpoint.h"
#include "common/config.h"
#include "common/status.h"
#include "backends/cuda/device_memory.h"
#include "backends/cuda/kernels.h"

namespace numoe::cuda {

struct StagedMatrix {
  std::string name;
  WType type = WType::kBF16;
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> bytes;  // rows·cols elements; empty for synthetic weights (filled on the device)
  std::vector<float> scale;    // FP8: the block grid [scale_rows, scale_cols]
  int64_t scale_rows = 0, scale_cols = 0;
  int64_t row_base = 0, col_base = 0;  // FP8: this slice's place in the grid
  int32_t bo = 128, bi = 128;
};

class WeightSource {
 public:
  // `ckpt` == nullptr: synthetic weights of `cfg`'s shapes in the official formats, random with `seed`.
  WeightSource(const Checkpoint* ckpt, const ModelConfig& cfg, bool fp32, bool fp8_weights, uint64_t seed);

  // Rows [r0, r0 + rows) x columns [c0, c0 + cols) of the logical matrix `name` ([out, in]).
  // `force_wide`: a plain (non-FP8) result is F32 in fp32 mode even when stored BF16 (so that matrices of
  // mixed storage can be stacked).
  StatusOr<StagedMatrix> Matrix(const std::string& name, int64_t out, int64_t in, int64_t r0, int64_t rows, int64_t c0,
                                int64_t cols, bool force_wide = false) const;
  StatusOr<StagedMatrix> Matrix(const std::string& name, int64_t out, int64_t in, bool force_wide = false) const {
    return Matrix(name, out, in, 0, out, 0, in, force_wide);
  }
  // fp32 values of a small tensor (norms, mHC parameters, sinks, ape, biases): `numel` values.
  StatusOr<std::vector<float>> Vector(const std::string& name, int64_t numel) const;
  StatusOr<std::vector<int32_t>> Tid2Eid(const std::string& name, int64_t vocab, int64_t k, int64_t experts) const;
  bool HasTensor(const std::string& name) const;
  bool synthetic() const { return ckpt_ == nullptr; }

 private:
  const Checkpoint* ckpt_;
  ModelConfig cfg_;
  bool fp32_, fp8_weights_;
  uint64_t seed_;
  std::map<std::string, ExpectedTensor> expected_;  // synthetic formats
};

// Stacks matrices row-wise (same columns, same device type). FP8 parts must each start and end on a block-row
// boundary of their own grid; returns false (and leaves `out` untouched) when they cannot be stacked.
bool StackRows(const std::vector<StagedMatrix>& parts, StagedMatrix* out);

// Uploads to the current device; synthetic matrices are filled there. The allocations go to `keep`.
StatusOr<DevW> Upload(const StagedMatrix& m, uint64_t seed, cudaStream_t stream, std::vector<DeviceMem>* keep);
StatusOr<float*> UploadF32(const std::vector<float>& v, const std::string& what, cudaStream_t stream,
                           std::vector<DeviceMem>* keep);
StatusOr<int32_t*> UploadI32(const std::vector<int32_t>& v, const std::string& what, cudaStream_t stream,
                             std::vector<DeviceMem>* keep);

}  // namespace numoe::cuda
