#include "gpu_service/expert_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

#include "common/packed_layout.h"

namespace numoe::gpu {

Status ValidateExpertArena(const ExpertArenaSpec& s, const ModelConfig& c) {
  auto bad = [](const std::string& field, const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("expert_arena.", field, ": ", what));
  };
  if (s.fd < 0 || s.fd > (int64_t{1} << 30)) return bad("fd", absl::StrCat(s.fd, " is no descriptor number"));
  if (s.bytes <= 0) return bad("bytes", absl::StrCat(s.bytes, " must be > 0"));
  if (s.num_experts != c.n_routed_experts) {
    return bad("num_experts", absl::StrCat(s.num_experts, ", but the model routes to ", c.n_routed_experts,
                                           " experts (n_routed_experts)"));
  }
  if (s.hidden != c.hidden_size) {
    return bad("hidden", absl::StrCat(s.hidden, ", but the model's hidden_size is ", c.hidden_size));
  }
  if (s.inter != c.moe_intermediate_size) {
    return bad("inter", absl::StrCat(s.inter, ", but the model's moe_intermediate_size is ", c.moe_intermediate_size));
  }
  const int64_t stride = experts::PackedExpertShape{s.hidden, s.inter}.stride();
  if (s.stride != stride) {
    return bad("stride", absl::StrCat(s.stride, ", but the packed layout of ", s.hidden, " x ", s.inter,
                                      " experts has stride ", stride));
  }
  if (static_cast<int64_t>(s.layer_offsets.size()) != c.num_hidden_layers) {
    return bad("layer_offsets", absl::StrCat(s.layer_offsets.size(), " offsets, but the model has ",
                                             c.num_hidden_layers, " layers (num_hidden_layers)"));
  }
  const int64_t layer_bytes = s.num_experts * s.stride;
  for (size_t l = 0; l < s.layer_offsets.size(); ++l) {
    const int64_t off = s.layer_offsets[l];
    const std::string field = absl::StrCat("layer_offsets[", l, "]");
    if (off < 0 || off % experts::kExpertAlign != 0) {
      return bad(field, absl::StrCat(off, " is not a non-negative multiple of ", experts::kExpertAlign));
    }
    if (off > s.bytes - layer_bytes) {
      return bad(field, absl::StrCat("the layer [", off, ", ", off + layer_bytes, ") runs past bytes (", s.bytes, ")"));
    }
  }
  return absl::OkStatus();
}

int64_t CalibratedPrefillRows(int64_t layer_bytes, double h2d_gbps, double row_seconds) {
  if (!(h2d_gbps > 0) || !(row_seconds > 0) || layer_bytes <= 0) return 0;
  const double upload_s = static_cast<double>(layer_bytes) / (h2d_gbps * 1e9);
  const double rows = std::ceil(upload_s / row_seconds);
  return rows >= double(int64_t{1} << 40) ? (int64_t{1} << 40) : std::max<int64_t>(1, static_cast<int64_t>(rows));
}

StatusOr<std::unique_ptr<MappedExpertArena>> MappedExpertArena::Map(const ExpertArenaSpec& spec,
                                                                    const ModelConfig& config, bool writable) {
  RETURN_IF_ERROR(ValidateExpertArena(spec, config));
  return MapChecked(spec, writable);
}

StatusOr<std::unique_ptr<MappedExpertArena>> MappedExpertArena::Reopen(bool writable) const {
  return MapChecked(spec_, writable);
}

StatusOr<std::unique_ptr<MappedExpertArena>> MappedExpertArena::MapChecked(const ExpertArenaSpec& spec, bool writable) {
  const std::string path = absl::StrCat("/proc/", spec.pid, "/fd/", spec.fd);
  const int fd = open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat("expert_arena: cannot open ", path, ": ", std::strerror(errno),
                                                      " (the worker must run on this host, as this user)"));
  }
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return absl::FailedPreconditionError(absl::StrCat("expert_arena: ", path,
                                                      seals < 0 ? " is not a memfd" : " is not sealed against shrinking",
                                                      " (F_SEAL_SHRINK), so it could shrink under the mapping"));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_size != spec.bytes) {
    return absl::FailedPreconditionError(absl::StrCat("expert_arena.bytes: ", spec.bytes, ", but ", path, " holds ",
                                                      static_cast<int64_t>(st.st_size), " bytes"));
  }
  void* p = mmap(nullptr, static_cast<size_t>(spec.bytes), writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED,
                 fd, 0);
  if (p == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("expert_arena: mmap of ", spec.bytes, " bytes of ", path,
                                            " failed: ", std::strerror(errno)));
  }
  std::unique_ptr<MappedExpertArena> a(new MappedExpertArena());
  a->spec_ = spec;
  a->writable_ = writable;
  a->base_ = p;
  a->size_ = static_cast<size_t>(spec.bytes);
  const uint8_t* base = static_cast<const uint8_t*>(p);
  a->host_.regions.push_back({base, spec.bytes});
  for (int64_t off : spec.layer_offsets) a->host_.layers.push_back(base + off);
  a->host_.num_experts = spec.num_experts;
  a->host_.hidden = spec.hidden;
  a->host_.inter = spec.inter;
  a->host_.stride = spec.stride;
  return a;
}

MappedExpertArena::~MappedExpertArena() {
  if (base_ != nullptr) munmap(base_, size_);
}

}  // namespace numoe::gpu
