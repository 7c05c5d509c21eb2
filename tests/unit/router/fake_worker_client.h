// In-process fake workers for the router's unit tests: each Generate call is recorded and driven by the test
// (tokens, end, failure), or answered at once by an echo rule.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "router/balancer/balancer.h"
#include "router/balancer/worker_client.h"

namespace numoe::router::testing {

struct FakeCall : WorkerCall {
  std::string worker;
  v1::WorkerGenerateRequest request;
  std::shared_ptr<WorkerCallSink> sink;
  std::atomic<bool> cancelled{false};
  std::atomic<bool> ended{false};
  bool end_on_cancel = true;

  void Cancel() override {
    cancelled = true;
    if (end_on_cancel) End(absl::CancelledError("cancelled"));
  }
  void Tokens(std::vector<int32_t> ids, const std::string& finish = "", uint32_t index = 0) {
    if (ended) return;
    v1::WorkerGenerateResponse r;
    r.mutable_token_ids()->Assign(ids.begin(), ids.end());
    r.set_finish_reason(finish);
    r.set_index(index);
    sink->OnResponse(r);
  }
  void End(const Status& s = absl::OkStatus()) {
    if (!ended.exchange(true)) sink->OnEnd(s);
  }
};

// Shared state of every fake worker of one test.
struct FakeCluster {
  enum class Mode {
    kManual,  // calls wait for the test
    kEcho,    // prompt (without a leading BOS) echoed cyclically up to max_new_tokens, then OK, inside Generate
  };
  std::mutex mu;
  Mode mode = Mode::kManual;
  std::map<std::string, bool> stats_ok;        // default true
  std::map<std::string, uint32_t> max_sequences;
  std::map<std::string, absl::StatusCode> fail_generate;  // fail at once with this code
  std::vector<std::shared_ptr<FakeCall>> calls;

  std::vector<std::shared_ptr<FakeCall>> Calls() {
    std::lock_guard<std::mutex> lock(mu);
    return calls;
  }
  size_t CallsTo(const std::string& w) {
    std::lock_guard<std::mutex> lock(mu);
    size_t n = 0;
    for (auto& c : calls) n += c->worker == w ? 1 : 0;
    return n;
  }
};

class FakeWorkerClient : public WorkerClient {
 public:
  FakeWorkerClient(std::string address, std::shared_ptr<FakeCluster> cluster)
      : address_(std::move(address)), cluster_(std::move(cluster)) {}

  std::shared_ptr<WorkerCall> Generate(const v1::WorkerGenerateRequest& request, double,
                                       std::shared_ptr<WorkerCallSink> sink) override {
    auto call = std::make_shared<FakeCall>();
    call->worker = address_;
    call->request = request;
    call->sink = std::move(sink);
    FakeCluster::Mode mode;
    std::optional<absl::StatusCode> fail;
    {
      std::lock_guard<std::mutex> lock(cluster_->mu);
      cluster_->calls.push_back(call);
      mode = cluster_->mode;
      auto it = cluster_->fail_generate.find(address_);
      if (it != cluster_->fail_generate.end()) fail = it->second;
    }
    if (fail) {
      call->End(Status(*fail, "fake failure"));
    } else if (mode == FakeCluster::Mode::kEcho) {
      std::vector<int32_t> prompt(request.prompt_ids().begin(), request.prompt_ids().end());
      if (prompt.size() > 1 && prompt.front() == 0) prompt.erase(prompt.begin());  // BOS (0 in tiny-v4)
      for (uint32_t i = 0; i < request.max_new_tokens() && !call->cancelled; ++i) {
        call->Tokens({prompt[i % prompt.size()]}, i + 1 == request.max_new_tokens() ? "length" : "");
      }
      call->End();
    }
    return call;
  }

  void Stats(double, std::function<void(StatusOr<v1::WorkerStats>)> done) override {
    bool ok = true;
    uint32_t max_seq = 4;
    {
      std::lock_guard<std::mutex> lock(cluster_->mu);
      if (auto it = cluster_->stats_ok.find(address_); it != cluster_->stats_ok.end()) ok = it->second;
      if (auto it = cluster_->max_sequences.find(address_); it != cluster_->max_sequences.end()) max_seq = it->second;
    }
    if (!ok) {
      done(absl::UnavailableError("fake: down"));
      return;
    }
    v1::WorkerStats s;
    s.set_worker_id(address_);
    s.set_max_sequences(max_seq);
    done(s);
  }

 private:
  std::string address_;
  std::shared_ptr<FakeCluster> cluster_;
};

inline Balancer::ClientFactory FakeFactory(std::shared_ptr<FakeCluster> cluster) {
  return [cluster](const std::string& address) { return std::make_unique<FakeWorkerClient>(address, cluster); };
}

// Records a generation's events.
struct RecordingObserver : GenerationObserver {
  std::mutex mu;
  std::vector<int32_t> ids;
  bool ended = false;
  Status status;
  std::string finish_reason;
  void OnResponse(const v1::WorkerGenerateResponse& r) override {
    std::lock_guard<std::mutex> lock(mu);
    ids.insert(ids.end(), r.token_ids().begin(), r.token_ids().end());
  }
  void OnEnd(const Status& s, const std::string& fr) override {
    std::lock_guard<std::mutex> lock(mu);
    ended = true;
    status = s;
    finish_reason = fr;
  }
};

}  // namespace numoe::router::testing
