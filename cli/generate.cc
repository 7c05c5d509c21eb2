// numoe generate: one-process generation (the worker's experts and the CPU backend linked together).
#include <algorithm>
#include <chrono>
#include <thread>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "common/args.h"
#include "common/checkpoint.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "common/tokenizer/tokenizer.h"
#include "backends/cpu/cpu_model.h"
#include "model/generation.h"
#include "model/spec_policy.h"
#include "common/thread_pool.h"
#include "worker/experts/reference_experts.h"
#include "worker/experts/inprocess.h"
#include "worker/service/worker_app.h"

namespace numoe::cli {
namespace {

struct Flags {
  std::string model;
  std::string prompt;
  std::string prompt_ids;
  int64_t max_new_tokens = 64;
  double temperature = 0.0;
  double top_p = 1.0;
  int64_t top_k = 0;
  int64_t seed = 0;
  bool ignore_eos = false;
  bool no_bos = false;
  int64_t prefill_chunk = 0;
  std::string logits_out;
  int64_t threads = 0;
  bool quiet = false;
  worker::ExpertsImpl experts = worker::ExpertsImpl::kKernels;
  SpecFlags spec;  // resolved by the one --spec policy (model/spec_policy.h), as numoe serve's
};

Status WriteLogits(const std::string& path, const GenerateRequest& req, const GenerateResult& res, int64_t vocab) {
  std::vector<int64_t> tokens(res.tokens.begin(), res.tokens.end());
  std::vector<TensorToWrite> t = {
      {"prefill_logits", DType::kF32, {static_cast<int64_t>(req.prompt.size()), vocab}, res.prefill_logits.data()},
      {"step_logits", DType::kF32, {static_cast<int64_t>(res.tokens.size()), vocab}, res.step_logits.data()},
      {"tokens", DType::kI64, {static_cast<int64_t>(tokens.size())}, tokens.data()},
  };
  return WriteSafetensors(path, t, {{"producer", "numoe generate"}});
}

int Fail(const Status& s) {
  std::fprintf(stderr, "numoe generate: %s\n", std::string(s.message()).c_str());
  return 1;
}

}  // namespace

int RunGenerate(int argc, char** argv) {
  Flags f;
  ArgParser p(argv[0],
              "Generate text from a prompt in one process (CPU backend + in-process expert kernels).\n"
              "The text streams to stdout as it is generated; statistics go to stderr.");
  p.AddString("model", "DIR", "checkpoint directory (config.json, safetensors, tokenizer.json)", &f.model, true);
  p.AddString("prompt", "TEXT", "prompt text (encoded with the model's tokenizer; BOS is prepended)", &f.prompt);
  p.AddString("prompt-ids", "1,2,3", "prompt as token ids instead of text (used as given)", &f.prompt_ids);
  p.AddInt("max-new-tokens", "N", "tokens to generate at most", &f.max_new_tokens, 0, 1 << 20);
  p.AddDouble("temperature", "T", "sampling temperature; 0 = greedy", &f.temperature, 0.0, 100.0);
  p.AddDouble("top-p", "P", "nucleus sampling mass in (0, 1]", &f.top_p, 1e-9, 1.0);
  p.AddInt("top-k", "K", "sample among the K most likely tokens; 0 = all", &f.top_k, 0, INT32_MAX);
  p.AddInt("seed", "S", "random seed (same seed, same output)", &f.seed, 0, INT64_MAX);
  p.AddFlag("ignore-eos", "keep generating past <｜end▁of▁sentence｜>", &f.ignore_eos);
  p.AddFlag("no-bos", "do not prepend BOS to --prompt", &f.no_bos);
  p.AddInt("prefill-chunk", "K", "feed the prompt in chunks of K tokens (0 = all at once, 1 = token by token)",
           &f.prefill_chunk, 0, INT32_MAX);
  p.AddString("logits-out", "FILE",
              "write a safetensors file with prefill_logits F32 [S,V], step_logits F32 [N,V], tokens I64 [N]",
              &f.logits_out);
  p.AddInt("threads", "N", "compute threads (0 = all cores of this machine)", &f.threads, 0, 4096);
  p.AddFlag("quiet", "print only the generated text", &f.quiet);
  p.AddEnum("experts",
            "routed experts on the packed MXFP4 kernels (ISA from NUMOE_ISA or the best available) or the fp32 "
            "reference",
            &f.experts);
  p.AddEnum("spec",
            "speculative decoding: auto = the checkpoint's drafter (dspark with DSpark stages, mtp with MTP stages, "
            "else none); ngram drafts from the prompt and generated text (no weights); none turns it off",
            &f.spec.spec);
  p.AddInt("spec-depth", "K",
           "draft tokens per step (0 = the checkpoint's dspark_block_size, else 5; mtp applies its one block "
           "recursively)",
           &f.spec.depth, 0, 16);
  p.AddFlag("spec-adaptive", "adapt the depth per sequence from recent acceptance (up to --spec-depth)",
            &f.spec.adaptive);
  int rc = 0;
  if (!p.ParseOrExit(argc, argv, &rc)) return rc;
  if (f.prompt.empty() == f.prompt_ids.empty()) {
    return Fail(absl::InvalidArgumentError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3"));
  }

  auto ckpt = Checkpoint::Open(f.model);
  if (!ckpt.ok()) return Fail(ckpt.status());
  const ModelConfig& cfg = (*ckpt)->config();
  auto tok = tokenizer::Tokenizer::Load(f.model);
  if (!tok.ok()) return Fail(tok.status());

  GenerateRequest req;
  if (!f.prompt_ids.empty()) {
    auto ids = ParseIntList(f.prompt_ids, "--prompt-ids");
    if (!ids.ok()) return Fail(ids.status());
    for (int64_t id : *ids) {
      if (id < 0 || id >= cfg.vocab_size) {
        return Fail(absl::InvalidArgumentError(
            absl::StrCat("--prompt-ids: token id ", id, " is out of range [0, ", cfg.vocab_size, ")")));
      }
      req.prompt.push_back(static_cast<int32_t>(id));
    }
  } else {
    tokenizer::EncodeOptions eo;
    auto ids = (*tok)->Encode(f.prompt, eo);
    if (!ids.ok()) return Fail(ids.status());
    if (!f.no_bos) req.prompt.push_back(static_cast<int32_t>(cfg.bos_token_id));
    req.prompt.insert(req.prompt.end(), ids->begin(), ids->end());
  }
  req.max_new_tokens = f.max_new_tokens;
  req.sampling.temperature = f.temperature;
  req.sampling.top_p = f.top_p;
  req.sampling.top_k = f.top_k;
  req.sampling.seed = static_cast<uint64_t>(f.seed);
  req.ignore_eos = f.ignore_eos;
  req.eos_token_id = cfg.eos_token_id;
  req.prefill_chunk = f.prefill_chunk;
  req.keep_logits = !f.logits_out.empty();
  if (Status s = ValidateRequest(req, cfg.vocab_size); !s.ok()) return Fail(s);

  // This process runs the CPU backend, which runs both model drafters.
  auto plan = ResolveSpec(f.spec, DrafterOf(**ckpt, f.model), KnownDrafterSupport(Backend::kCpu, /*tp=*/1));
  if (!plan.ok()) return Fail(plan.status());
  const SpecConfig& spec = plan->config;
  const bool drafter = plan->load != SpecMethod::kNone;

  const int nthreads = f.threads > 0 ? static_cast<int>(f.threads)
                                     : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  ThreadPool pool(nthreads);
  auto t0 = std::chrono::steady_clock::now();
  auto model = cpu::CpuModel::Create(**ckpt, &pool, {.drafter = drafter});
  if (!model.ok()) return Fail(model.status());
  std::unique_ptr<ExpertBackend> experts;
  if (f.experts == worker::ExpertsImpl::kKernels) {
    auto e = InProcessExperts::Load(**ckpt, &pool, {.include_drafter = drafter});
    if (!e.ok()) return Fail(e.status());
    experts = std::move(*e);
  } else {
    auto e = cpu::ReferenceExperts::Load(**ckpt, drafter);
    if (!e.ok()) return Fail(e.status());
    experts = std::move(*e);
  }
  auto t1 = std::chrono::steady_clock::now();
  if (!f.quiet) {
    std::fprintf(stderr, "loaded %s in %.2f s (%lld prompt tokens)\n", f.model.c_str(),
                 std::chrono::duration<double>(t1 - t0).count(), static_cast<long long>(req.prompt.size()));
  }

  tokenizer::StreamDecoder dec(**tok, /*skip_special_tokens=*/true);
  std::chrono::steady_clock::time_point first;
  int64_t generated = 0;
  auto on_token = [&](size_t, int32_t id) {
    if (generated++ == 0) first = std::chrono::steady_clock::now();
    std::string s = dec.Add(id);
    std::fwrite(s.data(), 1, s.size(), stdout);
    std::fflush(stdout);
  };
  auto res = GenerateBatch(**model, *experts, {req}, on_token, spec);
  if (!res.ok()) return Fail(res.status());
  std::string tail = dec.Finish();
  std::fwrite(tail.data(), 1, tail.size(), stdout);
  std::fputs("\n", stdout);
  auto t2 = std::chrono::steady_clock::now();
  if (!f.logits_out.empty()) {
    if (Status s = WriteLogits(f.logits_out, req, (*res)[0], cfg.vocab_size); !s.ok()) return Fail(s);
  }
  if (!f.quiet && generated > 0) {
    const double prefill_s = std::chrono::duration<double>(first - t1).count();
    const double decode_s = std::chrono::duration<double>(t2 - first).count();
    std::fprintf(stderr, "prefill: %lld tokens in %.3f s (%.1f tok/s); decode: %lld tokens in %.3f s (%.1f tok/s); finish: %s\n",
                 static_cast<long long>(req.prompt.size()), prefill_s, req.prompt.size() / prefill_s,
                 static_cast<long long>(generated - 1), decode_s, generated > 1 ? (generated - 1) / decode_s : 0.0,
                 (*res)[0].finish_reason.c_str());
    if (spec.method != SpecMethod::kNone) {
      const SpecStats& st = (*res)[0].spec;
      std::fprintf(stderr, "spec %s depth %lld: %lld verify steps, %lld drafted, %lld accepted (%.2f per step)\n",
                   SpecMethodName(spec.method), static_cast<long long>(spec.depth), static_cast<long long>(st.steps),
                   static_cast<long long>(st.drafted), static_cast<long long>(st.accepted),
                   st.mean_accepted_per_step());
    }
  }
  return 0;
}

}  // namespace numoe::cli
