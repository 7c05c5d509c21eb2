#include "worker/experts/moe_compute.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "common/clock.h"
#include "common/log.h"
#include "worker/experts/kernel_ops.h"
#include "common/packed_layout.h"

namespace numoe {

using experts::KernelOps;
using experts::kSuperCols;
using experts::kTileRows;
using experts::RoundUp;

namespace {

size_t Align64(size_t n) { return (n + 63) & ~size_t{63}; }

inline float Silu(float g) { return g / (1.0f + std::exp(-g)); }

// o[c] += w * y[c] for c < n, four columns at a time: the same multiply and add per column as the scalar
// loop (so the same bits), a quarter of the instructions (GCC -O2 leaves the scalar loop scalar: o and y may
// alias). At prefill sizes this is every routed row's down output, 6 x 4096 per token.
inline void AddScaled(float* o, const float* y, float w, int64_t n) {
  typedef float V4 __attribute__((vector_size(16), aligned(4)));
  const V4 wv = {w, w, w, w};
  int64_t c = 0;
  for (; c + 4 <= n; c += 4) {
    V4 ov, yv;
    std::memcpy(&ov, o + c, sizeof(ov));
    std::memcpy(&yv, y + c, sizeof(yv));
    ov += wv * yv;
    std::memcpy(o + c, &ov, sizeof(ov));
  }
  for (; c < n; ++c) o[c] += w * y[c];
}

}  // namespace

// A 64-byte aligned byte buffer that only grows.
class MoeCompute::Buffer {
 public:
  uint8_t* Reserve(size_t bytes) {
    if (bytes > size_) {
      size_ = Align64(std::max(bytes, size_ + size_ / 2));
      data_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, size_)));
      NCHECK(data_ != nullptr) << "out of memory for " << size_ << " bytes of expert scratch";
    }
    return data_.get();
  }
  uint8_t* data() const { return data_.get(); }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> data_;
  size_t size_ = 0;
};

// One expert used by this step.
struct MoeCompute::Plan {
  int64_t expert = 0;
  int64_t rows = 0;          // routed rows (duplicates in a row merged)
  int64_t first_route = 0;   // its routes are [first_route, first_route + rows)
  const KernelOps* ops = nullptr;
  bool prefill = false;           // ops is a prefill kernel (int8 prefill path or AMX), not the streaming one
  size_t x_acts = 0, h_acts = 0;  // offsets into x_acts_ / h_acts_
};

// Gate/up work: tile pairs [tile_begin, tile_end) of one plan.
struct MoeCompute::Unit {
  int32_t plan = 0;
  int32_t tile_begin = 0, tile_end = 0;
};

// Progress of one plan within a Run (see Run: replaces barriers between phases).
struct alignas(kCacheLine) MoeCompute::PlanSync {
  std::atomic<int> x_state{0};     // 0: activations not prepared, 1: being prepared, 2: ready
  std::atomic<int> units_left{0};  // gate/up units not finished
  std::atomic<int> h_ready{0};     // 1: h activations ready for the down projection
};

struct alignas(kCacheLine) MoeCompute::ThreadScratch {
  Buffer kernel;  // the kernel's own scratch (AMX B tiles)
  Buffer out;     // kernel results before the epilogue
  std::vector<experts::ByteRange> ahead;  // the bytes of the thread's next work unit (read_ahead)
  experts::ReadAhead read_ahead;
};

MoeCompute::MoeCompute(ThreadPool* pool, Isa isa, const MoeComputeOptions& options)
    : pool_(pool), isa_(isa), options_(options), h_(new Buffer), x_acts_(new Buffer), h_acts_(new Buffer) {
  NCHECK(pool_ != nullptr) << "MoeCompute needs a thread pool";
  const CpuFeatures& f = GetCpuFeatures();
  if (isa == Isa::kAmx && options.emulate_amx) {
    if (!(IsaAvailable(Isa::kAvx512, f) && f.avx512bf16 && f.avx512vbmi)) {
      usable_ = absl::FailedPreconditionError("emulated AMX needs AVX-512 VNNI, BF16 and VBMI");
    }
  } else if (!IsaAvailable(isa, f)) {
    usable_ = absl::FailedPreconditionError(
        absl::StrCat("ISA ", IsaName(isa), " is not available here (cpu: ", f.ToString(), ")"));
  }
  vbmi_ = f.avx512vbmi && !options.avx512_without_vbmi;
  thread_scratch_.resize(pool_->size());
}

MoeCompute::~MoeCompute() = default;

const KernelOps& MoeCompute::OpsFor(int64_t rows, bool bf16_exact) const {
  switch (isa_) {
    case Isa::kGeneric: return experts::GenericKernelOps();
    case Isa::kAvx2: return experts::Avx2KernelOps(options_.precision);
    case Isa::kAvx512: return Int8OpsFor(rows);
    case Isa::kAmx:
      if (rows >= options_.amx_min_rows && bf16_exact) {
        return options_.emulate_amx ? experts::AmxEmulatedKernelOps(options_.precision)
                                    : experts::AmxKernelOps(options_.precision);
      }
      return Int8OpsFor(rows);
  }
  return experts::GenericKernelOps();
}

const KernelOps& MoeCompute::Int8OpsFor(int64_t rows) const {
  if (options_.int8_prefill_min_rows > 0 && rows >= options_.int8_prefill_min_rows) {
    return vbmi_ ? experts::Avx512VbmiPrefillKernelOps(options_.precision)
                 : experts::Avx512PrefillKernelOps(options_.precision);
  }
  return Int8Ops();
}

const KernelOps& MoeCompute::Int8Ops() const {
  return vbmi_ ? experts::Avx512VbmiKernelOps(options_.precision) : experts::Avx512KernelOps(options_.precision);
}

Status MoeCompute::Run(const ExpertLayer& layer, float swiglu_limit, const MoeBatch& b) {
  RETURN_IF_ERROR(usable_);
  if (b.rows < 0 || b.top_k < 0) {
    return absl::InvalidArgumentError(absl::StrCat("moe: rows (", b.rows, ") and top_k (", b.top_k, ") must be >= 0"));
  }
  if (!(swiglu_limit >= 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("moe: swiglu_limit must be >= 0 (0 = no clamp), got ", swiglu_limit));
  }
  if (b.rows == 0) return absl::OkStatus();
  if (b.x == nullptr || b.out == nullptr || (b.top_k > 0 && (b.expert_ids == nullptr || b.expert_weights == nullptr))) {
    return absl::InvalidArgumentError("moe: null x, out, expert_ids or expert_weights");
  }
  const int64_t num_experts = layer.num_experts();
  for (int64_t i = 0; i < b.rows * b.top_k; ++i) {
    const int32_t e = b.expert_ids[i];
    if (e < 0 || e >= num_experts) {
      return absl::InvalidArgumentError(absl::StrCat("moe: expert_ids[", i / b.top_k, "][", i % b.top_k, "] = ", e,
                                                     " is out of range [0, ", num_experts, ")"));
    }
  }
  const int64_t hidden = layer.hidden(), inter = layer.inter();
  const experts::PackedExpertShape& shape = layer.shape();
  const int64_t hidden_p = shape.gate_up().padded_cols(), inter_p = shape.down().padded_cols();
  const int64_t inter_tiles = shape.gate_up().tiles(), hidden_tiles = shape.down().tiles();
  const int64_t ldh = inter_tiles * kTileRows;
  const int64_t gate_up_chunk = std::max<int64_t>(1, options_.gate_up_chunk);
  const int64_t down_chunk = std::max<int64_t>(1, options_.down_chunk);

  // Group routes by expert (counting sort), merging a row's duplicate ids into one route.
  counts_.assign(num_experts, 0);
  const auto is_repeat = [&](int64_t r, int64_t k) {
    const int32_t* ids = b.expert_ids + r * b.top_k;
    for (int64_t j = 0; j < k; ++j)
      if (ids[j] == ids[k]) return true;
    return false;
  };
  int64_t routes = 0;
  for (int64_t r = 0; r < b.rows; ++r) {
    for (int64_t k = 0; k < b.top_k; ++k) {
      if (!is_repeat(r, k)) {
        ++counts_[b.expert_ids[r * b.top_k + k]];
        ++routes;
      }
    }
  }
  first_route_.resize(num_experts + 1);
  plans_.clear();
  size_t x_bytes = 0, h_bytes = 0;
  int64_t max_rows = 0;
  for (int64_t e = 0, pos = 0; e < num_experts; ++e) {
    first_route_[e] = pos;
    if (counts_[e] == 0) continue;
    Plan p;
    p.expert = e;
    p.rows = counts_[e];
    p.first_route = pos;
    p.ops = &OpsFor(p.rows, layer.bf16_exact());
    p.prefill = (isa_ == Isa::kAvx512 || isa_ == Isa::kAmx) && p.ops != &Int8Ops();
    p.x_acts = x_bytes;
    p.h_acts = h_bytes;
    x_bytes += Align64(p.ops->act_bytes(p.rows, hidden_p));
    h_bytes += Align64(p.ops->act_bytes(p.rows, inter_p));
    max_rows = std::max(max_rows, p.rows);
    plans_.push_back(p);
    pos += counts_[e];
  }
  route_row_.resize(routes);
  route_weight_.resize(routes);
  x_rows_.resize(routes);
  h_rows_.resize(routes);
  std::fill(counts_.begin(), counts_.end(), 0);  // now: routes placed so far per expert
  for (int64_t r = 0; r < b.rows; ++r) {
    for (int64_t k = 0; k < b.top_k; ++k) {
      const int32_t e = b.expert_ids[r * b.top_k + k];
      const float w = b.expert_weights[r * b.top_k + k];
      if (is_repeat(r, k)) {  // this row's route to e is the last one placed for e
        route_weight_[first_route_[e] + counts_[e] - 1] += w;
        continue;
      }
      const int64_t q = first_route_[e] + counts_[e]++;
      route_row_[q] = r;
      route_weight_[q] = w;
      x_rows_[q] = b.x + r * hidden;
    }
  }

  uint8_t* h = h_->Reserve(static_cast<size_t>(routes * ldh) * sizeof(float));
  for (int64_t q = 0; q < routes; ++q) h_rows_[q] = reinterpret_cast<const float*>(h) + q * ldh;
  uint8_t* x_acts = x_acts_->Reserve(x_bytes);
  uint8_t* h_acts = h_acts_->Reserve(h_bytes);
  size_t kernel_scratch = 0;
  for (const Plan& p : plans_) {
    kernel_scratch = std::max({kernel_scratch, p.ops->scratch_bytes(hidden_p), p.ops->scratch_bytes(inter_p)});
  }
  const size_t out_scratch =
      static_cast<size_t>(max_rows * std::max(2 * gate_up_chunk, down_chunk) * kTileRows) * sizeof(float);
  for (ThreadScratch& s : thread_scratch_) {
    s.kernel.Reserve(kernel_scratch);
    s.out.Reserve(out_scratch);
    s.ahead.reserve(plans_.size());
  }
  units_.clear();
  for (size_t i = 0; i < plans_.size(); ++i) {
    for (int64_t t = 0; t < inter_tiles; t += gate_up_chunk) {
      units_.push_back(Unit{static_cast<int32_t>(i), static_cast<int32_t>(t),
                            static_cast<int32_t>(std::min(inter_tiles, t + gate_up_chunk))});
    }
  }
  const int64_t down_units = experts::CeilDiv(hidden_tiles, down_chunk);
  // Prefill steps (some expert on a prefill kernel): its activations are prepared first, one plan per work
  // item, by all threads (otherwise the first thread to reach an expert prepares them while the others wait
  // for it), and each thread claims its next item before running the current one, so that every kernel call
  // knows the next call's tiles and prefetches their first run (TileArgs::next_tiles).
  prep_plans_.clear();
  bool prefill_step = false;
  for (size_t i = 0; i < plans_.size(); ++i) {
    if (!plans_[i].prefill) continue;
    prefill_step = true;
    if (options_.prefill_prepare > 0) prep_plans_.push_back(static_cast<int32_t>(i));
  }
  const bool next_prefetch = prefill_step && options_.prefill_next_prefetch > 0;
  const int64_t prep_items = static_cast<int64_t>(prep_plans_.size());
  for (auto& n : next_) n.store(0, std::memory_order_relaxed);
  const float limit = swiglu_limit;

  // Per-plan progress instead of barriers: a thread only ever waits for the expert it needs next, so a
  // descheduled thread (this machine is shared) delays one expert, not the whole step.
  if (plan_sync_capacity_ < plans_.size()) {
    plan_sync_ = std::make_unique<PlanSync[]>(plans_.size());
    plan_sync_capacity_ = plans_.size();
  }
  for (size_t i = 0; i < plans_.size(); ++i) {
    plan_sync_[i].x_state.store(0, std::memory_order_relaxed);
    plan_sync_[i].h_ready.store(0, std::memory_order_relaxed);
    plan_sync_[i].units_left.store(0, std::memory_order_relaxed);
  }
  for (const Unit& u : units_) plan_sync_[u.plan].units_left.fetch_add(1, std::memory_order_relaxed);
  const auto wait_for = [](const std::atomic<int>& flag, int value) {
    for (int spins = 0; flag.load(std::memory_order_acquire) != value; ++spins) {
      if (spins < 4096) {
        __builtin_ia32_pause();
      } else {
        std::this_thread::yield();
      }
    }
  };

  int64_t work_bytes = 0;
  for (const Plan& p : plans_) work_bytes += layer.expert_stream_bytes() * experts::CeilDiv(p.rows, 16);
  const int64_t gate_up_units = static_cast<int64_t>(units_.size());
  const bool read_ahead = options_.read_ahead > 0;
  const auto body = [&](int thread) {
    ThreadScratch& scratch = thread_scratch_[thread];
    // Work items in claim order: gate/up units (phase 0), then down units (phase 1); phase -1: none left.
    // With read_ahead the next item is claimed before the current one runs, and the current one's kernel
    // calls read the next one's bytes (TileArgs::read_ahead), so that it computes from L2.
    struct Item {
      int phase = -1;
      int64_t index = 0;
    };
    bool prep_left = prep_items > 0, gate_up_left = true;
    const auto claim = [&]() -> Item {
      if (prep_left) {
        const int64_t u = next_[2].fetch_add(1, std::memory_order_relaxed);
        if (u < prep_items) return {2, u};
        prep_left = false;
      }
      if (gate_up_left) {
        const int64_t u = next_[0].fetch_add(1, std::memory_order_relaxed);
        if (u < gate_up_units) return {0, u};
        gate_up_left = false;
      }
      const int64_t u = next_[1].fetch_add(1, std::memory_order_relaxed);
      if (u < down_units) return {1, u};
      return {};
    };
    // The bytes an item's kernel calls read, in order, into scratch.ahead.
    const auto set_ahead = [&](const Item& item) {
      scratch.ahead.clear();
      if (item.phase == 0) {
        const Unit& unit = units_[item.index];
        const uint8_t* t = layer.expert_data(plans_[unit.plan].expert) + shape.gate_tile_offset(unit.tile_begin);
        scratch.ahead.push_back({t, t + 2 * (unit.tile_end - unit.tile_begin) * shape.gate_up().tile_bytes()});
      } else if (item.phase == 1) {
        const int64_t t0 = item.index * down_chunk, t1 = std::min(hidden_tiles, t0 + down_chunk);
        for (const Plan& p : plans_) {
          const uint8_t* t = layer.expert_data(p.expert) + shape.down_tile_offset(t0);
          scratch.ahead.push_back({t, t + (t1 - t0) * shape.down().tile_bytes()});
        }
      }
      scratch.read_ahead = {nullptr, nullptr, scratch.ahead.data(), scratch.ahead.data() + scratch.ahead.size(),
                            static_cast<int>(options_.read_ahead)};
    };
    // The tiles of an item's first kernel call (prefill steps: the calls before it prefetch their first run).
    const auto first_tiles = [&](const Item& item) -> experts::ByteRange {
      if (item.phase == 0) {
        const Unit& unit = units_[item.index];
        const uint8_t* t = layer.expert_data(plans_[unit.plan].expert) + shape.gate_tile_offset(unit.tile_begin);
        return {t, t + 2 * (unit.tile_end - unit.tile_begin) * shape.gate_up().tile_bytes()};
      }
      if (item.phase == 1 && !plans_.empty()) {
        const int64_t t0 = item.index * down_chunk, t1 = std::min(hidden_tiles, t0 + down_chunk);
        const uint8_t* t = layer.expert_data(plans_[0].expert) + shape.down_tile_offset(t0);
        return {t, t + (t1 - t0) * shape.down().tile_bytes()};
      }
      return {};
    };
    experts::ByteRange next_item_tiles;  // first_tiles of the item claimed after the current one
    bool current_read_ahead = false;  // the current item's bytes were read ahead
    const auto set_args = [&](experts::TileArgs& args) {
      args.scratch = scratch.kernel.data();
      args.prefetch_bytes = options_.prefetch_bytes;
      args.max_streams = options_.max_streams;
      args.prefetch_page_lines = options_.prefetch_page_lines;
      args.read_ahead = read_ahead ? &scratch.read_ahead : nullptr;
      args.tiles_read_ahead = current_read_ahead;
      args.prefetch_l1 = options_.prefetch_l1 > 0;
      args.even_runs = options_.prefill_even_runs > 0;
      args.wide_passes = options_.wide_passes > 0;
    };
    // 1. Gate and up, tile pair by tile pair, then SwiGLU into h. The first thread to reach an expert
    //    prepares its activations (the others wait for that); the last one to finish an expert's units
    //    prepares its h activations for the down projection.
    const auto prepare_x = [&](int64_t plan, bool wait) {
      const Plan& p = plans_[plan];
      PlanSync& sync = plan_sync_[plan];
      int expected = 0;
      if (sync.x_state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
        p.ops->prepare_acts(&x_rows_[p.first_route], p.rows, hidden, hidden_p, x_acts + p.x_acts);
        sync.x_state.store(2, std::memory_order_release);
      } else if (wait) {
        wait_for(sync.x_state, 2);
      }
    };
    const auto gate_up = [&](int64_t u) {
      const Unit& unit = units_[u];
      const Plan& p = plans_[unit.plan];
      PlanSync& sync = plan_sync_[unit.plan];
      prepare_x(unit.plan, true);
      const int64_t pairs = unit.tile_end - unit.tile_begin;
      float* y = reinterpret_cast<float*>(scratch.out.data());
      experts::TileArgs args;
      args.tiles = layer.expert_data(p.expert) + shape.gate_tile_offset(unit.tile_begin);
      args.num_tiles = 2 * pairs;
      args.tile_stride = shape.gate_up().tile_bytes();
      args.supers = hidden_p / kSuperCols;
      args.acts = x_acts + p.x_acts;
      args.m = p.rows;
      args.out = y;
      args.ldo = 2 * pairs * kTileRows;
      set_args(args);
      args.next_tiles = next_item_tiles.begin;
      args.next_tiles_end = next_item_tiles.end;
      p.ops->tiles(args);
      for (int64_t i = 0; i < p.rows; ++i) {
        float* hrow = reinterpret_cast<float*>(h) + (p.first_route + i) * ldh + unit.tile_begin * kTileRows;
        const float* yi = y + i * args.ldo;
        for (int64_t q = 0; q < pairs; ++q) {
          for (int64_t j = 0; j < kTileRows; ++j) {
            float g = yi[32 * q + j], v = yi[32 * q + 16 + j];
            if (limit > 0.0f) {
              g = std::min(g, limit);
              v = std::clamp(v, -limit, limit);
            }
            hrow[16 * q + j] = Silu(g) * v;
          }
        }
      }
      if (sync.units_left.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        p.ops->prepare_acts(&h_rows_[p.first_route], p.rows, inter, inter_p, h_acts + p.h_acts);
        sync.h_ready.store(1, std::memory_order_release);
      }
    };
    // 2. Down: each unit owns output columns [16 t0, 16 t1) of every row and adds all experts into them,
    //    in expert order (the order gate/up finishes in).
    const auto down = [&](int64_t u) {
      const int64_t t0 = u * down_chunk, t1 = std::min(hidden_tiles, t0 + down_chunk);
      const int64_t c0 = t0 * kTileRows, c1 = std::min(hidden, t1 * kTileRows);
      for (int64_t r = 0; r < b.rows; ++r) std::memset(b.out + r * hidden + c0, 0, sizeof(float) * (c1 - c0));
      float* y = reinterpret_cast<float*>(scratch.out.data());
      for (size_t pi = 0; pi < plans_.size(); ++pi) {
        const Plan& p = plans_[pi];
        wait_for(plan_sync_[pi].h_ready, 1);
        experts::TileArgs args;
        args.tiles = layer.expert_data(p.expert) + shape.down_tile_offset(t0);
        args.num_tiles = t1 - t0;
        args.tile_stride = shape.down().tile_bytes();
        args.supers = inter_p / kSuperCols;
        args.acts = h_acts + p.h_acts;
        args.m = p.rows;
        args.out = y;
        args.ldo = (t1 - t0) * kTileRows;
        set_args(args);
        if (!next_prefetch) {
          // no hint: the call's first run is read cold
        } else if (pi + 1 < plans_.size()) {
          args.next_tiles = layer.expert_data(plans_[pi + 1].expert) + shape.down_tile_offset(t0);
          args.next_tiles_end = args.next_tiles + (t1 - t0) * shape.down().tile_bytes();
        } else {
          args.next_tiles = next_item_tiles.begin;
          args.next_tiles_end = next_item_tiles.end;
        }
        p.ops->tiles(args);
        for (int64_t i = 0; i < p.rows; ++i) {
          const int64_t q = p.first_route + i;
          const float w = route_weight_[q];
          float* o = b.out + route_row_[q] * hidden + c0;
          const float* yi = y + i * args.ldo;
          AddScaled(o, yi, w, c1 - c0);
        }
      }
    };
    const bool claim_ahead = read_ahead || next_prefetch;
    for (Item item = claim(); item.phase >= 0;) {
      Item next_item;
      if (claim_ahead) {
        next_item = claim();
        if (read_ahead) set_ahead(next_item);
        if (next_prefetch) next_item_tiles = first_tiles(next_item);
      }
      if (item.phase == 2) {
        prepare_x(prep_plans_[item.index], false);
      } else if (item.phase == 0) {
        gate_up(item.index);
      } else {
        down(item.index);
      }
      // Only a next item read to its end skips the kernels' prefetch (read-ahead is one line per line
      // computed, so a smaller current item, or one on a kernel that does not read ahead, leaves some).
      const experts::ReadAhead& ra = scratch.read_ahead;
      current_read_ahead = read_ahead && next_item.phase >= 0 && ra.next == ra.last && ra.p >= ra.end;
      item = claim_ahead ? next_item : claim();
    }
  };
  // Pooled runs time their threads' first start and last finish, for handoff_seconds().
  const auto timed_body = [&](int thread) {
    int64_t unset = 0;
    first_enter_ns_.compare_exchange_strong(unset, SteadyNanos(), std::memory_order_relaxed);
    body(thread);
    const int64_t now = SteadyNanos();
    for (int64_t last = last_exit_ns_.load(std::memory_order_relaxed);
         now > last && !last_exit_ns_.compare_exchange_weak(last, now, std::memory_order_relaxed);) {
    }
  };
  if (work_bytes < options_.inline_max_bytes) {
    ++inline_runs_;
    body(0);
  } else {
    ++pooled_runs_;
    first_enter_ns_.store(0, std::memory_order_relaxed);
    last_exit_ns_.store(0, std::memory_order_relaxed);
    const int64_t start = SteadyNanos();
    pool_->RunOnAvailable(timed_body);
    const int64_t end = SteadyNanos();  // RunOnAvailable's return orders the threads' stores before these loads
    handoff_seconds_ += 1e-9 * static_cast<double>((first_enter_ns_.load(std::memory_order_relaxed) - start) +
                                                   (end - last_exit_ns_.load(std::memory_order_relaxed)));
  }
  return absl::OkStatus();
}

}  // namespace numoe
