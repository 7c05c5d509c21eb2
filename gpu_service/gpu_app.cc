#include "gpu_service/gpu_app.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <chrono>
#include <memory>
#include <thread>

#include "common/checkpoint.h"
#include "common/log.h"
#include "common/thread_pool.h"
#include "model/step.h"
#include "backends/cpu/cpu_model.h"
#include "backends/cuda/cuda_model.h"
#include "gpu_service/gpu_server.h"
#include "common/process.h"

namespace numoe::gpu {

namespace {

StatusOr<std::unique_ptr<ModelBackend>> CreateBackend(const GpuAppConfig& c, const Checkpoint& ckpt, ThreadPool* pool,
                                                      bool drafter) {
  if (c.backend == "cpu") {
    ASSIGN_OR_RETURN(auto model, cpu::CpuModel::Create(ckpt, pool, {.drafter = drafter}));
    return std::unique_ptr<ModelBackend>(std::move(model));
  }
  CudaOptions o;
  o.device = static_cast<int>(c.cuda_device);
  o.tp = static_cast<int>(c.tp);
  o.max_sequences = c.max_sequences;
  o.drafter = drafter;
  o.drafter_experts = c.drafter_experts;
  // Without a CUDA build this is the stub's UNAVAILABLE, which says so.
  auto model = CreateCudaModel(ckpt, o);
  if (!model.ok()) return Status(model.status().code(), absl::StrCat("--backend cuda: ", model.status().message()));
  return model;
}

// Resolves --spec against the checkpoint and the backend, before any weight is loaded. Errors say what to
// change.
StatusOr<SpecMethod> ResolveSpec(const GpuAppConfig& c, const Checkpoint& ckpt) {
  const std::string own = SpecMethodName(ckpt.drafter());
  // The CUDA backend runs the DSpark drafter on the device with --tp 1; it has no MTP drafter.
  auto cuda_lacks = [&](const std::string& m) -> std::string {
    if (c.backend != "cuda") return "";
    if (m == "mtp") return "the CUDA backend has no MTP drafter";
    if (m == "dspark" && c.tp != 1) return "the CUDA backend runs the DSpark drafter with --tp 1 only";
    return "";
  };
  if (c.spec == "auto") {
    if (const std::string why = cuda_lacks(own); !why.empty()) {
      NLOG(INFO) << "numoe-gpu: the checkpoint has a " << own << " drafter, but " << why << ": no model drafter";
      return SpecMethod::kNone;
    }
    return ParseSpecMethod(own);
  }
  auto m = ParseSpecMethod(c.spec);
  if (!m.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--spec must be auto, none, dspark, mtp or ngram (got '", c.spec, "')"));
  }
  if (*m == SpecMethod::kDspark || *m == SpecMethod::kMtp) {
    if (const std::string why = cuda_lacks(c.spec); !why.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("--spec ", c.spec, ": ", why, "; use --spec ngram or none, or --backend cpu"));
    }
    if (own != c.spec) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--spec ", c.spec, ": ", c.model_dir, " has ", own == std::string("none") ? "no drafter stages" : "a " + own +
          " drafter", " (", ckpt.mtp_stages(), " mtp.* stages, dspark_block_size ", ckpt.config().dspark_block_size,
          "); use --spec ", own == std::string("none") ? "ngram or none" : own + ", ngram or none"));
    }
  }
  return *m;
}

}  // namespace

int RunGpuApp(const GpuAppConfig& config) {
  BlockShutdownSignals();
  auto fail = [](const Status& st) {
    NLOG(ERROR) << "numoe-gpu: " << st;
    return 1;
  };
  if (config.backend != "cpu" && config.backend != "cuda") {
    return fail(absl::InvalidArgumentError(absl::StrCat("--backend must be cpu or cuda (got '", config.backend, "')")));
  }
  if ((config.drafter_experts != "worker" && config.drafter_experts != "gpu") ||
      (config.drafter_experts == "gpu" && config.backend != "cuda")) {
    return fail(absl::InvalidArgumentError(absl::StrCat("--drafter-experts must be worker, or gpu with --backend cuda (got '",
                                                        config.drafter_experts, "', --backend ", config.backend, ")")));
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto ckpt = Checkpoint::Open(config.model_dir);
  if (!ckpt.ok()) return fail(ckpt.status());
  auto fingerprint = ModelFingerprint(config.model_dir);
  if (!fingerprint.ok()) return fail(fingerprint.status());
  auto spec = ResolveSpec(config, **ckpt);
  if (!spec.ok()) return fail(spec.status());
  const bool load_drafter = *spec == SpecMethod::kDspark || *spec == SpecMethod::kMtp;
  // The CPU backend's matmuls run on this pool; one Forward at a time uses it (steps are serialised).
  const int threads = config.threads > 0 ? static_cast<int>(config.threads)
                                         : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  std::unique_ptr<ThreadPool> pool;
  if (config.backend == "cpu") pool = std::make_unique<ThreadPool>(threads);
  auto model = CreateBackend(config, **ckpt, pool.get(), load_drafter);
  if (!model.ok()) return fail(model.status());
  if (load_drafter && (*model)->drafter() != *spec) {
    return fail(absl::UnimplementedError(absl::StrCat("--spec ", SpecMethodName(*spec), ": the ", config.backend,
                                                      " backend loaded no ", SpecMethodName(*spec),
                                                      " drafter for this checkpoint; use --spec ngram or none")));
  }
  // Verification needs speculative steps and Rollback, which the backend declares.
  const Capabilities caps = (*model)->capabilities();
  const bool verify = caps.verify;
  if (!verify && *spec != SpecMethod::kNone) {
    return fail(absl::UnimplementedError(absl::StrCat("--spec ", SpecMethodName(*spec), ": the ", config.backend,
                                                      " backend cannot verify drafts yet (no Rollback); use --spec none")));
  }
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  NLOG(INFO) << "numoe-gpu: loaded " << config.model_dir << " on the " << config.backend << " backend in " << load_s
             << " s, " << (config.backend == "cpu" ? absl::StrCat(threads, " threads") : std::string("GPU"))
             << " (" << (*ckpt)->config().num_hidden_layers << " layers, hidden " << (*ckpt)->config().hidden_size
             << ", vocab " << (*ckpt)->config().vocab_size << "); drafter " << SpecMethodName((*model)->drafter())
             << (verify ? ", verifies drafts" : ", cannot verify drafts (speculative decoding off)");

  GpuServerOptions opts;
  opts.backend = config.backend;
  opts.fingerprint = *fingerprint;
  opts.heartbeat_ms = config.heartbeat_ms;
  opts.lease_ms = config.lease_ms;
  opts.max_workers = config.max_workers;
  opts.max_sequences = config.max_sequences;
  opts.channel.spin_us = static_cast<int>(config.spin_us);
  opts.drafter = (*model)->drafter();
  opts.verify = verify;
  opts.max_model_drafts = MaxDraftsPerItem(caps);
  opts.drafter_experts_on_gpu = config.drafter_experts == "gpu" && (*model)->drafter() == SpecMethod::kDspark;
  GpuServer server(model->get(), (*ckpt)->config(), opts);
  GpuGrpcService service(&server);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  const std::string addr = absl::StrCat(config.host, ":", config.port);
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
             << h.spec_accepted.load() << " accepted";
  grpc_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}

}  // namespace numoe::gpu
