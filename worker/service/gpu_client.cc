#include "worker/service/gpu_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>

#include "common/log.h"
#include "common/grpc_status.h"

namespace numoe::worker {

namespace {
using Clock = std::chrono::steady_clock;
}

StatusOr<std::unique_ptr<GpuClient>> GpuClient::Register(const std::string& address,
                                                         const v1::RegisterRequest& request, int64_t wait_ms) {
  auto c = std::unique_ptr<GpuClient>(new GpuClient());
  c->stub_ = v1::GpuService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  const auto deadline = Clock::now() + std::chrono::milliseconds(wait_ms);
  auto backoff = std::chrono::milliseconds(100);
  for (int attempt = 1;; ++attempt) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Status st = c->stub_->Register(&ctx, request, &c->registration_);
    if (st.ok()) return c;
    Status s = FromGrpcStatus(st, absl::StrCat("register with numoe-gpu at ", address));
    if (st.error_code() != grpc::StatusCode::UNAVAILABLE || Clock::now() + backoff > deadline) return s;
    if (attempt == 1 || attempt % 10 == 0) NLOG(INFO) << s << " (retrying)";
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
  }
}

GpuClient::~GpuClient() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Status GpuClient::lost_status() const {
  std::lock_guard<std::mutex> lk(mu_);
  return lost_status_;
}

void GpuClient::StartHeartbeats() {
  thread_ = std::thread([this] { HeartbeatLoop(); });
}

void GpuClient::HeartbeatLoop() {
  const auto every = std::chrono::milliseconds(std::max<uint32_t>(registration_.heartbeat_ms(), 10));
  const auto lease = std::chrono::milliseconds(std::max<uint32_t>(registration_.lease_ms(), 100));
  auto last_ok = Clock::now();
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    cv_.wait_for(lk, every, [&] { return stop_; });
    if (stop_) break;
    lk.unlock();
    v1::HeartbeatRequest req;
    req.set_lease(registration_.lease());
    v1::HeartbeatResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + every * 2);
    grpc::Status st = stub_->Heartbeat(&ctx, req, &resp);
    lk.lock();
    if (st.ok()) {
      last_ok = Clock::now();
      continue;
    }
    if (st.error_code() == grpc::StatusCode::NOT_FOUND || Clock::now() - last_ok > lease) {
      lost_status_ = FromGrpcStatus(st, "heartbeat to numoe-gpu");
      lost_.store(true);
      NLOG(ERROR) << "lost the numoe-gpu lease: " << lost_status_;
      break;
    }
  }
}

Status GpuClient::Release() {
  v1::ReleaseRequest req;
  req.set_lease(registration_.lease());
  v1::ReleaseResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return FromGrpcStatus(stub_->Release(&ctx, req, &resp), "release from numoe-gpu");
}

}  // namespace numoe::worker
