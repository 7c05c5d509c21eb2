#include "worker/engine/micro_batch_executor.h"

#include <algorithm>
#include <thread>

#include "common/clock.h"

namespace numoe::engine {

Status SerialExperts::RunLocked(const MoeRequest& request) {
  const int64_t t0 = SteadyNanos();
  Status st = inner_->RunRouted(request);
  busy_ns_.fetch_add(SteadyNanos() - t0, std::memory_order_relaxed);
  calls_.fetch_add(1, std::memory_order_relaxed);
  return st;
}

Status SerialExperts::RunRouted(const MoeRequest& request) {
  waiting_.fetch_add(1, std::memory_order_acq_rel);
  std::unique_lock<std::mutex> lk(mu_);
  waiting_.fetch_sub(1, std::memory_order_acq_rel);
  Status st = RunLocked(request);
  lk.unlock();
  cv_.notify_all();
  return st;
}

Status SerialExperts::RunYielding(const MoeRequest& request) {
  if (request.rows <= 0) return absl::OkStatus();
  const int64_t piece = piece_rows_ > 0 && hidden_ > 0 ? piece_rows_ : request.rows;
  for (int64_t at = 0; at < request.rows; at += piece) {
    MoeRequest part = request;
    part.rows = std::min(piece, request.rows - at);
    part.x = request.x + at * hidden_;
    part.out = request.out + at * hidden_;
    part.expert_ids = request.expert_ids + at * request.top_k;
    part.expert_weights = request.expert_weights + at * request.top_k;
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return waiting_.load(std::memory_order_acquire) == 0; });
    pieces_.fetch_add(1, std::memory_order_relaxed);
    RETURN_IF_ERROR(RunLocked(part));
  }
  return absl::OkStatus();
}

MicroBatchExecutor::MicroBatchExecutor(std::vector<Executor*> parts, const SerialExperts* experts, Executor* lane)
    : parts_(std::move(parts)), experts_(experts), open_(parts_.size(), 0), subs_(parts_.size()), lane_(lane) {}

MicroBatchExecutor::~MicroBatchExecutor() {
  if (lane_thread_.joinable()) lane_thread_.join();
}

ExecutorLimits MicroBatchExecutor::limits() const { return parts_.front()->limits(); }

bool MicroBatchExecutor::healthy() const {
  return std::all_of(parts_.begin(), parts_.end(), [](const Executor* p) { return p->healthy(); }) &&
         (lane_ == nullptr || lane_->healthy());
}

StatusOr<MicroBatchExecutor::Where*> MicroBatchExecutor::Find(ExecSeq seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("executor: no open sequence ", seq));
  if (it->second.in_lane) {
    return absl::FailedPreconditionError(absl::StrCat("executor: sequence ", seq, " is in the prefill lane's step"));
  }
  return &it->second;
}

Status MicroBatchExecutor::StartLaneStep(std::span<const StepItem> items) {
  if (lane_ == nullptr) return absl::UnimplementedError("executor: no prefill lane");
  if (lane_thread_.joinable()) return absl::FailedPreconditionError("executor: the prefill lane's step is running");
  if (items.empty()) return absl::InvalidArgumentError("executor: empty step");
  lane_items_.clear();
  lane_seqs_.clear();
  // Hand each sequence to the lane; on a failure the ones moved so far go back.
  auto undo = [&] {
    for (ExecSeq id : lane_seqs_) {
      Where& w = seqs_.at(id);
      if (auto h = lane_->Detach(w.inner); h.ok()) (void)parts_[w.part]->Adopt(*h);
      w.in_lane = false;
    }
    lane_seqs_.clear();
    lane_items_.clear();
  };
  for (const StepItem& item : items) {
    auto w = Find(item.seq);
    Status st = w.status();
    StatusOr<SeqHandoff> h = absl::UnknownError("");
    if (st.ok()) {
      h = parts_[(*w)->part]->Detach((*w)->inner);
      st = h.status();
    }
    if (st.ok()) {
      st = lane_->Adopt(*h);
      if (!st.ok()) (void)parts_[(*w)->part]->Adopt(*h);
    }
    if (!st.ok()) {
      undo();
      return st;
    }
    (*w)->in_lane = true;
    lane_seqs_.push_back(item.seq);
    lane_items_.push_back(item);
    lane_items_.back().seq = (*w)->inner;
  }
  lane_done_.store(false, std::memory_order_release);
  lane_thread_ = std::thread([this] {
    lane_status_ = lane_->Step(lane_items_, &lane_out_);
    lane_done_.store(true, std::memory_order_release);
  });
  return absl::OkStatus();
}

bool MicroBatchExecutor::LaneStepDone() const { return lane_done_.load(std::memory_order_acquire); }

Status MicroBatchExecutor::FinishLaneStep(StepOutput* out) {
  if (!lane_thread_.joinable()) return absl::FailedPreconditionError("executor: no prefill lane step is running");
  lane_thread_.join();
  ++lane_steps_;
  Status moved;
  for (ExecSeq id : lane_seqs_) {
    Where& w = seqs_.at(id);
    w.in_lane = false;
    auto h = lane_->Detach(w.inner);
    Status st = h.ok() ? parts_[w.part]->Adopt(*h) : h.status();
    if (moved.ok() && !st.ok()) moved = st;
  }
  lane_seqs_.clear();
  RETURN_IF_ERROR(lane_status_);
  RETURN_IF_ERROR(moved);
  *out = std::move(lane_out_);
  return absl::OkStatus();
}

double MicroBatchExecutor::expert_seconds() const {
  if (experts_ != nullptr) return experts_->busy_seconds();
  double s = 0;
  for (const Executor* p : parts_) s += p->expert_seconds();
  return s;
}

PrefixCacheFigures MicroBatchExecutor::prefix_cache() const {
  return parts_[std::min(last_part_.load(std::memory_order_relaxed), parts_.size() - 1)]->prefix_cache();
}

StatusOr<ExecSeq> MicroBatchExecutor::Open(const SamplingParams& sampling) {
  // The part with the fewest open sequences first; a full one passes to the next.
  std::vector<size_t> order(parts_.size());
  for (size_t p = 0; p < order.size(); ++p) order[p] = p;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return open_[a] < open_[b]; });
  Status last;
  for (size_t p : order) {
    auto inner = parts_[p]->Open(sampling);
    if (inner.ok()) {
      const ExecSeq id = next_++;
      seqs_.emplace(id, Where{p, *inner});
      ++open_[p];
      return id;
    }
    last = inner.status();
    if (!absl::IsResourceExhausted(last)) break;  // a bad request or a broken part: the others would say the same
  }
  return last;
}

StatusOr<ExecSeq> MicroBatchExecutor::Fork(ExecSeq parent, const SamplingParams& sampling) {
  ASSIGN_OR_RETURN(Where* found, Find(parent));
  const Where w = *found;  // the child's state is a copy of the parent's: the same part
  ASSIGN_OR_RETURN(ExecSeq inner, parts_[w.part]->Fork(w.inner, sampling));
  const ExecSeq id = next_++;
  seqs_.emplace(id, Where{w.part, inner});
  ++open_[w.part];
  return id;
}

Status MicroBatchExecutor::Close(ExecSeq seq) {
  ASSIGN_OR_RETURN(Where* found, Find(seq));
  const Where w = *found;
  seqs_.erase(seq);
  --open_[w.part];
  return parts_[w.part]->Close(w.inner);
}

Status MicroBatchExecutor::Flush() {
  Status first;
  for (Executor* p : parts_) {
    Status st = p->Flush();
    if (first.ok() && !st.ok()) first = st;
  }
  return first;
}

Status MicroBatchExecutor::Step(std::span<const StepItem> items, StepOutput* out) {
  if (items.empty()) return absl::InvalidArgumentError("executor: empty step");
  for (Sub& s : subs_) {
    s.items.clear();
    s.at.clear();
  }
  std::vector<size_t> part_of(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    ASSIGN_OR_RETURN(Where* w, Find(items[i].seq));
    Sub& s = subs_[w->part];
    part_of[i] = w->part;
    s.items.push_back(items[i]);
    s.items.back().seq = w->inner;
    s.at.push_back(i);
  }
  // Every part with items at once: the first on this thread, the others on one thread each.
  std::vector<size_t> running;
  for (size_t p = 0; p < subs_.size(); ++p) {
    if (!subs_[p].items.empty()) running.push_back(p);
  }
  auto run = [this](size_t p) {
    Sub& s = subs_[p];
    s.status = parts_[p]->Step(s.items, &s.out);
  };
  std::vector<std::thread> helpers;
  for (size_t k = 1; k < running.size(); ++k) helpers.emplace_back(run, running[k]);
  run(running[0]);
  for (std::thread& t : helpers) t.join();
  if (running.size() > 1) ++split_steps_;
  last_part_.store(running.back(), std::memory_order_relaxed);
  for (size_t p : running) RETURN_IF_ERROR(subs_[p].status);

  // Merge, in the items' order: per-item arrays, the emitted tokens (and their log-probs) item after item,
  // the logits of the items that asked.
  bool logprobs = false;
  for (size_t p : running) {
    const Sub& s = subs_[p];
    const size_t n = s.items.size();
    if (s.out.tokens.size() != n || s.out.counts.size() != n || s.out.drafted.size() != n ||
        s.out.accepted.size() != n || s.out.cached.size() != n ||
        (!s.out.logprobs.empty() && s.out.logprobs.size() != s.out.emitted.size())) {
      return absl::InternalError(absl::StrCat("executor: micro-batch ", p, "'s step output does not fit its ", n,
                                              " items"));
    }
    logprobs = logprobs || !s.out.logprobs.empty();
  }
  out->Reset(items.size());
  std::vector<size_t> local(subs_.size(), 0), emitted_at(subs_.size(), 0), logits_at(subs_.size(), 0);
  for (size_t i = 0; i < items.size(); ++i) {
    const size_t p = part_of[i];
    const Sub& s = subs_[p];
    const size_t j = local[p]++;
    out->tokens[i] = s.out.tokens[j];
    out->counts[i] = s.out.counts[j];
    out->drafted[i] = s.out.drafted[j];
    out->accepted[i] = s.out.accepted[j];
    out->cached[i] = s.out.cached[j];
    const size_t count = static_cast<size_t>(std::max<int32_t>(s.out.counts[j], 0));
    if (emitted_at[p] + count > s.out.emitted.size()) {
      return absl::InternalError(absl::StrCat("executor: micro-batch ", p, "'s counts run past its emitted tokens"));
    }
    const size_t e = emitted_at[p];
    out->emitted.insert(out->emitted.end(), s.out.emitted.begin() + e, s.out.emitted.begin() + e + count);
    if (logprobs) {
      if (s.out.logprobs.empty()) {
        out->logprobs.resize(out->logprobs.size() + count);
      } else {
        out->logprobs.insert(out->logprobs.end(), s.out.logprobs.begin() + e, s.out.logprobs.begin() + e + count);
      }
    }
    emitted_at[p] += count;
    if (items[i].logits || items[i].all_logits) {
      if (logits_at[p] >= s.out.logits.size()) {
        return absl::InternalError(absl::StrCat("executor: micro-batch ", p, " returned fewer logits than asked"));
      }
      out->logits.push_back(std::move(subs_[p].out.logits[logits_at[p]++]));
    }
  }
  return absl::OkStatus();
}

}  // namespace numoe::engine
