#include "gpu_service/merged_step.h"

#include <algorithm>
#include <cstring>

namespace numoe::gpu {

bool MergeEnabled(MergeLanes m, bool cuda_backend) {
  // auto: off on both backends, as measured (README "Merged passes"): in one pass the workers wait for the
  // model's layers and the model for the slowest worker's experts, where separate lanes overlap the two.
  (void)cuda_backend;
  return m == MergeLanes::kOn;
}

StatusOr<RowSplit> SplitRows(const int64_t* seqs, int64_t n, size_t parts, const std::function<int(int64_t)>& owner) {
  if (seqs == nullptr && n > 0) {
    return absl::UnimplementedError("merged pass: the model backend does not name each MoE row's sequence");
  }
  RowSplit s;
  s.rows.resize(parts);
  for (int64_t r = 0; r < n; ++r) {
    const int p = owner(seqs[r]);
    if (p < 0 || static_cast<size_t>(p) >= parts) {
      return absl::InternalError(absl::StrCat("merged pass: MoE row ", r, " belongs to sequence ", seqs[r],
                                              ", which no part of the step holds"));
    }
    s.rows[static_cast<size_t>(p)].push_back(r);
  }
  return s;
}

template <typename T>
void GatherRows(const T* src, int64_t width, std::span<const int64_t> rows, T* dst) {
  const size_t w = static_cast<size_t>(width);
  for (size_t i = 0; i < rows.size(); ++i) std::memcpy(dst + i * w, src + static_cast<size_t>(rows[i]) * w, w * sizeof(T));
}

template <typename T>
void ScatterRows(const T* src, int64_t width, std::span<const int64_t> rows, T* dst) {
  const size_t w = static_cast<size_t>(width);
  for (size_t i = 0; i < rows.size(); ++i) std::memcpy(dst + static_cast<size_t>(rows[i]) * w, src + i * w, w * sizeof(T));
}

template void GatherRows<float>(const float*, int64_t, std::span<const int64_t>, float*);
template void GatherRows<int32_t>(const int32_t*, int64_t, std::span<const int64_t>, int32_t*);
template void ScatterRows<float>(const float*, int64_t, std::span<const int64_t>, float*);

Status MergedExperts::RunRouted(const MoeRequest& r) {
  std::vector<MergePart>& parts = *parts_;
  ASSIGN_OR_RETURN(RowSplit split, SplitRows(r.seqs, r.rows, parts.size(), [&](int64_t seq) {
                     for (size_t p = 0; p < parts.size(); ++p) {
                       for (const CachedSequence* s : parts[p].states) {
                         if (s->model_seq == seq) return static_cast<int>(p);
                       }
                     }
                     return -1;
                   }));
  const int64_t K = r.top_k;
  // Hidden size from the part's channel; every part serves the same model.
  bufs_.resize(parts.size());
  for (size_t p = 0; p < parts.size(); ++p) {
    Buf& b = bufs_[p];
    b.posted = false;
    const std::vector<int64_t>& rows = split.rows[p];
    if (rows.empty() || !parts[p].status.ok()) continue;
    const int64_t D = parts[p].experts->hidden();
    const int64_t m = static_cast<int64_t>(rows.size());
    b.x.resize(static_cast<size_t>(m * D));
    b.out.resize(b.x.size());
    b.ids.resize(static_cast<size_t>(m * K));
    b.w.resize(b.ids.size());
    GatherRows(r.x, D, rows, b.x.data());
    GatherRows(r.expert_ids, K, rows, b.ids.data());
    GatherRows(r.expert_weights, K, rows, b.w.data());
    b.req = MoeRequest{.layer = r.layer, .rows = m, .top_k = K, .x = b.x.data(), .expert_ids = b.ids.data(),
                       .expert_weights = b.w.data(), .out = b.out.data()};
    if (Status st = parts[p].experts->Post(b.req); !st.ok()) {
      parts[p].status = st;
      continue;
    }
    b.posted = true;
  }
  if (yield_ != nullptr) yield_->unlock();
  for (size_t p = 0; p < parts.size(); ++p) {
    if (!bufs_[p].posted) continue;
    if (Status st = parts[p].experts->Collect(bufs_[p].req); !st.ok()) parts[p].status = st;
  }
  if (yield_ != nullptr) yield_->lock();
  // A failed part's rows get zeros (the step goes on for the others; that part's answer is its error).
  for (size_t p = 0; p < parts.size(); ++p) {
    const std::vector<int64_t>& rows = split.rows[p];
    if (rows.empty()) continue;
    const int64_t D = parts[p].experts->hidden();
    if (!parts[p].status.ok()) {
      for (int64_t row : rows) std::fill_n(r.out + row * D, D, 0.0f);
      continue;
    }
    ScatterRows(bufs_[p].out.data(), D, rows, r.out);
  }
  return absl::OkStatus();
}

void SliceStepOutput(const StepOutput& all, std::span<const StepItem> items, size_t begin, size_t end,
                     StepOutput* part) {
  size_t emitted = 0, logits = 0;
  for (size_t i = 0; i < begin; ++i) {
    emitted += static_cast<size_t>(all.counts[i]);
    if (items[i].logits || items[i].all_logits) ++logits;
  }
  size_t emitted_end = emitted, logits_end = logits;
  for (size_t i = begin; i < end; ++i) {
    emitted_end += static_cast<size_t>(all.counts[i]);
    if (items[i].logits || items[i].all_logits) ++logits_end;
  }
  auto slice = [&](const auto& v, size_t a, size_t b, auto* dst) { dst->assign(v.begin() + a, v.begin() + b); };
  slice(all.tokens, begin, end, &part->tokens);
  slice(all.counts, begin, end, &part->counts);
  slice(all.drafted, begin, end, &part->drafted);
  slice(all.accepted, begin, end, &part->accepted);
  if (all.cached.size() >= end) {
    slice(all.cached, begin, end, &part->cached);
  } else {
    part->cached.clear();
  }
  slice(all.emitted, emitted, emitted_end, &part->emitted);
  slice(all.logits, logits, logits_end, &part->logits);
  if (all.logprobs.empty()) {
    part->logprobs.clear();
  } else {
    slice(all.logprobs, emitted, emitted_end, &part->logprobs);
  }
}

void MergeQueue::Post(PendingStep* p) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    posted_.push_back(p);
    last_post_[p->session] = std::chrono::steady_clock::now();
  }
  cv_.notify_all();
}

void MergeQueue::AwaitPeers(PendingStep* p) {
  std::unique_lock<std::mutex> lk(mu_);
  const auto now = std::chrono::steady_clock::now();
  const auto step = std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(step_s_));
  cv_.wait_until(lk, now + step, [&] {
    if (p->taken) return true;
    const auto active_since = std::chrono::steady_clock::now() - 4 * step;
    for (const auto& entry : last_post_) {
      if (entry.second < active_since) continue;
      const auto* session = entry.first;  // (not a structured binding: clang does not capture those in C++20)
      const bool posted = std::any_of(posted_.begin(), posted_.end(), [&](PendingStep* q) { return q->session == session; });
      if (!posted) return false;
    }
    return true;
  });
}

void MergeQueue::RecordStep(double seconds) {
  std::lock_guard<std::mutex> lk(mu_);
  step_s_ = seconds;
}

void MergeQueue::Forget(const void* session) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    last_post_.erase(session);
  }
  cv_.notify_all();
}

std::vector<PendingStep*> MergeQueue::Take(PendingStep* self, size_t max_parts) {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<PendingStep*> group;
  if (self->taken) return group;
  self->taken = true;
  group.push_back(self);
  std::erase(posted_, self);
  for (auto it = posted_.begin(); it != posted_.end() && group.size() < max_parts;) {
    (*it)->taken = true;
    group.push_back(*it);
    it = posted_.erase(it);
  }
  return group;
}

void MergeQueue::Finish(PendingStep* p, Status st) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    p->status = std::move(st);
    p->done = true;
  }
  cv_.notify_all();
}

void MergeQueue::Wait(PendingStep* p) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return p->done; });
}

}  // namespace numoe::gpu
