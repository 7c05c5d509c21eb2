// The routed-expert FFN of one MoE layer for one step, on the CPU.
//
//   out[r] = sum_k expert_weights[r,k] * down_e( silu(min(gate_e(x_r), L)) * clamp(up_e(x_r), -L, L) ),
//   e = expert_ids[r,k], L = swiglu_limit (0 = no clamp).
// Duplicate ids in a row each count (their weights are summed and the expert is computed once for that
// row). Every expert used by the batch is streamed from memory exactly once per Run, for all rows routed
// to it, in address order, by the pool's threads together (ThreadPool::RunOnAvailable: the caller takes
// part when the pool lets it, and a worker that is slow to wake is not waited for) or, for tiny steps, by
// the calling thread alone. Threads synchronise per expert (no barriers); the result is the same bit for
// bit whichever threads compute it (each output column is summed in expert order).
//
// Accuracy by ISA (against exact weights and fp32 math; details in worker/kernels/*), per GEMV output,
// applied to x (gate/up) and then to the SwiGLU output h (down):
//   generic: fp32 rounding only (~1e-7 relative): the reference.
//   avx2, avx512: activations quantised per 32 columns, |err| <= sum_b max|a_b| / D * sum_{c in b} |W_c|
//     with D = 32512 (ActivationPrecision::kHigh, two int8 levels, ~1e-4 relative on the output) or
//     D = 254 (kLow, one int8 level, ~1% relative).
//   amx: bf16 activations (two terms: |err| <= 2^-17 sum |W||a|; one term: 2^-9) for experts with
//     >= amx_min_rows rows, the avx512 kernel of the same precision for the others.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "common/thread_pool.h"
#include "worker/experts/expert_layer.h"
#include "worker/experts/isa.h"

namespace numoe {
namespace experts {
struct KernelOps;
}

struct MoeBatch {
  int64_t rows = 0;                        // N >= 0
  int64_t top_k = 0;                       // routes per row
  const float* x = nullptr;                // [rows, hidden]
  const int32_t* expert_ids = nullptr;     // [rows, top_k], each in [0, num_experts)
  const float* expert_weights = nullptr;   // [rows, top_k]
  float* out = nullptr;                    // [rows, hidden], overwritten (must not alias x)
};

struct MoeComputeOptions {
  ActivationPrecision precision = ActivationPrecision::kHigh;
  // Under Isa::kAmx, experts with fewer routed rows than this run on the AVX-512 int8 kernel: decoding a
  // weight tile to bf16 only pays off when enough rows share it. Measured on an Emerald Rapids core (one
  // thread, weights in cache, GFLOP/s AVX-512 vs AMX): 4 rows 192 vs 114, 16 rows 199 vs 394,
  // 64 rows 213 vs 417.
  int64_t amx_min_rows = 16;
  // Experts with at least this many routed rows run the AVX-512 int8 kernel's prefill path (weight tiles
  // decoded once per call into a cache-resident buffer, register-blocked over 4 rows x 2-3 tiles; same
  // results bit for bit), fewer rows the streaming kernel. 0 = never. Measured with numoe-bench experts
  // --compare-prefill-min-rows on the 2-vCPU Emerald Rapids VM (V4-Flash experts, 2 threads, 3 runs
  // interleaved, median ratios to the read yardstick): T=128 (~3 rows per expert) streaming 0.489, prefill
  // from 4 rows 0.444, from 1 row 0.381: with few rows the decoded buffer's store and reload cost more than
  // the decode it saves, and the streaming kernel overlaps DRAM better. T=512 (~12 rows): streaming 0.172,
  // from 1 row 0.197, from 16 rows 0.190, from 8 rows 0.177 (within that run's noise of each other).
  int64_t int8_prefill_min_rows = 8;
  // Tests only: run Isa::kAmx with the tile instructions emulated in scalar code (needs AVX-512 BF16 and
  // VBMI, not AMX).
  bool emulate_amx = false;
  // Tests and benchmarks only: the AVX-512 int8 kernel without its VBMI nibble decode on a CPU that has
  // VBMI (the results are the same bit for bit; the decode costs more uops).
  bool avx512_without_vbmi = false;
  // Steps whose weight work is below this many bytes run on the calling thread alone, without waking
  // the pool (work = each used expert's streamed bytes times ceil(rows / 16)); 0 = always use the pool.
  // Such a step is ~10 us or less on one core (weights in cache), while a hand-off costs 1-2 us to a
  // spinning worker and tens to hundreds to a sleeping or descheduled one (shared 2-core AVX-512 VM,
  // 1-row steps: tiny-v4 shapes 2.9 us inline vs p90 235 us through a sleeping 1-thread pool; demo-v4
  // shapes, 209 KB, 8.5 us either way at the median but a heavier tail through the pool). numoe-bench
  // experts prints the pool's hand-off on an empty job (2 pinned threads on the 2-vCPU VM, medians): all
  // threads started 1.7-2.2 us after submit and the call back 3.4-4.3 us when they are spinning, 37-52 /
  // 39-55 us after 2 ms idle (asleep); a V4-Flash decode step's own hand-off (handoff_seconds) is 8-9 us of
  // a 4.3 ms step at T=1 (0.2%) and 20-24 us of 16.6 ms at T=4: not where the missing bandwidth goes.
  int64_t inline_max_bytes = 256 << 10;
  // Software prefetch of the int8 (AVX2/AVX-512) kernels (into L1 or L2: prefetch_l1): bytes ahead of the
  // super-block being read (0 = none). Measured with numoe-bench experts on the Emerald Rapids host (V4-Flash experts, T=1, random
  // top-6, ratio of kernel GB/s to the read yardstick, medians of 3 runs interleaved in one process), with
  // the earlier kernel (one tile at a time, 16.7 GB/s per thread in L2), every line prefetched:
  //   threads            2      8      16
  //   2 KiB, into L1   0.73     -    0.71   (the old setting, 17 prefetches at each super-block's start)
  //   4 KiB, into L1   0.69   0.82   0.90   (these three rows: down units of 4 tiles)
  //   4 KiB, into L2   0.73   0.82   0.91
  //   8 KiB, into L2   0.71   0.94   0.90
  // and none at all 0.55 at 2 threads (the rows of a column compare settings within one process). On the
  // 2-vCPU Emerald Rapids VM (numoe-bench experts --compare-*, 5 runs interleaved, medians of ratios), the
  // kernel of four tiles at once (27.5 GB/s per thread in L2), T=1, 2 threads: every line 4 KiB ahead
  // 0.68-0.71, 2 KiB 0.67, 8 KiB 0.66, 1 KiB 0.78, none 0.78-0.79, only the first line of each 4 KiB page
  // 4 KiB ahead (prefetch_page_lines = 1) 0.79, its first 4 lines 0.75; another run, T=1 / T=4: page-start
  // 0.79 / 0.77, none 0.79 / 0.76, every line 4 KiB ahead 0.76 / 0.69. The likely reason: a prefetch to L2
  // holds one of the core's 16 L1 fill buffers until DRAM answers, so one per line caps the core near 16
  // lines in flight and stalls its loads; the L2 streamer holds none but stops at each 4 KiB page, so one
  // line per page, ahead, restarts it there without the cap.
  // Note that "none" (prefetch_bytes 0) and page-start mode still prefetch each line itself just before
  // its load (TilePassGroup). Measured this session on the VM (T=1, 2 threads, 7 runs interleaved, medians
  // of ratios), variants not kept: no prefetch instruction at all 0.686 against 0.798 for that own-line
  // prefetch (and 23.6 against 30.1 GB/s per thread in L2, separate processes); the own-line prefetch
  // moved 128 / 256 / 512 / 1024 bytes ahead 0.762 / 0.782 / 0.787 / 0.772 against 0.795; the page-start
  // line 8 KiB ahead 0.782 against 0.809, its first 2 lines 0.815; the first 4 or 16 lines of each stream
  // of a thread's next kernel call prefetched before the current call (next unit claimed one ahead) 0.793 /
  // 0.806 against 0.809, and 0.685 against 0.686 in a second run. T=4: every prefetch off but the own line
  // 0.804 against 0.790, at most 2 tiles at once 0.752.
  // Kept since: every line prefetched 2 KiB ahead INTO L1 (prefetch_l1 = 1, prefetch_page_lines = 0).
  // Measured on the VM with numoe-bench experts --compare-set (2 threads, medians of ratios, the variants
  // run between the same read passes; "old" = prefetcht1 of the page-start line 4 KiB ahead plus the
  // own-line prefetch, the setting before):
  //   T=1, 5 runs: L1 2 KiB 0.865, 1 KiB 0.856, 4 KiB 0.802, old 0.767 (read 25.2 GB/s)
  //   T=1, 5 runs: L1 2 KiB 0.769, old 0.722 (another run, read 22 GB/s)
  //   T=1, 7 runs: L1 2 KiB 0.717, 1 KiB 0.767, 3 KiB 0.763, old 0.693 (a disturbed run, read 11.5 GB/s)
  //   T=4, 5 runs: L1 2 KiB 0.818, old 0.719; again: L1 2 KiB 0.760, 1 KiB 0.785, 4 KiB 0.733, old 0.761
  //   T=4, 7 runs: L1 2 KiB 0.783, 1 KiB 0.785, 3 KiB 0.731, old 0.702 (disturbed, read 12.4 GB/s)
  // The likely reason: a line prefetched into L2 takes an L1 fill buffer twice (once until DRAM answers,
  // once more when the load brings it from L2), into L1 once; the core's 16 fill buffers are what caps
  // the lines in flight. (perf stat on this VM counts no hardware events, so this is inferred from the
  // rates, not counted.)
  int64_t prefetch_bytes = 2048;
  // Tiles the int8 kernels read at once, each its own sequential stream (0: as many as the registers hold
  // for the expert's row count: 4 for 1 row on AVX-512; 1 = one tile after the other). Four tiles give
  // the core four times the independent accumulator chains: 1 row in L2 (numoe-bench experts --in-cache,
  // the 2-vCPU VM), 16.7 GB/s per thread one tile at a time, 27.5 with four and the VBMI decode. From
  // DRAM it made no difference there (--compare-streams 1: 0.684 against 0.677, T=1, 2 threads).
  int64_t max_streams = 0;
  // > 0: the software prefetch touches only the first this many lines of each 4 KiB page, prefetch_bytes
  // ahead (the L2 streamer, which stops at page boundaries, fetches the rest); 0: every line.
  int64_t prefetch_page_lines = 0;
  // Work units: gate/up tile pairs per unit (one expert, contiguous), down tiles per unit (of every used
  // expert). Down units of 8 tiles (32 per step for V4-Flash) leave threads idle at the end of a step when
  // there are many threads: 16 threads 0.87 with 8, 0.91 with 4; 8 threads 0.73 -> 0.82; 2 threads 0.67 ->
  // 0.73. Gate/up units of 2 pairs instead of 4: 0.75 / 0.79 at 2 / 16 threads against 0.75 / 0.88.
  // With the four-tile kernel on the 2-vCPU VM (numoe-bench experts --compare-gate-up-chunk / -down-chunk,
  // interleaved runs, medians of ratios, 2 threads; the main setting and a variant of the same setting
  // differ by up to 0.015 there): T=1, 15 runs, gate/up units of 4 / 8 pairs 0.796 (again, as a variant:
  // 0.811) / 0.802; shorter runs of 5-7 had given 8 pairs 0.886 / 0.830 / 0.813 against 0.845 / 0.802 /
  // 0.813, 16 pairs 0.801, 2 pairs 0.838 (against 0.845); down units of 2 / 8 tiles 0.825 / 0.852
  // against 0.845, and 0.808 against 0.813. No size measurably better than 4 at 2 threads, and 4 is the
  // best measured at 16: kept.
  int64_t gate_up_chunk = 4;
  int64_t down_chunk = 4;
  // > 0: each thread claims its next work unit before computing the current one, and the int8 streaming
  // kernel reads the next unit's bytes while it computes (one line per 64 bytes of tiles it reads,
  // TileArgs::read_ahead), so that the next unit computes from L2 with the DRAM stream in the background
  // as one sequential read; 1 with plain loads, 2 with prefetcht0, 3 with prefetcht1. 0: off (the default).
  // Measured on the VM (T=1, 2 threads, 5 runs, medians of ratios, the old L2 prefetch otherwise): plain
  // loads 0.573 (they hold retirement until DRAM answers), prefetcht0 0.756, prefetcht1 0.804, against
  // 0.736 without; again 0.754 against 0.722; with the L1 prefetch (kept above) 0.857 against 0.865 at
  // T=1 and 0.689 against 0.760 at T=4 (where a down unit's next unit, 24 experts x 4 tiles, is 1.7 MB
  // of the 2 MB L2): not kept.
  int64_t read_ahead = 0;
  // 1: the int8 kernels' software prefetch (prefetch_bytes, prefetch_page_lines) goes into L1 (prefetcht0)
  // instead of L2 (prefetcht1), so that a line prefetched ahead is not fetched once more from L2.
  int64_t prefetch_l1 = 1;
  // Prefill steps (some expert on a prefill kernel: the int8 prefill path or AMX), each 0|1 (the README's
  // Performance section, CPU prefill kernels, has the measurements):
  //   prefill_prepare: the experts' activations are prepared first, one expert per work item, by all
  //     threads (0: by the first thread to reach an expert, while the others that reach it wait).
  //   prefill_next_prefetch: each thread claims its next work item before running the current one, and
  //     each kernel call prefetches the next call's first run of tiles (TileArgs::next_tiles), so that no
  //     call starts from DRAM (0: the first run of every call is read cold).
  //   prefill_even_runs: the int8 prefill path splits a call's tiles into runs as even as possible
  //     (TileArgs::even_runs).
  int64_t prefill_prepare = 1;
  int64_t prefill_next_prefetch = 1;
  int64_t prefill_even_runs = 1;
  // 1: where a vector register holds half of a 16-row tile (AVX2), the int8 streaming kernel computes both
  // halves in one pass over the tile, each 64-byte line loaded once while it arrives and each activation
  // broadcast feeding both halves (TileArgs::wide_passes; the results are the same bit for bit). 0: one pass
  // per half, the second reading the whole tile again from L2.
  int64_t wide_passes = 1;
};

class MoeCompute {
 public:
  // `pool` (not owned) must outlive this object; its threads (ThreadPool::RunOnAvailable) do the work of
  // all but the smallest steps (see inline_max_bytes), which run on the calling thread.
  MoeCompute(ThreadPool* pool, Isa isa, const MoeComputeOptions& options = {});
  ~MoeCompute();
  MoeCompute(const MoeCompute&) = delete;
  MoeCompute& operator=(const MoeCompute&) = delete;

  // Errors (nothing computed, `out` untouched): ISA not available, negative sizes, null pointers, an
  // expert id out of range (named by row and slot), a negative or NaN swiglu_limit. Not thread-safe: one
  // Run at a time per MoeCompute (it owns the step's scratch).
  Status Run(const ExpertLayer& layer, float swiglu_limit, const MoeBatch& batch);

  Isa isa() const { return isa_; }
  // Runs so far that ran on the calling thread alone / were handed to the pool. For tests and diagnostics.
  int64_t inline_runs() const { return inline_runs_; }
  int64_t pooled_runs() const { return pooled_runs_; }
  // Seconds that pooled Runs spent outside their threads' work (from entering Run to the first thread
  // starting, and from the last thread finishing to returning), summed: the pool's hand-off cost.
  double handoff_seconds() const { return handoff_seconds_; }
  // The kernel that runs an expert with `rows` routed rows of a layer whose weights are (not) exact in bf16
  // (ExpertLayer::bf16_exact).
  const experts::KernelOps& OpsFor(int64_t rows, bool bf16_exact) const;
  // The AVX-512 int8 kernel: with the VBMI decode where the CPU has it.
  const experts::KernelOps& Int8Ops() const;
  // The AVX-512 int8 kernel for an expert of `rows` rows: the prefill path from int8_prefill_min_rows on.
  const experts::KernelOps& Int8OpsFor(int64_t rows) const;

 private:
  class Buffer;
  struct Plan;
  struct Unit;
  struct alignas(kCacheLine) PlanSync;
  struct alignas(kCacheLine) ThreadScratch;

  ThreadPool* pool_;
  Isa isa_;
  MoeComputeOptions options_;
  Status usable_;
  bool vbmi_ = false;
  // Scratch reused across Runs (grown, never shrunk): no allocation once warmed up.
  std::vector<int64_t> counts_, first_route_;
  std::vector<int64_t> route_row_;
  std::vector<float> route_weight_;
  std::vector<Plan> plans_;
  std::vector<Unit> units_;
  std::vector<int32_t> prep_plans_;  // plans whose activations a prefill step prepares up front (Run)
  std::vector<const float*> x_rows_, h_rows_;
  std::unique_ptr<Buffer> h_, x_acts_, h_acts_;
  std::vector<ThreadScratch> thread_scratch_;
  std::unique_ptr<PlanSync[]> plan_sync_;
  size_t plan_sync_capacity_ = 0;
  int64_t inline_runs_ = 0, pooled_runs_ = 0;
  double handoff_seconds_ = 0;
  alignas(kCacheLine) std::atomic<int64_t> next_[3];  // work claimed: gate/up units, down units, preparations
  alignas(kCacheLine) std::atomic<int64_t> first_enter_ns_{0}, last_exit_ns_{0};
};

}  // namespace numoe
