#include "common/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace numoe {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// The reference implementation's bound; a real shard header is a few hundred KB.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr size_t kMaxDims = 8;

struct DTypeInfo {
  DType type;
  std::string_view name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::kF32, "F32", 4},         {DType::kBF16, "BF16", 2}, {DType::kF16, "F16", 2},
    {DType::kF8_E4M3, "F8_E4M3", 1}, {DType::kF8_E8M0, "F8_E8M0", 1}, {DType::kI8, "I8", 1},
    {DType::kU8, "U8", 1},           {DType::kI32, "I32", 4},   {DType::kI64, "I64", 8},
};

// Product of non-negative dims times `elem`, or false when it does not fit in int64.
bool CheckedBytes(const std::vector<int64_t>& shape, size_t elem, int64_t* numel, uint64_t* bytes) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) return false;
    n *= d;
  }
  if (n != 0 && static_cast<uint64_t>(n) > std::numeric_limits<uint64_t>::max() / elem) return false;
  *numel = n;
  *bytes = static_cast<uint64_t>(n) * elem;
  return true;
}

std::string ShapeText(const std::vector<int64_t>& shape) { return "[" + absl::StrJoin(shape, ", ") + "]"; }

// Reads a JSON value that must be a non-negative integer that fits in int64.
bool JsonToNonNegInt(const json& v, int64_t* out) {
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(u);
    return true;
  }
  if (v.is_number_integer()) {
    int64_t i = v.get<int64_t>();
    if (i < 0) return false;
    *out = i;
    return true;
  }
  return false;
}

std::string Errno() { return std::strerror(errno); }

}  // namespace

size_t DTypeSize(DType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.size;
  return 1;
}

std::string_view DTypeName(DType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.name;
  return "?";
}

StatusOr<DType> ParseDType(std::string_view name) {
  for (const auto& d : kDTypes)
    if (d.name == name) return d.type;
  return absl::InvalidArgumentError(absl::StrCat("unsupported dtype '", std::string(name),
                                                 "' (supported: F32, BF16, F16, F8_E4M3, F8_E8M0, I8, U8, I32, I64)"));
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorView::ShapeString() const { return ShapeText(shape); }

// ---- SafetensorsFile ------------------------------------------------------

SafetensorsFile::~SafetensorsFile() {
  if (base_ != nullptr) munmap(const_cast<uint8_t*>(base_), size_);
}

StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", Errno()));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    std::string err = Errno();
    ::close(fd);
    return absl::InternalError(absl::StrCat(path, ": fstat failed: ", err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": file is ", size, " bytes, too small for a safetensors header (truncated?)"));
  }
  void* p = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  std::string mmap_err = p == MAP_FAILED ? Errno() : "";
  ::close(fd);
  if (p == MAP_FAILED) return absl::InternalError(absl::StrCat(path, ": mmap failed: ", mmap_err));
  f->base_ = static_cast<const uint8_t*>(p);
  f->size_ = size;

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | f->base_[i];
  if (header_len > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header length ", header_len,
                                                   " is absurd (limit ", kMaxHeaderBytes, " bytes; file is ", size,
                                                   " bytes): not a safetensors file or corrupt"));
  }
  if (header_len > size - 8) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header length ", header_len, " runs past the end of the ",
                                                   size, "-byte file (truncated?)"));
  }
  const char* hbegin = reinterpret_cast<const char*>(f->base_ + 8);
  json header = json::parse(hbegin, hbegin + header_len, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(path, ": header is not valid JSON"));
  if (!header.is_object())
    return absl::InvalidArgumentError(absl::StrCat(path, ": header is not a JSON object"));

  const uint64_t data_start = 8 + header_len;
  const uint64_t data_size = size - data_start;
  struct Span {
    uint64_t begin, end;
    size_t index;
  };
  std::vector<Span> spans;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": __metadata__ is not an object"));
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          return absl::InvalidArgumentError(
              absl::StrCat(path, ": __metadata__ value of '", m.key(), "' is not a string"));
        f->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& what) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", name, "': ", what));
    };
    if (!v.is_object()) return bad("entry is not an object");
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string()) return bad("missing or non-string 'dtype'");
    if (sh == v.end() || !sh->is_array()) return bad("missing or non-array 'shape'");
    if (off == v.end() || !off->is_array() || off->size() != 2) return bad("'data_offsets' must be [begin, end]");
    StatusOr<DType> dtype = ParseDType(dt->get<std::string>());
    if (!dtype.ok()) return bad(std::string(dtype.status().message()));
    if (sh->size() > kMaxDims) return bad(absl::StrCat("shape has ", sh->size(), " dims (at most ", kMaxDims, ")"));
    TensorView t;
    t.name = name;
    t.dtype = *dtype;
    for (const json& d : *sh) {
      int64_t dim = 0;
      if (!JsonToNonNegInt(d, &dim)) return bad(absl::StrCat("bad shape ", sh->dump(), " (dims must be integers >= 0)"));
      t.shape.push_back(dim);
    }
    int64_t numel = 0;
    uint64_t nbytes = 0;
    if (!CheckedBytes(t.shape, DTypeSize(t.dtype), &numel, &nbytes))
      return bad(absl::StrCat("shape ", ShapeText(t.shape), " overflows"));
    int64_t b = 0, e = 0;
    if (!JsonToNonNegInt((*off)[0], &b) || !JsonToNonNegInt((*off)[1], &e))
      return bad(absl::StrCat("bad data_offsets ", off->dump()));
    if (e < b) return bad(absl::StrCat("data_offsets ", off->dump(), " are reversed"));
    if (static_cast<uint64_t>(e) > data_size)
      return bad(absl::StrCat("data_offsets ", off->dump(), " run past the data section (", data_size,
                              " bytes; file truncated?)"));
    if (static_cast<uint64_t>(e - b) != nbytes)
      return bad(absl::StrCat("shape ", ShapeText(t.shape), " x ", std::string(DTypeName(t.dtype)), " is ", nbytes,
                              " bytes but data_offsets ", off->dump(), " span ", e - b, " bytes"));
    t.data = f->base_ + data_start + b;
    t.nbytes = static_cast<size_t>(nbytes);
    spans.push_back({static_cast<uint64_t>(b), static_cast<uint64_t>(e), f->tensors_.size()});
    f->tensors_.push_back(std::move(t));
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  for (size_t i = 1; i < spans.size(); ++i) {
    const Span& prev = spans[i - 1];
    const Span& cur = spans[i];
    // Zero-sized tensors occupy no bytes and may share an offset with anything.
    if (cur.begin == cur.end || prev.begin == prev.end) continue;
    if (cur.begin < prev.end) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", f->tensors_[cur.index].name,
                                                     "' overlaps tensor '", f->tensors_[prev.index].name,
                                                     "' in the data section"));
    }
  }
  for (auto& t : f->tensors_) t.file = &f->path_;
  for (size_t i = 0; i < f->tensors_.size(); ++i) f->by_name_.emplace(f->tensors_[i].name, i);
  return f;
}

const TensorView* SafetensorsFile::Find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

// ---- TensorStore ----------------------------------------------------------

namespace {

StatusOr<std::string> ReadSmallFile(const std::string& path, size_t limit) {
  std::error_code ec;
  auto size = fs::file_size(path, ec);
  if (ec) return absl::NotFoundError(absl::StrCat(path, ": cannot read: ", ec.message()));
  if (size > limit) return absl::InvalidArgumentError(absl::StrCat(path, ": ", size, " bytes is too large"));
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

StatusOr<std::unique_ptr<TensorStore>> TensorStore::Open(const std::string& path) {
  auto store = std::make_unique<TensorStore>();
  std::error_code ec;
  fs::path p(path);
  if (!fs::exists(p, ec)) return absl::NotFoundError(absl::StrCat(path, ": no such file or directory"));

  fs::path index_path;
  std::vector<fs::path> shard_paths;
  if (fs::is_directory(p, ec)) {
    if (fs::exists(p / "model.safetensors.index.json", ec)) {
      index_path = p / "model.safetensors.index.json";
    } else if (fs::exists(p / "model.safetensors", ec)) {
      shard_paths.push_back(p / "model.safetensors");
    } else {
      for (const auto& e : fs::directory_iterator(p, ec))
        if (e.is_regular_file() && EndsWith(e.path().filename().string(), ".safetensors"))
          shard_paths.push_back(e.path());
      std::sort(shard_paths.begin(), shard_paths.end());
      if (shard_paths.empty())
        return absl::NotFoundError(
            absl::StrCat(path, ": no model.safetensors.index.json and no *.safetensors file in the directory"));
    }
  } else if (EndsWith(path, ".json")) {
    index_path = p;
  } else {
    shard_paths.push_back(p);
  }

  // Index: weight_map name -> shard file (relative to the index's directory).
  std::map<std::string, std::string> weight_map;
  if (!index_path.empty()) {
    const std::string ipath = index_path.string();
    ASSIGN_OR_RETURN(std::string text, ReadSmallFile(ipath, 1u << 30));
    json idx = json::parse(text, nullptr, false);
    if (idx.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(ipath, ": not valid JSON"));
    if (!idx.is_object()) return absl::InvalidArgumentError(absl::StrCat(ipath, ": not a JSON object"));
    auto wm = idx.find("weight_map");
    if (wm == idx.end() || !wm->is_object())
      return absl::InvalidArgumentError(absl::StrCat(ipath, ": missing 'weight_map' object"));
    std::set<std::string> files;
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it.value().is_string())
        return absl::InvalidArgumentError(
            absl::StrCat(ipath, ": weight_map entry for tensor '", it.key(), "' is not a file name"));
      std::string file = it.value().get<std::string>();
      // Shards live next to the index; a path that climbs out of the directory is refused.
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
        return absl::InvalidArgumentError(
            absl::StrCat(ipath, ": tensor '", it.key(), "' maps to an invalid shard name '", file, "'"));
      weight_map[it.key()] = file;
      files.insert(file);
    }
    for (const auto& file : files) {
      fs::path sp = index_path.parent_path() / file;
      if (!fs::exists(sp, ec)) {
        std::string example;
        for (const auto& [n, fl] : weight_map)
          if (fl == file) {
            example = n;
            break;
          }
        return absl::NotFoundError(absl::StrCat(ipath, ": shard '", file, "' (holding tensor '", example,
                                                "' and others) does not exist"));
      }
      shard_paths.push_back(sp);
    }
  }

  std::map<std::string, std::string, std::less<>> owner;  // tensor -> shard path, for duplicate messages
  for (const auto& sp : shard_paths) {
    ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(sp.string()));
    for (const auto& t : file->tensors()) {
      auto [it, inserted] = owner.emplace(t.name, file->path());
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' appears in two shards: ", it->second,
                                                       " and ", file->path()));
      }
      store->by_name_.emplace(t.name, &t);
    }
    store->files_.push_back(std::move(file));
  }
  if (!index_path.empty()) {
    for (const auto& [name, file] : weight_map) {
      auto it = store->by_name_.find(name);
      const std::string shard = (index_path.parent_path() / file).string();
      if (it == store->by_name_.end()) {
        return absl::NotFoundError(absl::StrCat(index_path.string(), ": tensor '", name, "' is mapped to ", shard,
                                                " but that shard does not contain it"));
      }
      if (*it->second->file != shard) {
        return absl::InvalidArgumentError(absl::StrCat(index_path.string(), ": tensor '", name, "' is mapped to ",
                                                       shard, " but is stored in ", *it->second->file));
      }
    }
  }
  return store;
}

const TensorView* TensorStore::Find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

StatusOr<const TensorView*> TensorStore::Get(std::string_view name) const {
  const TensorView* t = Find(name);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat("tensor '", std::string(name), "' not found in the checkpoint"));
  return t;
}

std::vector<std::string> TensorStore::Names() const {
  std::vector<std::string> names;
  names.reserve(by_name_.size());
  for (const auto& [n, t] : by_name_) names.push_back(n);
  return names;
}

// ---- writer ---------------------------------------------------------------

Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) {
    json m = json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = m;
  }
  uint64_t offset = 0;
  std::vector<uint64_t> sizes;
  std::set<std::string> seen;
  for (const auto& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__")
      return absl::InvalidArgumentError(absl::StrCat(path, ": invalid tensor name '", t.name, "'"));
    if (!seen.insert(t.name).second)
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", t.name, "' given twice"));
    int64_t numel = 0;
    uint64_t nbytes = 0;
    if (!CheckedBytes(t.shape, DTypeSize(t.dtype), &numel, &nbytes))
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", t.name, "': bad shape ", ShapeText(t.shape)));
    if (nbytes > 0 && t.data == nullptr)
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", t.name, "' has no data"));
    header[t.name] = {{"dtype", std::string(DTypeName(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + nbytes}}};
    sizes.push_back(nbytes);
    offset += nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::PermissionDeniedError(absl::StrCat(tmp, ": cannot create: ", Errno()));
    uint8_t len[8];
    uint64_t n = text.size();
    for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));
    out.write(reinterpret_cast<const char*>(len), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (size_t i = 0; i < tensors.size(); ++i)
      if (sizes[i] > 0) out.write(static_cast<const char*>(tensors[i].data), static_cast<std::streamsize>(sizes[i]));
    out.flush();
    if (!out) {
      std::string err = Errno();
      std::remove(tmp.c_str());
      return absl::DataLossError(absl::StrCat(path, ": write failed: ", err));
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    std::remove(tmp.c_str());
    return absl::DataLossError(absl::StrCat(path, ": rename failed: ", ec.message()));
  }
  return absl::OkStatus();
}

}  // namespace numoe
