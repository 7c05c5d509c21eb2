#include "worker/experts/expert_layer.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "common/log.h"
#include "common/thread_pool.h"

namespace numoe {
namespace {

using experts::kBlockCols;
using experts::kE8M0Pad;
using experts::kSuperBytes;
using experts::kSuperCols;
using experts::kSuperNibbleBytes;
using experts::kTileRows;
using experts::PackedMatrixShape;

const char* const kMatrixNames[3] = {"w1 (gate)", "w3 (up)", "w2 (down)"};

// Checks one matrix; widens [min_scale, max_scale] with its scale bytes.
Status ValidateMatrix(const Mxfp4Matrix& m, int64_t rows, int64_t cols, int64_t expert, int which, int* min_scale,
                      int* max_scale) {
  const auto where = [&] { return absl::StrCat("expert ", expert, " ", kMatrixNames[which]); };
  if (m.packed == nullptr || m.scales == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(where(), ": null weight or scale pointer"));
  }
  if (m.rows != rows || m.cols != cols) {
    return absl::InvalidArgumentError(absl::StrCat(where(), ": logical shape [", m.rows, ", ", m.cols,
                                                   "], expected [", rows, ", ", cols, "]"));
  }
  const int64_t nblocks = experts::CeilDiv(cols, kBlockCols);
  const int64_t n = rows * nblocks;
  int lo = 255, hi = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int e = m.scales[i];
    lo = std::min(lo, e);
    hi = std::max(hi, e);
  }
  if (hi == 255) {
    for (int64_t i = 0; i < n; ++i) {
      if (m.scales[i] == 255) {
        return absl::InvalidArgumentError(absl::StrCat(where(), ": scale of row ", i / nblocks, " block ",
                                                       i % nblocks, " is 0xFF (NaN in E8M0)"));
      }
    }
  }
  *min_scale = std::min(*min_scale, lo);
  *max_scale = std::max(*max_scale, hi);
  return absl::OkStatus();
}

// Nibbles 0..3 of a 16-bit value -> the low nibbles of bytes 0..3.
inline uint32_t Spread(uint32_t x) {
  return (x & 0xFu) | ((x & 0xF0u) << 4) | ((x & 0xF00u) << 8) | ((x & 0xF000u) << 12);
}

inline int Nibble(const Mxfp4Matrix& m, int64_t r, int64_t c) {
  if (r >= m.rows || c >= m.cols) return 0;
  return (m.packed[r * (m.cols / 2) + c / 2] >> (4 * (c & 1))) & 0xF;
}

// Writes row tile t of `m` (geometry `shape`) to dst (shape.tile_bytes() bytes).
void PackTile(const Mxfp4Matrix& m, const PackedMatrixShape& shape, int64_t t, uint8_t* dst) {
  const int64_t nblocks = experts::CeilDiv(m.cols, kBlockCols);
  const int64_t half = m.cols / 2;
  for (int64_t s = 0; s < shape.supers(); ++s) {
    uint8_t* sp = dst + s * kSuperBytes;
    const bool full_cols = kSuperCols * (s + 1) <= m.cols;
    for (int j = 0; j < kTileRows; ++j) {
      const int64_t r = kTileRows * t + j;
      for (int b = 0; b < 4; ++b) {
        const int64_t kb = 4 * s + b;
        sp[kSuperNibbleBytes + 16 * b + j] =
            static_cast<uint8_t>(r < m.rows && kb < nblocks ? m.scales[r * nblocks + kb] : kE8M0Pad);
        for (int g = 0; g < 4; ++g) {
          const int64_t c = kSuperCols * s + 32 * b + 4 * g;  // columns c..c+3 (low), c+16..c+19 (high)
          uint32_t word = 0;
          if (r < m.rows && full_cols) {
            const uint8_t* row = m.packed + r * half;
            const uint32_t lo = row[c / 2] | (static_cast<uint32_t>(row[c / 2 + 1]) << 8);
            const uint32_t hi = row[c / 2 + 8] | (static_cast<uint32_t>(row[c / 2 + 9]) << 8);
            word = Spread(lo) | (Spread(hi) << 4);
          } else if (r < m.rows) {
            for (int q = 0; q < 4; ++q) {
              word |= static_cast<uint32_t>(Nibble(m, r, c + q) | (Nibble(m, r, c + 16 + q) << 4)) << (8 * q);
            }
          }
          std::memcpy(sp + 256 * b + 64 * g + 4 * j, &word, 4);
        }
      }
    }
  }
}

void PackExpert(const ExpertWeightsRef& w, const experts::PackedExpertShape& shape, uint8_t* dst) {
  const PackedMatrixShape gu = shape.gate_up(), dn = shape.down();
  for (int64_t t = 0; t < gu.tiles(); ++t) {
    PackTile(w.w1, gu, t, dst + shape.gate_tile_offset(t));
    PackTile(w.w3, gu, t, dst + shape.gate_tile_offset(t) + gu.tile_bytes());
  }
  for (int64_t t = 0; t < dn.tiles(); ++t) PackTile(w.w2, dn, t, dst + shape.down_tile_offset(t));
  // The alignment gap up to the next expert is never read; keep it deterministic.
  std::memset(dst + shape.data_bytes(), 0, shape.stride() - shape.data_bytes());
}

}  // namespace

StatusOr<std::unique_ptr<ExpertLayer>> ExpertLayer::Pack(int64_t hidden, int64_t inter,
                                                         const std::vector<ExpertWeightsRef>& experts, Isa isa,
                                                         const ExpertPackOptions& options) {
  if (hidden <= 0 || inter <= 0 || hidden % 2 != 0 || inter % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert layer: hidden (", hidden, ") and inter (", inter, ") must be positive and even"));
  }
  if (experts.empty()) return absl::InvalidArgumentError("expert layer: no experts");
  if (!IsaAvailable(isa)) {
    return absl::FailedPreconditionError(absl::StrCat("expert layer: ISA ", IsaName(isa), " is not available here"));
  }
  int min_scale = 255, max_scale = 0;
  for (size_t e = 0; e < experts.size(); ++e) {
    const int64_t id = static_cast<int64_t>(e);
    RETURN_IF_ERROR(ValidateMatrix(experts[e].w1, inter, hidden, id, 0, &min_scale, &max_scale));
    RETURN_IF_ERROR(ValidateMatrix(experts[e].w3, inter, hidden, id, 1, &min_scale, &max_scale));
    RETURN_IF_ERROR(ValidateMatrix(experts[e].w2, hidden, inter, id, 2, &min_scale, &max_scale));
  }
  std::unique_ptr<ExpertLayer> layer(new ExpertLayer());
  layer->num_experts_ = static_cast<int64_t>(experts.size());
  layer->shape_ = experts::PackedExpertShape{hidden, inter};
  layer->isa_ = isa;
  layer->bf16_exact_ = min_scale >= 2 && max_scale <= 252;
  const size_t total = static_cast<size_t>(layer->shape_.stride() * layer->num_experts_);
  const NodeAllocOptions alloc{.node = options.numa_node, .huge_pages = options.huge_pages};
  if (options.arena != nullptr) {
    ASSIGN_OR_RETURN(layer->buffer_, options.arena->Allocate(total, alloc, &layer->arena_offset_));
  } else {
    ASSIGN_OR_RETURN(layer->buffer_, AllocateOnNode(total, alloc));
  }
  const auto pack_range = [&](int64_t begin, int64_t end, int) {
    for (int64_t e = begin; e < end; ++e) {
      PackExpert(experts[e], layer->shape_, layer->buffer_.data() + e * layer->shape_.stride());
    }
  };
  if (options.pool != nullptr) {
    options.pool->ParallelForDynamic(layer->num_experts_, 1, pack_range);
  } else {
    pack_range(0, layer->num_experts_, 0);
  }
  if (isa == Isa::kAmx && !layer->bf16_exact_) {
    NLOG(WARNING) << "expert layer: scale bytes span [" << min_scale << ", " << max_scale
                  << "], outside bf16's exact range [2, 252]; this layer runs on AVX-512 instead of AMX";
  }
  return layer;
}

}  // namespace numoe
