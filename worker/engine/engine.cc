#include "worker/engine/engine.h"

#include <algorithm>
#include <chrono>

#include "common/log.h"
#include "model/spec_policy.h"

namespace numoe::engine {

namespace {

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr double kRateWindowS = 5.0;

}  // namespace

// The choices of one request share its id, its sink and their fork.
struct Engine::Group {
  RequestId id = 0;
  std::shared_ptr<TokenSink> sink;
  int32_t n = 1;
  bool ended = false;         // OnError was sent: every choice stops
  Request* leader = nullptr;  // choice 0 while it runs (the fork parent)
  int32_t awaiting = 0;       // choices admitted and waiting to be forked from the leader
};

struct Engine::Request {
  std::shared_ptr<Group> group;
  int32_t choice = 0;
  EngineRequest req;
  ExecSeq seq = 0;
  bool await_fork = false;  // admitted, to be forked from group->leader (no sequence yet)
  bool open = false;     // has an executor sequence
  size_t fed = 0;        // prompt tokens fed
  int32_t next = -1;     // last sampled token, not fed yet
  int64_t generated = 0;
  int64_t cached = 0;  // prompt tokens the executor restored from its prefix cache
  bool done = false;
  bool in_lane = false;      // its prompt chunk is in the prefill lane's step
  bool close_after_lane = false;  // closed (cancelled, failed) while in the lane: closed when the lane step ends
  // Speculative decoding: prompt + generated (the n-gram drafter's haystack; kept only for kNgram), this
  // sequence's draft depth, and this step's feed [next, drafts...].
  std::vector<int32_t> history;
  int64_t depth = 0;
  std::vector<int32_t> feed;

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
  if (o.prefill_lane_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_lane_tokens must be >= 0 (got ", o.prefill_lane_tokens, ")"));
  }
  if (o.max_context < 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_context must be >= 0 (got ", o.max_context, ")"));
  }
  if (o.spec.method != SpecMethod::kNone) {
    if (Status st = ValidateSpec(o.spec); !st.ok()) return absl::InvalidArgumentError(absl::StrCat("spec: ", st.message()));
  }
  return absl::OkStatus();
}

Status CheckSpec(const SpecConfig& spec, const ExecutorLimits& limits) {
  return CheckSpecAgainstModel(spec, limits.model, ModelSide::kNumoeGpu);
}

Engine::Engine(Executor* executor, const EngineOptions& options) : executor_(executor), options_(options) {
  const ExecutorLimits lim = executor_->limits();
  vocab_ = lim.vocab_size;
  if (lim.max_step_tokens > 0) options_.max_step_tokens = std::min(options_.max_step_tokens, lim.max_step_tokens);
  if (lim.max_seqs > 0) options_.max_seqs = std::min(options_.max_seqs, lim.max_seqs);
  options_.max_seqs = std::max<int64_t>(options_.max_seqs, 1);
  options_.max_step_tokens = std::max<int64_t>(options_.max_step_tokens, 1);
  stats_.max_seqs = options_.max_seqs;
  // The worker refuses a bad spec at start-up (CheckSpecAgainstGpu); an engine given a spec its executor
  // cannot serve runs without speculation rather than asking the executor for something it cannot do.
  if (options_.spec.method != SpecMethod::kNone) {
    if (Status st = CheckSpec(options_.spec, lim); !st.ok()) {
      NLOG(WARNING) << "speculative decoding off: " << st;
      options_.spec.method = SpecMethod::kNone;
    }
  }
  max_drafts_ = options_.spec.depth;
  if (options_.spec.method != SpecMethod::kNgram && lim.max_model_drafts() > 0) {
    max_drafts_ = std::min(max_drafts_, lim.max_model_drafts());
  }
  stats_.spec_method = options_.spec.method;
  lane_on_ = options_.prefill_lane_tokens > 0 && executor_->has_prefill_lane();
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
  if (lane_busy_) {  // its sequences come back to be closed below
    (void)executor_->FinishLaneStep(&lane_out_);
    lane_busy_ = false;
    for (Request* r : lane_owner_) r->in_lane = false;
  }
  std::deque<std::unique_ptr<Request>> queued;
  {
    std::lock_guard<std::mutex> lk(mu_);
    queued.swap(queue_);
    stats_.queued = 0;
    stats_.active = 0;
    stats_.outstanding_tokens = 0;
  }
  const Status gone = absl::UnavailableError("the worker is shutting down");
  for (auto& r : queued) Fail(*r, gone);
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
  if (request.n < 1 || request.n > kMaxChoices) {
    return absl::InvalidArgumentError(absl::StrCat("n must be in [1, ", kMaxChoices, "] (got ", request.n, ")"));
  }
  if (request.max_new_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens must be >= 0 (got ", request.max_new_tokens, ")"));
  }
  if (Status st = ValidateSampling(request.sampling, vocab_); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.", st.message()));
  }
  if (options_.max_context > 0 && static_cast<int64_t>(request.prompt.size()) >= options_.max_context) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_ids: ", request.prompt.size(),
                                                   " tokens leave no room within the context limit of ",
                                                   options_.max_context));
  }
  if (!executor_->healthy()) return absl::UnavailableError("the worker lost its gpu service");
  auto group = std::make_shared<Group>();
  group->sink = std::move(sink);
  group->n = request.n;
  std::vector<std::unique_ptr<Request>> choices;
  for (int32_t i = 0; i < request.n; ++i) {
    auto r = std::make_unique<Request>();
    r->group = group;
    r->choice = i;
    r->req = request;
    r->req.sampling.seed = ChoiceSeed(request.sampling.seed, i);
    choices.push_back(std::move(r));
  }
  RequestId id;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) return absl::UnavailableError("the worker is shutting down");
    if (static_cast<int64_t>(queue_.size()) >= options_.max_queue) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the worker's queue is full (", queue_.size(), " requests waiting); retry later"));
    }
    id = group->id = next_id_++;
    for (auto& r : choices) {
      stats_.outstanding_tokens += r->outstanding();
      queue_.push_back(std::move(r));
    }
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
  if (r.in_lane) {  // the lane holds it: FinishLane closes it
    r.close_after_lane = true;
    return;
  }
  r.open = false;
  if (Status st = executor_->Close(r.seq); !st.ok()) {
    NLOG(WARNING) << "request " << r.req.request_id << ": closing its sequence failed: " << st;
  }
}

void Engine::Fail(Request& r, const Status& status) {
  CloseSequence(r);
  r.done = true;
  if (r.group->ended) return;
  r.group->ended = true;  // its other choices stop at the next step
  r.group->sink->OnError(status);
}

void Engine::AdmitOne(Request& r, const std::unordered_set<RequestId>& cancels) {
  Group& g = *r.group;
  if (g.ended) {
    r.done = true;
  } else if (cancels.count(g.id) != 0) {
    Fail(r, absl::CancelledError("the request was cancelled"));
  } else if (r.req.max_new_tokens == 0) {
    r.done = true;
    g.sink->OnTokens(r.choice, {}, {}, "length");
  } else if (r.choice > 0 && g.leader != nullptr && !g.leader->done && executor_->limits().model.fork &&
             r.req.prompt.size() >= 2 && g.leader->fed <= r.req.prompt.size() - 1) {
    // The leader has not passed the fork point (all but the last prompt token): fork from it there.
    r.await_fork = true;
    ++g.awaiting;
    r.depth = max_drafts_;
  } else if (auto seq = executor_->Open(r.req.sampling); !seq.ok()) {
    Fail(r, seq.status());
  } else {
    r.seq = *seq;
    r.open = true;
    r.depth = max_drafts_;
    if (options_.spec.method == SpecMethod::kNgram) r.history = r.req.prompt;
    if (r.choice == 0) g.leader = &r;
  }
}

int64_t Engine::RunForks() {
  int64_t forks = 0;
  for (auto& rp : running_) {
    Request& r = *rp;
    if (!r.await_fork || r.done) continue;
    Group& g = *r.group;
    Request* leader = g.leader;
    const size_t fork_at = r.req.prompt.size() - 1;
    const bool leader_ok = leader != nullptr && !leader->done && leader->open && leader->fed <= fork_at;
    if (leader_ok && leader->fed < fork_at) continue;  // not there yet
    r.await_fork = false;
    --g.awaiting;
    StatusOr<ExecSeq> seq = absl::UnavailableError("the leader is gone");
    if (leader_ok) seq = executor_->Fork(leader->seq, r.req.sampling);
    if (seq.ok()) {
      r.fed = fork_at;
      ++forks;
    } else {
      // Prefill it alone (the leader ended, or the fork failed).
      if (leader_ok) NLOG(WARNING) << "request " << r.req.request_id << ": fork failed, prefilling: " << seq.status();
      seq = executor_->Open(r.req.sampling);
      if (!seq.ok()) {
        Fail(r, seq.status());
        continue;
      }
    }
    r.seq = *seq;
    r.open = true;
    if (options_.spec.method == SpecMethod::kNgram) r.history = r.req.prompt;
  }
  return forks;
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
        if (cancels.count((*it)->group->id) != 0) {
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
  for (auto& r : dropped) Fail(*r, cancelled);
  for (auto& r : running_) {
    if (!r->done && cancels.count(r->group->id) != 0) Fail(*r, cancelled);
  }
  for (auto& r : admitted) {
    AdmitOne(*r, cancels);
    running_.push_back(std::move(r));
  }
  // The other choices of a request that failed stop here.
  for (auto& r : running_) {
    if (!r->done && r->group->ended) {
      CloseSequence(*r);
      r->done = true;
    }
  }
  const int64_t forks = RunForks();

  // The prefill lane: a finished lane step's output first, then the next lane step.
  bool ran = false;
  int64_t new_tokens = 0, lane_prompt_tokens = 0;
  SpecStats spec;
  PrefixTally prefix;
  StepTrace trace;
  trace.forks = forks;
  if (lane_busy_ && executor_->LaneStepDone()) {
    new_tokens += FinishLane(&trace, &spec, &prefix, &lane_prompt_tokens);
    ran = true;
  }
  if (lane_on_ && !lane_busy_) {
    StartLane(&trace);
    ran = ran || lane_busy_;
  }

  // 2. Build the step: decode tokens first (rotating start so a tight budget is fair), then drafts for
  // those decode items from what is left of the budget, then prompt chunks.
  items_.clear();
  item_owner_.clear();
  int64_t budget = options_.max_step_tokens;
  const size_t n = running_.size();
  for (size_t k = 0; k < n && budget > 0; ++k) {
    Request& r = *running_[(rotate_ + k) % n];
    if (r.done || r.fed < r.req.prompt.size() || r.next < 0) continue;
    r.feed.assign(1, r.next);
    items_.push_back(StepItem{.seq = r.seq, .sample = true});
    item_owner_.push_back(&r);
    --budget;
    ++trace.decode_tokens;
  }
  ++rotate_;
  const size_t decode_items = items_.size();
  if (options_.spec.method != SpecMethod::kNone) {
    for (size_t i = 0; i < decode_items && budget > 0; ++i) {
      Request& r = *item_owner_[i];
      const int64_t k = DraftsFor(r, budget);
      if (k <= 0) continue;
      if (options_.spec.method == SpecMethod::kNgram) {
        std::vector<int32_t> d = NgramPropose(r.history, k, options_.spec.ngram_max, options_.spec.ngram_min);
        r.feed.insert(r.feed.end(), d.begin(), d.end());
        items_[i].drafts = static_cast<int32_t>(d.size());
        budget -= static_cast<int64_t>(d.size());
      } else {
        items_[i].model_drafts = static_cast<int32_t>(k);
        budget -= k;
      }
    }
  }
  // The feeds are final now: point the decode items at them.
  for (size_t i = 0; i < decode_items; ++i) items_[i].tokens = item_owner_[i]->feed;
  for (auto& rp : running_) {
    if (budget <= 0) break;
    Request& r = *rp;
    if (r.done || !r.open || r.fed >= r.req.prompt.size() || UsesLane(r)) continue;
    int64_t chunk = static_cast<int64_t>(r.req.prompt.size() - r.fed);
    // A leader with choices to fork stops before the last prompt token (RunForks then copies it).
    if (r.group->leader == &r && r.group->awaiting > 0) {
      chunk = std::min<int64_t>(chunk, static_cast<int64_t>(r.req.prompt.size() - 1 - r.fed));
      if (chunk <= 0) continue;
    }
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

  // 3. Run it (with nothing but the prefill lane to wait for, wait for it).
  if (items_.empty() && lane_busy_) {
    new_tokens += FinishLane(&trace, &spec, &prefix, &lane_prompt_tokens);
    ran = true;
  }
  const bool beside_lane = lane_busy_ && !items_.empty();
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
      new_tokens += TakeOutput(items_, item_owner_, out_, &trace, &spec, &prefix);
    }
  }
  for (auto& r : running_) {
    if (r->done && r->group->leader == r.get()) r->group->leader = nullptr;
  }
  running_.erase(
      std::remove_if(running_.begin(), running_.end(), [](const auto& r) { return r->done && !r->in_lane; }),
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
    stats_.prompt_tokens += trace.prefill_tokens + lane_prompt_tokens;
    stats_.lane_steps += trace.lane_steps;
    if (beside_lane) ++stats_.steps_beside_lane;
    stats_.spec_verify_steps += spec.steps;
    stats_.spec_drafted += spec.drafted;
    stats_.spec_accepted += spec.accepted;
    stats_.prefix_queried_tokens += prefix.queried;
    stats_.prefix_hit_tokens += prefix.hit;
    trace_ = trace;
    UpdateRateLocked();
  }
  return ran;
}

int64_t Engine::TakeOutput(std::span<const StepItem> items, const std::vector<Request*>& owners, StepOutput& out,
                           StepTrace* trace, SpecStats* spec, PrefixTally* prefix) {
  int64_t new_tokens = 0;
  size_t offset = 0;  // into out.emitted (and out.logprobs, which is empty or as long)
  const bool have_logprobs = !out.logprobs.empty() && out.logprobs.size() == out.emitted.size();
  const bool have_counts = out.counts.size() == items.size() && out.drafted.size() == items.size() &&
                           out.accepted.size() == items.size();
  for (size_t i = 0; i < items.size(); ++i) {
    Request& r = *owners[i];
    if (r.done) {  // cancelled while its chunk was in the prefill lane: its tokens are dropped
      if (have_counts && items[i].sample) offset += static_cast<size_t>(std::max<int64_t>(out.counts[i], 0));
      continue;
    }
    if (r.fed < r.req.prompt.size()) r.fed += items[i].tokens.size();
    if (out.cached.size() == items.size()) r.cached += out.cached[i];
    if (!items[i].sample) continue;
    if (r.generated == 0) {  // the prompt is done: what the prefix cache saved of it is final
      if (executor_->prefix_cache().bytes >= 0) {
        prefix->queried += static_cast<int64_t>(r.req.prompt.size());
        prefix->hit += r.cached;
      }
      if (!r.group->ended) r.group->sink->OnPromptCached(r.choice, r.cached);
    }
    // The tokens this item emitted: counts[i] of them from out.emitted, or out.tokens[i] alone from an
    // executor that fills neither (it never verifies drafts then).
    std::span<const int32_t> emitted;
    std::span<const EmittedLogprobs> logprobs;
    int64_t drafted = 0, accepted = 0;
    if (have_counts) {
      const int64_t count = out.counts[i];
      drafted = out.drafted[i];
      accepted = out.accepted[i];
      const int64_t rows = items[i].drafts + items[i].model_drafts;
      if (count < 1 || count > 1 + rows || offset + static_cast<size_t>(count) > out.emitted.size() ||
          drafted < 0 || drafted > rows || accepted < 0 || accepted > drafted) {
        Fail(r, absl::InternalError(absl::StrCat("the executor's step output for request ", r.req.request_id,
                                                 " is inconsistent (count ", count, ", drafted ", drafted,
                                                 ", accepted ", accepted, ", rows ", rows, ")")));
        offset = out.emitted.size();
        continue;
      }
      emitted = std::span<const int32_t>(out.emitted).subspan(offset, static_cast<size_t>(count));
      if (have_logprobs && r.req.sampling.logprobs >= 0) {
        logprobs = std::span<const EmittedLogprobs>(out.logprobs).subspan(offset, static_cast<size_t>(count));
      }
      offset += static_cast<size_t>(count);
    } else {
      if (items[i].drafts + items[i].model_drafts > 0) {
        Fail(r, absl::InternalError("the executor verified drafts without reporting counts"));
        continue;
      }
      emitted = std::span<const int32_t>(&out.tokens[i], 1);
    }
    if (drafted > 0) {
      ++spec->steps;
      spec->drafted += drafted;
      spec->accepted += accepted;
      trace->draft_tokens += drafted;
      if (options_.spec.adaptive) {
        if (accepted == drafted) r.depth = std::min(r.depth + 1, max_drafts_);
        if (accepted == 0) r.depth = std::max<int64_t>(r.depth - 1, 1);
      }
    }
    // Each token goes through the stop logic; the first that ends the request drops the rest.
    std::string_view reason;
    size_t kept = 0;
    const auto& stops = r.req.stop_token_ids;
    while (kept < emitted.size() && reason.empty()) {
      const int32_t tok = emitted[kept++];
      ++r.generated;
      if (options_.spec.method == SpecMethod::kNgram) r.history.push_back(tok);
      if ((!r.req.ignore_eos && tok == options_.eos_token_id) ||
          std::find(stops.begin(), stops.end(), tok) != stops.end()) {
        reason = "stop";
      } else if (r.generated >= r.req.max_new_tokens ||
                 (options_.max_context > 0 &&
                  static_cast<int64_t>(r.req.prompt.size()) + r.generated >= options_.max_context)) {
        reason = "length";
      }
    }
    r.next = emitted[kept - 1];
    new_tokens += static_cast<int64_t>(kept);
    if (!reason.empty()) {
      CloseSequence(r);  // before the client hears the end (a remote close rides the next step/flush)
      r.done = true;
    }
    if (r.group->ended) continue;  // a sibling failed in this step: the sweep closes this one
    r.group->sink->OnTokens(r.choice, emitted.first(kept), logprobs.empty() ? logprobs : logprobs.first(kept),
                            reason);
  }
  return new_tokens;
}

bool Engine::UsesLane(const Request& r) const {
  return lane_on_ && r.group->n == 1 && static_cast<int64_t>(r.req.prompt.size()) >= options_.prefill_lane_tokens;
}

void Engine::StartLane(StepTrace* trace) {
  lane_items_.clear();
  lane_owner_.clear();
  int64_t budget = options_.max_step_tokens;
  const int64_t most = options_.prefill_chunk > 0 ? options_.prefill_chunk : budget;
  for (auto& rp : running_) {  // oldest first
    if (budget <= 0) break;
    Request& r = *rp;
    if (r.done || !r.open || r.fed >= r.req.prompt.size() || !UsesLane(r)) continue;
    const int64_t chunk = std::min({static_cast<int64_t>(r.req.prompt.size() - r.fed), most, budget});
    const bool completes = r.fed + static_cast<size_t>(chunk) == r.req.prompt.size();
    lane_items_.push_back(StepItem{.seq = r.seq,
                                   .tokens = std::span<const int32_t>(r.req.prompt.data() + r.fed, chunk),
                                   .sample = completes});
    lane_owner_.push_back(&r);
    budget -= chunk;
    trace->lane_tokens += chunk;
  }
  if (lane_items_.empty()) return;
  if (Status st = executor_->StartLaneStep(lane_items_); !st.ok()) {
    NLOG(WARNING) << "prefill lane step over " << lane_items_.size() << " sequences did not start: " << st;
    for (Request* r : lane_owner_) Fail(*r, st);
    trace->lane_tokens = 0;
    return;
  }
  for (Request* r : lane_owner_) r->in_lane = true;
  lane_busy_ = true;
  ++trace->lane_steps;
}

int64_t Engine::FinishLane(StepTrace* trace, SpecStats* spec, PrefixTally* prefix, int64_t* prompt_tokens) {
  lane_busy_ = false;
  Status st = executor_->FinishLaneStep(&lane_out_);
  for (Request* r : lane_owner_) {
    r->in_lane = false;
    if (r->close_after_lane) CloseSequence(*r);
  }
  if (!st.ok()) {
    NLOG(WARNING) << "prefill lane step over " << lane_items_.size() << " sequences failed: " << st;
    for (Request* r : lane_owner_) {
      if (!r->done) Fail(*r, st);
    }
    if (!executor_->healthy()) {
      for (auto& r : running_) {
        if (!r->done) Fail(*r, st);
      }
    }
    return 0;
  }
  for (const StepItem& it : lane_items_) *prompt_tokens += static_cast<int64_t>(it.tokens.size());
  return TakeOutput(lane_items_, lane_owner_, lane_out_, trace, spec, prefix);
}

int64_t Engine::DraftsFor(const Request& r, int64_t budget) const {
  // Never draft past what may still be emitted: the step emits up to 1 + k tokens.
  int64_t k = std::min(r.depth, budget);
  k = std::min(k, r.req.max_new_tokens - r.generated - 1);
  if (options_.max_context > 0) {
    k = std::min(k, options_.max_context - static_cast<int64_t>(r.req.prompt.size()) - r.generated - 1);
  }
  return std::max<int64_t>(k, 0);
}

void Engine::UpdateRateLocked() {
  const double now = NowSeconds();
  rate_window_.emplace_back(now, stats_.tokens_generated);
  while (rate_window_.size() > 2 && now - rate_window_.front().first > kRateWindowS) rate_window_.pop_front();
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  EngineStats s = stats_;
  s.expert_seconds = executor_->expert_seconds();
  const PrefixCacheFigures prefix = executor_->prefix_cache();
  s.prefix_cache_bytes = prefix.bytes;
  s.prefix_host_bytes = prefix.host_bytes;
  s.prefix_evicted = prefix.evicted;
  s.prefix_host_evicted = prefix.host_evicted;
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
