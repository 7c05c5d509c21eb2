// safetensors loading: mmap'd, zero-copy views, single file or sharded via model.safetensors.index.json.
//
// The files are untrusted input. Every malformed case is a Status naming the file (and the tensor when
// there is one), never a crash and never a read out of bounds:
//   header length past the end of the file or absurd (e.g. 2^63), header not valid JSON / not an object,
//   unknown dtype, negative or overflowing shape, data_offsets outside the data section, reversed or
//   overlapping, shape x dtype size != byte span, duplicate names across shards, an index naming a
//   missing shard or a tensor that its shard does not contain.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace numoe {

// Every dtype the official DeepSeek-V4 files use.
enum class DType { kF32, kBF16, kF16, kF8_E4M3, kF8_E8M0, kI8, kU8, kI32, kI64 };

// Bytes per element.
size_t DTypeSize(DType t);
// The safetensors spelling ("F32", "BF16", "F8_E4M3", ...).
std::string_view DTypeName(DType t);
StatusOr<DType> ParseDType(std::string_view name);

// A zero-copy view of one tensor inside a mapped file. Valid while the owning store lives.
// `data` is only as aligned as the file's data_offsets make it (the format does not require alignment):
// read multi-byte elements with memcpy or copy the tensor before using it as an aligned array.
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // as stored (packed FP4 rows are in/2 wide)
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
  const std::string* file = nullptr;  // path of the shard that holds it

  int64_t numel() const;
  std::string ShapeString() const;  // "[64, 128]"
};

// One mapped .safetensors file.
class SafetensorsFile {
 public:
  static StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorView* Find(std::string_view name) const;
  size_t file_size() const { return size_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  std::vector<TensorView> tensors_;
  std::map<std::string, size_t, std::less<>> by_name_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint directory: `model.safetensors.index.json` + shards, or a single
// `*.safetensors` file (also accepted: a path to one .safetensors file).
class TensorStore {
 public:
  static StatusOr<std::unique_ptr<TensorStore>> Open(const std::string& path);

  const TensorView* Find(std::string_view name) const;   // nullptr when absent
  StatusOr<const TensorView*> Get(std::string_view name) const;  // NotFound naming the tensor
  std::vector<std::string> Names() const;                 // sorted
  size_t num_tensors() const { return by_name_.size(); }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*, std::less<>> by_name_;
};

// Writes a safetensors file (used by tests, `numoe mkmodel` and --logits-out). `data` must hold
// exactly numel * DTypeSize bytes for each tensor.
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const void* data;
};
Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                        const std::map<std::string, std::string>& metadata = {});

}  // namespace numoe
