#include "worker/engine/engine.h"

#include <algorithm>
#include <chrono>

#include "common/log.h"

namespace numoe::engine {

namespace {

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr double kRateWindowS = 5.0;

}  // namespace

struct Engine::Request {
  RequestId id = 0;
  EngineRequest req;
  std::shared_ptr<TokenSink> sink;
  ExecSeq seq = 0;
  bool open = false;     // has an executor sequence
  size_t fed = 0;        // prompt tokens fed
  int32_t next = -1;     // last sampled token, not fed yet
  int64_t generated = 0;
  bool done = false;

  int64_t outstanding() const {
    return static_cast<int64_t>(req.prompt.size() - fed) + std::max<int64_t>(req.max_new_tokens - generated, 0);
  }
};

Status ValidateEngineOptions(const EngineOptions& o) {
  if (o.max_seqs < 1) return absl::InvalidArgumentError(absl::StrCat("max_seqs must be >= 1 (got ", o.max_seqs, ")"));
  if (o.max_step_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_step_tokens must be >= 1 (got ", o.max_step_tokens, ")"));
  }
  if (o.prefill_chunk < 0) {
    return absl::InvalidArgumentError(absl::StrCat("prefill_chunk must be >= 0 (got ", o.prefill_chunk, ")"));
  }
  if (o.max_queue < 0) return absl::InvalidArgumentError(absl::StrCat("max_queue must be >= 0 (got ", o.max_queue, ")"));
  if (o.max_context < 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_context must be >= 0 (got ", o.max_context, ")"));
  }
  return absl::OkStatus();
}

Engine::Engine(Executor* executor, const EngineOptions& options) : executor_(executor), options_(options) {
  const ExecutorLimits lim = executor_->limits();
  vocab_ = lim.vocab_size;
  if (lim.max_step_tokens > 0) options_.max_step_tokens = std::min(options_.max_step_tokens, lim.max_step_tokens);
  if (lim.max_seqs > 0) options_.max_seqs = std::min(options_.max_seqs, lim.max_seqs);
  options_.max_seqs = std::max<int64_t>(options_.max_seqs, 1);
  options_.max_step_tokens = std::max<int64_t>(options_.max_step_tokens, 1);
  stats_.max_seqs = options_.max_seqs;
}

Engine::~Engine() { Stop(); }

void Engine::Start() {
  std::lock_guard<std::mutex> lk(mu_);
  if (thread_.joinable() || stopping_) return;
  thread_ = std::thread([this] { Loop(); });
}

void Engine::Stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::deque<std::unique_ptr<Request>> queued;
  {
    std::lock_guard<std::mutex> lk(mu_);
    queued.swap(queue_);
    stats_.queued = 0;
    stats_.active = 0;
    stats_.outstanding_tokens = 0;
  }
  const Status gone = absl::UnavailableError("the worker is shutting down");
  for (auto& r : queued) r->sink->OnError(gone);
  for (auto& r : running_) {
    if (!r->done) Fail(*r, gone);
  }
  running_.clear();
  (void)executor_->Flush();
}

StatusOr<RequestId> Engine::Submit(EngineRequest request, std::shared_ptr<TokenSink> sink) {
  if (request.prompt.empty()) return absl::InvalidArgumentError("prompt_ids: must contain at least one token");
  for (size_t i = 0; i < request.prompt.size(); ++i) {
    if (request.prompt[i] < 0 || request.prompt[i] >= vocab_) {
      return absl::InvalidArgumentError(absl::StrCat("prompt_ids[", i, "]: token id ", request.prompt[i],
                                                     " is out of range [0, ", vocab_, ")"));
    }
  }
  for (size_t i = 0; i < request.stop_token_ids.size(); ++i) {
    if (request.stop_token_ids[i] < 0 || request.stop_token_ids[i] >= vocab_) {
      return absl::InvalidArgumentError(absl::StrCat("stop_token_ids[", i, "]: token id ", request.stop_token_ids[i],
                                                     " is out of range [0, ", vocab_, ")"));
    }
  }
  if (request.max_new_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens must be >= 0 (got ", request.max_new_tokens, ")"));
  }
  if (Status st = ValidateSampling(request.sampling); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.", st.message()));
  }
  if (options_.max_context > 0 && static_cast<int64_t>(request.prompt.size()) >= options_.max_context) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_ids: ", request.prompt.size(),
                                                   " tokens leave no room within the context limit of ",
                                                   options_.max_context));
  }
  if (!executor_->healthy()) return absl::UnavailableError("the worker lost its gpu service");
  auto r = std::make_unique<Request>();
  r->req = std::move(request);
  r->sink = std::move(sink);
  RequestId id;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) return absl::UnavailableError("the worker is shutting down");
    if (static_cast<int64_t>(queue_.size()) >= options_.max_queue) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the worker's queue is full (", queue_.size(), " requests waiting); retry later"));
    }
    id = r->id = next_id_++;
    stats_.outstanding_tokens += r->outstanding();
    queue_.push_back(std::move(r));
    stats_.queued = static_cast<int64_t>(queue_.size());
  }
  cv_.notify_all();
  return id;
}

void Engine::Cancel(RequestId id) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    cancels_.insert(id);
  }
  cv_.notify_all();
}

bool Engine::HasWorkLocked() const { return !queue_.empty() || !cancels_.empty() || !running_.empty(); }

void Engine::Loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stopping_ || HasWorkLocked(); });
      if (stopping_) return;
    }
    StepOnce();
  }
}

void Engine::CloseSequence(Request& r) {
  if (!r.open) return;
  r.open = false;
  if (Status st = executor_->Close(r.seq); !st.ok()) {
    NLOG(WARNING) << "request " << r.req.request_id << ": closing its sequence failed: " << st;
  }
}

void Engine::Fail(Request& r, const Status& status) {
  CloseSequence(r);
  r.done = true;
  r.sink->OnError(status);
}

bool Engine::StepOnce() {
  // 1. Under the lock: take cancellations, drop cancelled queued requests, admit up to max_seqs.
  std::unordered_set<RequestId> cancels;
  std::vector<std::unique_ptr<Request>> dropped, admitted;
  {
    std::lock_guard<std::mutex> lk(mu_);
    cancels.swap(cancels_);
    if (!cancels.empty()) {
      for (auto it = queue_.begin(); it != queue_.end();) {
        if (cancels.count((*it)->id) != 0) {
          stats_.outstanding_tokens -= (*it)->outstanding();
          dropped.push_back(std::move(*it));
          it = queue_.erase(it);
        } else {
          ++it;
        }
      }
    }
    while (static_cast<int64_t>(running_.size() + admitted.size()) < options_.max_seqs && !queue_.empty()) {
      admitted.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
    stats_.queued = static_cast<int64_t>(queue_.size());
  }
  const Status cancelled = absl::CancelledError("the request was cancelled");
  for (auto& r : dropped) r->sink->OnError(cancelled);
  for (auto& r : running_) {
    if (cancels.count(r->id) != 0) Fail(*r, cancelled);
  }
  for (auto& r : admitted) {
    if (cancels.count(r->id) != 0) {
      r->done = true;
      r->sink->OnError(cancelled);
    } else if (r->req.max_new_tokens == 0) {
      r->done = true;
      r->sink->OnTokens({}, "length");
    } else if (auto seq = executor_->Open(r->req.sampling); !seq.ok()) {
      r->done = true;
      r->sink->OnError(seq.status());
    } else {
      r->seq = *seq;
      r->open = true;
    }
    running_.push_back(std::move(r));
  }

  // 2. Build the step: decode tokens first (rotating start so a tight budget is fair), then prompt chunks.
  items_.clear();
  item_owner_.clear();
  int64_t budget = options_.max_step_tokens;
  StepTrace trace;
  const size_t n = running_.size();
  for (size_t k = 0; k < n && budget > 0; ++k) {
    Request& r = *running_[(rotate_ + k) % n];
    if (r.done || r.fed < r.req.prompt.size() || r.next < 0) continue;
    items_.push_back(StepItem{.seq = r.seq, .tokens = std::span<const int32_t>(&r.next, 1), .sample = true});
    item_owner_.push_back(&r);
    --budget;
    ++trace.decode_tokens;
  }
  ++rotate_;
  for (auto& rp : running_) {
    if (budget <= 0) break;
    Request& r = *rp;
    if (r.done || r.fed >= r.req.prompt.size()) continue;
    int64_t chunk = static_cast<int64_t>(r.req.prompt.size() - r.fed);
    if (options_.prefill_chunk > 0) chunk = std::min(chunk, options_.prefill_chunk);
    chunk = std::min(chunk, budget);
    const bool completes = r.fed + static_cast<size_t>(chunk) == r.req.prompt.size();
    items_.push_back(StepItem{.seq = r.seq,
                              .tokens = std::span<const int32_t>(r.req.prompt.data() + r.fed, chunk),
                              .sample = completes});
    item_owner_.push_back(&r);
    budget -= chunk;
    trace.prefill_tokens += chunk;
    trace.largest_prefill_chunk = std::max(trace.largest_prefill_chunk, chunk);
  }
  trace.sequences = static_cast<int64_t>(items_.size());

  // 3. Run it.
  bool ran = false;
  int64_t new_tokens = 0;
  if (!items_.empty()) {
    ran = true;
    Status st = executor_->Step(items_, &out_);
    if (!st.ok()) {
      NLOG(WARNING) << "step over " << items_.size() << " sequences failed: " << st;
      for (Request* r : item_owner_) Fail(*r, st);
      if (!executor_->healthy()) {
        for (auto& r : running_) {
          if (!r->done) Fail(*r, st);
        }
      }
    } else {
      for (size_t i = 0; i < items_.size(); ++i) {
        Request& r = *item_owner_[i];
        if (r.fed < r.req.prompt.size()) r.fed += items_[i].tokens.size();
        if (!items_[i].sample) continue;
        const int32_t tok = out_.tokens[i];
        r.next = tok;
        ++r.generated;
        ++new_tokens;
        const auto& stops = r.req.stop_token_ids;
        std::string_view reason;
        if ((!r.req.ignore_eos && tok == options_.eos_token_id) ||
            std::find(stops.begin(), stops.end(), tok) != stops.end()) {
          reason = "stop";
        } else if (r.generated >= r.req.max_new_tokens ||
                   (options_.max_context > 0 &&
                    static_cast<int64_t>(r.req.prompt.size()) + r.generated >= options_.max_context)) {
          reason = "length";
        }
        if (!reason.empty()) {
          CloseSequence(r);  // before the client hears the end (a remote close rides the next step/flush)
          r.done = true;
        }
        r.sink->OnTokens(std::span<const int32_t>(&tok, 1), reason);
      }
    }
  }
  running_.erase(std::remove_if(running_.begin(), running_.end(), [](const auto& r) { return r->done; }),
                 running_.end());
  // Going idle: deferred closes must not wait for the next request.
  if (running_.empty()) (void)executor_->Flush();

  // 4. Publish figures.
  int64_t outstanding = 0;
  for (auto& r : running_) outstanding += r->outstanding();
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& r : queue_) outstanding += r->outstanding();
  stats_.active = static_cast<int64_t>(running_.size());
  stats_.outstanding_tokens = outstanding;
  if (ran) {
    ++stats_.steps;
    stats_.tokens_generated += new_tokens;
    stats_.prompt_tokens += trace.prefill_tokens;
    trace_ = trace;
    UpdateRateLocked();
  }
  return ran;
}

void Engine::UpdateRateLocked() {
  const double now = NowSeconds();
  rate_window_.emplace_back(now, stats_.tokens_generated);
  while (rate_window_.size() > 2 && now - rate_window_.front().first > kRateWindowS) rate_window_.pop_front();
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  EngineStats s = stats_;
  s.decode_tokens_per_s = 0.0;
  if (rate_window_.size() >= 2) {
    const double now = NowSeconds();
    const auto& [t0, n0] = rate_window_.front();
    const auto& [t1, n1] = rate_window_.back();
    if (now - t1 < kRateWindowS && t1 > t0) s.decode_tokens_per_s = static_cast<double>(n1 - n0) / (now - t0);
  }
  return s;
}

StepTrace Engine::last_step() const {
  std::lock_guard<std::mutex> lk(mu_);
  return trace_;
}

}  // namespace numoe::engine
