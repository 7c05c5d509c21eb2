// Fuzzes the model loader's safetensors reading (common/safetensors.h): TensorStore::Open on a directory the
// input fills. Input: first byte 'I' = an index directory: the bytes up to the first NUL are
// model.safetensors.index.json, the rest the shard "model-00001-of-00001.safetensors"; any other first byte =
// the rest is a single model.safetensors. A store that opens must have every tensor's bytes inside its file.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>

#include "common/safetensors.h"
#include "tests/support/files.h"

namespace {

const numoe::test::TempDir& Scratch() {
  static const numoe::test::TempDir* dir = new numoe::test::TempDir("fuzz-safetensors");
  return *dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  namespace fs = std::filesystem;
  const fs::path dir = Scratch().path();
  for (const char* name : {"model.safetensors.index.json", "model-00001-of-00001.safetensors", "model.safetensors"}) {
    std::error_code ec;
    fs::remove(dir / name, ec);
  }
  std::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] == 'I') {
    const size_t nul = in.find('\0');
    const std::string_view index = in.substr(0, nul);
    const std::string_view shard = nul == std::string_view::npos ? std::string_view() : in.substr(nul + 1);
    numoe::test::WriteFile(dir / "model.safetensors.index.json", std::string(index));
    numoe::test::WriteFile(dir / "model-00001-of-00001.safetensors", std::string(shard));
  } else {
    numoe::test::WriteFile(dir / "model.safetensors", std::string(in));
  }
  auto store = numoe::TensorStore::Open(dir.string());
  if (!store.ok()) return 0;
  // Every view lies inside its mapped file: touch its first and last byte (ASan / SEGV otherwise).
  unsigned sum = 0;
  for (const std::string& name : (*store)->Names()) {
    auto t = (*store)->Get(name);
    if (!t.ok()) std::abort();  // Names() lists only what Get finds
    const numoe::TensorView* v = *t;
    if (v->nbytes != static_cast<size_t>(v->numel()) * numoe::DTypeSize(v->dtype)) std::abort();
    if (v->nbytes > 0) sum += v->data[0] + v->data[v->nbytes - 1];
    (void)v->ShapeString();
  }
  return sum == 0xFFFFFFFFu ? -1 : 0;  // keeps the reads (never true: at most 2 x 255 per tensor)
}
