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
#include <memory>
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
  friend class SharedArena;
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

// One sealable memfd that NodeBuffers map slices of (MAP_SHARED), so that another process can map the same
// pages: the worker packs its expert layers into one (GPU prefill: numoe-gpu maps it read-only and
// registers it for DMA, with no second host copy). Each Allocate grows the file by a 2 MB multiple and maps
// the new range, bound to the node like AllocateOnNode (mbind after mmap, before the first touch). Pages:
// hugetlb when Create found enough free reserved 2 MB pages for `expected_bytes` (MFD_HUGETLB), else shmem
// THP when /sys/kernel/mm/transparent_hugepage/shmem_enabled allows madvise, else 4 KiB.
// Seal() forbids growing and shrinking the file from then on (F_SEAL_GROW | F_SEAL_SHRINK), so a process
// that maps it can never see it shrink under its mapping (which would be SIGBUS). Not thread-safe.
class SharedArena {
 public:
  static StatusOr<std::unique_ptr<SharedArena>> Create(const std::string& name, size_t expected_bytes,
                                                       bool huge_pages = true);
  ~SharedArena();  // closes the fd; buffers already mapped stay valid (they hold the pages)
  SharedArena(const SharedArena&) = delete;
  SharedArena& operator=(const SharedArena&) = delete;

  // `bytes` (rounded up to 2 MB) at file offset *offset, mapped read-write, bound to options.node.
  // FailedPrecondition after Seal().
  StatusOr<NodeBuffer> Allocate(size_t bytes, const NodeAllocOptions& options, int64_t* offset);
  Status Seal();
  int fd() const { return fd_; }
  int64_t size() const { return size_; }  // bytes allocated so far (the file's size)
  const std::string& page_mode() const { return page_mode_; }

 private:
  SharedArena() = default;
  int fd_ = -1;
  int64_t size_ = 0;
  bool sealed_ = false;
  std::string page_mode_ = "4k";
};

}  // namespace numoe
