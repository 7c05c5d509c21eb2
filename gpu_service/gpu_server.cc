#include "gpu_service/gpu_server.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "common/log.h"
#include "common/grpc_status.h"

namespace numoe::gpu {

GpuServer::GpuServer(ModelBackend* model, const ModelConfig& config, const GpuServerOptions& options)
    : config_(config), options_(options) {
  host_.model = model;
  host_.interleaved_steps = model->capabilities().interleaved_steps;
  host_.lanes = model->capabilities().lanes;
  host_.merge = options_.merge;
  if (options_.prefix_cache && model->capabilities().fork) {
    prefix_cache_ = std::make_unique<PrefixCache>(model, options_.prefix);
    host_.prefix_cache = prefix_cache_.get();
  }
  // Leases start at a random point so a worker of a previous numoe-gpu run (same port) can never pass
  // for a current one: its heartbeat gets NOT_FOUND.
  std::random_device rd;
  next_lease_ = ((uint64_t{rd()} << 32 | rd()) & 0xffffffffffffull) + 1;
  if (options_.lease_ms <= 0) options_.lease_ms = 4 * options_.heartbeat_ms;
  janitor_ = std::thread([this] { Janitor(); });
}

GpuServer::~GpuServer() { Shutdown(); }

StatusOr<v1::RegisterResponse> GpuServer::Register(const v1::RegisterRequest& req) {
  if (req.model_fingerprint() != options_.fingerprint) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model_fingerprint: the worker loaded a different model (", req.model_fingerprint(),
        ") than numoe-gpu serves (", options_.fingerprint, "); start both with the same --model"));
  }
  if (req.max_sequences() < 1 || req.max_sequences() > options_.max_sequences) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_sequences must be in [1, ", options_.max_sequences, "] (got ", req.max_sequences(), ")"));
  }
  if (req.max_step_tokens() < 1 || req.max_step_tokens() > options_.max_step_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("max_step_tokens must be in [1, ", options_.max_step_tokens,
                                                   "] (got ", req.max_step_tokens(), ")"));
  }
  if (!std::isfinite(req.expert_row_seconds()) || req.expert_row_seconds() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert_row_seconds must be finite and >= 0 (got ", req.expert_row_seconds(), ")"));
  }
  // GPU prefill: the worker's expert arena, checked against the model and mapped (before anything is created).
  std::unique_ptr<MappedExpertArena> arena;
  if (req.has_expert_arena() && options_.gpu_prefill && options_.gpu_prefill_threshold != 0) {
    const v1::ExpertArena& a = req.expert_arena();
    ExpertArenaSpec spec{.pid = req.pid(),
                         .fd = a.fd(),
                         .bytes = static_cast<int64_t>(std::min<uint64_t>(a.bytes(), uint64_t{1} << 62)),
                         .num_experts = a.num_experts(),
                         .hidden = a.hidden(),
                         .inter = a.inter(),
                         .stride = static_cast<int64_t>(std::min<uint64_t>(a.stride(), uint64_t{1} << 62))};
    for (uint64_t off : a.layer_offsets()) spec.layer_offsets.push_back(static_cast<int64_t>(std::min<uint64_t>(off, uint64_t{1} << 62)));
    auto mapped = MappedExpertArena::Map(spec, config_);
    if (absl::IsInvalidArgument(mapped.status())) return mapped.status();
    if (!mapped.ok()) {
      NLOG(WARNING) << "GPU prefill off for worker " << req.worker_id() << ": " << mapped.status();
    } else {
      arena = std::move(*mapped);
    }
  }
  shm::Geometry g;
  g.hidden = static_cast<uint32_t>(config_.hidden_size);
  g.top_k = static_cast<uint32_t>(config_.num_experts_per_tok);
  g.max_rows = req.max_step_tokens();
  g.max_seqs = req.max_sequences();
  g.vocab = static_cast<uint32_t>(config_.vocab_size);
  g.logits_rows = req.return_logits() ? g.max_seqs : 0;
  if (options_.drafter == SpecMethod::kDspark || options_.drafter == SpecMethod::kMtp) {
    g.drafter = options_.drafter;
    g.max_model_drafts = static_cast<uint32_t>(std::clamp<int64_t>(options_.max_model_drafts, 1, 4096));
  }
  g.verify = options_.verify || g.drafter != SpecMethod::kNone ? 1 : 0;
  g.fork = options_.fork ? 1 : 0;

  uint64_t lease;
  std::shared_ptr<SequenceTable> table;  // null: the session's own
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (shutdown_) return absl::UnavailableError("numoe-gpu is shutting down");
    if (req.share_sequences_with() != 0) {
      auto it = sessions_.find(req.share_sequences_with());
      if (it == sessions_.end() || it->second->info().pid != req.pid() || it->second->ended()) {
        return absl::InvalidArgumentError(absl::StrCat("share_sequences_with: lease ", req.share_sequences_with(),
                                                       " is not a live session of this worker (pid ", req.pid(), ")"));
      }
      table = it->second->table();
    }
    if (static_cast<int64_t>(sessions_.size()) >= options_.max_workers) {
      return absl::ResourceExhaustedError(absl::StrCat("numoe-gpu already serves ", sessions_.size(),
                                                       " workers (--max-workers)"));
    }
    lease = next_lease_++;
  }
  const std::string name = absl::StrCat("/numoe-gpu-", getpid(), "-", lease);
  ASSIGN_OR_RETURN(auto channel, shm::Channel::Create(name, g, options_.channel));
  const uint64_t bytes = channel->bytes();
  auto session = std::make_unique<WorkerSession>(
      &host_,
      SessionInfo{.lease = lease, .worker_id = req.worker_id(), .pid = req.pid(), .background = req.prefill_lane()},
      std::move(channel),
      std::move(table));
  const bool gpu_prefill = arena != nullptr;
  if (gpu_prefill) session->SetExpertArena(std::move(arena), options_.gpu_prefill_threshold, req.expert_row_seconds());
  session->Start([this](uint64_t gone) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      to_free_.push_back(gone);
    }
    cv_.notify_all();
  });
  {
    std::lock_guard<std::mutex> lk(mu_);
    sessions_.emplace(lease, std::move(session));
  }
  NLOG(INFO) << "worker " << req.worker_id() << " (pid " << req.pid() << ") registered: lease " << lease
             << ", channel " << name << " (" << bytes / 1024 << " KiB, " << g.max_seqs << " sequences x "
             << g.max_rows << " tokens per step, drafter " << SpecMethodName(options_.drafter)
             << (g.verify ? ", verifies drafts)" : ")");
  v1::RegisterResponse resp;
  resp.set_lease(lease);
  resp.set_shm_name(name);
  resp.set_shm_bytes(bytes);
  resp.set_hidden_size(g.hidden);
  resp.set_num_layers(static_cast<uint32_t>(config_.num_hidden_layers));
  resp.set_top_k(g.top_k);
  resp.set_vocab_size(g.vocab);
  resp.set_heartbeat_ms(static_cast<uint32_t>(options_.heartbeat_ms));
  resp.set_max_step_tokens(g.max_rows);
  resp.set_max_sequences(g.max_seqs);
  resp.set_logits_rows(g.logits_rows);
  resp.set_lease_ms(static_cast<uint32_t>(options_.lease_ms));
  resp.set_backend(options_.backend);
  resp.set_drafter_experts_on_gpu(options_.drafter_experts_on_gpu);
  resp.set_gpu_prefill(gpu_prefill);
  return resp;
}

Status GpuServer::Heartbeat(uint64_t lease) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = sessions_.find(lease);
  if (it == sessions_.end() || it->second->ended()) {
    return absl::NotFoundError(absl::StrCat("lease ", lease, " is unknown or expired; register again"));
  }
  it->second->Touch();
  return absl::OkStatus();
}

Status GpuServer::Release(uint64_t lease) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (sessions_.count(lease) == 0) return absl::NotFoundError(absl::StrCat("lease ", lease, " is unknown"));
    to_free_.push_back(lease);
  }
  cv_.notify_all();
  return absl::OkStatus();
}

v1::GpuStats GpuServer::Stats() const {
  v1::GpuStats s;
  s.set_backend(options_.backend);
  s.set_steps(host_.steps.load());
  s.set_tokens(host_.tokens.load());
  s.set_layer_hops(host_.hops.count());
  s.set_overlapped_steps(host_.overlapped_steps.load());
  s.set_merged_steps(host_.merged_steps.load());
  s.set_merged_passes(host_.merged_passes.load());
  s.set_merge_lanes(host_.merge);
  s.set_layer_hop_p50_us(host_.hops.Percentile(50));
  s.set_layer_hop_p99_us(host_.hops.Percentile(99));
  if (prefix_cache_ != nullptr) {
    const PrefixCacheStats p = prefix_cache_->stats();
    s.set_prefix_cache(true);
    s.set_prefix_queried_tokens(p.queried_tokens);
    s.set_prefix_hit_tokens(p.hit_tokens);
    s.set_prefix_checkpoints(static_cast<uint64_t>(p.entries));
    s.set_prefix_bytes(static_cast<uint64_t>(p.bytes));
    s.set_prefix_budget_bytes(static_cast<uint64_t>(p.budget_bytes));
    s.set_prefix_evicted(p.evicted);
    s.set_prefix_host_checkpoints(static_cast<uint64_t>(p.host_entries));
    s.set_prefix_host_bytes(static_cast<uint64_t>(p.host_bytes));
    s.set_prefix_host_pages(static_cast<uint64_t>(p.host_pages));
    s.set_prefix_host_budget_bytes(static_cast<uint64_t>(p.host_budget_bytes));
    s.set_prefix_host_stored(p.host_stored);
    s.set_prefix_host_evicted(p.host_evicted);
    s.set_prefix_host_hits(p.host_hits);
  }
  const int64_t now = SteadyMillis();
  std::lock_guard<std::mutex> lk(mu_);
  uint32_t seqs = 0;
  for (const auto& [lease, w] : sessions_) {
    v1::GpuWorkerStats* ws = s.add_worker_stats();
    ws->set_worker_id(w->info().worker_id);
    ws->set_lease(lease);
    ws->set_pid(w->info().pid);
    ws->set_sequences(static_cast<uint32_t>(w->sequences()));
    ws->set_steps(w->steps());
    ws->set_tokens(w->tokens());
    ws->set_heartbeat_age_ms(static_cast<uint64_t>(std::max<int64_t>(now - w->last_heartbeat_ms(), 0)));
    seqs += static_cast<uint32_t>(w->sequences());
  }
  s.set_workers(static_cast<uint32_t>(sessions_.size()));
  s.set_sequences(seqs);
  return s;
}

void GpuServer::Reap(std::vector<std::unique_ptr<WorkerSession>>* doomed, const char* why) {
  for (auto& w : *doomed) {
    const int64_t seqs = w->sequences();
    w->Stop();  // joins its thread and releases its sequences (outside mu_: may wait for a Forward)
    NLOG(INFO) << "freed worker " << w->info().worker_id << " (lease " << w->info().lease << "): " << why << "; "
               << seqs << " sequences released";
  }
  doomed->clear();
}

void GpuServer::Janitor() {
  const auto tick = std::chrono::milliseconds(std::max<int64_t>(options_.heartbeat_ms / 4, 10));
  for (;;) {
    std::vector<std::unique_ptr<WorkerSession>> gone, expired;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait_for(lk, tick, [&] { return shutdown_ || !to_free_.empty(); });
      if (shutdown_) return;
      for (uint64_t lease : to_free_) {
        auto it = sessions_.find(lease);
        if (it == sessions_.end()) continue;
        gone.push_back(std::move(it->second));
        sessions_.erase(it);
      }
      to_free_.clear();
      const int64_t now = SteadyMillis();
      for (auto it = sessions_.begin(); it != sessions_.end();) {
        if (now - it->second->last_heartbeat_ms() > options_.lease_ms) {
          expired.push_back(std::move(it->second));
          it = sessions_.erase(it);
        } else {
          // The name is only needed until the worker has mapped the channel.
          if (it->second->channel()->peer_attached()) (void)it->second->channel()->Unlink();
          ++it;
        }
      }
    }
    Reap(&gone, "released, or its process exited");
    Reap(&expired, "its lease expired (no heartbeat)");
  }
}

void GpuServer::Shutdown() {
  std::map<uint64_t, std::unique_ptr<WorkerSession>> all;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (shutdown_) return;
    shutdown_ = true;
    all.swap(sessions_);
  }
  cv_.notify_all();
  if (janitor_.joinable()) janitor_.join();
  for (auto& [lease, w] : all) w->Stop();
}

// ---- gRPC edge ----

grpc::ServerUnaryReactor* GpuGrpcService::Register(grpc::CallbackServerContext* ctx, const v1::RegisterRequest* request,
                                                   v1::RegisterResponse* response) {
  auto* reactor = ctx->DefaultReactor();
  auto r = server_->Register(*request);
  if (r.ok()) *response = std::move(*r);
  reactor->Finish(ToGrpcStatus(r.status()));
  return reactor;
}

grpc::ServerUnaryReactor* GpuGrpcService::Heartbeat(grpc::CallbackServerContext* ctx,
                                                    const v1::HeartbeatRequest* request, v1::HeartbeatResponse*) {
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(server_->Heartbeat(request->lease())));
  return reactor;
}

grpc::ServerUnaryReactor* GpuGrpcService::Stats(grpc::CallbackServerContext* ctx, const v1::GpuStatsRequest*,
                                                v1::GpuStats* response) {
  auto* reactor = ctx->DefaultReactor();
  *response = server_->Stats();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* GpuGrpcService::Release(grpc::CallbackServerContext* ctx, const v1::ReleaseRequest* request,
                                                  v1::ReleaseResponse*) {
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(server_->Release(request->lease())));
  return reactor;
}

}  // namespace numoe::gpu
