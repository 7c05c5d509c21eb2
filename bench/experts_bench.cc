// numoe-bench experts: routed-expert kernel bandwidth against the machine's streaming-read bandwidth.
//
// First the yardstick's read loops are timed on all packed expert weights (read_bandwidth.h) and the fastest
// is kept. Then each run measures, on the same pinned threads and the same memory: (1) a streaming read
// over all packed expert weights with that loop (read_gbps), (2) MoE steps of T tokens with random top-k
// routing per token and layer, cycling through the layers (kernel_gbps = unique expert bytes streamed per
// second of MoeCompute::Run), then (3) the read again. read_gbps of a run averages its two read passes.
// Reported: medians over runs. A ratio above --max-ratio (1.05) exits 1: no kernel can stream faster than
// the fastest read, so such a ratio means the yardstick is wrong, not that the kernel is fast.
// The last line is one JSON object:
//   {"isa","tokens","threads","kernel_gbps","read_gbps","ratio","tflops","read_method"}, and with --peak also
//   "peak_tflops" (the multiply instruction's register-resident peak on the same threads), "tflops_ratio"
//   (tflops / peak_tflops: how near a prefill-sized call comes to the compute it could do) and "issued_ratio"
//   (tflops_ratio x the multiply instructions issued per multiply-add of the FFN: 2 with --precision high,
//   whose two activation levels (int8 or bf16) each take an instruction, 1 with low: the share of the peak
//   that the kernel's instructions use). "precision" names the activation precision; "read_bound_tflops" is
//   what the steps would reach if they streamed their weights at read_gbps (tflops / ratio): no kernel can
//   pass it. "step_ms" is the median step, "step_handoff_us" the part of it outside the threads' work
//   (MoeCompute::handoff_seconds), "empty_job_{started,finished}_us" the pool's hand-off on an empty job (submit
//   to the last thread starting / to the call returning, workers spinning) and "idle_job_*" the same after
//   2 ms without work (workers asleep).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/commands.h"
#include "bench/read_bandwidth.h"
#include "common/args.h"
#include "common/log.h"
#include "common/numa.h"
#include "common/thread_pool.h"
#include "common/topology.h"
#include "deploy/placement.h"
#include "worker/experts/expert_layer.h"
#include "worker/experts/isa.h"
#include "worker/experts/kernel_ops.h"
#include "worker/experts/moe_compute.h"

namespace numoe::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Preset {
  const char* name;
  int64_t hidden, inter, experts, top_k;
};

constexpr Preset kPresets[] = {
    {"v4-flash", 4096, 2048, 256, 6},  // DeepSeek-V4-Flash routed experts
    {"small", 512, 256, 32, 6},        // smoke tests
};

// GB/s of packed weights that `ops` consumes for `rows` activation rows when the weights are already in L2:
// the calling thread runs the first 8 gate/up tile pairs of `expert` (a private copy, ~560 KB for V4-Flash)
// for about `seconds`. What a thread could stream if memory cost nothing.
double InCacheGbps(const experts::KernelOps& ops, const ExpertLayer& layer, int64_t expert, int64_t rows,
                   double seconds) {
  const experts::PackedExpertShape& shape = layer.shape();
  const int64_t tiles = std::min<int64_t>(16, 2 * shape.gate_up().tiles());
  const int64_t tile_bytes = shape.gate_up().tile_bytes(), kp = shape.gate_up().padded_cols();
  const auto aligned = [](size_t n) {
    return std::unique_ptr<uint8_t, decltype(&std::free)>(
        static_cast<uint8_t*>(std::aligned_alloc(64, (n + 63) & ~size_t{63})), &std::free);
  };
  auto weights = aligned(tiles * tile_bytes), acts = aligned(ops.act_bytes(rows, kp));
  auto scratch = aligned(ops.scratch_bytes(kp) + 64);
  std::memcpy(weights.get(), layer.expert_data(expert) + shape.gate_tile_offset(0), tiles * tile_bytes);
  std::vector<float> x(rows * layer.hidden()), out(rows * tiles * experts::kTileRows);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.1f * static_cast<float>(i));
  std::vector<const float*> row_ptrs(rows);
  for (int64_t r = 0; r < rows; ++r) row_ptrs[r] = x.data() + r * layer.hidden();
  ops.prepare_acts(row_ptrs.data(), rows, layer.hidden(), kp, acts.get());
  experts::TileArgs args;
  args.tiles = weights.get();
  args.num_tiles = tiles;
  args.tile_stride = tile_bytes;
  args.supers = kp / experts::kSuperCols;
  args.acts = acts.get();
  args.m = rows;
  args.out = out.data();
  args.ldo = tiles * experts::kTileRows;
  args.scratch = scratch.get();
  ops.tiles(args);  // warm
  int64_t calls = 0;
  const auto t0 = Clock::now();
  double s = 0;
  while (s < seconds) {
    for (int i = 0; i < 16; ++i) ops.tiles(args);
    calls += 16;
    s = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  return static_cast<double>(calls * tiles * tile_bytes) / s / 1e9;
}

// Bytes of this process's memory on transparent or hugetlb 2 MB pages (0 when it cannot tell).
double HugePageBytes() {
  std::ifstream f("/proc/self/smaps_rollup");
  std::string key;
  double total = 0;
  for (double kb; f >> key;) {
    if (key == "AnonHugePages:" || key == "Shared_Hugetlb:" || key == "Private_Hugetlb:") {
      if (f >> kb) total += kb * 1024;
    }
  }
  return total;
}

// The pool's hand-off on an empty job: from submitting it to the last thread starting, and to the call
// returning, in microseconds (medians of `jobs`), either back to back (the workers still spinning) or after
// `idle_us` without work (longer than the pool's spin: they have gone to sleep).
struct Handoff {
  double started_us = 0, finished_us = 0;
};
Handoff EmptyJobHandoff(ThreadPool& pool, int jobs, int idle_us) {
  std::vector<double> started, finished;
  struct alignas(kCacheLine) Slot {
    Clock::time_point t;
  };
  std::vector<Slot> starts(pool.size());
  for (int j = 0; j < jobs; ++j) {
    if (idle_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(idle_us));
    const auto t0 = Clock::now();
    pool.RunOnAll([&](int t) { starts[t].t = Clock::now(); });
    const auto t1 = Clock::now();
    Clock::time_point last = t0;
    for (const Slot& s : starts) last = std::max(last, s.t);
    started.push_back(std::chrono::duration<double, std::micro>(last - t0).count());
    finished.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  return {Median(started), Median(finished)};
}

}  // namespace

int RunExpertsBench(int argc, char** argv) {
  ArgParser parser(argv[0],
                   "Routed-expert kernel GB/s against the machine's streaming-read GB/s (same threads, same run).");
  std::string preset_name = "v4-flash", isa_name, precision_name = "high";
  int64_t tokens = 1, threads = 0, layers = 0, runs = 5, seed = 1, amx_min_rows = -1, prefill_min_rows = -1;
  int64_t prefetch = -1, gate_up_chunk = 0, down_chunk = 0, huge_pages = 1, read_trials = 3, spin_us = -1, vbmi = 1,
          page_lines = -1, read_ahead = -1, prefetch_l1 = -1,
          in_cache_rows = 0;
  double seconds = 1.0, max_ratio = 1.05;
  bool json = false, peak = false, in_cache = false, compare_vbmi = false, compare_huge_pages = false;
  std::vector<int> compare_prefetch, compare_streams, compare_page_lines, compare_prefill_min_rows;
  std::vector<int> compare_gate_up_chunk, compare_down_chunk, compare_read_ahead;
  std::string compare_set;
  parser.AddString("preset", "NAME", "expert shapes: v4-flash (4096x2048, 256 experts, top-6) or small", &preset_name);
  parser.AddInt("tokens", "T", "tokens per step (each routed to top-k random experts per layer)", &tokens, 1, 1 << 20);
  parser.AddInt("threads", "N", "kernel threads, pinned to the first N CPUs of NUMA node 0 (default: all)", &threads,
                0, 4096);
  parser.AddInt("layers", "L", "layers of distinct weights (default: >= 20x the LLC and >= 2 GiB)", &layers, 0,
                1000);
  parser.AddInt("runs", "R", "runs; medians are reported", &runs, 1, 1000);
  parser.AddDouble("seconds", "S", "kernel time per run (at least 3 steps)", &seconds, 0.0, 3600.0);
  parser.AddString("isa", "ISA", "generic|avx2|avx512|amx (default: NUMOE_ISA or the best available)", &isa_name);
  parser.AddString("precision", "P", "activation precision of the fast kernels: high (default) or low", &precision_name);
  parser.AddInt("seed", "N", "routing and data seed", &seed);
  parser.AddInt("amx-min-rows", "N", "with --isa amx: experts with fewer rows use AVX-512 (default: MoeCompute's)",
                &amx_min_rows, -1, 1 << 20);
  parser.AddInt("prefill-min-rows", "N",
                "AVX-512 int8: experts with at least N rows use the prefill path, 0 = never (default: MoeCompute's)",
                &prefill_min_rows, -1, 1 << 20);
  parser.AddInt("prefetch", "BYTES", "int8 kernels' software prefetch distance, 0 = none (default: MoeCompute's)",
                &prefetch, -1, 1 << 20);
  parser.AddInt("gate-up-chunk", "N", "tile pairs per gate/up work unit (default: MoeCompute's)", &gate_up_chunk, 0,
                1 << 16);
  parser.AddInt("down-chunk", "N", "tiles per down work unit (default: MoeCompute's)", &down_chunk, 0, 1 << 16);
  parser.AddInt("huge-pages", "0|1", "pack the weights on 2 MB pages when the system allows (default 1)", &huge_pages,
                0, 1);
  parser.AddInt("page-lines", "N",
                "int8 kernels: prefetch only the first N lines of each 4 KiB page, 0 = every line (default: "
                "MoeCompute's)",
                &page_lines, -1, 64);
  parser.AddInt("read-ahead", "0-3",
                "int8 kernels: each thread reads its next work unit's bytes while computing the current one, "
                "which then computes from L2: 1 with plain loads, 2 prefetcht0, 3 prefetcht1, 0 = off (default: "
                "MoeCompute's)",
                &read_ahead, -1, 3);
  parser.AddInt("prefetch-l1", "0|1",
                "int8 kernels: software prefetch into L1 (prefetcht0) instead of L2 (default: MoeCompute's)",
                &prefetch_l1, -1, 1);
  parser.AddInt("vbmi", "0|1",
                "AVX-512 int8 kernel: decode nibbles with VBMI permutes where the CPU has them (default 1)", &vbmi, 0,
                1);
  parser.AddIntList("compare-prefetch", "LIST",
                    "also run the kernel with these prefetch distances (bytes), interleaved with the main setting in "
                    "every run, so that all see the same memory; each gets its own medians",
                    &compare_prefetch);
  parser.AddIntList("compare-streams", "LIST",
                    "also run the kernel with at most these many tiles read at once, interleaved the same way",
                    &compare_streams);
  parser.AddIntList("compare-page-lines", "LIST",
                    "also run the kernel prefetching only the first N lines of each 4 KiB page, for each N listed, "
                    "interleaved the same way",
                    &compare_page_lines);
  parser.AddIntList("compare-prefill-min-rows", "LIST",
                    "also run the kernel with the AVX-512 prefill path from these many rows per expert on (0 = "
                    "never), interleaved the same way",
                    &compare_prefill_min_rows);
  parser.AddIntList("compare-gate-up-chunk", "LIST",
                    "also run the kernel with gate/up work units of these many tile pairs (per-thread slicing), "
                    "interleaved the same way",
                    &compare_gate_up_chunk);
  parser.AddIntList("compare-down-chunk", "LIST",
                    "also run the kernel with down work units of these many tiles, interleaved the same way",
                    &compare_down_chunk);
  parser.AddIntList("compare-read-ahead", "LIST",
                    "also run the kernel with these read-ahead modes (0-3, as --read-ahead), interleaved the same way",
                    &compare_read_ahead);
  parser.AddString("compare-set", "SPECS",
                   "also run these variants, interleaved the same way: ';'-separated, each a ','-separated list of "
                   "KEY=VALUE that changes several settings at once (keys: prefetch, page-lines, streams, "
                   "gate-up-chunk, down-chunk, vbmi, prefill-min-rows, read-ahead, prefetch-l1, prefill-prepare, "
                   "prefill-next-prefetch, prefill-even-runs, wide-passes), e.g. "
                   "'streams=1,page-lines=0,prefetch=2048;gate-up-chunk=8'",
                   &compare_set);
  parser.AddFlag("compare-huge-pages",
                 "pack every other layer on 4 KiB pages (the rest as --huge-pages says) and run the main setting "
                 "on each half, interleaved the same way (each half is read by its own variant, so each sees "
                 "twice the LLC share of a full run)",
                 &compare_huge_pages);
  parser.AddFlag("compare-vbmi", "also run the main setting without the VBMI decode, interleaved the same way",
                 &compare_vbmi);
  parser.AddInt("spin-us", "US", "how long idle pool threads poll for the next job (default: the pool's)", &spin_us,
                -1, 1 << 20);
  parser.AddInt("read-trials", "N", "passes of each read loop when choosing the fastest (medians compared)",
                &read_trials, 1, 100);
  parser.AddDouble("max-ratio", "R", "exit 1 when the kernel/read ratio exceeds R (a yardstick that is too slow)",
                   &max_ratio, 0.0, 1e9);
  parser.AddFlag("peak", "also measure the multiply instruction's register-resident peak on the same threads", &peak);
  parser.AddFlag("in-cache", "also measure the decode kernel's GB/s per thread on L2-resident weights (same rows)",
                 &in_cache);
  parser.AddInt("in-cache-rows", "N", "rows of the --in-cache measurement (default: min(T, 8))", &in_cache_rows, 0,
                1 << 16);
  parser.AddFlag("json", "print only the JSON line (the last line is JSON either way)", &json);
  parser.AddEpilog("\nExample: numoe-bench experts --preset v4-flash --tokens 1 --threads 2 --runs 5\n");
  int rc = 0;
  if (!parser.ParseOrExit(argc, argv, &rc)) return rc;
  const auto fail = [&](const Status& st) {
    std::fprintf(stderr, "%s: %s\n", argv[0], std::string(st.message()).c_str());
    return 1;
  };

  const Preset* preset = nullptr;
  for (const auto& p : kPresets)
    if (preset_name == p.name) preset = &p;
  if (preset == nullptr) return fail(absl::InvalidArgumentError("unknown --preset '" + preset_name + "'"));
  Isa isa;
  if (isa_name.empty()) {
    auto selected = SelectIsa();
    if (!selected.ok()) return fail(selected.status());
    isa = *selected;
  } else {
    auto parsed = ParseIsa(isa_name);
    if (!parsed.ok()) return fail(parsed.status());
    if (!IsaAvailable(*parsed)) return fail(absl::FailedPreconditionError("--isa " + isa_name + " is not available"));
    isa = *parsed;
  }
  MoeComputeOptions moe_options;
  if (amx_min_rows >= 0) moe_options.amx_min_rows = amx_min_rows;
  if (prefill_min_rows >= 0) moe_options.int8_prefill_min_rows = prefill_min_rows;
  if (prefetch >= 0) moe_options.prefetch_bytes = prefetch;
  if (gate_up_chunk > 0) moe_options.gate_up_chunk = gate_up_chunk;
  if (down_chunk > 0) moe_options.down_chunk = down_chunk;
  moe_options.avx512_without_vbmi = vbmi == 0;
  if (page_lines >= 0) moe_options.prefetch_page_lines = page_lines;
  if (read_ahead >= 0) moe_options.read_ahead = read_ahead;
  if (prefetch_l1 >= 0) moe_options.prefetch_l1 = prefetch_l1;
  if (precision_name == "low") {
    moe_options.precision = ActivationPrecision::kLow;
  } else if (precision_name != "high") {
    return fail(absl::InvalidArgumentError("--precision must be high or low"));
  }

  // One worker on the first node (deploy/placement.h), with --threads kernel threads (default: one per
  // CPU of the node, SMT siblings included: the figure is the node's, not the planner's thread count).
  auto topo = ProbeTopology();
  if (!topo.ok()) return fail(topo.status());
  auto placement = deploy::PlaceWorkers(
      *topo, {.workers = 1,
              .threads_per_worker = threads > 0 ? static_cast<int>(threads) : topo->nodes.front().num_cpus,
              .threads_flag = "--threads"});
  if (!placement.ok()) return fail(placement.status());
  const std::vector<int>& cpus = placement->front().thread_cpus;
  ThreadPool::Options pool_options{.num_threads = static_cast<int>(cpus.size()), .cpus = cpus};
  if (spin_us >= 0) pool_options.spin_us = static_cast<int>(spin_us);
  auto pool_or = ThreadPool::Create(pool_options);
  if (!pool_or.ok()) return fail(pool_or.status());
  ThreadPool& pool = **pool_or;

  // Source experts in checkpoint format: a few distinct ones, reused by every packed expert slot (the
  // packed copies are distinct memory, which is what the measurement is about).
  const experts::PackedExpertShape shape{preset->hidden, preset->inter};
  const int64_t layer_bytes = shape.stride() * preset->experts;
  const int64_t llc = LastLevelCacheBytes();
  if (layers == 0) {
    // An expert a step reads is still in the LLC from an earlier step with a probability of about LLC / weights
    // (the read passes stream everything once and get no such help): 20x keeps that below 5%. With 4x, a 300 MiB
    // LLC gave the kernel up to 9% of its bytes from cache and ratios up to 1.04 against the honest read.
    const int64_t want = std::max<int64_t>(20 * llc, int64_t{2} << 30);
    layers = preset->experts >= 64 ? std::max<int64_t>(1, (want + layer_bytes - 1) / layer_bytes) : 1;
  }
  if (compare_huge_pages && layers % 2 != 0) ++layers;  // as many layers on each page size
  std::mt19937_64 rng(static_cast<uint64_t>(seed));
  constexpr int kSources = 8;
  struct Source {
    std::vector<uint8_t> packed[3], scales[3];
  };
  std::vector<Source> sources(kSources);
  const int64_t rows[3] = {preset->inter, preset->inter, preset->hidden};
  const int64_t cols[3] = {preset->hidden, preset->hidden, preset->inter};
  // Scales around 2^-6: V4-Flash-like magnitudes, inside bf16's exact range so AMX is eligible.
  std::uniform_int_distribution<int> scale_dist(118, 124);
  for (auto& s : sources) {
    for (int m = 0; m < 3; ++m) {
      s.packed[m].resize(rows[m] * cols[m] / 2);
      s.scales[m].resize(rows[m] * (cols[m] / 32));
      for (size_t i = 0; i < s.packed[m].size(); i += 8) {
        const uint64_t r = rng();
        std::memcpy(s.packed[m].data() + i, &r, std::min<size_t>(8, s.packed[m].size() - i));
      }
      for (auto& b : s.scales[m]) b = static_cast<uint8_t>(scale_dist(rng));
    }
  }
  std::vector<ExpertWeightsRef> refs(preset->experts);
  for (int64_t e = 0; e < preset->experts; ++e) {
    const Source& s = sources[e % kSources];
    Mxfp4Matrix m[3];
    for (int i = 0; i < 3; ++i) m[i] = Mxfp4Matrix{s.packed[i].data(), s.scales[i].data(), rows[i], cols[i]};
    refs[e] = ExpertWeightsRef{m[0], m[1], m[2]};
  }
  const auto pack_t0 = Clock::now();
  std::vector<std::unique_ptr<ExpertLayer>> packed;
  {
    // Packing is load-time work: use every CPU of the node, not just the measured threads.
    ThreadPool pack_pool(topo->nodes.front().num_cpus);
    for (int64_t l = 0; l < layers; ++l) {
      auto layer = ExpertLayer::Pack(preset->hidden, preset->inter, refs, isa,
                                     {.numa_node = placement->front().nodes.front(),
                                      .huge_pages = huge_pages != 0 && !(compare_huge_pages && l % 2 == 1),
                                      .pool = &pack_pool});
      if (!layer.ok()) return fail(layer.status());
      packed.push_back(std::move(*layer));
    }
  }
  sources.clear();
  const double pack_s = std::chrono::duration<double>(Clock::now() - pack_t0).count();
  const double weight_gb = static_cast<double>(layer_bytes) * layers / 1e9;
  if (!json) {
    std::printf("preset %s: hidden %ld, inter %ld, %ld experts/layer, top-%ld; %ld layer(s), %.2f GB of packed "
                "weights (LLC %.0f MiB), %s pages%s (%.2f GB of this process on 2 MB pages), packed in %.1f s\n",
                preset->name, preset->hidden, preset->inter, preset->experts, preset->top_k, layers, weight_gb,
                llc / 1048576.0, packed[0]->page_mode().c_str(),
                compare_huge_pages ? absl::StrCat(" (odd layers: ", packed[1]->page_mode(), ")").c_str() : "",
                HugePageBytes() / 1e9, pack_s);
    std::printf("isa %s, precision %s, %d threads on CPUs", IsaName(isa), precision_name.c_str(), pool.size());
    for (int c : pool.cpus()) std::printf(" %d", c);
    std::printf(", tokens %ld; kernel %s, prefetch %ld bytes ahead (%s), units of %ld gate/up tile pairs and %ld "
                "down tiles, read-ahead %s\n",
                tokens, MoeCompute(&pool, isa, moe_options).OpsFor(std::min<int64_t>(tokens, 8), false).name,
                moe_options.prefetch_bytes,
                moe_options.prefetch_page_lines > 0
                    ? absl::StrCat("the first ", moe_options.prefetch_page_lines, " line(s) of each 4 KiB page").c_str()
                    : "every line",
                moe_options.gate_up_chunk, moe_options.down_chunk, moe_options.read_ahead == 0 ? "off" : moe_options.read_ahead == 1 ? "loads" : moe_options.read_ahead == 2 ? "prefetcht0" : "prefetcht1");
  }

  double peak_tflops = 0;  // in the JSON when --peak measured it
  if (peak && (isa == Isa::kAmx || isa == Isa::kAvx512)) {
    std::vector<double> per_thread(pool.size());
    pool.RunOnAll([&](int t) {
      per_thread[t] = isa == Isa::kAmx ? experts::AmxBf16PeakFlops(0.5) : experts::Avx512VnniPeakFlops(0.5);
    });
    double total = 0;
    for (double f : per_thread) total += f;
    peak_tflops = total / 1e12;
    if (!json) {
      std::printf("peak %.3f TFLOP/s on %d threads (%s, register-resident)\n", total / 1e12, pool.size(),
                  isa == Isa::kAmx ? "AMX TDPBF16PS bf16" : "AVX-512 VPDPBUSD int8");
    }
  }
  if (in_cache && !json) {
    const int64_t rows = in_cache_rows > 0 ? in_cache_rows : std::min<int64_t>(tokens, 8);
    const experts::KernelOps& ops = MoeCompute(&pool, isa, moe_options).OpsFor(rows, packed[0]->bf16_exact());
    std::vector<double> per_thread(pool.size());
    pool.RunOnAll([&](int t) { per_thread[t] = InCacheGbps(ops, *packed[0], t, rows, 0.3); });
    // 2 flops per weight and row: a packed tile of tile_bytes holds 16 x Kp weights.
    const double flops_per_byte = 2.0 * rows * experts::kTileRows * packed[0]->shape().gate_up().padded_cols() /
                                  static_cast<double>(packed[0]->shape().gate_up().tile_bytes());
    std::printf("in-cache kernel (%s, %ld rows, weights in L2): %.2f GB/s per thread (median of %d), %.2f GB/s on "
                "all = %.3f TFLOP/s\n",
                ops.name, rows, Median(per_thread), pool.size(), Median(per_thread) * pool.size(),
                Median(per_thread) * pool.size() * flops_per_byte / 1e3);
  }
  // The main setting, then the --compare-* variants: each run times them one after another between its two
  // read passes.
  struct Variant {
    std::string name;
    std::unique_ptr<MoeCompute> moe;
    std::vector<double> kernel_gbps, ratios;
    std::vector<const ExpertLayer*> layers;  // cycled through by its steps (default: all)
  };
  std::vector<Variant> variants;
  variants.push_back({"main", std::make_unique<MoeCompute>(&pool, isa, moe_options), {}, {}});
  if (compare_huge_pages) {
    variants.push_back({absl::StrCat("main on ", packed[1]->page_mode(), " pages"),
                        std::make_unique<MoeCompute>(&pool, isa, moe_options), {}, {}});
    for (int64_t l = 0; l < layers; ++l) variants[l % 2].layers.push_back(packed[l].get());
  }
  for (int n : compare_gate_up_chunk) {
    MoeComputeOptions o = moe_options;
    o.gate_up_chunk = n;
    variants.push_back({absl::StrCat("gate/up units of ", n), std::make_unique<MoeCompute>(&pool, isa, o), {}, {}});
  }
  for (int n : compare_down_chunk) {
    MoeComputeOptions o = moe_options;
    o.down_chunk = n;
    variants.push_back({absl::StrCat("down units of ", n), std::make_unique<MoeCompute>(&pool, isa, o), {}, {}});
  }
  for (absl::string_view spec : absl::StrSplit(compare_set, ';', absl::SkipWhitespace())) {
    MoeComputeOptions o = moe_options;
    for (absl::string_view kv : absl::StrSplit(spec, ',', absl::SkipWhitespace())) {
      const std::vector<std::string> parts = absl::StrSplit(kv, '=');
      int64_t v = 0;
      if (parts.size() != 2 || !absl::SimpleAtoi(parts[1], &v) || v < 0) {
        return fail(absl::InvalidArgumentError(
            absl::StrCat("--compare-set: '", kv, "' is not KEY=VALUE with a non-negative integer VALUE")));
      }
      const std::string& key = parts[0];
      if (key == "prefetch") {
        o.prefetch_bytes = v;
      } else if (key == "page-lines") {
        o.prefetch_page_lines = v;
      } else if (key == "streams") {
        o.max_streams = v;
      } else if (key == "gate-up-chunk" && v > 0) {
        o.gate_up_chunk = v;
      } else if (key == "down-chunk" && v > 0) {
        o.down_chunk = v;
      } else if (key == "vbmi" && v <= 1) {
        o.avx512_without_vbmi = v == 0;
      } else if (key == "prefill-min-rows") {
        o.int8_prefill_min_rows = v;
      } else if (key == "read-ahead" && v <= 3) {
        o.read_ahead = v;
      } else if (key == "prefetch-l1" && v <= 1) {
        o.prefetch_l1 = v;
      } else if (key == "prefill-prepare" && v <= 1) {
        o.prefill_prepare = v;
      } else if (key == "prefill-next-prefetch" && v <= 1) {
        o.prefill_next_prefetch = v;
      } else if (key == "prefill-even-runs" && v <= 1) {
        o.prefill_even_runs = v;
      } else if (key == "wide-passes" && v <= 1) {
        o.wide_passes = v;
      } else {
        return fail(absl::InvalidArgumentError(absl::StrCat("--compare-set: unknown key or bad value in '", kv,
                                                            "' (keys: prefetch, page-lines, streams, gate-up-chunk, "
                                                            "down-chunk, vbmi 0|1, prefill-min-rows, read-ahead 0-3, prefetch-l1 0|1, prefill-prepare 0|1, "
                                                            "prefill-next-prefetch 0|1, prefill-even-runs 0|1, wide-passes 0|1)")));
      }
    }
    variants.push_back({std::string(spec), std::make_unique<MoeCompute>(&pool, isa, o), {}, {}});
  }
  for (int pf : compare_prefetch) {
    MoeComputeOptions o = moe_options;
    o.prefetch_bytes = pf;
    variants.push_back({absl::StrCat("prefetch ", pf), std::make_unique<MoeCompute>(&pool, isa, o), {}, {}});
  }
  for (int n : compare_streams) {
    MoeComputeOptions o = moe_options;
    o.max_streams = n;
    variants.push_back({absl::StrCat("streams ", n), std::make_unique<MoeCompute>(&pool, isa, o), {}, {}});
  }
  for (int n : compare_page_lines) {
    MoeComputeOptions o = moe_options;
    o.prefetch_page_lines = n;
    variants.push_back({absl::StrCat("page lines ", n), std::make_unique<MoeCompute>(&pool, isa, o), {}, {}});
  }
  for (int n : compare_prefill_min_rows) {
    MoeComputeOptions o = moe_options;
    o.int8_prefill_min_rows = n;
    variants.push_back({absl::StrCat("prefill from ", n, " rows"), std::make_unique<MoeCompute>(&pool, isa, o), {}, {}});
  }
  for (int n : compare_read_ahead) {
    if (n < 0 || n > 3) return fail(absl::InvalidArgumentError("--compare-read-ahead: each value must be 0-3"));
    MoeComputeOptions o = moe_options;
    o.read_ahead = n;
    variants.push_back({absl::StrCat("read-ahead ", n), std::make_unique<MoeCompute>(&pool, isa, o), {}, {}});
  }
  if (compare_vbmi) {
    MoeComputeOptions o = moe_options;
    o.avx512_without_vbmi = true;
    variants.push_back({"without vbmi", std::make_unique<MoeCompute>(&pool, isa, o), {}, {}});
  }
  for (Variant& v : variants) {
    if (v.layers.empty()) {
      for (const auto& l : packed) v.layers.push_back(l.get());
    }
  }
  MoeCompute& moe = *variants[0].moe;
  std::vector<float> x(tokens * preset->hidden), out(tokens * preset->hidden), w(tokens * preset->top_k);
  std::vector<int32_t> ids(tokens * preset->top_k);
  std::uniform_real_distribution<float> ux(-1.0f, 1.0f), uw(0.1f, 1.0f);
  for (auto& v : x) v = ux(rng);
  for (auto& v : w) v = uw(rng);
  std::vector<int32_t> perm(preset->experts);
  std::vector<char> used(preset->experts);
  const auto route = [&]() -> int64_t {  // random top-k (distinct) per token; returns unique experts
    std::fill(used.begin(), used.end(), 0);
    int64_t unique = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t k = 0; k < preset->top_k; ++k) {  // partial Fisher-Yates
        if (k == 0) std::iota(perm.begin(), perm.end(), 0);
        std::uniform_int_distribution<int64_t> pick(k, preset->experts - 1);
        std::swap(perm[k], perm[pick(rng)]);
        ids[t * preset->top_k + k] = perm[k];
        if (!used[perm[k]]) used[perm[k]] = 1, ++unique;
      }
    }
    return unique;
  };
  // The yardstick: every read loop on all packed weights (this also touches every page once: first touch
  // of guest memory is slow), the fastest kept.
  std::vector<ReadSpan> spans;
  for (const auto& l : packed) spans.push_back({l->expert_data(0), l->bytes()});
  uint64_t sink = 0;
  const ReadChoice choice = ChooseReadMethod(pool, spans, static_cast<int>(read_trials), &sink);
  const ReadMethod& reader = *choice.best;
  if (!json) {
    std::printf("read loops (median of %ld passes each, %.1f s in all): %s; using %s\n", read_trials, choice.seconds,
                choice.Summary().c_str(), reader.name);
  }
  // The pool's own hand-off, on an empty job: back to back, and after 2 ms idle (the workers asleep).
  const Handoff warm_handoff = EmptyJobHandoff(pool, 200, 0);
  const Handoff idle_handoff = EmptyJobHandoff(pool, 50, 2000);
  if (!json) {
    std::printf("pool hand-off, empty job (medians): back to back, all %d threads started %.1f us, returned %.1f us "
                "after submit; after 2 ms idle %.1f / %.1f us\n",
                pool.size(), warm_handoff.started_us, warm_handoff.finished_us, idle_handoff.started_us,
                idle_handoff.finished_us);
  }
  // Warm up the kernel's scratch.
  route();
  if (Status st = moe.Run(*packed[0], 10.0f, MoeBatch{tokens, preset->top_k, x.data(), ids.data(), w.data(), out.data()});
      !st.ok()) {
    return fail(st);
  }

  for (size_t v = 1; v < variants.size(); ++v) {  // their scratch too
    if (Status st = variants[v].moe->Run(*packed[0], 10.0f,
                                         MoeBatch{tokens, preset->top_k, x.data(), ids.data(), w.data(), out.data()});
        !st.ok()) {
      return fail(st);
    }
  }

  std::vector<double> kernel_gbps, read_gbps, tflops, step_ms, handoff_us;
  for (int64_t run = 0; run < runs; ++run) {
    double read_s = ReadPass(pool, reader, spans, &sink), read_bytes = SpanBytes(spans);
    std::vector<double> run_gbps;
    for (size_t v = 0; v < variants.size(); ++v) {
      MoeCompute& vm = *variants[v].moe;
      double kernel_s = 0, bytes = 0, flops = 0;
      int64_t steps = 0;
      const double handoff0 = vm.handoff_seconds();
      while (steps < 3 || kernel_s < seconds) {
        const ExpertLayer& layer = *variants[v].layers[steps % variants[v].layers.size()];
        const int64_t unique = route();
        const auto t0 = Clock::now();
        Status st =
            vm.Run(layer, 10.0f, MoeBatch{tokens, preset->top_k, x.data(), ids.data(), w.data(), out.data()});
        kernel_s += std::chrono::duration<double>(Clock::now() - t0).count();
        if (!st.ok()) return fail(st);
        bytes += static_cast<double>(unique * layer.expert_stream_bytes());
        flops += 6.0 * tokens * preset->top_k * preset->hidden * preset->inter;
        ++steps;
      }
      run_gbps.push_back(bytes / kernel_s / 1e9);
      if (v == 0) {
        tflops.push_back(flops / kernel_s / 1e12);
        step_ms.push_back(1e3 * kernel_s / steps);
        handoff_us.push_back(1e6 * (vm.handoff_seconds() - handoff0) / steps);
      }
    }
    read_s += ReadPass(pool, reader, spans, &sink);
    read_bytes += SpanBytes(spans);
    read_gbps.push_back(read_bytes / read_s / 1e9);
    for (size_t v = 0; v < variants.size(); ++v) {
      variants[v].kernel_gbps.push_back(run_gbps[v]);
      variants[v].ratios.push_back(run_gbps[v] / read_gbps.back());
    }
    kernel_gbps.push_back(run_gbps[0]);
    if (!json) {
      std::printf("run %ld: %.3f ms/step, kernel %.2f GB/s, read %.2f GB/s, ratio %.3f, %.4f TFLOP/s", run + 1,
                  step_ms.back(), kernel_gbps.back(), read_gbps.back(), kernel_gbps.back() / read_gbps.back(),
                  tflops.back());
      for (size_t v = 1; v < variants.size(); ++v) {
        std::printf("; %s: %.2f GB/s, %.3f", variants[v].name.c_str(), run_gbps[v], variants[v].ratios.back());
      }
      std::printf("\n");
    }
  }
  const double k = Median(kernel_gbps), r = Median(read_gbps);
  std::vector<double> ratios;
  for (size_t i = 0; i < kernel_gbps.size(); ++i) ratios.push_back(kernel_gbps[i] / read_gbps[i]);
  if (!json) {
    std::printf("medians over %ld runs: kernel %.2f GB/s, read %.2f GB/s, ratio of medians %.3f (median of ratios "
                "%.3f), %.4f TFLOP/s (checksum %llu)\n",
                runs, k, r, k / r, Median(ratios), Median(tflops), static_cast<unsigned long long>(sink & 0xff));
    std::printf("hand-off (a step's time outside its threads' work, median over runs): %.1f us = %.2f%% of a %.3f ms "
                "step\n",
                Median(handoff_us), 0.1 * Median(handoff_us) / Median(step_ms), Median(step_ms));
    for (size_t v = 1; v < variants.size(); ++v) {
      std::printf("compared, %s: kernel %.2f GB/s, median of ratios %.3f (main setting %.3f)\n",
                  variants[v].name.c_str(), Median(variants[v].kernel_gbps), Median(variants[v].ratios),
                  Median(ratios));
    }
  }
  const int levels = moe_options.precision == ActivationPrecision::kHigh ? 2 : 1;
  std::printf("{\"isa\":\"%s\",\"precision\":\"%s\",\"tokens\":%ld,\"threads\":%d,\"kernel_gbps\":%.3f,"
              "\"read_gbps\":%.3f,\"ratio\":%.4f,\"tflops\":%.5f,\"read_bound_tflops\":%.5f,\"read_method\":\"%s\","
              "\"step_ms\":%.4f,\"step_handoff_us\":%.2f,\"empty_job_started_us\":%.2f,\"empty_job_finished_us\":%.2f,"
              "\"idle_job_started_us\":%.2f,\"idle_job_finished_us\":%.2f%s}\n",
              IsaName(isa), precision_name.c_str(), tokens, pool.size(), k, r, k / r, Median(tflops),
              Median(tflops) * r / k, reader.name, Median(step_ms), Median(handoff_us), warm_handoff.started_us,
              warm_handoff.finished_us, idle_handoff.started_us, idle_handoff.finished_us,
              peak_tflops > 0 ? absl::StrFormat(",\"peak_tflops\":%.4f,\"tflops_ratio\":%.4f,\"issued_ratio\":%.4f",
                                                peak_tflops, Median(tflops) / peak_tflops,
                                                levels * Median(tflops) / peak_tflops).c_str()
                              : "");
  if (k / r > max_ratio) {
    std::fprintf(stderr,
                 "%s: FAILED: the kernel streamed %.2f GB/s, %.3f x the read yardstick's %.2f GB/s (%s), above "
                 "--max-ratio %.2f: the yardstick is not the fastest read of these threads, so no ratio of this run "
                 "can be trusted\n",
                 argv[0], k, k / r, r, reader.name, max_ratio);
    return 1;
  }
  return 0;
}

}  // namespace numoe::bench
