// The balancer: admits generations, queues them when every worker is full, sends each to a worker chosen by
// policy.h, health-checks the workers, and retries or fails requests when a worker fails.
//
// Rules:
//   - Every worker starts down and is up once its Stats health check answers; checks run every
//     health_interval_s; `unhealthy_after` failed checks in a row mark it down, and a Generate call that
//     fails with a transport error (UNAVAILABLE, or the stream cut) marks it down at once. A down worker
//     rejoins when a health check passes again.
//   - Submit answers at once: Unavailable when no worker is up, ResourceExhausted when every worker is at
//     its in-flight limit and the router's queue already holds max_queue requests. Otherwise the request
//     runs now or waits in the queue (at most queue_timeout_s, then Unavailable).
//   - A request whose worker fails before it produced any token is retried on another worker (the failed
//     ones are excluded), up to max_attempts; UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED, UNKNOWN, INTERNAL
//     and a CANCELLED the router did not ask for are retryable. Other codes (e.g. INVALID_ARGUMENT) end
//     the request with that status. Out of workers to try: ResourceExhausted if the last one was busy,
//     else Unavailable. A failure after the first token ends the request with Unavailable
//     ("worker ... failed mid-stream"); it is never replayed, so a client never sees a token twice.
//
// Threading: every public method is thread-safe. One mutex guards workers, queue and request states;
// worker calls are started and observers are called outside it. Observers of one request are never
// called concurrently.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "common/status.h"
#include "numoe/v1/worker.pb.h"
#include "router/balancer/policy.h"
#include "router/balancer/worker_client.h"

namespace numoe::router {

struct BalancerOptions {
  std::vector<std::string> workers;  // host:port, in --workers order
  PolicyOptions policy;
  // In-flight requests per worker; 0 = 2 x the worker's reported max_sequences (kDefaultSlots until its
  // first Stats answer, or when it reports 0).
  int max_in_flight_per_worker = 0;
  // Requests waiting in the router for a free worker slot before Submit answers ResourceExhausted.
  int max_queue = 256;
  double queue_timeout_s = 60.0;
  double health_interval_s = 1.0;  // <= 0: no background checks (tests call CheckHealthNow)
  double health_timeout_s = 2.0;
  int unhealthy_after = 2;  // failed health checks in a row that mark a worker down
  int max_attempts = 3;     // workers tried per request (failures before the first token)
  double request_timeout_s = 0;  // > 0: a worker call longer than this ends with DeadlineExceeded

  bool operator==(const BalancerOptions&) const = default;
};

// What one generation sees. OnResponse for each worker message with tokens (one choice's ids and their
// log-probs; WorkerGenerateResponse::index names the choice) zero or more times, then OnEnd exactly once (OK =
// finished normally, `finish_reason` of the worker's last message). Calls never overlap.
class GenerationObserver {
 public:
  virtual ~GenerationObserver() = default;
  virtual void OnResponse(const v1::WorkerGenerateResponse& response) = 0;
  virtual void OnEnd(const Status& status, const std::string& finish_reason) = 0;
};

class Balancer;
struct Job;

// Handle of an admitted generation. Cancel() ends it (observer gets OnEnd(Cancelled) unless it already
// ended); safe to call any number of times from any thread, also after the balancer finished the job.
class GenerationHandle {
 public:
  GenerationHandle(Balancer* balancer, std::shared_ptr<Job> job) : balancer_(balancer), job_(std::move(job)) {}
  void Cancel();

 private:
  Balancer* balancer_;
  std::shared_ptr<Job> job_;
};

struct WorkerSnapshot {
  std::string address;
  bool up = false;
  int64_t in_flight = 0;            // this router's requests on the worker
  int64_t outstanding_tokens = 0;   // this router's estimate (policy load)
  int64_t slots = 0;                // in-flight limit in use
  v1::WorkerStats stats;            // last successful Stats answer
};

class Balancer {
 public:
  static constexpr int kDefaultSlots = 16;
  using ClientFactory = std::function<std::unique_ptr<WorkerClient>(const std::string& address)>;

  Balancer(BalancerOptions options, const ClientFactory& factory);
  ~Balancer();
  Balancer(const Balancer&) = delete;
  Balancer& operator=(const Balancer&) = delete;

  // Starts the health-check thread (its first round runs at once). No-op when health_interval_s <= 0.
  void Start();
  // Stops health checks; does not touch requests in flight.
  void Stop();

  // Admits one generation. `prompt_ids` are request.prompt_ids (used for affinity and load).
  StatusOr<std::shared_ptr<GenerationHandle>> Submit(v1::WorkerGenerateRequest request,
                                                     std::shared_ptr<GenerationObserver> observer);

  // One health round; returns when every worker answered or timed out.
  void CheckHealthNow();

  std::vector<WorkerSnapshot> Snapshot() const;
  int up_count() const;
  size_t queued() const;
  size_t in_flight() const;
  // Called (outside the lock) whenever the number of up workers changes; set before Start().
  void SetUpCountListener(std::function<void(int up)> listener);

 private:
  friend class GenerationHandle;
  friend class AttemptSink;
  struct Worker;
  struct Launch {
    std::shared_ptr<Job> job;
    size_t worker = 0;
    int attempt = 0;
  };
  struct Ending {
    std::shared_ptr<Job> job;
    Status status;
    std::string finish_reason;
  };

  void Cancel(const std::shared_ptr<Job>& job);
  void OnAttemptResponse(const std::shared_ptr<Job>& job, int attempt, const v1::WorkerGenerateResponse& response);
  void OnAttemptEnd(const std::shared_ptr<Job>& job, int attempt, const Status& status);
  void OnHealth(size_t worker, const StatusOr<v1::WorkerStats>& stats);

  // With mu_ held: picks a worker for `job` (nullopt = none has a slot), updates accounting.
  std::optional<size_t> PlaceLocked(const std::shared_ptr<Job>& job);
  // With mu_ held: starts whatever queued jobs now fit; expires old ones.
  void DrainQueueLocked(std::vector<Launch>* launches, std::vector<Ending>* endings);
  void ReleaseLocked(const std::shared_ptr<Job>& job);
  int UpCountLocked() const;
  int64_t SlotsLocked(const Worker& w) const;
  void MarkDownLocked(size_t worker, const std::string& why);
  // Outside mu_: starts calls, delivers endings, notifies the up-count listener.
  void Finish(std::vector<Launch> launches, std::vector<Ending> endings, int up_before);
  void HealthLoop();
  // Counts a callback from a worker client as running, so the destructor waits for it.
  class CallbackScope;

  const BalancerOptions options_;
  std::vector<std::unique_ptr<Worker>> workers_;

  mutable std::mutex mu_;
  std::condition_variable idle_cv_;  // in_flight_, callbacks_ or health checks reached zero
  std::deque<std::shared_ptr<Job>> queue_;
  std::unordered_set<std::shared_ptr<Job>> running_;
  size_t in_flight_ = 0;
  int callbacks_ = 0;  // worker-call and Stats callbacks executing right now
  std::function<void(int)> up_listener_;

  std::mutex health_mu_;
  std::condition_variable health_cv_;
  bool stopping_ = false;
  std::thread health_thread_;
};

}  // namespace numoe::router
