// numoe-bench cuda: one decode step of the CUDA backend on V4-Flash-shaped non-expert weights (synthetic,
// full width, generated in device memory: no checkpoint on disk), at several batch sizes and contexts,
// next to the floor that the GPU's memory bandwidth sets for the bytes the step reads. The routed experts
// belong to the CPU worker and are stubbed to zeros; the per-layer host exchange still happens.
// --draft-experts worker,gpu (with --model, a checkpoint with DSpark stages, e.g. `numoe mkmodel --preset
// v4-flash --layers 1 --drafter dspark`) instead times the DSpark Draft() call per step with the stages' routed
// experts on the CPU (InProcessExperts in this process, the worker's kernels) or on the GPU
// (CudaOptions::drafter_experts = "gpu"), and prints the GPU memory the latter costs.
// --packed-moe instead times the routed experts of a prefill step on the GPU (cuda::PackedMoe on the worker's
// packed expert layout: bucket by expert, w13 + SwiGLU and w2 on bf16 tensor cores, combine) at V4-Flash's shape
// (256 experts of 4096 x 2048, k = 6, uniform random routing) for --moe-rows rows, with the activations as a bf16
// hi + lo pair and/or one bf16: ms, useful TFLOP/s (6 · rows · k · hidden · inter per call) and its share of the
// bf16 mma.sync peak measured here by a register-resident loop.
// --verify K also times a speculative verify step (1 + K tokens per sequence, every row's logits copied back,
// as numoe-gpu verifies drafts) followed by Rollback(K) of every sequence (nothing accepted: the most work).
#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/commands.h"
#include "common/args.h"
#include "common/checkpoint.h"
#include "common/config.h"
#include "common/thread_pool.h"
#include "backends/cuda/cuda_model.h"
#include "backends/cuda/kernel_profile.h"
#include "worker/experts/inprocess.h"

namespace numoe::bench {
namespace {

class ZeroExperts final : public ExpertBackend {
 public:
  explicit ZeroExperts(int64_t hidden) : hidden_(hidden) {}
  Status RunRouted(const MoeRequest& r) override {
    std::memset(r.out, 0, static_cast<size_t>(r.rows * hidden_) * sizeof(float));
    return absl::OkStatus();
  }

 private:
  int64_t hidden_;
};

// V4-Flash's config (tests/data/v4-flash-0731.config.json) with `layers` main layers: 2 sliding, then CSA on
// even and HCA on odd layers; the first 3 layers hash-routed.
StatusOr<ModelConfig> FlashConfig(int64_t layers, int64_t max_positions) {
  nlohmann::json ratios = nlohmann::json::array();
  for (int64_t l = 0; l < layers; ++l) ratios.push_back(l < 2 ? 0 : (l % 2 == 0 ? 4 : 128));
  nlohmann::json j = {
      {"architectures", {"DeepseekV4ForCausalLM"}},
      {"model_type", "deepseek_v4"},
      {"vocab_size", 129280},
      {"hidden_size", 4096},
      {"num_hidden_layers", layers},
      {"num_attention_heads", 64},
      {"num_key_value_heads", 1},
      {"head_dim", 512},
      {"qk_rope_head_dim", 64},
      {"q_lora_rank", 1024},
      {"o_groups", 8},
      {"o_lora_rank", 1024},
      {"sliding_window", 128},
      {"compress_ratios", ratios},
      {"compress_rope_theta", 160000.0},
      {"rope_theta", 10000.0},
      {"rope_scaling",
       {{"type", "yarn"}, {"factor", 16}, {"original_max_position_embeddings", 65536}, {"beta_fast", 32}, {"beta_slow", 1}}},
      {"max_position_embeddings", max_positions},
      {"index_n_heads", 64},
      {"index_head_dim", 128},
      {"index_topk", 512},
      {"n_routed_experts", 256},
      {"n_shared_experts", 1},
      {"num_experts_per_tok", 6},
      {"moe_intermediate_size", 2048},
      {"num_hash_layers", std::min<int64_t>(3, layers)},
      {"scoring_func", "sqrtsoftplus"},
      {"routed_scaling_factor", 1.5},
      {"swiglu_limit", 10.0},
      {"hc_mult", 4},
      {"hc_sinkhorn_iters", 20},
      {"hc_eps", 1e-6},
      {"rms_norm_eps", 1e-6},
      {"tie_word_embeddings", false},
      {"quantization_config",
       {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"scale_fmt", "ue8m0"}, {"weight_block_size", {128, 128}},
        {"activation_scheme", "dynamic"}}},
      {"expert_dtype", "fp4"},
  };
  return ParseModelConfig(j.dump(), "flash-shaped bench config");
}

// Bytes of cache one decode row reads at `context` tokens: window ring, attended compressed entries and the
// indexer keys it scores.
double CacheBytesPerRow(const ModelConfig& c, int64_t context, int64_t elem) {
  double b = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const AttnType t = c.layer_types[static_cast<size_t>(l)];
    b += static_cast<double>(std::min(c.sliding_window, context) * c.head_dim);
    if (t == AttnType::kCSA) {
      const int64_t vis = context / c.csa_rate;
      b += static_cast<double>(std::min(c.index_topk, vis) * c.head_dim + vis * c.index_head_dim);
    } else if (t == AttnType::kHCA) {
      b += static_cast<double>(context / c.hca_rate * c.head_dim);
    }
  }
  return b * static_cast<double>(elem);
}


// Wraps the host experts: time spent in the drafter stages' layers (>= num_hidden_layers).
class TimedExperts final : public ExpertBackend {
 public:
  TimedExperts(ExpertBackend* inner, int64_t main_layers) : inner_(inner), main_layers_(main_layers) {}
  Status RunRouted(const MoeRequest& r) override {
    const auto t0 = std::chrono::steady_clock::now();
    Status st = inner_->RunRouted(r);
    if (r.layer >= main_layers_) {
      stage_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
    return st;
  }
  double stage_ms = 0;

 private:
  ExpertBackend* inner_;
  int64_t main_layers_;
};

std::string HostCpuName() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t c = line.find(':');
      return c == std::string::npos ? line : line.substr(c + 2);
    }
  }
  return "unknown CPU";
}

int RunDraftExpertsBench(const std::string& model_dir, const std::string& placements_s,
                         const std::vector<int64_t>& batches, int64_t depth, int64_t context, int64_t steps,
                         int64_t threads, int64_t device, bool json) {
  std::vector<std::string> placements;
  for (size_t p = 0; p <= placements_s.size();) {
    const size_t q = std::min(placements_s.find(',', p), placements_s.size());
    const std::string f = placements_s.substr(p, q - p);
    if (f != "worker" && f != "gpu") {
      std::fprintf(stderr, "--draft-experts: '%s' is not worker or gpu\n", f.c_str());
      return 2;
    }
    placements.push_back(f);
    p = q + 1;
  }
  if (model_dir.empty()) {
    std::fprintf(stderr, "--draft-experts needs --model DIR (a checkpoint with DSpark stages, e.g. numoe mkmodel "
                         "--preset v4-flash --layers 1 --drafter dspark)\n");
    return 2;
  }
  if (!CudaCompiledIn() || CudaDeviceCount() == 0) {
    std::fprintf(stderr, "numoe-bench cuda: %s\n", CudaCompiledIn() ? "no CUDA device" : "built without CUDA");
    return 1;
  }
  auto ck = Checkpoint::Open(model_dir);
  if (!ck.ok()) {
    std::fprintf(stderr, "%s\n", ck.status().ToString().c_str());
    return 1;
  }
  const ModelConfig& c = (*ck)->config();
  if ((*ck)->mtp_stages() == 0 || c.dspark_block_size <= 0) {
    std::fprintf(stderr, "%s has no DSpark stages (make one with numoe mkmodel --drafter dspark)\n", model_dir.c_str());
    return 1;
  }
  if (threads == 0) threads = std::max<int64_t>(1, std::thread::hardware_concurrency());
  ThreadPool pool(static_cast<int>(threads));
  const auto tl = std::chrono::steady_clock::now();
  auto host = InProcessExperts::Load(**ck, &pool, {.include_drafter = true});
  if (!host.ok()) {
    std::fprintf(stderr, "%s\n", host.status().ToString().c_str());
    return 1;
  }
  const std::string cpu = HostCpuName();
  if (!json) {
    std::printf("checkpoint %s: %lld layers + %lld DSpark stages, %lld experts x [%lld, %lld], top-%lld\n",
                model_dir.c_str(), static_cast<long long>(c.num_hidden_layers),
                static_cast<long long>((*ck)->mtp_stages()), static_cast<long long>(c.n_routed_experts),
                static_cast<long long>(c.moe_intermediate_size), static_cast<long long>(c.hidden_size),
                static_cast<long long>(c.num_experts_per_tok));
    std::printf("host experts: %s, %lld threads, ISA %s, %.2f GB packed, loaded in %.1f s\n", cpu.c_str(),
                static_cast<long long>(threads), IsaName((*host)->isa()),
                static_cast<double>((*host)->bytes()) / 1e9,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - tl).count());
  }
  TimedExperts timed(host->get(), c.num_hidden_layers);
  const int64_t max_b = *std::max_element(batches.begin(), batches.end());
  nlohmann::json results = nlohmann::json::array();
  std::map<int64_t, std::vector<std::vector<int32_t>>> first_drafts;  // batch -> the first placement's drafts
  for (const std::string& where : placements) {
    CudaOptions opt;
    opt.device = static_cast<int>(device);
    opt.max_sequences = max_b;
    opt.max_context = context + depth + 64;
    opt.max_step_tokens = std::max<int64_t>(max_b * depth, 256);
    opt.drafter_experts = where;
    const auto t0 = std::chrono::steady_clock::now();
    auto model = CreateCudaBackend(**ck, opt);
    if (!model.ok()) {
      std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
      return 1;
    }
    CudaBackend& m = **model;
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const int64_t extra = m.drafter_expert_bytes();
    if (!json) {
      std::printf("\n[drafter experts on the %s] loaded in %.1f s, extra GPU memory %.2f GiB; %s\n",
                  where == "gpu" ? "GPU" : "worker (CPU)", load_s, static_cast<double>(extra) / (1 << 30),
                  m.Describe().c_str());
      std::printf("%6s %6s %10s %10s %10s %14s\n", "batch", "depth", "draft_ms", "p50_ms", "max_ms", "host_exp_ms");
    }
    for (int64_t B : batches) {
      std::vector<SequenceId> seqs;
      Status st = absl::OkStatus();
      std::vector<int32_t> prompt(static_cast<size_t>(context));
      for (int64_t i = 0; i < B && st.ok(); ++i) {
        for (int64_t t = 0; t < context; ++t) {
          prompt[static_cast<size_t>(t)] = static_cast<int32_t>((t * 7919 + i * 104729 + 13) % c.vocab_size);
        }
        auto s = m.CreateSequence();
        st = s.status();
        if (!st.ok()) break;
        seqs.push_back(*s);
        SequenceStep step;
        step.seq = *s;
        step.tokens = prompt;
        std::vector<SequenceLogits> out;
        st = m.Forward({&step, 1}, &timed, &out);
      }
      std::vector<double> ms;
      double host_ms = 0;
      std::vector<std::vector<int32_t>> drafts;
      for (int64_t it = 0; it < steps + 2 && st.ok(); ++it) {
        std::vector<DraftRequest> reqs;
        for (int64_t i = 0; i < B; ++i) {
          reqs.push_back(DraftRequest{seqs[static_cast<size_t>(i)], static_cast<int32_t>((i * 31 + 7) % c.vocab_size),
                                      depth, nullptr});
        }
        std::vector<DraftResult> out;
        timed.stage_ms = 0;
        const auto d0 = std::chrono::steady_clock::now();
        st = m.Draft(reqs, &timed, &out);
        const double d = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - d0).count();
        if (st.ok() && it >= 2) {  // two warm-up calls
          ms.push_back(d);
          host_ms += timed.stage_ms;
        }
        if (st.ok() && it == 0) {
          for (const DraftResult& r : out) drafts.push_back(r.tokens);
        }
      }
      for (SequenceId s : seqs) (void)m.ReleaseSequence(s);
      if (!st.ok()) {
        std::fprintf(stderr, "%s batch %lld: %s\n", where.c_str(), static_cast<long long>(B), st.ToString().c_str());
        return 1;
      }
      std::vector<double> sorted = ms;
      std::sort(sorted.begin(), sorted.end());
      double mean = 0;
      for (double v : ms) mean += v;
      mean /= static_cast<double>(ms.size());
      host_ms /= static_cast<double>(ms.size());
      int64_t same = -1;
      auto fd = first_drafts.find(B);
      if (fd == first_drafts.end()) {
        first_drafts[B] = drafts;
      } else {
        same = 0;
        for (size_t i = 0; i < drafts.size() && i < fd->second.size(); ++i) {
          for (size_t t = 0; t < drafts[i].size() && t < fd->second[i].size(); ++t) same += drafts[i][t] == fd->second[i][t];
        }
      }
      if (!json) {
        std::printf("%6lld %6lld %10.3f %10.3f %10.3f %14.3f", static_cast<long long>(B), static_cast<long long>(depth),
                    mean, sorted[sorted.size() / 2], sorted.back(), host_ms);
        if (same >= 0) {
          std::printf("   draft tokens equal to the %s run: %lld/%lld", placements[0].c_str(),
                      static_cast<long long>(same), static_cast<long long>(B * depth));
        }
        std::printf("\n");
      }
      results.push_back({{"drafter_experts", where},
                         {"batch", B},
                         {"depth", depth},
                         {"draft_ms", mean},
                         {"draft_p50_ms", sorted[sorted.size() / 2]},
                         {"host_expert_ms", host_ms},
                         {"extra_gpu_bytes", extra},
                         {"drafts_equal_to_first", same}});
    }
  }
  if (!json) {
    std::printf("\ndraft_ms: wall time of one Draft() call (all stages, head, Markov correction, drafts back on the "
                "host); host_exp_ms: of which the stages' routed experts on the CPU.\n");
  }
  nlohmann::json summary = {{"bench", "cuda-draft-experts"}, {"host_cpu", cpu}, {"threads", threads},
                            {"context", context},            {"results", results}};
  std::printf("%s\n", summary.dump().c_str());
  return 0;
}

// Kernels of a profile grouped by (kernel, note): device time summed, most time first.
struct KernelRecordGroup {
  std::string kernel, what;
  int64_t calls = 0, bytes = 0;
  double us = 0;
};
std::vector<KernelRecordGroup> GroupKernels(const std::vector<cuda::KernelRecord>& records) {
  std::map<std::pair<std::string, std::string>, KernelRecordGroup> by;
  for (const cuda::KernelRecord& r : records) {
    KernelRecordGroup& g = by[{r.kernel, r.what}];
    g.kernel = r.kernel;
    g.what = r.what;
    ++g.calls;
    g.bytes += r.bytes;
    g.us += static_cast<double>(r.end_ns - r.start_ns) / 1e3;
  }
  std::vector<KernelRecordGroup> out;
  for (auto& [key, g] : by) out.push_back(std::move(g));
  std::sort(out.begin(), out.end(), [](const KernelRecordGroup& a, const KernelRecordGroup& b) { return a.us > b.us; });
  return out;
}

// Prints one profiled step's kernels (largest first) and returns them as JSON rows.
nlohmann::json KernelTable(const std::vector<KernelRecordGroup>& groups, double copy_gbps, bool json) {
  double total_us = 0;
  for (const auto& g : groups) total_us += g.us;
  if (!json) {
    std::printf("%9s %6s %7s %9s %9s %7s  %s\n", "us/step", "share", "calls", "us/call", "GB/s", "of_copy",
                "kernel [what it moves]");
  }
  nlohmann::json rows = nlohmann::json::array();
  for (size_t i = 0; i < groups.size(); ++i) {
    const KernelRecordGroup& g = groups[i];
    const double gbps = g.bytes > 0 ? static_cast<double>(g.bytes) / (g.us * 1e3) : 0;
    if (!json && (i < 60 || g.us >= 0.005 * total_us)) {
      char gb[32] = "-", of[32] = "-";
      if (gbps > 0) {
        std::snprintf(gb, sizeof(gb), "%.0f", gbps);
        std::snprintf(of, sizeof(of), "%.0f%%", 100.0 * gbps / copy_gbps);
      }
      std::printf("%9.1f %5.1f%% %7lld %9.2f %9s %7s  %s%s%s%s\n", g.us, 100.0 * g.us / total_us,
                  static_cast<long long>(g.calls), g.us / static_cast<double>(g.calls), gb, of, g.kernel.c_str(),
                  g.what.empty() ? "" : " [", g.what.c_str(), g.what.empty() ? "" : "]");
    }
    rows.push_back({{"kernel", g.kernel}, {"what", g.what}, {"calls", g.calls}, {"us", g.us}, {"bytes", g.bytes}});
  }
  return rows;
}

// Runs `step` four times (three warm-ups), profiling the last: its kernels grouped, and its gpu_ms.
StatusOr<std::pair<std::vector<KernelRecordGroup>, double>> ProfileFourth(CudaBackend& m,
                                                                          const std::function<Status(int)>& step) {
  std::vector<KernelRecordGroup> groups;
  double gpu_ms = 0;
  for (int it = 0; it < 4; ++it) {
    m.set_collect_stats(it == 3);
    if (it == 3) RETURN_IF_ERROR(cuda::StartKernelProfile());
    Status st = step(it);
    if (it == 3) {
      auto records = cuda::StopKernelProfile();
      RETURN_IF_ERROR(st);
      if (!records.ok()) return records.status();
      groups = GroupKernels(*records);
      gpu_ms = m.last_stats().gpu_ms;
    }
    RETURN_IF_ERROR(st);
  }
  return std::make_pair(std::move(groups), gpu_ms);
}

// --kernels: one decode step per batch with every kernel launched on its own (graphs off, so each launch keeps
// its CUPTI correlation and the GEMM launcher's note), recorded, and grouped by kernel and note.
// --kernels-prefill N: also one prefill step of a new sequence feeding N prompt tokens at once.
StatusOr<nlohmann::json> ProfileKernels(const ModelConfig& cfg, const std::string& fmt, const std::string& cache,
                                        int device, int tp, const std::vector<int64_t>& batches, int64_t context,
                                        int64_t prefill_rows, double copy_gbps, int64_t layers, bool json) {
  const int64_t max_b = *std::max_element(batches.begin(), batches.end());
  CudaOptions opt;
  opt.bf16_cache = cache == "bf16";
  opt.device = device;
  opt.tp = tp;
  opt.fp8_weights = fmt == "fp8";
  opt.max_sequences = max_b + 1;
  opt.max_context = std::max(context, prefill_rows) + 16;
  opt.max_step_tokens = std::max<int64_t>({max_b, prefill_rows, 16});
  opt.graphs = false;
  ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> model, CreateSyntheticCudaBackend(cfg, opt, 42));
  CudaBackend& m = *model;
  ZeroExperts zero(cfg.hidden_size);
  nlohmann::json out = nlohmann::json::array();
  auto report = [&](const std::vector<KernelRecordGroup>& groups, double gpu_ms, const std::string& title,
                    nlohmann::json entry) {
    double total_us = 0;
    int64_t launches = 0;
    for (const auto& g : groups) total_us += g.us, launches += g.calls;
    if (!json) {
      std::printf("\n[kernels of %s: %s weights, %s cache, %lld layers; launched one by one] %lld launches, %.3f ms "
                  "of kernels, step gpu_ms %.3f\n",
                  title.c_str(), fmt.c_str(), cache.c_str(), static_cast<long long>(layers),
                  static_cast<long long>(launches), total_us / 1e3, gpu_ms);
    }
    entry["weights"] = fmt;
    entry["cache"] = cache;
    entry["kernel_us"] = total_us;
    entry["launches"] = launches;
    entry["eager_gpu_ms"] = gpu_ms;
    entry["rows"] = KernelTable(groups, copy_gbps, json);
    out.push_back(std::move(entry));
  };
  for (int64_t B : batches) {
    std::vector<SequenceId> seqs;
    for (int64_t i = 0; i < B; ++i) {
      ASSIGN_OR_RETURN(SequenceId s, m.CreateSequence());
      seqs.push_back(s);
      RETURN_IF_ERROR(m.FillRandomContext(s, context, 1000 + static_cast<uint64_t>(i)));
    }
    std::vector<int32_t> toks(static_cast<size_t>(B), 5), next;
    auto got = ProfileFourth(m, [&](int) {
      std::vector<SequenceStep> step(static_cast<size_t>(B));
      for (int64_t i = 0; i < B; ++i) {
        step[static_cast<size_t>(i)].seq = seqs[static_cast<size_t>(i)];
        step[static_cast<size_t>(i)].tokens = std::span<const int32_t>(&toks[static_cast<size_t>(i)], 1);
      }
      Status st = m.ForwardGreedy(step, &zero, &next);
      if (st.ok()) toks = next;
      return st;
    });
    for (SequenceId s : seqs) (void)m.ReleaseSequence(s);
    if (!got.ok()) return got.status();
    char title[96];
    std::snprintf(title, sizeof(title), "one decode step: batch %lld, context %lld", static_cast<long long>(B),
                  static_cast<long long>(context));
    report(got->first, got->second, title, {{"batch", B}, {"context", context}});
  }
  if (prefill_rows > 0) {
    std::vector<int32_t> prompt(static_cast<size_t>(prefill_rows));
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(5 + i % 1000);
    auto got = ProfileFourth(m, [&](int) -> Status {
      ASSIGN_OR_RETURN(SequenceId s, m.CreateSequence());
      SequenceStep step;
      step.seq = s;
      step.tokens = prompt;
      std::vector<int32_t> next;
      Status st = m.ForwardGreedy(std::span<const SequenceStep>(&step, 1), &zero, &next);
      (void)m.ReleaseSequence(s);
      return st;
    });
    if (!got.ok()) return got.status();
    char title[96];
    std::snprintf(title, sizeof(title), "one prefill step: %lld prompt tokens of a new sequence",
                  static_cast<long long>(prefill_rows));
    report(got->first, got->second, title, {{"prefill_rows", prefill_rows}});
  }
  if (!json) {
    std::printf("\nGB/s: bytes the launcher says it moves (weights and their scales once, activations in and out) "
                "over its device time; of_copy: of the device copy bandwidth above. Launched one by one, a step has "
                "launch gaps that graphs remove: compare the kernel sum with gpu_ms above.\n");
  }
  return out;
}


int RunPackedMoeBench(const std::vector<int64_t>& rows, const std::string& precisions_s, int64_t iters, int64_t device,
                      bool json) {
  std::vector<std::pair<std::string, bool>> precisions;  // name, split
  for (size_t p = 0; p <= precisions_s.size();) {
    const size_t q = std::min(precisions_s.find(',', p), precisions_s.size());
    const std::string f = precisions_s.substr(p, q - p);
    if (f != "hilo" && f != "bf16") {
      std::fprintf(stderr, "--moe-precision: '%s' is not hilo or bf16\n", f.c_str());
      return 2;
    }
    precisions.emplace_back(f, f == "hilo");
    p = q + 1;
  }
  constexpr int64_t kExperts = 256, kHidden = 4096, kInter = 2048, kTopK = 6;
  auto peak = MeasureMmaBf16PeakFlops(static_cast<int>(device));
  if (!peak.ok()) {
    std::fprintf(stderr, "%s\n", std::string(peak.status().message()).c_str());
    return 1;
  }
  if (!json) {
    std::printf("PackedMoe: %lld experts of %lld x %lld (packed MXFP4), k = %lld, uniform random routing\n",
                static_cast<long long>(kExperts), static_cast<long long>(kHidden), static_cast<long long>(kInter),
                static_cast<long long>(kTopK));
    std::printf("bf16 mma.sync peak (register loop): %.1f TFLOP/s\n", *peak / 1e12);
    std::printf("%-6s %7s %10s %10s %10s %12s %10s\n", "acts", "rows", "ms", "TFLOP/s", "of peak", "mma TFLOP/s",
                "scratch MB");
  }
  nlohmann::json points = nlohmann::json::array();
  for (const auto& [name, split] : precisions) {
    auto got = BenchPackedMoe(static_cast<int>(device), rows, kTopK, kExperts, kHidden, kInter, split,
                              static_cast<int>(iters));
    if (!got.ok()) {
      std::fprintf(stderr, "%s\n", std::string(got.status().message()).c_str());
      return 1;
    }
    for (const PackedMoeBenchPoint& p : *got) {
      if (!json) {
        std::printf("%-6s %7lld %10.3f %10.1f %10.3f %12.1f %10.1f\n", name.c_str(), static_cast<long long>(p.rows),
                    p.ms, p.flops / 1e12, p.flops / *peak, p.mma_flops / 1e12, p.scratch_bytes / 1e6);
      }
      points.push_back({{"activations", name},
                        {"rows", p.rows},
                        {"ms", p.ms},
                        {"tflops", p.flops / 1e12},
                        {"fraction_of_peak", p.flops / *peak},
                        {"mma_tflops", p.mma_flops / 1e12},
                        {"scratch_bytes", p.scratch_bytes}});
    }
  }
  const nlohmann::json summary = {{"bench", "cuda_packed_moe"}, {"experts", kExperts}, {"hidden", kHidden},
                                  {"inter", kInter},            {"k", kTopK},          {"peak_tflops", *peak / 1e12},
                                  {"points", points}};
  std::printf("%s\n", summary.dump().c_str());
  return 0;
}

}  // namespace

int RunCudaBench(int argc, char** argv) {
  ArgParser parser(argv[0],
                   "One decode step of the CUDA backend on V4-Flash-shaped synthetic non-expert weights: GPU time vs "
                   "the memory-bandwidth floor, and device memory per sequence per 1K tokens.");
  std::string batch_s = "1,4,16", context_s = "4096,65536", weights_s = "fp8,bf16", cache_s = "bf16";
  int64_t layers = 43, steps = 10, device = 0, tp = 1, verify = 0;
  bool json = false, no_graphs = false, kernels = false;
  parser.AddString("batch", "LIST", "batch sizes (sequences decoding together)", &batch_s);
  parser.AddString("context", "LIST", "tokens of context per sequence", &context_s);
  parser.AddString("weights", "LIST", "dense weight formats on the device: fp8 (weight-only GEMM) and/or bf16", &weights_s);
  parser.AddString("cache", "LIST", "cache element types: bf16 and/or fp32", &cache_s);
  parser.AddInt("layers", "N", "main layers (V4-Flash: 43)", &layers, 1, 1000);
  parser.AddInt("steps", "N", "timed decode steps per point", &steps, 1, 100000);
  parser.AddInt("device", "ID", "first GPU", &device, 0, 64);
  parser.AddInt("tp", "N", "tensor-parallel GPUs", &tp, 1, 64);
  parser.AddInt("verify", "K", "also time a speculative step of 1 + K tokens per sequence + Rollback(K); 0 = off",
                &verify, 0, 16);
  std::string draft_experts, model_dir;
  int64_t draft_depth = 5, draft_context = 256, threads = 0;
  parser.AddString("draft-experts", "LIST",
                   "instead of the decode step: time Draft() (DSpark) with the stages' routed experts on the worker "
                   "(CPU kernels in this process) and/or the gpu, e.g. worker,gpu (needs --model; --batch, --steps)",
                   &draft_experts);
  parser.AddString("model", "DIR", "--draft-experts: checkpoint with DSpark stages", &model_dir);
  parser.AddInt("draft-depth", "K", "--draft-experts: draft tokens per sequence", &draft_depth, 1, 16);
  parser.AddInt("draft-context", "N", "--draft-experts: prompt tokens per sequence before drafting", &draft_context, 1,
                1 << 20);
  parser.AddInt("threads", "N", "--draft-experts: CPU expert threads (0 = every core)", &threads, 0, 4096);
  bool packed_moe = false;
  std::string moe_rows_s = "512,2048,16384", moe_precision_s = "hilo,bf16";
  parser.AddFlag("packed-moe",
                 "instead of the decode step: time the routed experts of a prefill step on the GPU (PackedMoe on the "
                 "worker's packed layout, V4-Flash shape: 256 experts, k = 6) against the bf16 mma peak (--steps calls "
                 "per point)",
                 &packed_moe);
  parser.AddString("moe-rows", "LIST", "--packed-moe: rows (tokens) per call", &moe_rows_s);
  parser.AddString("moe-precision", "LIST",
                   "--packed-moe: activations as a bf16 hi + lo pair (hilo) and/or one bf16 (bf16)", &moe_precision_s);
  parser.AddFlag("no-graphs", "launch kernels one by one instead of replaying CUDA graphs", &no_graphs);
  parser.AddFlag("kernels",
                 "also profile one decode step per batch (first weights/cache/context, kernels launched one by one): "
                 "every kernel's device time, what it moves, GB/s and share of the step (needs libcupti; NUMOE_CUPTI "
                 "names it)",
                 &kernels);
  int64_t kernels_prefill = 0;
  parser.AddInt("kernels-prefill", "N",
                "with --kernels, also profile one prefill step of a new sequence feeding N prompt tokens (routed "
                "experts zero, as in the decode steps); 0 = off",
                &kernels_prefill, 0, 1 << 20);
  parser.AddFlag("json", "print only the JSON summary line", &json);
  int rc = 0;
  if (!parser.ParseOrExit(argc, argv, &rc)) return rc;
  auto batches = ParseIntList(batch_s, "--batch");
  auto contexts = ParseIntList(context_s, "--context");
  if (!batches.ok() || !contexts.ok()) {
    std::fprintf(stderr, "%s\n", std::string((!batches.ok() ? batches.status() : contexts.status()).message()).c_str());
    return 2;
  }
  if (packed_moe) {
    auto moe_rows = ParseIntList(moe_rows_s, "--moe-rows");
    if (!moe_rows.ok() || moe_rows->empty()) {
      std::fprintf(stderr, "%s\n", moe_rows.ok() ? "--moe-rows: empty" : std::string(moe_rows.status().message()).c_str());
      return 2;
    }
    for (int64_t r : *moe_rows) {
      if (r < 1 || r > 65536) {
        std::fprintf(stderr, "--moe-rows: %lld is outside [1, 65536]\n", static_cast<long long>(r));
        return 2;
      }
    }
    return RunPackedMoeBench(*moe_rows, moe_precision_s, steps, device, json);
  }
  if (!draft_experts.empty()) {
    return RunDraftExpertsBench(model_dir, draft_experts, *batches, draft_depth, draft_context, steps, threads, device,
                                json);
  }
  auto split = [](const std::string& list, std::initializer_list<const char*> allowed, const char* flag,
                  std::vector<std::string>* out) {
    for (size_t p = 0; p <= list.size();) {
      const size_t q = std::min(list.find(',', p), list.size());
      const std::string f = list.substr(p, q - p);
      bool ok = false;
      for (const char* a : allowed) ok = ok || f == a;
      if (!ok) {
        std::fprintf(stderr, "%s: '%s' is not one of the allowed values\n", flag, f.c_str());
        return false;
      }
      out->push_back(f);
      p = q + 1;
    }
    return true;
  };
  std::vector<std::string> formats, caches;
  if (!split(weights_s, {"fp8", "bf16"}, "--weights", &formats) || !split(cache_s, {"bf16", "fp32"}, "--cache", &caches)) {
    return 2;
  }
  std::vector<std::pair<std::string, std::string>> configs;
  for (const auto& w : formats) {
    for (const auto& c : caches) configs.push_back({w, c});
  }
  if (!CudaCompiledIn() || CudaDeviceCount() == 0) {
    std::fprintf(stderr, "numoe-bench cuda: %s\n", CudaCompiledIn() ? "no CUDA device" : "built without CUDA");
    return 1;
  }
  const int64_t max_b = *std::max_element(batches->begin(), batches->end());
  const int64_t max_c = *std::max_element(contexts->begin(), contexts->end());
  auto cfg = FlashConfig(layers, std::max<int64_t>(1048576, max_c + steps + 16));
  if (!cfg.ok()) {
    std::fprintf(stderr, "%s\n", cfg.status().ToString().c_str());
    return 1;
  }
  auto bw = MeasureDeviceCopyGBps(static_cast<int>(device), int64_t{2} << 30, 5);
  if (!bw.ok()) {
    std::fprintf(stderr, "%s\n", bw.status().ToString().c_str());
    return 1;
  }
  if (!json) std::printf("device copy bandwidth: %.0f GB/s (read + write, 2 GiB D2D)\n", *bw);

  nlohmann::json results = nlohmann::json::array();
  ZeroExperts zero(cfg->hidden_size);
  for (const auto& [fmt, cache] : configs) {
    CudaOptions opt;
    opt.bf16_cache = cache == "bf16";
    opt.device = static_cast<int>(device);
    opt.tp = static_cast<int>(tp);
    opt.fp8_weights = fmt == "fp8";
    opt.max_sequences = max_b;
    opt.max_context = max_c + 2 * (steps + 3) + verify + 32;
    opt.max_step_tokens = std::max<int64_t>(max_b * (verify + 1), 16);
    opt.graphs = !no_graphs;
    auto model = CreateSyntheticCudaBackend(*cfg, opt, 42);
    if (!model.ok()) {
      std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
      return 1;
    }
    CudaBackend& m = **model;
    if (!json) std::printf("\n[%s weights, %s cache] %s\n", fmt.c_str(), cache.c_str(), m.Describe().c_str());
    if (!json) {
      std::printf("%6s %8s %10s %10s %10s %10s %9s %12s %12s\n", "batch", "context", "gpu_ms", "wall_ms", "read_GB",
                  "floor_ms", "of_floor", "MiB/seq/1K", "fixed_MiB");
    }
    for (int64_t B : *batches) {
      for (int64_t C : *contexts) {
        std::vector<SequenceId> seqs;
        Status st = absl::OkStatus();
        for (int64_t i = 0; i < B && st.ok(); ++i) {
          auto s = m.CreateSequence();
          st = s.status();
          if (st.ok()) {
            seqs.push_back(*s);
            st = m.FillRandomContext(*s, C, 1000 + static_cast<uint64_t>(i));
          }
        }
        double gpu = 0, wall = 0;
        int timed = 0;
        std::vector<int32_t> toks(static_cast<size_t>(B), 5), next;
        for (int64_t it = 0; it < steps + 3 && st.ok(); ++it) {
          std::vector<SequenceStep> step(static_cast<size_t>(B));
          for (int64_t i = 0; i < B; ++i) {
            step[static_cast<size_t>(i)].seq = seqs[static_cast<size_t>(i)];
            step[static_cast<size_t>(i)].tokens = std::span<const int32_t>(&toks[static_cast<size_t>(i)], 1);
          }
          m.set_collect_stats(it >= 3);
          st = m.ForwardGreedy(step, &zero, &next);
          if (st.ok() && it >= 3) {
            gpu += m.last_stats().gpu_ms;
            wall += m.last_stats().wall_ms;
            ++timed;
          }
          if (st.ok()) toks = next;
        }
        // Verify steps: 1 + K tokens per sequence with all logits, then every sequence rolls back K.
        double vgpu = 0, vwall = 0, rb_ms = 0;
        int vtimed = 0;
        for (int64_t it = 0; verify > 0 && it < steps + 1 && st.ok(); ++it) {
          std::vector<int32_t> feed(static_cast<size_t>(B * (verify + 1)), 7);
          std::vector<SequenceStep> step(static_cast<size_t>(B));
          for (int64_t i = 0; i < B; ++i) {
            SequenceStep& q = step[static_cast<size_t>(i)];
            q.seq = seqs[static_cast<size_t>(i)];
            q.tokens = std::span<const int32_t>(&feed[static_cast<size_t>(i * (verify + 1))],
                                                static_cast<size_t>(verify + 1));
            q.all_logits = true;
            q.speculative = true;
          }
          std::vector<SequenceLogits> out;
          m.set_collect_stats(it >= 1);
          st = m.Forward(step, &zero, &out);
          const auto t0 = std::chrono::steady_clock::now();
          for (int64_t i = 0; i < B && st.ok(); ++i) st = m.Rollback(seqs[static_cast<size_t>(i)], verify);
          const double rb = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
          if (st.ok() && it >= 1) {
            vgpu += m.last_stats().gpu_ms;
            vwall += m.last_stats().wall_ms;
            rb_ms += rb;
            ++vtimed;
          }
        }
        SequenceMemory mem;
        if (st.ok()) {
          auto mm = m.Memory(seqs[0]);
          st = mm.status();
          if (st.ok()) mem = *mm;
        }
        for (SequenceId s : seqs) (void)m.ReleaseSequence(s);
        if (!st.ok()) {
          std::fprintf(stderr, "batch %lld context %lld: %s\n", static_cast<long long>(B), static_cast<long long>(C),
                       st.ToString().c_str());
          return 1;
        }
        gpu /= timed;
        wall /= timed;
        if (vtimed > 0) {
          vgpu /= vtimed;
          vwall /= vtimed;
          rb_ms /= vtimed;
        }
        const double bytes = static_cast<double>(m.weight_bytes_per_step()) +
                             static_cast<double>(B) * CacheBytesPerRow(*cfg, C, cache == "bf16" ? 2 : 4) *
                                 static_cast<double>(tp);
        const double floor_ms = bytes / (*bw * 1e9) * 1e3 / static_cast<double>(tp);
        const double per_k = static_cast<double>(mem.growing_bytes) / (static_cast<double>(mem.position) / 1024.0) /
                             static_cast<double>(1 << 20);
        if (!json) {
          std::printf("%6lld %8lld %10.3f %10.3f %10.3f %10.3f %8.0f%% %12.2f %12.1f\n", static_cast<long long>(B),
                      static_cast<long long>(C), gpu, wall, bytes / 1e9, floor_ms, 100.0 * floor_ms / gpu, per_k,
                      static_cast<double>(mem.fixed_bytes) / (1 << 20));
          if (vtimed > 0) {
            std::printf("%6s %8s %10.3f %10.3f   <- verify step of %lld tokens/seq (all logits), then Rollback(%lld): "
                        "%.3f ms for all\n",
                        "", "", vgpu, vwall, static_cast<long long>(verify + 1), static_cast<long long>(verify), rb_ms);
          }
        }
        results.push_back({{"weights", fmt},
                           {"cache", cache},
                           {"batch", B},
                           {"context", C},
                           {"gpu_ms", gpu},
                           {"wall_ms", wall},
                           {"bytes_read", bytes},
                           {"floor_ms", floor_ms},
                           {"mib_per_seq_per_1k_tokens", per_k},
                           {"fixed_mib_per_seq", static_cast<double>(mem.fixed_bytes) / (1 << 20)},
                           {"capacity_mib_per_seq", static_cast<double>(mem.capacity_bytes) / (1 << 20)},
                           {"verify_k", verify},
                           {"verify_gpu_ms", vgpu},
                           {"verify_wall_ms", vwall},
                           {"rollback_ms", rb_ms}});
      }
    }
  }
  if (!json) {
    std::printf("\ngpu_ms: device time of the step's segments (CUDA events; the per-layer expert exchange with the "
                "host is excluded); floor: bytes read / copy bandwidth.\n");
  }
  nlohmann::json profiles = nlohmann::json::array();
  if (kernels) {
    const auto& [fmt, cache] = configs.front();
    auto p = ProfileKernels(*cfg, fmt, cache, static_cast<int>(device), static_cast<int>(tp), *batches,
                            contexts->front(), kernels_prefill, *bw, layers, json);
    if (!p.ok()) {
      std::fprintf(stderr, "--kernels: %s\n", std::string(p.status().message()).c_str());
      return 1;
    }
    profiles = *p;
  }
  nlohmann::json summary = {{"bench", "cuda"},      {"layers", layers},      {"copy_gbps", *bw},
                            {"tp", tp},             {"graphs", !no_graphs},  {"results", results}};
  if (kernels) summary["kernels"] = profiles;
  std::printf("%s\n", summary.dump().c_str());
  return 0;
}

}  // namespace numoe::bench
