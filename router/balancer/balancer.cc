#include "router/balancer/balancer.h"

#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace numoe::router {

using Clock = std::chrono::steady_clock;

struct Balancer::Worker {
  std::string address;
  uint64_t id_hash = 0;
  uint64_t group_hash = 0;  // HostHash(address): the workers of one host share its numoe-gpu's prefix cache
  std::unique_ptr<WorkerClient> client;
  bool up = false;
  bool ever_up = false;
  bool check_in_progress = false;
  int failures = 0;  // failed health checks in a row
  int64_t in_flight = 0;
  int64_t outstanding = 0;
  bool has_stats = false;
  v1::WorkerStats stats;
};

struct Job {
  enum class State { kQueued, kRunning, kDone };
  v1::WorkerGenerateRequest request;
  std::shared_ptr<GenerationObserver> observer;
  uint64_t prefix_hash = 0;
  State state = State::kQueued;
  std::vector<bool> tried;
  int attempts = 0;    // attempts started
  int attempt_id = 0;  // id of the current attempt (events of older ones are dropped)
  size_t worker = 0;
  std::shared_ptr<WorkerCall> call;
  bool cancel_requested = false;
  bool got_token = false;
  int64_t generated = 0;
  int64_t charged = 0;  // tokens this job adds to its worker's outstanding load
  std::string finish_reason;
  Clock::time_point enqueued;
};

// Forwards one attempt's events to the balancer, tagged with the attempt id.
class AttemptSink : public WorkerCallSink {
 public:
  AttemptSink(Balancer* balancer, std::shared_ptr<Job> job, int attempt)
      : balancer_(balancer), job_(std::move(job)), attempt_(attempt) {}
  void OnResponse(const v1::WorkerGenerateResponse& response) override {
    balancer_->OnAttemptResponse(job_, attempt_, response);
  }
  void OnEnd(const Status& status) override { balancer_->OnAttemptEnd(job_, attempt_, status); }

 private:
  Balancer* balancer_;
  std::shared_ptr<Job> job_;
  int attempt_;
};

void GenerationHandle::Cancel() { balancer_->Cancel(job_); }

class Balancer::CallbackScope {
 public:
  explicit CallbackScope(Balancer* b) : b_(b) {
    std::lock_guard<std::mutex> lock(b_->mu_);
    ++b_->callbacks_;
  }
  ~CallbackScope() {
    std::lock_guard<std::mutex> lock(b_->mu_);
    if (--b_->callbacks_ == 0) b_->idle_cv_.notify_all();
  }
  CallbackScope(const CallbackScope&) = delete;
  CallbackScope& operator=(const CallbackScope&) = delete;

 private:
  Balancer* b_;
};

namespace {

bool Retryable(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kCancelled:
      return true;
    default:
      return false;
  }
}

// The error for a request that ran out of workers to try: busy workers mean "retry later" (429), anything
// else "unavailable" (503).
Status Exhausted(const Status& last, const std::string& message) {
  return last.code() == absl::StatusCode::kResourceExhausted ? absl::ResourceExhaustedError(message)
                                                               : absl::UnavailableError(message);
}

// The choices a request asks for (proto3 0 = 1).
int64_t Choices(const v1::WorkerGenerateRequest& r) { return std::max<int64_t>(1, r.n()); }

// Codes that mean the connection or the process is gone, not that this one request was bad.
bool TransportFailure(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kCancelled;
}

}  // namespace

Balancer::Balancer(BalancerOptions options, const ClientFactory& factory) : options_(std::move(options)) {
  for (const std::string& address : options_.workers) {
    auto w = std::make_unique<Worker>();
    w->address = address;
    w->id_hash = StableHash(address);
    w->group_hash = HostHash(address);
    w->client = factory(address);
    workers_.push_back(std::move(w));
  }
}

Balancer::~Balancer() {
  Stop();
  // Worker calls hold raw pointers back to us: cancel them and wait until each has ended.
  std::vector<std::shared_ptr<Job>> jobs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs.assign(queue_.begin(), queue_.end());
    jobs.insert(jobs.end(), running_.begin(), running_.end());
  }
  for (auto& job : jobs) Cancel(job);
  std::unique_lock<std::mutex> lock(mu_);
  auto idle = [&] {
    if (in_flight_ != 0 || callbacks_ != 0) return false;
    for (const auto& w : workers_) {
      if (w->check_in_progress) return false;
    }
    return true;
  };
  if (!idle_cv_.wait_for(lock, std::chrono::seconds(10), idle)) {
    NLOG(ERROR) << "balancer: " << in_flight_ << " worker calls still running at shutdown";
  }
}

void Balancer::Start() {
  if (options_.health_interval_s <= 0 || health_thread_.joinable()) return;
  health_thread_ = std::thread([this] { HealthLoop(); });
}

void Balancer::Stop() {
  {
    std::lock_guard<std::mutex> lock(health_mu_);
    stopping_ = true;
  }
  health_cv_.notify_all();
  if (health_thread_.joinable()) health_thread_.join();
}

void Balancer::SetUpCountListener(std::function<void(int)> listener) {
  std::lock_guard<std::mutex> lock(mu_);
  up_listener_ = std::move(listener);
}

int Balancer::UpCountLocked() const {
  int n = 0;
  for (const auto& w : workers_) n += w->up ? 1 : 0;
  return n;
}

int Balancer::up_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return UpCountLocked();
}

size_t Balancer::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

size_t Balancer::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_;
}

int64_t Balancer::SlotsLocked(const Worker& w) const {
  if (options_.max_in_flight_per_worker > 0) return options_.max_in_flight_per_worker;
  if (w.has_stats && w.stats.max_sequences() > 0) return 2 * static_cast<int64_t>(w.stats.max_sequences());
  return kDefaultSlots;
}

std::vector<WorkerSnapshot> Balancer::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<WorkerSnapshot> out;
  for (const auto& w : workers_) {
    WorkerSnapshot s;
    s.address = w->address;
    s.up = w->up;
    s.in_flight = w->in_flight;
    s.outstanding_tokens = w->outstanding;
    s.slots = SlotsLocked(*w);
    s.stats = w->stats;
    out.push_back(std::move(s));
  }
  return out;
}

std::optional<size_t> Balancer::PlaceLocked(const std::shared_ptr<Job>& job_ptr) {
  Job& job = *job_ptr;
  std::vector<WorkerLoad> loads(workers_.size());
  for (size_t i = 0; i < workers_.size(); ++i) {
    const Worker& w = *workers_[i];
    loads[i].id_hash = w.id_hash;
    loads[i].group_hash = w.group_hash;
    loads[i].up = w.up;
    loads[i].has_slot = w.in_flight < SlotsLocked(w);
    loads[i].excluded = job.tried[i];
    loads[i].outstanding_tokens = w.outstanding;
    loads[i].in_flight = w.in_flight;
  }
  std::optional<size_t> pick = ChooseWorker(loads, job.prefix_hash, options_.policy);
  if (!pick) return std::nullopt;
  Worker& w = *workers_[*pick];
  job.state = Job::State::kRunning;
  job.worker = *pick;
  job.tried[*pick] = true;
  ++job.attempts;
  ++job.attempt_id;
  job.charged = job.request.prompt_ids_size() + Choices(job.request) * static_cast<int64_t>(job.request.max_new_tokens());
  ++w.in_flight;
  w.outstanding += job.charged;
  ++in_flight_;
  running_.insert(job_ptr);
  return pick;
}

void Balancer::ReleaseLocked(const std::shared_ptr<Job>& job_ptr) {
  Job& job = *job_ptr;
  running_.erase(job_ptr);
  Worker& w = *workers_[job.worker];
  --w.in_flight;
  w.outstanding -= job.charged;
  job.charged = 0;
  job.call.reset();
  --in_flight_;
}

void Balancer::MarkDownLocked(size_t worker, const std::string& why) {
  Worker& w = *workers_[worker];
  if (!w.up) return;
  w.up = false;
  NLOG(WARNING) << "worker " << w.address << " marked down: " << why;
}

StatusOr<std::shared_ptr<GenerationHandle>> Balancer::Submit(v1::WorkerGenerateRequest request,
                                                             std::shared_ptr<GenerationObserver> observer) {
  auto job = std::make_shared<Job>();
  job->prefix_hash = PrefixHash(std::span<const int32_t>(request.prompt_ids().data(), request.prompt_ids_size()), options_.policy.prefix_tokens);
  job->request = std::move(request);
  job->observer = std::move(observer);
  job->tried.assign(workers_.size(), false);
  job->enqueued = Clock::now();
  std::vector<Launch> launches;
  int up_before = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    up_before = UpCountLocked();
    if (up_before == 0) {
      return absl::UnavailableError(
          absl::StrCat("no worker is up (", workers_.size(), " configured); retry when /health reports one"));
    }
    if (queue_.empty()) {
      if (auto w = PlaceLocked(job)) launches.push_back({job, *w, job->attempt_id});
    }
    if (launches.empty()) {
      if (queue_.size() >= static_cast<size_t>(std::max(0, options_.max_queue))) {
        return absl::ResourceExhaustedError(absl::StrCat("every worker is at its in-flight limit and the queue of ",
                                                         options_.max_queue, " requests is full"));
      }
      queue_.push_back(job);
    }
  }
  Finish(std::move(launches), {}, up_before);
  return std::make_shared<GenerationHandle>(this, job);
}

void Balancer::Cancel(const std::shared_ptr<Job>& job) {
  std::shared_ptr<WorkerCall> call;
  std::vector<Ending> endings;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (job->state == Job::State::kDone || job->cancel_requested) return;
    job->cancel_requested = true;
    if (job->state == Job::State::kQueued) {
      queue_.erase(std::remove(queue_.begin(), queue_.end(), job), queue_.end());
      job->state = Job::State::kDone;
      endings.push_back({job, absl::CancelledError("request cancelled"), ""});
    } else {
      call = job->call;  // null while the call is being started: the launcher cancels it then
    }
  }
  if (call) call->Cancel();
  for (auto& e : endings) {
    std::shared_ptr<GenerationObserver> observer = std::move(e.job->observer);
    observer->OnEnd(e.status, e.finish_reason);
  }
}

void Balancer::OnAttemptResponse(const std::shared_ptr<Job>& job, int attempt,
                                 const v1::WorkerGenerateResponse& response) {
  CallbackScope scope(this);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (job->state != Job::State::kRunning || job->attempt_id != attempt) return;
    if (!response.finish_reason().empty()) job->finish_reason = response.finish_reason();
    if (response.token_ids().empty()) return;
    job->got_token = true;
    job->generated += response.token_ids_size();
    // After the first token the prompt is prefilled: only the tokens still to generate remain.
    int64_t charge = std::max<int64_t>(
        0, Choices(job->request) * static_cast<int64_t>(job->request.max_new_tokens()) - job->generated);
    workers_[job->worker]->outstanding += charge - job->charged;
    job->charged = charge;
  }
  job->observer->OnResponse(response);
}

void Balancer::OnAttemptEnd(const std::shared_ptr<Job>& job, int attempt, const Status& status) {
  CallbackScope scope(this);
  std::vector<Launch> launches;
  std::vector<Ending> endings;
  int up_before = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (job->state != Job::State::kRunning || job->attempt_id != attempt) return;
    up_before = UpCountLocked();
    size_t wi = job->worker;
    const std::string& address = workers_[wi]->address;
    ReleaseLocked(job);
    if (status.ok()) {
      job->state = Job::State::kDone;
      endings.push_back({job, absl::OkStatus(), job->finish_reason});
    } else if (job->cancel_requested) {
      job->state = Job::State::kDone;
      endings.push_back({job, absl::CancelledError("request cancelled"), ""});
    } else {
      if (TransportFailure(status.code())) MarkDownLocked(wi, std::string(status.message()));
      std::string what = absl::StrCat("worker ", address, ": ", absl::StatusCodeToString(status.code()), ": ",
                                      status.message());
      if (status.code() == absl::StatusCode::kDeadlineExceeded) {
        job->state = Job::State::kDone;
        endings.push_back({job, absl::DeadlineExceededError(absl::StrCat("the request ran longer than ",
                                                                         options_.request_timeout_s, " s (", what, ")")),
                           ""});
      } else if (job->got_token) {
        job->state = Job::State::kDone;
        endings.push_back({job, absl::UnavailableError(absl::StrCat(what, " (failed mid-stream)")), ""});
      } else if (Retryable(status.code()) && job->attempts < options_.max_attempts) {
        bool other_up = false;
        for (size_t i = 0; i < workers_.size(); ++i) other_up |= workers_[i]->up && !job->tried[i];
        if (other_up) {
          NLOG(INFO) << "retrying request " << job->request.request_id() << " on another worker after " << what;
          job->state = Job::State::kQueued;
          job->enqueued = Clock::now();
          queue_.push_front(job);
        } else {
          job->state = Job::State::kDone;
          endings.push_back({job, Exhausted(status, absl::StrCat(what, "; no other worker is up")), ""});
        }
      } else if (Retryable(status.code())) {
        job->state = Job::State::kDone;
        endings.push_back({job, Exhausted(status, absl::StrCat(what, " (after ", job->attempts, " attempts)")), ""});
      } else {
        job->state = Job::State::kDone;
        endings.push_back({job, status, ""});
      }
    }
    DrainQueueLocked(&launches, &endings);
  }
  Finish(std::move(launches), std::move(endings), up_before);
}

void Balancer::DrainQueueLocked(std::vector<Launch>* launches, std::vector<Ending>* endings) {
  const auto now = Clock::now();
  const auto timeout = std::chrono::duration<double>(options_.queue_timeout_s);
  for (auto it = queue_.begin(); it != queue_.end();) {
    Job& job = **it;
    if (now - job.enqueued > timeout) {
      job.state = Job::State::kDone;
      endings->push_back({*it, absl::UnavailableError(absl::StrCat("waited ", options_.queue_timeout_s,
                                                                     " s in the queue for a free worker slot")),
                          ""});
      it = queue_.erase(it);
      continue;
    }
    if (auto w = PlaceLocked(*it)) {
      launches->push_back({*it, *w, job.attempt_id});
      it = queue_.erase(it);
      continue;
    }
    ++it;
  }
}

void Balancer::Finish(std::vector<Launch> launches, std::vector<Ending> endings, int up_before) {
  for (Launch& l : launches) {
    auto sink = std::make_shared<AttemptSink>(this, l.job, l.attempt);
    std::shared_ptr<WorkerCall> call = workers_[l.worker]->client->Generate(l.job->request, options_.request_timeout_s, sink);
    bool cancel_now = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (l.job->state == Job::State::kRunning && l.job->attempt_id == l.attempt) {
        l.job->call = call;
        cancel_now = l.job->cancel_requested;
      }
    }
    if (cancel_now && call) call->Cancel();
  }
  for (Ending& e : endings) {
    // The observer is dropped with the last event: it usually holds the handle, which holds the job.
    std::shared_ptr<GenerationObserver> observer = std::move(e.job->observer);
    observer->OnEnd(e.status, e.finish_reason);
  }
  std::function<void(int)> listener;
  int up_now = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    up_now = UpCountLocked();
    if (up_now != up_before) listener = up_listener_;
  }
  if (listener) listener(up_now);
}

void Balancer::OnHealth(size_t worker, const StatusOr<v1::WorkerStats>& stats) {
  CallbackScope scope(this);
  std::vector<Launch> launches;
  std::vector<Ending> endings;
  int up_before = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    up_before = UpCountLocked();
    Worker& w = *workers_[worker];
    w.check_in_progress = false;
    if (stats.ok()) {
      w.stats = *stats;
      w.has_stats = true;
      w.failures = 0;
      if (!w.up) {
        w.up = true;
        NLOG(INFO) << "worker " << w.address << (w.ever_up ? " rejoined" : " is up") << " (id '"
                   << stats->worker_id() << "', max_sequences " << stats->max_sequences() << ")";
        w.ever_up = true;
      }
    } else {
      ++w.failures;
      if (w.up && w.failures >= options_.unhealthy_after) {
        MarkDownLocked(worker, absl::StrCat("health check failed ", w.failures, " times: ",
                                            stats.status().message()));
      }
    }
    DrainQueueLocked(&launches, &endings);
  }
  Finish(std::move(launches), std::move(endings), up_before);
}

void Balancer::CheckHealthNow() {
  struct Round {
    std::mutex mu;
    std::condition_variable cv;
    size_t pending = 0;
  };
  auto round = std::make_shared<Round>();
  std::vector<size_t> todo;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (workers_[i]->check_in_progress) continue;
      workers_[i]->check_in_progress = true;
      todo.push_back(i);
    }
  }
  round->pending = todo.size();
  for (size_t i : todo) {
    workers_[i]->client->Stats(options_.health_timeout_s, [this, i, round](StatusOr<v1::WorkerStats> s) {
      OnHealth(i, s);
      std::lock_guard<std::mutex> lock(round->mu);
      if (--round->pending == 0) round->cv.notify_all();
    });
  }
  std::unique_lock<std::mutex> lock(round->mu);
  round->cv.wait(lock, [&] { return round->pending == 0; });
}

void Balancer::HealthLoop() {
  const auto interval = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(options_.health_interval_s));
  auto next_check = Clock::now();
  std::unique_lock<std::mutex> lock(health_mu_);
  while (!stopping_) {
    if (Clock::now() >= next_check) {
      next_check = Clock::now() + interval;
      // Asynchronous: a hung worker delays only its own next check, never the others'.
      std::vector<size_t> todo;
      {
        std::lock_guard<std::mutex> l(mu_);
        for (size_t i = 0; i < workers_.size(); ++i) {
          if (workers_[i]->check_in_progress) continue;
          workers_[i]->check_in_progress = true;
          todo.push_back(i);
        }
      }
      lock.unlock();
      for (size_t i : todo) {
        workers_[i]->client->Stats(options_.health_timeout_s,
                                   [this, i](StatusOr<v1::WorkerStats> s) { OnHealth(i, s); });
      }
      lock.lock();
    }
    // Queue deadlines are checked between health rounds too.
    std::vector<Launch> launches;
    std::vector<Ending> endings;
    int up_before = 0;
    {
      std::lock_guard<std::mutex> l(mu_);
      up_before = UpCountLocked();
      if (!queue_.empty()) DrainQueueLocked(&launches, &endings);
    }
    if (!launches.empty() || !endings.empty()) {
      lock.unlock();
      Finish(std::move(launches), std::move(endings), up_before);
      lock.lock();
    }
    health_cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return stopping_; });
  }
}

}  // namespace numoe::router
