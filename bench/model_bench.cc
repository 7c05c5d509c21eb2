// numoe-bench model: one-process prefill and decode tokens/s on the CPU backend with the in-process
// expert kernels. The baseline the kernels and the CUDA backend are compared with.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "bench/commands.h"
#include "common/args.h"
#include "common/checkpoint.h"
#include "common/thread_pool.h"
#include "backends/cpu/cpu_model.h"
#include "worker/experts/reference_experts.h"
#include "worker/experts/inprocess.h"

namespace numoe::bench {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

int Fail(const Status& s) {
  std::fprintf(stderr, "numoe-bench model: %s\n", std::string(s.message()).c_str());
  return 1;
}

}  // namespace

int RunModelBench(int argc, char** argv) {
  std::string model = "tests/data/tiny-v4";
  int64_t prompt_len = 128, decode = 32, threads = 0, runs = 3, batch = 1;
  bool json = false;
  std::string experts_kind = "kernels";
  ArgParser p(argv[0], "Prefill and decode tokens/s of the one-process CPU path (model + expert kernels).");
  p.AddString("model", "DIR", "checkpoint directory", &model);
  p.AddInt("prompt-len", "N", "prompt tokens prefilled in one step", &prompt_len, 1, 1 << 20);
  p.AddInt("decode", "N", "decode steps timed after the prefill", &decode, 1, 1 << 20);
  p.AddInt("batch", "B", "sequences decoded together", &batch, 1, 4096);
  p.AddInt("threads", "N", "compute threads (0 = all cores)", &threads, 0, 4096);
  p.AddInt("runs", "R", "repetitions (the median is reported)", &runs, 1, 1000);
  p.AddFlag("json", "print only the JSON line", &json);
  p.AddString("experts", "kernels|reference", "routed experts on the packed kernels or the fp32 reference",
              &experts_kind);
  int rc = 0;
  if (!p.ParseOrExit(argc, argv, &rc)) return rc;

  auto ck = Checkpoint::Open(model);
  if (!ck.ok()) return Fail(ck.status());
  const ModelConfig& cfg = (*ck)->config();
  const int nthreads = threads > 0 ? static_cast<int>(threads) : static_cast<int>(std::thread::hardware_concurrency());
  ThreadPool pool(std::max(1, nthreads));
  auto m = cpu::CpuModel::Create(**ck, &pool);
  if (!m.ok()) return Fail(m.status());
  std::unique_ptr<ExpertBackend> experts;
  std::string isa = "fp32-reference";
  if (experts_kind == "kernels") {
    auto ex = InProcessExperts::Load(**ck, &pool);
    if (!ex.ok()) return Fail(ex.status());
    isa = IsaName((*ex)->isa());
    experts = std::move(*ex);
  } else if (experts_kind == "reference") {
    auto ex = cpu::ReferenceExperts::Load(**ck);
    if (!ex.ok()) return Fail(ex.status());
    experts = std::move(*ex);
  } else {
    return Fail(absl::InvalidArgumentError("--experts must be kernels or reference"));
  }

  std::vector<double> prefill_tps, decode_tps;
  std::vector<SequenceLogits> out;
  for (int64_t run = 0; run < runs; ++run) {
    std::vector<SequenceId> seqs;
    std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(batch));
    for (int64_t b = 0; b < batch; ++b) {
      auto s = (*m)->CreateSequence();
      if (!s.ok()) return Fail(s.status());
      seqs.push_back(*s);
      for (int64_t i = 0; i < prompt_len; ++i) {
        prompts[b].push_back(static_cast<int32_t>((i * 7919 + b * 31 + run) % cfg.vocab_size));
      }
    }
    std::vector<SequenceStep> steps;
    for (int64_t b = 0; b < batch; ++b) steps.push_back({seqs[b], prompts[b], false});
    auto t0 = std::chrono::steady_clock::now();
    if (Status s = (*m)->Forward(steps, experts.get(), &out); !s.ok()) return Fail(s);
    auto t1 = std::chrono::steady_clock::now();
    prefill_tps.push_back(static_cast<double>(prompt_len * batch) / std::chrono::duration<double>(t1 - t0).count());
    std::vector<int32_t> next(static_cast<size_t>(batch));
    for (int64_t i = 0; i < decode; ++i) {
      for (int64_t b = 0; b < batch; ++b) {
        next[b] = static_cast<int32_t>((i * 17 + b) % cfg.vocab_size);
        steps[b] = {seqs[b], std::span<const int32_t>(&next[b], 1), false};
      }
      if (Status s = (*m)->Forward(steps, experts.get(), &out); !s.ok()) return Fail(s);
    }
    auto t2 = std::chrono::steady_clock::now();
    decode_tps.push_back(static_cast<double>(decode * batch) / std::chrono::duration<double>(t2 - t1).count());
    for (SequenceId s : seqs) (void)(*m)->ReleaseSequence(s);
  }
  const double pf = Median(prefill_tps), dc = Median(decode_tps);
  if (!json) {
    std::printf("model %s: %lld layers, hidden %lld, %lld experts top-%lld; experts %s, %d threads\n", model.c_str(),
                static_cast<long long>(cfg.num_hidden_layers), static_cast<long long>(cfg.hidden_size),
                static_cast<long long>(cfg.n_routed_experts), static_cast<long long>(cfg.num_experts_per_tok),
                isa.c_str(), pool.size());
    std::printf("prefill: %.1f tok/s (batch %lld x %lld tokens, median of %lld)\n", pf,
                static_cast<long long>(batch), static_cast<long long>(prompt_len), static_cast<long long>(runs));
    std::printf("decode:  %.1f tok/s (batch %lld, %lld steps, median of %lld)\n", dc, static_cast<long long>(batch),
                static_cast<long long>(decode), static_cast<long long>(runs));
  }
  std::printf("{\"bench\":\"model\",\"model\":\"%s\",\"isa\":\"%s\",\"threads\":%d,\"batch\":%lld,\"prompt_len\":%lld,"
              "\"prefill_tok_s\":%.2f,\"decode_tok_s\":%.2f}\n",
              model.c_str(), isa.c_str(), pool.size(), static_cast<long long>(batch),
              static_cast<long long>(prompt_len), pf, dc);
  return 0;
}

}  // namespace numoe::bench
