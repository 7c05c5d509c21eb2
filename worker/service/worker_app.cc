#include "worker/service/worker_app.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <memory>

#include "common/checkpoint.h"
#include "common/log.h"
#include "common/process.h"
#include "common/shm_channel.h"
#include "common/thread_pool.h"
#include "worker/experts/reference_experts.h"
#include "model/spec_policy.h"
#include "model/step.h"
#include "worker/engine/engine.h"
#include "worker/engine/micro_batch_executor.h"
#include "worker/engine/remote_executor.h"
#include "worker/experts/inprocess.h"
#include "worker/experts/sim_experts.h"
#include "worker/service/gpu_client.h"
#include "worker/service/numa_bind.h"
#include "worker/service/progress.h"
#include "worker/service/worker_service.h"

namespace numoe::worker {

namespace {

// Loads the routed experts of every main layer into this (bound) process's memory: repacked for the
// CPU kernels (default), or dequantized to fp32 (reference: exact, small models only).
// `drafter`: also the MTP/DSpark stages' experts (layers num_hidden_layers + s), for numoe-gpu's drafter.
// `arena`: filled with the shared expert arena (GPU prefill) of packed experts; left unset otherwise.
StatusOr<std::unique_ptr<ExpertBackend>> LoadExperts(const WorkerAppConfig& c, const Checkpoint& ckpt, ThreadPool* pool,
                                                     const NumaBinding& binding, bool drafter, v1::ExpertArena* arena) {
  const ModelFootprint fp = StoredFootprint(ckpt);
  const int64_t total = fp.routed_expert_bytes + (drafter ? fp.mtp_routed_expert_bytes : 0);
  ProgressBar bar("loading routed experts", total);
  bar.Update(0);
  if (c.experts == ExpertsImpl::kReference) {
    ASSIGN_OR_RETURN(auto experts, cpu::ReferenceExperts::Load(ckpt, drafter));
    bar.Done(total);
    NLOG(INFO) << "numoe-worker: routed experts loaded as fp32 reference";
    return std::unique_ptr<ExpertBackend>(std::move(experts));
  }
  InProcessExpertsOptions o;
  o.numa_node = binding.memory_node;
  o.include_drafter = drafter;
  o.shared_arena = true;  // numoe-gpu may map it for GPU prefill (no copy: the same pages)
  // Progress in stored bytes (what the checkpoint holds), by layers packed.
  o.progress = [&](int64_t done, int64_t layers, int64_t) { bar.Update(layers > 0 ? total * done / layers : 0); };
  ASSIGN_OR_RETURN(auto experts, InProcessExperts::Load(ckpt, pool, o));
  bar.Done(total);
  NLOG(INFO) << "numoe-worker: routed experts packed for the " << IsaName(experts->isa()) << " kernels ("
             << experts->bytes() << " bytes, " << pool->size() << " threads; shared arena of "
             << experts->arena()->size() << " bytes, " << experts->arena()->page_mode() << " pages)";
  const HostExperts& h = *experts->host_experts();
  arena->set_fd(static_cast<uint32_t>(experts->arena()->fd()));
  arena->set_bytes(static_cast<uint64_t>(experts->arena()->size()));
  arena->set_num_experts(static_cast<uint32_t>(h.num_experts));
  arena->set_hidden(static_cast<uint32_t>(h.hidden));
  arena->set_inter(static_cast<uint32_t>(h.inter));
  arena->set_stride(static_cast<uint64_t>(h.stride));
  for (int64_t off : experts->arena_offsets()) arena->add_layer_offsets(static_cast<uint64_t>(off));
  return std::unique_ptr<ExpertBackend>(std::move(experts));
}

// The routed-expert time per row and layer at a prefill-sized batch (`rows` rows, random routing over every
// expert), for numoe-gpu's GPU prefill threshold: one call of layer 0, after a warm-up call.
StatusOr<double> MeasureExpertRowSeconds(ExpertBackend& experts, const ModelConfig& c, int64_t rows) {
  const int64_t K = c.num_experts_per_tok, D = c.hidden_size, E = c.n_routed_experts;
  std::vector<float> x(static_cast<size_t>(rows * D)), out(x.size()), w(static_cast<size_t>(rows * K), 1.0f / K);
  std::vector<int32_t> ids(static_cast<size_t>(rows * K));
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto next = [&] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  for (float& v : x) v = static_cast<float>(static_cast<int64_t>(next() % 2001) - 1000) * 1e-3f;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < K; ++k) ids[static_cast<size_t>(r * K + k)] = static_cast<int32_t>((next() % E + k) % E);
  }
  MoeRequest q{.layer = 0, .rows = rows, .top_k = K, .x = x.data(), .expert_ids = ids.data(),
               .expert_weights = w.data(), .out = out.data()};
  RETURN_IF_ERROR(experts.RunRouted(q));
  const auto t0 = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(experts.RunRouted(q));
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / static_cast<double>(rows);
}

std::string DefaultWorkerId(const std::vector<int>& nodes) {
  std::string id = "worker";
  for (int n : nodes) id += "-n" + std::to_string(n);
  return absl::StrCat(id, "-", getpid());
}

}  // namespace

int RunWorkerApp(const WorkerAppConfig& c) {
  BlockShutdownSignals();
  auto fail = [](const Status& st) {
    NLOG(ERROR) << "numoe-worker: " << st;
    return 1;
  };
  // 1. NUMA: the placement the launcher decided (threads and memory on the node(s)), applied before
  // anything big is allocated.
  WorkerPlacement placement;
  if (!c.no_numa_bind) placement.nodes = c.numa_nodes;
  placement.threads = static_cast<int>(c.threads);
  placement.thread_cpus = c.cpus;
  auto applied = ApplyPlacement(placement);
  if (!applied.ok()) return fail(applied.status());
  const NumaBinding binding = std::move(*applied);
  NLOG(INFO) << "numoe-worker: " << binding.description;
  const bool sim = c.sim_expert_gbps > 0;
  // Simulated experts compute nothing: no kernel threads.
  auto pool = ThreadPool::Create({.num_threads = sim ? 1 : binding.threads, .cpus = sim ? std::vector<int>{} : binding.cpus});
  if (!pool.ok()) return fail(pool.status());

  // 2. The model's routed experts.
  auto ckpt = Checkpoint::Open(c.model_dir);
  if (!ckpt.ok()) return fail(ckpt.status());
  auto fingerprint = ModelFingerprint(c.model_dir);
  if (!fingerprint.ok()) return fail(fingerprint.status());
  // --spec against the checkpoint before loading (a bad flag fails at once); numoe-gpu's backend is not
  // known yet, so --spec auto stays open until registration (CheckSpecAgainstGpu).
  auto spec = ResolveSpec(SpecFlags{.spec = c.spec, .depth = c.spec_depth, .adaptive = c.spec_adaptive},
                          DrafterOf(**ckpt, c.model_dir), DrafterSupport{});
  if (!spec.ok()) return fail(spec.status());
  const bool load_drafter_experts = spec->load != SpecMethod::kNone;
  const bool drafter_experts_here = load_drafter_experts && c.drafter_experts == DrafterExperts::kWorker;
  // The checkpoint's config and tensor geometry were checked by Open either way; simulated experts read
  // none of the experts' bytes.
  v1::ExpertArena arena;
  StatusOr<std::unique_ptr<ExpertBackend>> experts =
      sim ? StatusOr<std::unique_ptr<ExpertBackend>>(std::make_unique<SimExperts>((*ckpt)->config(), c.sim_expert_gbps))
          : LoadExperts(c, **ckpt, pool->get(), binding, drafter_experts_here, &arena);
  if (!experts.ok()) return fail(experts.status());
  // numoe-gpu weighs this against its upload bandwidth to pick the GPU prefill threshold.
  const int64_t probe_rows = std::clamp<int64_t>(c.max_step_tokens, 1, 512);
  auto row_seconds = MeasureExpertRowSeconds(**experts, (*ckpt)->config(), probe_rows);
  if (!row_seconds.ok()) return fail(row_seconds.status());
  NLOG(INFO) << "numoe-worker: routed experts take " << *row_seconds * 1e6 << " us per row per layer at " << probe_rows
             << " rows";
  std::string experts_text = "routed experts computed here";
  if (sim) {
    const int64_t bytes = SimExperts::ExpertBytes((*ckpt)->config());
    experts_text = absl::StrCat("simulated routed experts at ", c.sim_expert_gbps, " GB/s (none loaded: no arena, no "
                                "repack; each MoE call sleeps ", bytes, " bytes per distinct expert / G and returns "
                                "zeros)");
    NLOG(INFO) << "numoe-worker: --sim-expert-gbps " << c.sim_expert_gbps << ": " << experts_text;
  }

  // 3. numoe-gpu: register, attach the channel, keep the lease; once per micro-batch (each its own session,
  // channel and lane there; the second and further named "<id>:mb<i>").
  const std::string worker_id = c.worker_id.empty() ? DefaultWorkerId(binding.nodes) : c.worker_id;
  v1::RegisterRequest reg;
  reg.set_worker_id(worker_id);
  reg.set_pid(static_cast<uint32_t>(getpid()));
  reg.set_model_fingerprint(*fingerprint);
  reg.set_max_sequences(static_cast<uint32_t>(c.max_seqs));
  reg.set_max_step_tokens(static_cast<uint32_t>(c.max_step_tokens));
  reg.set_expert_row_seconds(*row_seconds);
  if (arena.layer_offsets_size() > 0) *reg.mutable_expert_arena() = arena;
  std::vector<std::unique_ptr<GpuClient>> gpus;
  std::vector<std::unique_ptr<shm::Channel>> channels;
  auto release_all = [&] {
    for (auto& g : gpus) (void)g->Release();
  };
  const int64_t parts = std::max<int64_t>(c.micro_batches, 1);
  // The prefill lane is one more session, after the micro-batches'; with it every session shares the first's
  // sequences (a sequence prefilled in the lane decodes in its micro-batch).
  const bool lane = c.prefill_lane_tokens > 0;
  for (int64_t part = 0; part < parts + (lane ? 1 : 0); ++part) {
    if (part > 0) reg.set_worker_id(part == parts ? absl::StrCat(worker_id, ":lane") : absl::StrCat(worker_id, ":mb", part));
    if (part > 0 && lane) reg.set_share_sequences_with(gpus.front()->registration().lease());
    reg.set_prefill_lane(part == parts);
    auto gpu = GpuClient::Register(c.gpu_address, reg, c.gpu_wait_ms);
    if (!gpu.ok()) {
      release_all();
      return fail(gpu.status());
    }
    gpus.push_back(std::move(*gpu));
    const v1::RegisterResponse& r = gpus.back()->registration();
    if (load_drafter_experts && !drafter_experts_here && !r.drafter_experts_on_gpu()) {
      release_all();
      return fail(absl::FailedPreconditionError(
          "--drafter-experts gpu: numoe-gpu runs the drafter's routed experts on the workers; start numoe-gpu with "
          "--drafter-experts gpu (--backend cuda) or this worker with --drafter-experts worker"));
    }
    if (part == 0 && drafter_experts_here && r.drafter_experts_on_gpu()) {
      NLOG(WARNING) << "numoe-worker: numoe-gpu runs the drafter's routed experts itself; this worker's copy is unused "
                       "(start it with --drafter-experts gpu to save the memory)";
    }
    auto channel = shm::Channel::Attach(r.shm_name());
    if (!channel.ok()) {
      release_all();
      return fail(channel.status());
    }
    (void)shm::Channel::RemoveName(r.shm_name());  // mapped: the name is no longer needed by anyone
    channels.push_back(std::move(*channel));
    gpus.back()->StartHeartbeats();
    NLOG(INFO) << "numoe-worker: registered with numoe-gpu at " << c.gpu_address << " (lease " << r.lease() << ", "
               << r.backend() << " backend, channel " << r.shm_name() << ", " << r.max_sequences() << " sequences x "
               << r.max_step_tokens() << " tokens per step; GPU prefill "
               << (r.gpu_prefill() ? "on: numoe-gpu mapped the expert arena" : "off")
               << (part == parts ? std::string("; the prefill lane")
                   : parts > 1 ? absl::StrCat("; micro-batch ", part + 1, " of ", parts) : std::string())
               << ")";
  }

  // 4. The engine over the remote executor(s): one per channel, their expert calls taking turns.
  engine::SerialExperts serial(experts->get(), (*ckpt)->config().hidden_size, c.prefill_lane_piece_rows);
  std::vector<std::unique_ptr<engine::RemoteExecutor>> remotes;
  std::vector<engine::Executor*> executor_parts;
  for (size_t i = 0; i < channels.size(); ++i) {
    // Sessions sharing one sequence table take keys from ranges of their own.
    const engine::ExecSeq first_key = lane ? (static_cast<engine::ExecSeq>(i) << 40) + 1 : 1;
    const bool is_lane = lane && i + 1 == channels.size();
    remotes.push_back(std::make_unique<engine::RemoteExecutor>(channels[i].get(), is_lane ? serial.lane() : &serial,
                                                               first_key));
    if (!is_lane) executor_parts.push_back(remotes.back().get());
  }
  engine::MicroBatchExecutor executor(executor_parts, &serial, lane ? remotes.back().get() : nullptr);
  if (Status st = CheckSpecAgainstGpu(&*spec, ChannelCapabilities(channels[0]->geometry())); !st.ok()) {
    release_all();
    return fail(st);
  }
  engine::EngineOptions eo{.max_seqs = c.max_seqs,
                           .max_step_tokens = c.max_step_tokens,
                           .prefill_chunk = c.prefill_chunk,
                           .max_queue = c.max_queue,
                           .eos_token_id = (*ckpt)->config().eos_token_id,
                           .max_context = (*ckpt)->config().max_position_embeddings,
                           .spec = spec->config,
                           .prefill_lane_tokens = c.prefill_lane_tokens};
  if (Status st = engine::ValidateEngineOptions(eo); !st.ok()) return fail(st);
  engine::Engine engine(&executor, eo);
  engine.Start();

  // 5. The Worker service.
  WorkerGrpcService service(&engine, WorkerServiceOptions{.worker_id = worker_id,
                                                          .numa_nodes = binding.nodes,
                                                          .default_max_tokens = c.default_max_tokens});
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  const std::string addr = absl::StrCat(c.host, ":", c.port);
  // gRPC shares a port with SO_REUSEPORT by default: a second daemon on a taken port would start and take half
  // its connections. Off, so it fails to listen instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(addr, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    release_all();  // numoe-gpu frees our sessions now, not when their leases run out
    return fail(absl::UnavailableError(absl::StrCat("cannot listen on ", addr, " (port in use?)")));
  }
  const std::string bound = absl::StrCat(c.host, ":", port);
  NLOG(INFO) << "numoe-worker " << worker_id << ": serving Worker on " << bound << " (max " << eo.max_seqs
             << " sequences, " << engine.options().max_step_tokens << " tokens per step, prefill chunk "
             << eo.prefill_chunk << ", " << parts << (parts == 1 ? " micro-batch" : " micro-batches")
             << (lane ? absl::StrCat(", prefill lane for prompts of ", c.prefill_lane_tokens, "+ tokens")
                      : std::string(", no prefill lane"))
             << ", speculative decoding "
             << (eo.spec.method == SpecMethod::kNone
                     ? std::string("off")
                     : absl::StrCat(SpecMethodName(eo.spec.method), " depth ", eo.spec.depth,
                                    eo.spec.adaptive ? " adaptive" : ""))
             << "; " << experts_text << ")";
  NotifyReady(bound);

  // 6. Until a signal, or until numoe-gpu is gone (lease lost, channel broken, or its process exited:
  // checked here too, so an idle worker notices at once rather than at its next step).
  Status gone;
  const int sig = WaitForShutdownSignal([&] {
    for (auto& g : gpus) {
      if (g->lost()) {
        gone = g->lost_status();
        return true;
      }
    }
    if (!engine.healthy()) {
      gone = absl::UnavailableError("the shared-memory channel failed");
      return true;
    }
    for (auto& ch : channels) {
      gone = ch->PeerStatus();
      if (!gone.ok()) return true;
    }
    return false;
  });
  int rc = 0;
  if (sig != 0) {
    NLOG(INFO) << "numoe-worker: signal " << sig << ", shutting down";
  } else {
    NLOG(ERROR) << "numoe-worker: lost numoe-gpu (" << gone << "); exiting";
    rc = 1;
  }
  engine.Stop();  // ends every stream (UNAVAILABLE) and flushes closes to numoe-gpu
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (rc == 0) release_all();
  return rc;
}

}  // namespace numoe::worker
