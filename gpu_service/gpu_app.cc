#include "gpu_service/gpu_app.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <chrono>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/checkpoint.h"
#include "common/tokenizer/tokenizer.h"
#include "common/log.h"
#include "common/thread_pool.h"
#include "model/spec_policy.h"
#include "model/step.h"
#include "backends/cpu/cpu_model.h"
#include "backends/cuda/cuda_model.h"
#include "gpu_service/gpu_flags.h"
#include "gpu_service/gpu_server.h"
#include "common/process.h"

namespace numoe::gpu {

namespace {

StatusOr<std::unique_ptr<ModelBackend>> CreateBackend(const GpuAppConfig& c, const Checkpoint& ckpt, ThreadPool* pool,
                                                      bool drafter) {
  if (c.backend == Backend::kCpu) {
    ASSIGN_OR_RETURN(auto model, cpu::CpuModel::Create(ckpt, pool, {.drafter = drafter}));
    return std::unique_ptr<ModelBackend>(std::move(model));
  }
  CudaOptions o;
  o.device = static_cast<int>(c.cuda_device);
  o.tp = static_cast<int>(c.tp);
  o.devices = c.gpus;
  o.max_sequences = c.max_sequences;
  o.lanes = c.lanes;
  o.max_step_tokens = c.pass_rows;
  o.drafter = drafter;
  o.drafter_experts = ChoiceName(c.drafter_experts);
  // Without a CUDA build this is the stub's UNAVAILABLE, which says so.
  auto model = CreateCudaModel(ckpt, o);
  if (!model.ok()) return Status(model.status().code(), absl::StrCat("--backend cuda: ", model.status().message()));
  return model;
}

}  // namespace

int RunGpuApp(const GpuAppConfig& flags) {
  BlockShutdownSignals();
  auto fail = [](const Status& st) {
    NLOG(ERROR) << "numoe-gpu: " << st;
    return 1;
  };
  GpuAppConfig config = flags;
  config.backend = ResolveBackend(flags.backend, CudaDeviceCount());
  if (flags.backend == Backend::kAuto) {
    NLOG(INFO) << "numoe-gpu: --backend auto: " << ChoiceName(config.backend) << " (" << CudaDeviceCount()
               << " CUDA device(s))";
  }
  if (Status st = ResolveGpus(&config, CudaDeviceCount()); !st.ok()) return fail(st);
  const std::string backend = ChoiceName(config.backend);
  if (Status st = CheckDrafterExperts(config.drafter_experts, config.backend); !st.ok()) return fail(st);
  const auto t0 = std::chrono::steady_clock::now();
  auto ckpt = Checkpoint::Open(config.model_dir);
  if (!ckpt.ok()) return fail(ckpt.status());
  auto fingerprint = ModelFingerprint(config.model_dir);
  if (!fingerprint.ok()) return fail(fingerprint.status());
  // --spec against the checkpoint and the backend, before any weight is loaded.
  auto spec = ResolveSpec(SpecFlags{.spec = config.spec}, DrafterOf(**ckpt, config.model_dir),
                          KnownDrafterSupport(config.backend, config.tp));
  if (!spec.ok()) return fail(spec.status());
  if (!spec->note.empty()) NLOG(INFO) << "numoe-gpu: " << spec->note;
  const bool load_drafter = spec->load != SpecMethod::kNone;
  // The CPU backend's matmuls run on this pool; one Forward at a time uses it (steps are serialised).
  const int threads = config.threads > 0 ? static_cast<int>(config.threads)
                                         : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  std::unique_ptr<ThreadPool> pool;
  if (config.backend == Backend::kCpu) pool = std::make_unique<ThreadPool>(threads);
  auto model = CreateBackend(config, **ckpt, pool.get(), load_drafter);
  if (!model.ok()) return fail(model.status());
  // Verification needs speculative steps and Rollback, which the backend declares.
  const Capabilities caps = (*model)->capabilities();
  const bool verify = caps.verify;
  if (Status st = CheckLoadedDrafter(*spec, caps, backend); !st.ok()) return fail(st);
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  NLOG(INFO) << "numoe-gpu: loaded " << config.model_dir << " on the " << backend << " backend in " << load_s
             << " s, " << (config.backend == Backend::kCpu ? absl::StrCat(threads, " threads") : std::string("GPU"))
             << " (" << (*ckpt)->config().num_hidden_layers << " layers, hidden " << (*ckpt)->config().hidden_size
             << ", vocab " << (*ckpt)->config().vocab_size << "); drafter " << SpecMethodName((*model)->drafter())
             << (verify ? ", verifies drafts" : ", cannot verify drafts (speculative decoding off)");
  if (!caps.interleaved_steps) {
    NLOG(INFO) << "numoe-gpu: workers take whole-step turns on the model"
               << (config.backend == Backend::kCuda && config.lanes > 0 ? " (--lanes needs --tp 1 and no DSpark drafter)"
                                                                        : "");
  } else if (caps.lanes > 0) {
    NLOG(INFO) << "numoe-gpu: the steps of up to " << caps.lanes - 1
               << " workers interleave layer by layer, each on its own lane (--lanes)";
  } else {
    NLOG(INFO) << "numoe-gpu: the steps of every worker interleave layer by layer";
  }

  GpuServerOptions opts;
  opts.backend = backend;
  opts.fingerprint = *fingerprint;
  opts.heartbeat_ms = config.heartbeat_ms;
  opts.lease_ms = config.lease_ms;
  opts.max_workers = config.max_workers;
  opts.max_sequences = config.max_sequences;
  opts.channel.spin_us = static_cast<int>(config.spin_us);
  opts.drafter = (*model)->drafter();
  opts.verify = verify;
  opts.max_model_drafts = MaxDraftsPerItem(caps);
  opts.fork = caps.fork;
  opts.drafter_experts_on_gpu = config.drafter_experts == DrafterExperts::kGpu && (*model)->drafter() == SpecMethod::kDspark;
  opts.prefix_cache = !config.no_prefix_cache;
  opts.merge = MergeEnabled(config.merge_lanes, config.backend == Backend::kCuda);
  NLOG(INFO) << "numoe-gpu: merged passes " << (opts.merge ? "on" : "off") << " (--merge-lanes "
             << ChoiceName(config.merge_lanes) << ")";
  opts.prefix.budget_bytes = static_cast<int64_t>(config.prefix_cache_gb * double(int64_t{1} << 30));
  opts.prefix.checkpoint_tokens = config.prefix_checkpoint_tokens;
  opts.prefix.host_budget_bytes = static_cast<int64_t>(config.prefix_cache_host_gb * double(int64_t{1} << 30));
  // A checkpoint takes one of the CUDA backend's sequence slots (--max-sequences): keep most for running ones
  // (a running sequence that finds none free evicts checkpoints anyway: PrefixCache::MakeRoom).
  if (config.backend == Backend::kCuda) opts.prefix.max_entries = std::max<int64_t>(1, config.max_sequences / 4);
  if (Status st = ValidatePrefixCacheOptions(opts.prefix); !st.ok()) return fail(st);
  opts.gpu_prefill = config.backend == Backend::kCuda;
  opts.gpu_prefill_threshold = config.gpu_prefill_threshold;
  if (!opts.gpu_prefill) {
    NLOG(INFO) << "numoe-gpu: --gpu-prefill-threshold " << config.gpu_prefill_threshold << " unused: the " << backend
               << " backend computes no routed experts (GPU prefill needs --backend cuda)";
  } else if (config.gpu_prefill_threshold == 0) {
    NLOG(INFO) << "numoe-gpu: GPU prefill off (--gpu-prefill-threshold 0)";
  } else {
    NLOG(INFO) << "numoe-gpu: GPU prefill for workers that share their expert arena, threshold "
               << (config.gpu_prefill_threshold > 0 ? absl::StrCat(config.gpu_prefill_threshold, " rows")
                                                    : std::string("calibrated per worker"));
  }
  if (!opts.prefix_cache) {
    NLOG(INFO) << "numoe-gpu: prefix cache off (--no-prefix-cache)";
  } else if (!caps.fork) {
    NLOG(INFO) << "numoe-gpu: no prefix cache: the " << backend << " backend cannot copy a sequence's state";
  } else {
    NLOG(INFO) << "numoe-gpu: prefix cache of " << config.prefix_cache_gb << " GiB (then "
               << config.prefix_cache_host_gb << " GiB of host RAM) shared by every worker, a checkpoint "
               << (opts.prefix.checkpoint_tokens > 0 ? absl::StrCat("every ", opts.prefix.checkpoint_tokens, " prompt tokens and ") : std::string())
               << "at each prompt's and answer's end";
  }
  GpuServer server(model->get(), (*ckpt)->config(), opts);
  // Constrained output (response_format, forced tool calls) masks tokens by their bytes: the model's tokenizer.
  if (auto tok = tokenizer::Tokenizer::Load(config.model_dir); tok.ok()) {
    server.host().grammars = std::make_unique<tokenizer::GrammarCache>(
        tokenizer::GrammarVocab::FromTokenizer(**tok, (*model)->vocab_size()));
  } else {
    NLOG(WARNING) << "numoe-gpu: no tokenizer in " << config.model_dir << " (" << tok.status().message()
                  << "): constrained output (response_format, forced tool calls) is refused";
  }
  GpuGrpcService service(&server);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  const std::string addr = absl::StrCat(config.host, ":", config.port);
  // gRPC shares a port with SO_REUSEPORT by default: a second daemon on a taken port would start and take half
  // its connections. Off, so it fails to listen instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(addr, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> grpc_server = builder.BuildAndStart();
  if (grpc_server == nullptr || port == 0) {
    return fail(absl::UnavailableError(absl::StrCat("cannot listen on ", addr, " (port in use?)")));
  }
  const std::string bound = absl::StrCat(config.host, ":", port);
  NLOG(INFO) << "numoe-gpu: serving GpuService on " << bound << " (heartbeat " << opts.heartbeat_ms << " ms, lease "
             << server.lease_ms() << " ms)";
  NotifyReady(bound);

  const int sig = WaitForShutdownSignal();
  NLOG(INFO) << "numoe-gpu: signal " << sig << ", shutting down";
  server.Shutdown();  // workers see their channels closed
  const ModelHost& h = server.host();
  NLOG(INFO) << "numoe-gpu: served " << h.steps.load() << " steps, " << h.tokens.load() << " rows; speculative: "
             << h.spec_steps.load() << " verify steps, " << h.spec_drafted.load() << " drafts, "
             << h.spec_accepted.load() << " accepted; merged: " << h.merged_steps.load() << " steps in "
             << h.merged_passes.load() << " passes";
  grpc_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}

}  // namespace numoe::gpu
