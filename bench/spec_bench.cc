// numoe-bench spec: speculative decoding's decode tokens/s against plain decoding, in one process (CPU model +
// the worker's expert kernels, GenerateBatch), next to what the routed-expert bytes read per step predict.
//
// Why the prediction is what it is: decode on this path is bound by reading weights. A verify step feeds
// 1 + k positions per sequence, and the expert kernels read each expert's weights once for all the rows routed
// to it (MoeCompute groups rows by expert), so the routed bytes of a step are |union of the step's experts| x
// expert bytes, summed over layers. A counting ExpertBackend records that union for every MoeRequest; the
// machine's streaming-read bandwidth is measured in the same process on the same threads; then
//   predicted tok/s = tokens emitted per step / (union bytes per step / bandwidth)
// for both modes. The dense fp32 weights of the CPU model are read once per step too; their bytes are shown as
// a second, fuller prediction (they dominate on small models). Greedy outputs with and without speculation
// must be identical (the bench fails if they are not): the speed-up is only worth reporting if it is free.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/commands.h"
#include "bench/read_bandwidth.h"
#include "common/args.h"
#include "common/checkpoint.h"
#include "common/thread_pool.h"
#include "common/tokenizer/tokenizer.h"
#include "backends/cpu/cpu_model.h"
#include "worker/experts/reference_experts.h"
#include "model/generation.h"
#include "model/spec_policy.h"
#include "worker/experts/inprocess.h"
#include "worker/service/worker_app.h"

namespace numoe::bench {
namespace {

// Code with a repeated shape: what prompt-lookup drafting is for (the demo model writes English, so whether
// it copies is up to it; the bench reports whatever acceptance comes out).
constexpr const char* kBuiltinPrompt =
    "def add(a, b):\n    return a + b\n\n"
    "def sub(a, b):\n    return a - b\n\n"
    "def mul(a, b):\n    return a * b\n\n"
    "def div(a, b):\n    return a / b\n\n"
    "def add(a, b):\n    return a + b\n\n"
    "def sub(a, b):\n    return a - b\n\n"
    "def mul(a, b):\n    return a * b\n\n"
    "def div(a, b):\n    return a / b\n\n"
    "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog sat on the log. "
    "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog sat on the log.\n";

// Records, per MoeRequest, the distinct experts the request's rows are routed to (what the kernels read once
// each) and the experts a row-by-row execution would read (rows x distinct per row, for comparison).
class CountingExperts final : public ExpertBackend {
 public:
  CountingExperts(ExpertBackend* inner, int64_t main_layers, int64_t num_experts, int64_t main_expert_bytes,
                  int64_t draft_expert_bytes)
      : inner_(inner), main_layers_(main_layers), main_bytes_(main_expert_bytes), draft_bytes_(draft_expert_bytes),
        seen_(static_cast<size_t>(num_experts), 0) {}

  Status RunRouted(const MoeRequest& r) override {
    if (counting_) {
      const int64_t E = static_cast<int64_t>(seen_.size());
      int64_t distinct = 0, per_row = 0;
      std::fill(seen_.begin(), seen_.end(), 0);
      for (int64_t row = 0; row < r.rows; ++row) {
        std::vector<int32_t> ids(r.expert_ids + row * r.top_k, r.expert_ids + (row + 1) * r.top_k);
        std::sort(ids.begin(), ids.end());
        per_row += std::unique(ids.begin(), ids.end()) - ids.begin();
        for (int32_t id : ids) {
          if (id < 0 || id >= E) continue;  // the inner backend reports it
          if (seen_[id]) continue;
          seen_[id] = 1;
          ++distinct;
        }
      }
      if (r.layer < main_layers_) {
        if (r.layer == 0) ++steps_;  // every Forward starts at layer 0
        union_experts_ += distinct;
        union_bytes_ += distinct * main_bytes_;
        row_bytes_ += per_row * main_bytes_;
        main_rows_ += r.layer == 0 ? r.rows : 0;
      } else {
        draft_bytes_total_ += distinct * draft_bytes_;
      }
    }
    return inner_->RunRouted(r);
  }

  // Counting starts once the prefill is done (the first emitted token): only decode steps are measured.
  void StartCounting() { counting_ = true; }
  void Reset() {
    counting_ = false;
    steps_ = union_experts_ = union_bytes_ = row_bytes_ = main_rows_ = draft_bytes_total_ = 0;
  }

  int64_t steps() const { return steps_; }                    // decode Forward calls
  int64_t union_experts() const { return union_experts_; }    // sum over steps and layers of |union|
  int64_t union_bytes() const { return union_bytes_; }        // main-layer routed bytes read
  int64_t row_bytes() const { return row_bytes_; }            // the same if every row read its own experts
  int64_t rows() const { return main_rows_; }                 // positions fed in decode steps
  int64_t draft_bytes() const { return draft_bytes_total_; }  // drafter-stage routed bytes (DSpark, MTP)

 private:
  ExpertBackend* inner_;
  int64_t main_layers_, main_bytes_, draft_bytes_;
  std::vector<uint8_t> seen_;
  bool counting_ = false;
  int64_t steps_ = 0, union_experts_ = 0, union_bytes_ = 0, row_bytes_ = 0, main_rows_ = 0, draft_bytes_total_ = 0;
};

// One mode's totals over all runs (the counters are the same every run for greedy decoding; tok/s is not).
struct ModeTotals {
  std::vector<double> tok_s;
  int64_t tokens = 0;  // decode tokens (after each sequence's first)
  int64_t steps = 0, union_experts = 0, union_bytes = 0, row_bytes = 0, rows = 0, draft_bytes = 0;
  SpecStats spec;
  std::vector<std::vector<int32_t>> outputs;  // last run's tokens per sequence
};

int Fail(const Status& s) {
  std::fprintf(stderr, "numoe-bench spec: %s\n", std::string(s.message()).c_str());
  return 1;
}

// fp32 bytes of the CPU model's dense weights read per step: every non-routed main-model matrix and vector
// (the embedding is a row lookup, so not counted). The drafter's dense stages are not included.
int64_t DenseBytesPerStep(const ModelConfig& cfg, int64_t mtp_stages) {
  int64_t params = 0;
  for (const ExpectedTensor& e : ExpectedTensors(cfg, mtp_stages)) {
    if (e.routed_expert || e.mtp_stage >= 0 || e.name == "embed.weight") continue;
    if (e.dtype == DType::kI32 || e.dtype == DType::kI64) continue;  // tid2eid: a lookup
    params += e.params();
  }
  return params * 4;
}

// Median GB/s of the fastest of the yardstick's read loops (read_bandwidth.h), `passes` passes of each.
double ReadGbps(ThreadPool& pool, size_t bytes, int passes) {
  std::vector<uint8_t> buf(bytes, 1);
  uint64_t sink = 0;
  const double gbps = ChooseReadMethod(pool, {{buf.data(), buf.size()}}, passes, &sink).best_gbps;
  if (sink == 42) std::fprintf(stderr, " ");  // keeps the sums alive
  return gbps;
}

}  // namespace

int RunSpecBench(int argc, char** argv) {
  std::string model = "tests/data/demo-v4", prompt_file;
  SpecChoice spec_choice = SpecChoice::kNgram;
  worker::ExpertsImpl experts_kind = worker::ExpertsImpl::kKernels;
  int64_t depth = 0, prompt_len = 0, max_tokens = 64, batch = 1, runs = 3, threads = 0, read_mib = 0;
  int64_t ngram_max = 4, ngram_min = 1;
  bool json_only = false;
  ArgParser p(argv[0],
              "Decode tokens/s with and without speculative decoding (one process: CPU model + expert kernels), the\n"
              "mean accepted length, and what the union of routed experts read per step predicts at this machine's\n"
              "read bandwidth. Greedy outputs of both modes must be identical (else exit 1).");
  p.AddString("model", "DIR", "checkpoint directory (with tokenizer.json)", &model);
  p.AddEnum("spec",
            "drafter of the speculative runs (auto = the checkpoint's own, as numoe serve resolves it; none is "
            "refused: the bench compares a drafter against plain decoding)",
            &spec_choice);
  p.AddInt("depth", "K", "drafts per verify step (default: the checkpoint's DSpark block size, else 5)", &depth, 1, 16);
  p.AddString("prompt", "FILE", "prompt text file (default: a built-in repetitive code + text prompt)", &prompt_file);
  p.AddInt("prompt-len", "N", "prompt tokens incl. BOS: the encoded text is repeated or cut to N (0 = as encoded)",
           &prompt_len, 0, 1 << 20);
  p.AddInt("max-tokens", "N", "tokens generated per sequence (EOS ignored)", &max_tokens, 2, 1 << 20);
  p.AddInt("batch", "B", "sequences decoded together (sequence b starts its prompt text b x 7 tokens later)", &batch, 1,
           256);
  p.AddInt("runs", "R", "runs of each mode, interleaved (the median tok/s is reported)", &runs, 1, 1000);
  p.AddInt("threads", "N", "compute threads (0 = all cores)", &threads, 0, 4096);
  p.AddEnum("experts", "routed experts on the packed kernels or the fp32 reference", &experts_kind);
  p.AddInt("ngram-max", "N", "n-gram drafter: longest suffix matched", &ngram_max, 1, 64);
  p.AddInt("ngram-min", "N", "n-gram drafter: shortest suffix matched", &ngram_min, 1, 64);
  p.AddInt("read-mib", "M", "read-bandwidth buffer in MiB (default: max(8 x LLC, 512 MiB))", &read_mib, 0, 1 << 20);
  p.AddFlag("json", "print only the JSON line", &json_only);
  p.AddEpilog(
      "\nexamples:\n"
      "  numoe-bench spec --model tests/data/demo-v4 --spec ngram --depth 4 --max-tokens 128\n"
      "  numoe mkmodel --preset v4-flash --layers 1 --experts 64 --out /tmp/v4f-1l\n"
      "  numoe-bench spec --model /tmp/v4f-1l --spec ngram --depth 4 --max-tokens 32 --runs 3\n");
  int rc = 0;
  if (!p.ParseOrExit(argc, argv, &rc)) return rc;
  if (spec_choice == SpecChoice::kNone) {
    return Fail(absl::InvalidArgumentError("--spec none: the bench compares a drafter against plain decoding; "
                                           "give ngram, dspark or mtp"));
  }

  auto ck = Checkpoint::Open(model);
  if (!ck.ok()) return Fail(ck.status());
  const ModelConfig& cfg = (*ck)->config();
  const int64_t stages = (*ck)->mtp_stages();
  // The one --spec policy (model/spec_policy.h) on the CPU backend, which runs both model drafters.
  auto plan = ResolveSpec(SpecFlags{.spec = spec_choice, .depth = depth}, DrafterOf(**ck, model),
                          KnownDrafterSupport(Backend::kCpu, /*tp=*/1));
  if (!plan.ok()) return Fail(plan.status());
  SpecConfig spec = plan->config;
  if (spec.method == SpecMethod::kNone) {
    return Fail(absl::FailedPreconditionError("--spec auto: " + model + " has no drafter stages; give --spec ngram"));
  }
  const std::string spec_name = SpecMethodName(spec.method);
  spec.ngram_max = static_cast<int>(ngram_max);
  spec.ngram_min = static_cast<int>(ngram_min);
  if (Status s = ValidateSpec(spec); !s.ok()) return Fail(s);

  // The prompt: text -> ids with the model's tokenizer, BOS first.
  std::string text = kBuiltinPrompt;
  if (!prompt_file.empty()) {
    std::ifstream f(prompt_file, std::ios::binary);
    if (!f) return Fail(absl::NotFoundError("--prompt: cannot read " + prompt_file));
    std::stringstream ss;
    ss << f.rdbuf();
    text = ss.str();
    if (text.empty()) return Fail(absl::InvalidArgumentError("--prompt: " + prompt_file + " is empty"));
  }
  auto tok = tokenizer::Tokenizer::Load(model);
  if (!tok.ok()) return Fail(tok.status());
  auto body = (*tok)->Encode(text);
  if (!body.ok()) return Fail(body.status());
  if (body->empty()) return Fail(absl::InvalidArgumentError("the prompt text encodes to no tokens"));
  std::vector<GenerateRequest> reqs(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    GenerateRequest& r = reqs[b];
    r.prompt.push_back(static_cast<int32_t>(cfg.bos_token_id));
    const size_t n = prompt_len > 0 ? static_cast<size_t>(prompt_len - 1) : body->size();
    const size_t start = static_cast<size_t>(b * 7) % body->size();
    for (size_t i = 0; i < n; ++i) r.prompt.push_back((*body)[(start + i) % body->size()]);
    r.max_new_tokens = max_tokens;
    r.ignore_eos = true;  // equal work in both modes and every run
    r.eos_token_id = cfg.eos_token_id;
    if (Status s = ValidateRequest(r, cfg.vocab_size); !s.ok()) return Fail(s);
  }

  const int nthreads =
      threads > 0 ? static_cast<int>(threads) : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  ThreadPool pool(nthreads);
  const bool drafter = plan->load != SpecMethod::kNone;
  auto t_load = std::chrono::steady_clock::now();
  // The plain runs use a model without the drafter: with it loaded, every step also feeds the drafter's state,
  // which plain decoding would not pay. With DSpark/MTP the model is reloaded with its drafter for the spec runs.
  std::unique_ptr<cpu::CpuModel> target;
  if (auto m = cpu::CpuModel::Create(**ck, &pool); m.ok()) {
    target = std::move(*m);
  } else {
    return Fail(m.status());
  }
  std::unique_ptr<ExpertBackend> experts;
  std::string isa = "fp32-reference";
  if (experts_kind == worker::ExpertsImpl::kKernels) {
    auto ex = InProcessExperts::Load(**ck, &pool, {.include_drafter = drafter});
    if (!ex.ok()) return Fail(ex.status());
    isa = IsaName((*ex)->isa());
    experts = std::move(*ex);
  } else {
    auto ex = cpu::ReferenceExperts::Load(**ck, drafter);
    if (!ex.ok()) return Fail(ex.status());
    experts = std::move(*ex);
  }
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();

  const ModelFootprint fp = ComputeFootprint(cfg, stages);
  const int64_t L = cfg.num_hidden_layers, E = cfg.n_routed_experts, K = cfg.num_experts_per_tok;
  const int64_t expert_bytes = fp.routed_expert_bytes / (L * E);
  const int64_t draft_expert_bytes = stages > 0 ? fp.mtp_routed_expert_bytes / (stages * E) : 0;
  const int64_t dense_bytes = DenseBytesPerStep(cfg, stages);
  CountingExperts counting(experts.get(), L, E, expert_bytes, draft_expert_bytes);

  auto say = [&](const std::string& line) {
    if (!json_only) std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  };
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "model %s: %lld layers, hidden %lld, %lld experts top-%lld, %.2f MB per expert; experts %s, %d threads; "
                "loaded in %.1f s",
                model.c_str(), static_cast<long long>(L), static_cast<long long>(cfg.hidden_size),
                static_cast<long long>(E), static_cast<long long>(K), expert_bytes / 1e6, isa.c_str(), pool.size(),
                load_s);
  say(buf);

  // The bandwidth, on the same threads the kernels use, before the runs.
  const size_t read_bytes = read_mib > 0 ? static_cast<size_t>(read_mib) << 20
                                         : static_cast<size_t>(std::max<int64_t>(8 * LastLevelCacheBytes(), 512 << 20));
  const double gbps = ReadGbps(pool, read_bytes, 5);
  std::snprintf(buf, sizeof(buf), "read bandwidth: %.2f GB/s (%d threads, %.0f MiB buffer, median of 5 passes)", gbps,
                pool.size(), read_bytes / 1048576.0);
  say(buf);

  auto run_once = [&](const SpecConfig& sc, ModeTotals* t) -> Status {
    counting.Reset();
    std::chrono::steady_clock::time_point first;
    int64_t emitted = 0;
    auto on_token = [&](size_t, int32_t) {
      if (emitted++ == 0) {
        first = std::chrono::steady_clock::now();
        counting.StartCounting();
      }
    };
    ASSIGN_OR_RETURN(std::vector<GenerateResult> res, GenerateBatch(*target, counting, reqs, on_token, sc));
    const auto end = std::chrono::steady_clock::now();
    // The prefill step emits every sequence's first token; the rest are decode tokens.
    const int64_t decode_tokens = emitted - batch;
    t->tok_s.push_back(static_cast<double>(decode_tokens) / std::chrono::duration<double>(end - first).count());
    t->tokens += decode_tokens;
    t->steps += counting.steps();
    t->union_experts += counting.union_experts();
    t->union_bytes += counting.union_bytes();
    t->row_bytes += counting.row_bytes();
    t->rows += counting.rows();
    t->draft_bytes += counting.draft_bytes();
    t->outputs.clear();
    for (const GenerateResult& r : res) {
      t->spec.steps += r.spec.steps;
      t->spec.drafted += r.spec.drafted;
      t->spec.accepted += r.spec.accepted;
      t->outputs.push_back(r.tokens);
    }
    return absl::OkStatus();
  };

  // Plain and speculative runs alternate (both see the same load on a shared machine), except with a model
  // drafter (DSpark, MTP), where all plain runs come first and the model is then reloaded with it.
  ModeTotals base, sp;
  for (int64_t run = 0; run < (drafter ? 2 * runs : runs); ++run) {
    if (!drafter || run < runs) {
      if (Status s = run_once(SpecConfig{}, &base); !s.ok()) return Fail(s);
    }
    if (drafter && run == runs - 1) {
      target.reset();
      const auto t0 = std::chrono::steady_clock::now();
      auto m = cpu::CpuModel::Create(**ck, &pool, {.drafter = true});
      if (!m.ok()) return Fail(m.status());
      target = std::move(*m);
      std::snprintf(buf, sizeof(buf), "reloaded with the %s drafter in %.1f s", spec_name.c_str(),
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      say(buf);
    }
    if (drafter && run < runs) continue;
    if (Status s = run_once(spec, &sp); !s.ok()) return Fail(s);
    for (int64_t b = 0; b < batch; ++b) {
      if (base.outputs[b] != sp.outputs[b]) {
        size_t i = 0;
        while (i < base.outputs[b].size() && i < sp.outputs[b].size() && base.outputs[b][i] == sp.outputs[b][i]) ++i;
        std::fprintf(stderr,
                     "numoe-bench spec: FAILED: greedy output of sequence %lld differs with --spec %s (run %lld): first "
                     "difference at token %zu (%d without, %d with speculation)\n",
                     static_cast<long long>(b), spec_name.c_str(), static_cast<long long>(run), i,
                     i < base.outputs[b].size() ? base.outputs[b][i] : -1,
                     i < sp.outputs[b].size() ? sp.outputs[b][i] : -1);
        return 1;
      }
    }
  }

  // Per decode step (one Forward over every sequence): tokens emitted and routed bytes read.
  struct Derived {
    double tok_s, tokens_per_step, rows_per_step, union_per_layer, union_mb, row_mb, draft_mb, predicted, predicted_dense,
        ratio, ratio_dense;
  };
  auto derive = [&](const ModeTotals& t) {
    Derived d{};
    d.tok_s = Median(t.tok_s);
    const double steps = std::max<int64_t>(t.steps, 1);
    d.tokens_per_step = t.tokens / steps;
    d.rows_per_step = t.rows / steps;
    d.union_per_layer = t.union_experts / steps / L;
    const double union_b = t.union_bytes / steps, draft_b = t.draft_bytes / steps;
    d.union_mb = union_b / 1e6;
    d.row_mb = t.row_bytes / steps / 1e6;
    d.draft_mb = draft_b / 1e6;
    d.predicted = union_b + draft_b > 0 ? d.tokens_per_step / ((union_b + draft_b) / (gbps * 1e9)) : 0.0;
    d.predicted_dense = d.tokens_per_step / ((union_b + draft_b + dense_bytes) / (gbps * 1e9));
    d.ratio = d.predicted > 0 ? d.tok_s / d.predicted : 0.0;
    d.ratio_dense = d.tok_s / d.predicted_dense;
    return d;
  };
  const Derived db = derive(base), ds = derive(sp);
  const double verify_steps = std::max<int64_t>(sp.spec.steps, 1);
  const double mean_accepted = sp.spec.accepted / verify_steps;
  const double emitted_per_verify = (sp.spec.accepted + sp.spec.steps) / verify_steps;
  const double speedup = db.tok_s > 0 ? ds.tok_s / db.tok_s : 0.0;
  const double predicted_speedup = db.predicted > 0 ? ds.predicted / db.predicted : 0.0;

  std::snprintf(buf, sizeof(buf), "prompt %zu tokens, %lld new per sequence, batch %lld, %lld runs per mode (median)",
                reqs[0].prompt.size(), static_cast<long long>(max_tokens), static_cast<long long>(batch),
                static_cast<long long>(runs));
  say(buf);
  auto mode_line = [&](const char* name, const Derived& d) {
    std::snprintf(buf, sizeof(buf),
                  "%-9s %8.2f tok/s | %.2f tokens and %.1f rows per step, %.1f experts per layer -> %.2f MB routed "
                  "(%.2f MB row by row) + %.2f MB drafter | predicted %.2f tok/s (x%.2f measured); with %.1f MB dense "
                  "fp32: %.2f tok/s (x%.2f)",
                  name, d.tok_s, d.tokens_per_step, d.rows_per_step, d.union_per_layer, d.union_mb, d.row_mb, d.draft_mb,
                  d.predicted, d.ratio, dense_bytes / 1e6, d.predicted_dense, d.ratio_dense);
    say(buf);
  };
  mode_line("plain:", db);
  mode_line((spec_name + ":").c_str(), ds);
  std::snprintf(buf, sizeof(buf),
                "depth %lld: drafted %lld, accepted %lld in %lld verify steps per run: mean accepted %.2f, %.2f tokens "
                "emitted per verify step; speed-up x%.2f (predicted x%.2f); greedy outputs identical",
                static_cast<long long>(spec.depth), static_cast<long long>(sp.spec.drafted / runs),
                static_cast<long long>(sp.spec.accepted / runs), static_cast<long long>(sp.spec.steps / runs), mean_accepted,
                emitted_per_verify, speedup, predicted_speedup);
  say(buf);

  auto r2 = [](double v) { return std::round(v * 1000.0) / 1000.0; };
  nlohmann::ordered_json j;
  j["bench"] = "spec";
  j["model"] = model;
  j["spec"] = spec_name;
  j["depth"] = spec.depth;
  j["batch"] = batch;
  j["runs"] = runs;
  j["threads"] = pool.size();
  j["isa"] = isa;
  j["prompt_len"] = reqs[0].prompt.size();
  j["max_tokens"] = max_tokens;
  j["layers"] = L;
  j["experts"] = E;
  j["top_k"] = K;
  j["expert_bytes"] = expert_bytes;
  j["dense_bytes_per_step"] = dense_bytes;
  j["read_gbps"] = r2(gbps);
  j["base_tok_s"] = r2(db.tok_s);
  j["spec_tok_s"] = r2(ds.tok_s);
  j["speedup"] = r2(speedup);
  j["drafted"] = sp.spec.drafted / runs;
  j["accepted"] = sp.spec.accepted / runs;
  j["verify_steps"] = sp.spec.steps / runs;
  j["mean_accepted"] = r2(mean_accepted);
  j["emitted_per_verify_step"] = r2(emitted_per_verify);
  j["base_tokens_per_step"] = r2(db.tokens_per_step);
  j["spec_tokens_per_step"] = r2(ds.tokens_per_step);
  j["base_union_experts_per_layer"] = r2(db.union_per_layer);
  j["spec_union_experts_per_layer"] = r2(ds.union_per_layer);
  j["base_union_bytes_per_step"] = static_cast<int64_t>(db.union_mb * 1e6);
  j["spec_union_bytes_per_step"] = static_cast<int64_t>(ds.union_mb * 1e6);
  j["spec_row_bytes_per_step"] = static_cast<int64_t>(ds.row_mb * 1e6);
  j["spec_draft_bytes_per_step"] = static_cast<int64_t>(ds.draft_mb * 1e6);
  j["base_predicted_tok_s"] = r2(db.predicted);
  j["spec_predicted_tok_s"] = r2(ds.predicted);
  j["predicted_speedup"] = r2(predicted_speedup);
  j["base_measured_over_predicted"] = r2(db.ratio);
  j["spec_measured_over_predicted"] = r2(ds.ratio);
  j["base_predicted_with_dense_tok_s"] = r2(db.predicted_dense);
  j["spec_predicted_with_dense_tok_s"] = r2(ds.predicted_dense);
  j["greedy_identical"] = true;
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace numoe::bench
