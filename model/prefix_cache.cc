#include "model/prefix_cache.h"

#include <algorithm>
#include <utility>

#include "common/log.h"

namespace numoe {

namespace {

bool StartsWith(std::span<const int32_t> tokens, std::span<const int32_t> prefix) {
  return prefix.size() <= tokens.size() && std::equal(prefix.begin(), prefix.end(), tokens.begin());
}

double MiB(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

}  // namespace

Status ValidatePrefixCacheOptions(const PrefixCacheOptions& o) {
  if (o.budget_bytes < 0) return absl::InvalidArgumentError("--prefix-cache-gb must be >= 0");
  if (o.checkpoint_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--prefix-checkpoint-tokens must be >= 0 (got ", o.checkpoint_tokens, ")"));
  }
  if (o.min_tokens < 1) return absl::InvalidArgumentError("prefix cache min_tokens must be >= 1");
  if (o.max_entries < 0) return absl::InvalidArgumentError("prefix cache max_entries must be >= 0");
  return absl::OkStatus();
}

PrefixCache::PrefixCache(ModelBackend* model, const PrefixCacheOptions& options) : model_(model), options_(options) {
  stats_.budget_bytes = options_.budget_bytes;
}

PrefixCache::~PrefixCache() {
  std::lock_guard<std::mutex> lk(mu_);
  for (const Entry& e : lru_) (void)model_->ReleaseSequence(e.seq);
  lru_.clear();
}

bool PrefixCache::Extends(std::span<const int32_t> prefix) const {
  std::lock_guard<std::mutex> lk(mu_);
  for (const Entry& e : lru_) {
    if (e.tokens.size() > prefix.size() && StartsWith(e.tokens, prefix)) return true;
  }
  return false;
}

StatusOr<PrefixCache::Restored> PrefixCache::Restore(std::span<const int32_t> tokens, int64_t limit) {
  std::lock_guard<std::mutex> lk(mu_);
  ++stats_.lookups;
  stats_.queried_tokens += tokens.size();
  limit = std::min<int64_t>(limit, static_cast<int64_t>(tokens.size()));
  for (;;) {
    auto best = lru_.end();
    for (auto it = lru_.begin(); it != lru_.end(); ++it) {
      const int64_t n = static_cast<int64_t>(it->tokens.size());
      if (n > limit || (best != lru_.end() && n <= static_cast<int64_t>(best->tokens.size()))) continue;
      if (StartsWith(tokens, it->tokens)) best = it;
    }
    if (best == lru_.end()) break;
    StatusOr<SequenceId> seq = model_->ForkSequence(best->seq);
    while (!seq.ok() && seq.status().code() == absl::StatusCode::kResourceExhausted && lru_.size() > 1 &&
           &lru_.back() != &*best) {
      EvictOneLocked("the backend needs room for a running sequence");
      seq = model_->ForkSequence(best->seq);
    }
    if (seq.ok()) {
      const int64_t position = static_cast<int64_t>(best->tokens.size());
      lru_.splice(lru_.begin(), lru_, best);
      ++stats_.hits;
      stats_.hit_tokens += static_cast<uint64_t>(position);
      return Restored{*seq, position};
    }
    // A checkpoint that cannot be copied serves nobody: drop it and look for the next one.
    NLOG(WARNING) << "prefix cache: dropping the checkpoint at " << best->tokens.size()
                  << " tokens: " << seq.status();
    (void)model_->ReleaseSequence(best->seq);
    stats_.bytes -= best->bytes;
    --stats_.entries;
    ++stats_.evicted;
    lru_.erase(best);
  }
  StatusOr<SequenceId> fresh = model_->CreateSequence();
  while (!fresh.ok() && fresh.status().code() == absl::StatusCode::kResourceExhausted && !lru_.empty()) {
    EvictOneLocked("the backend needs room for a running sequence");
    fresh = model_->CreateSequence();
  }
  if (!fresh.ok()) return fresh.status();
  return Restored{*fresh, 0};
}

std::list<PrefixCache::Entry>::iterator PrefixCache::FindLocked(std::span<const int32_t> tokens) {
  return std::find_if(lru_.begin(), lru_.end(), [&](const Entry& e) {
    return e.tokens.size() == tokens.size() && std::equal(tokens.begin(), tokens.end(), e.tokens.begin());
  });
}

Status PrefixCache::Store(SequenceId seq, std::span<const int32_t> tokens) {
  std::lock_guard<std::mutex> lk(mu_);
  if (static_cast<int64_t>(tokens.size()) < options_.min_tokens) return absl::OkStatus();
  if (auto it = FindLocked(tokens); it != lru_.end()) {
    lru_.splice(lru_.begin(), lru_, it);
    return absl::OkStatus();
  }
  StatusOr<SequenceId> copy = model_->ForkSequence(seq);
  if (!copy.ok()) {
    NLOG(WARNING) << "prefix cache: no checkpoint at " << tokens.size() << " tokens: " << copy.status();
    return copy.status();
  }
  InsertLocked(Entry{std::vector<int32_t>(tokens.begin(), tokens.end()), *copy, 0});
  return absl::OkStatus();
}

void PrefixCache::Adopt(SequenceId seq, std::vector<int32_t> tokens) {
  std::lock_guard<std::mutex> lk(mu_);
  StatusOr<SequenceMemory> mem = model_->Memory(seq);
  if (static_cast<int64_t>(tokens.size()) < options_.min_tokens || !mem.ok() ||
      mem->position != static_cast<int64_t>(tokens.size())) {
    (void)model_->ReleaseSequence(seq);
    return;
  }
  if (auto it = FindLocked(tokens); it != lru_.end()) {
    lru_.splice(lru_.begin(), lru_, it);
    (void)model_->ReleaseSequence(seq);
    return;
  }
  InsertLocked(Entry{std::move(tokens), seq, 0});
}

void PrefixCache::InsertLocked(Entry e) {
  StatusOr<SequenceMemory> mem = model_->Memory(e.seq);
  e.bytes = mem.ok() ? std::max(mem->capacity_bytes, mem->fixed_bytes + mem->growing_bytes) : 0;
  stats_.bytes += e.bytes;
  ++stats_.entries;
  ++stats_.stored;
  lru_.push_front(std::move(e));
  EvictLocked();
}

void PrefixCache::EvictLocked() {
  while (!lru_.empty() && (stats_.bytes > options_.budget_bytes || stats_.entries > options_.max_entries)) {
    EvictOneLocked(stats_.bytes > options_.budget_bytes ? "over the byte budget" : "over the checkpoint count");
  }
}

void PrefixCache::EvictOneLocked(const char* why) {
  Entry& e = lru_.back();
  (void)model_->ReleaseSequence(e.seq);
  stats_.bytes -= e.bytes;
  --stats_.entries;
  ++stats_.evicted;
  NLOG(INFO) << "prefix cache: evicted the checkpoint at " << e.tokens.size() << " tokens (" << MiB(e.bytes)
             << " MiB, " << why << "); " << stats_.entries << " left, " << MiB(stats_.bytes) << " of "
             << MiB(options_.budget_bytes) << " MiB";
  lru_.pop_back();
}

StatusOr<SequenceId> PrefixCache::MakeRoom(const std::function<StatusOr<SequenceId>()>& make) {
  for (;;) {
    StatusOr<SequenceId> id = make();
    if (id.ok() || id.status().code() != absl::StatusCode::kResourceExhausted) return id;
    std::lock_guard<std::mutex> lk(mu_);
    if (lru_.empty()) return id;
    EvictOneLocked("the backend needs room for a running sequence");
  }
}

PrefixCacheStats PrefixCache::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

}  // namespace numoe
