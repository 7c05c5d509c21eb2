#include "router/balancer/grpc_worker_client.h"

#include <chrono>
#include <mutex>

#include <grpcpp/grpcpp.h>

#include "common/grpc_status.h"
#include "numoe/v1/worker.grpc.pb.h"

namespace numoe::router {

namespace {

// One Generate stream. Owns itself from StartCall until OnDone (the self_ reference), as the callback API
// requires the reactor to outlive the call.
class GenerateReactor : public grpc::ClientReadReactor<v1::WorkerGenerateResponse>, public WorkerCall {
 public:
  GenerateReactor(std::shared_ptr<v1::Worker::Stub> stub, std::shared_ptr<WorkerCallSink> sink)
      : stub_(std::move(stub)), sink_(std::move(sink)) {}

  static std::shared_ptr<GenerateReactor> Start(std::shared_ptr<v1::Worker::Stub> stub,
                                                const v1::WorkerGenerateRequest& request, double timeout_seconds,
                                                std::shared_ptr<WorkerCallSink> sink) {
    auto r = std::make_shared<GenerateReactor>(std::move(stub), std::move(sink));
    r->self_ = r;
    if (timeout_seconds > 0) {
      r->context_.set_deadline(std::chrono::system_clock::now() +
                               std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000)));
    }
    r->request_ = request;
    r->stub_->async()->Generate(&r->context_, &r->request_, r.get());
    r->StartRead(&r->response_);
    r->StartCall();
    return r;
  }

  void Cancel() override { context_.TryCancel(); }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended; OnDone follows with the status
    sink_->OnResponse(response_);
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override {
    sink_->OnEnd(FromGrpcStatus(status));
    sink_.reset();
    std::shared_ptr<GenerateReactor> keep = std::move(self_);  // released when this function returns
  }

 private:
  std::shared_ptr<v1::Worker::Stub> stub_;
  std::shared_ptr<WorkerCallSink> sink_;
  std::shared_ptr<GenerateReactor> self_;
  grpc::ClientContext context_;
  v1::WorkerGenerateRequest request_;
  v1::WorkerGenerateResponse response_;
};

class GrpcWorkerClient : public WorkerClient {
 public:
  explicit GrpcWorkerClient(const std::string& address) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 200);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    // Separate workers on one host must get separate connections (the default subchannel pool would share).
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
    stub_ = std::shared_ptr<v1::Worker::Stub>(v1::Worker::NewStub(channel));
  }

  std::shared_ptr<WorkerCall> Generate(const v1::WorkerGenerateRequest& request, double timeout_seconds,
                                       std::shared_ptr<WorkerCallSink> sink) override {
    return GenerateReactor::Start(stub_, request, timeout_seconds, std::move(sink));
  }

  void Stats(double timeout_seconds, std::function<void(StatusOr<v1::WorkerStats>)> done) override {
    struct Call {
      grpc::ClientContext context;
      v1::WorkerStatsRequest request;
      v1::WorkerStats response;
    };
    auto call = std::make_shared<Call>();
    call->context.set_deadline(std::chrono::system_clock::now() +
                               std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000)));
    stub_->async()->Stats(&call->context, &call->request, &call->response,
                          [call, done = std::move(done), stub = stub_](grpc::Status status) {
                            if (status.ok()) {
                              done(call->response);
                            } else {
                              done(FromGrpcStatus(status));
                            }
                          });
  }

 private:
  std::shared_ptr<v1::Worker::Stub> stub_;
};

}  // namespace

std::unique_ptr<WorkerClient> MakeGrpcWorkerClient(const std::string& address) {
  return std::make_unique<GrpcWorkerClient>(address);
}

}  // namespace numoe::router
