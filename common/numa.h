// Node-local allocation on 2 MB pages.
//
// A numoe-worker serves one NUMA node: its expert weights live in that node's memory and its kernel
// threads run on that node's cores, so every weight byte is streamed from local DRAM. Where a worker runs
// is decided once, by deploy/placement.h's PlaceWorkers() over common/topology.h's Topology; the worker
// applies that placement (worker/service/numa_bind.h) and ExpertLayer::Pack allocates here, on the
// placement's node.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace numoe {

struct NodeAllocOptions {
  int node = -1;            // -1: no binding (the kernel's default policy)
  bool huge_pages = true;   // try hugetlbfs 2 MB pages, else transparent huge pages via MADV_HUGEPAGE
};

// An anonymous mapping, 2 MB aligned, bound to a node, zero-filled lazily; unmapped on destruction.
class NodeBuffer {
 public:
  NodeBuffer() = default;
  ~NodeBuffer();
  NodeBuffer(NodeBuffer&& other) noexcept;
  NodeBuffer& operator=(NodeBuffer&& other) noexcept;
  NodeBuffer(const NodeBuffer&) = delete;
  NodeBuffer& operator=(const NodeBuffer&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  // "hugetlb" (reserved 2 MB pages), "thp" (MADV_HUGEPAGE accepted) or "4k".
  const std::string& page_mode() const { return page_mode_; }

 private:
  friend StatusOr<NodeBuffer> AllocateOnNode(size_t bytes, const NodeAllocOptions& options);
  void Release();
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  uint8_t* map_base_ = nullptr;
  size_t map_size_ = 0;
  std::string page_mode_ = "4k";
};

// Allocates `bytes` (rounded up to 2 MB). Binding (mbind MPOL_BIND) failures on a multi-node machine are
// errors; on a single-node machine there is nothing to bind and no mbind call is made. Huge pages are
// best effort: hugetlbfs is used only when enough free 2 MB pages are reserved, else THP is requested
// when /sys/kernel/mm/transparent_hugepage/enabled allows it.
StatusOr<NodeBuffer> AllocateOnNode(size_t bytes, const NodeAllocOptions& options);

}  // namespace numoe
