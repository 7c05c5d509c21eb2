#include "common/numa.h"

#include <numa.h>
#include <numaif.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <algorithm>
#include <fstream>
#include <sstream>
#include <utility>

#include "common/log.h"

namespace numoe {
namespace {

constexpr size_t k2MB = size_t{2} << 20;
constexpr unsigned kMfdHuge2MB = 21u << 26;  // MFD_HUGE_2MB (linux/memfd.h: log2(2 MB) << MFD_HUGE_SHIFT)

size_t RoundUp(size_t v, size_t to) { return (v + to - 1) / to * to; }

int64_t ReadIntFile(const char* path, int64_t fallback) {
  std::ifstream f(path);
  int64_t v = fallback;
  if (!(f >> v)) return fallback;
  return v;
}

bool ThpAllowed() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string s = ss.str();
  return s.find("[always]") != std::string::npos || s.find("[madvise]") != std::string::npos;
}

bool NumaUsable() { return numa_available() >= 0 && numa_num_configured_nodes() > 1; }

bool ShmemThpAllowed() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string s = ss.str();
  return s.find("[always]") != std::string::npos || s.find("[advise]") != std::string::npos ||
         s.find("[within_size]") != std::string::npos;
}

// mbind MPOL_BIND of [p, p + size) to `node` (nothing on a single-node machine or for node < 0).
Status BindToNode(uint8_t* p, size_t size, int node) {
  if (node < 0 || !NumaUsable()) return absl::OkStatus();
  if (node > numa_max_node()) return absl::InvalidArgumentError(absl::StrCat("numa: node ", node, " does not exist"));
  unsigned long nodemask[16] = {};
  nodemask[node / (8 * sizeof(unsigned long))] |= 1ul << (node % (8 * sizeof(unsigned long)));
  if (mbind(p, size, MPOL_BIND, nodemask, sizeof(nodemask) * 8, MPOL_MF_STRICT) != 0) {
    return absl::InternalError(
        absl::StrCat("numa: mbind of ", size, " bytes to node ", node, " failed: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

NodeBuffer::~NodeBuffer() { Release(); }

NodeBuffer::NodeBuffer(NodeBuffer&& other) noexcept { *this = std::move(other); }

NodeBuffer& NodeBuffer::operator=(NodeBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    map_base_ = std::exchange(other.map_base_, nullptr);
    map_size_ = std::exchange(other.map_size_, 0);
    page_mode_ = std::exchange(other.page_mode_, "4k");
  }
  return *this;
}

void NodeBuffer::Release() {
  if (map_base_ != nullptr) munmap(map_base_, map_size_);
  map_base_ = data_ = nullptr;
  map_size_ = size_ = 0;
}

StatusOr<NodeBuffer> AllocateOnNode(size_t bytes, const NodeAllocOptions& options) {
  NodeBuffer buf;
  const size_t size = RoundUp(std::max<size_t>(bytes, 1), k2MB);
  if (options.huge_pages) {
    const int64_t free_huge = ReadIntFile("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages", 0);
    if (free_huge > 0 && static_cast<size_t>(free_huge) >= size / k2MB) {
      void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
      if (p != MAP_FAILED) {
        buf.map_base_ = buf.data_ = static_cast<uint8_t*>(p);
        buf.map_size_ = size;
        buf.page_mode_ = "hugetlb";
      }
    }
  }
  if (buf.map_base_ == nullptr) {
    // Over-map by 2 MB so the usable range starts on a 2 MB boundary (THP needs aligned ranges).
    const size_t map_size = size + k2MB;
    void* p = mmap(nullptr, map_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("numa: mmap of ", map_size, " bytes failed: ", std::strerror(errno)));
    }
    buf.map_base_ = static_cast<uint8_t*>(p);
    buf.map_size_ = map_size;
    buf.data_ = reinterpret_cast<uint8_t*>(RoundUp(reinterpret_cast<uintptr_t>(p), k2MB));
    if (options.huge_pages && ThpAllowed() && madvise(buf.data_, size, MADV_HUGEPAGE) == 0) buf.page_mode_ = "thp";
  }
  buf.size_ = size;
  RETURN_IF_ERROR(BindToNode(buf.data_, size, options.node));
  return buf;
}

StatusOr<std::unique_ptr<SharedArena>> SharedArena::Create(const std::string& name, size_t expected_bytes,
                                                           bool huge_pages) {
  std::unique_ptr<SharedArena> a(new SharedArena());
  if (huge_pages) {
    const int64_t free_huge = ReadIntFile("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages", 0);
    if (free_huge > 0 && static_cast<size_t>(free_huge) >= RoundUp(std::max<size_t>(expected_bytes, 1), k2MB) / k2MB) {
      a->fd_ = memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB | kMfdHuge2MB);
      if (a->fd_ >= 0) a->page_mode_ = "hugetlb";
    }
  }
  if (a->fd_ < 0) {
    a->fd_ = memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (a->fd_ < 0) {
      return absl::ResourceExhaustedError(absl::StrCat("numa: memfd_create(", name, ") failed: ", std::strerror(errno)));
    }
    if (huge_pages && ShmemThpAllowed()) a->page_mode_ = "thp";
  }
  return a;
}

SharedArena::~SharedArena() {
  if (fd_ >= 0) close(fd_);
}

StatusOr<NodeBuffer> SharedArena::Allocate(size_t bytes, const NodeAllocOptions& options, int64_t* offset) {
  if (sealed_) return absl::FailedPreconditionError("numa: shared arena is sealed; nothing more can be allocated");
  const size_t size = RoundUp(std::max<size_t>(bytes, 1), k2MB);
  const int64_t at = size_;
  if (ftruncate(fd_, at + static_cast<off_t>(size)) != 0) {
    return absl::ResourceExhaustedError(absl::StrCat("numa: growing the shared arena to ", at + static_cast<int64_t>(size),
                                                     " bytes failed: ", std::strerror(errno)));
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, static_cast<off_t>(at));
  if (p == MAP_FAILED) {
    const int err = errno;
    if (ftruncate(fd_, at) != 0) {
      // The file keeps the unmapped tail; the arena's size stays what was mapped.
    }
    return absl::ResourceExhaustedError(absl::StrCat("numa: mapping ", size, " bytes of the shared arena (",
                                                     page_mode_, ") failed: ", std::strerror(err)));
  }
  NodeBuffer buf;
  buf.map_base_ = buf.data_ = static_cast<uint8_t*>(p);
  buf.map_size_ = buf.size_ = size;
  buf.page_mode_ = page_mode_;
  if (page_mode_ == "thp") (void)madvise(p, size, MADV_HUGEPAGE);
  RETURN_IF_ERROR(BindToNode(buf.data_, size, options.node));
  size_ += static_cast<int64_t>(size);
  *offset = at;
  return buf;
}

Status SharedArena::Seal() {
  if (sealed_) return absl::OkStatus();
  if (fcntl(fd_, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
    return absl::InternalError(absl::StrCat("numa: sealing the shared arena failed: ", std::strerror(errno)));
  }
  sealed_ = true;
  return absl::OkStatus();
}

}  // namespace numoe
