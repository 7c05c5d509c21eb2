#include "common/numa.h"

#include <numa.h>
#include <numaif.h>
#include <sys/mman.h>

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
  if (options.node >= 0 && NumaUsable()) {
    if (options.node > numa_max_node()) {
      return absl::InvalidArgumentError(absl::StrCat("numa: node ", options.node, " does not exist"));
    }
    unsigned long nodemask[16] = {};
    nodemask[options.node / (8 * sizeof(unsigned long))] |= 1ul << (options.node % (8 * sizeof(unsigned long)));
    if (mbind(buf.data_, size, MPOL_BIND, nodemask, sizeof(nodemask) * 8, MPOL_MF_STRICT) != 0) {
      return absl::InternalError(absl::StrCat("numa: mbind of ", size, " bytes to node ", options.node,
                                              " failed: ", std::strerror(errno)));
    }
  }
  return buf;
}

}  // namespace numoe
