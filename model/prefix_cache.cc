#include "model/prefix_cache.h"

#include <algorithm>
#include <utility>

#include "common/hash.h"
#include "common/log.h"

namespace numoe {

namespace {

bool StartsWith(std::span<const int32_t> tokens, std::span<const int32_t> prefix) {
  return prefix.size() <= tokens.size() && std::equal(prefix.begin(), prefix.end(), tokens.begin());
}

double MiB(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

constexpr uint64_t kPageHashSeed = 0x7072656669787067ull;  // the chain's start, before any token

}  // namespace

Status ValidatePrefixCacheOptions(const PrefixCacheOptions& o) {
  if (o.budget_bytes < 0) return absl::InvalidArgumentError("--prefix-cache-gb must be >= 0");
  if (o.host_budget_bytes < 0) return absl::InvalidArgumentError("--prefix-cache-host-gb must be >= 0");
  if (o.page_tokens < 1) return absl::InvalidArgumentError("prefix cache page_tokens must be >= 1");
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
  const int64_t align = model_->capabilities().export_align;
  if (options_.host_budget_bytes > 0 && align > 0) {
    page_tokens_ = (std::max(options_.page_tokens, align) + align - 1) / align * align;
    stats_.host_budget_bytes = options_.host_budget_bytes;
  } else if (options_.host_budget_bytes > 0) {
    NLOG(WARNING) << "prefix cache: no host tier: this backend cannot export a sequence's state";
  }
  stats_.page_tokens = page_tokens_;
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
  for (const HostEntry& e : host_lru_) {
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
    // The host tier serves when it holds a deeper match.
    auto host = host_lru_.end();
    const int64_t have = best == lru_.end() ? 0 : static_cast<int64_t>(best->tokens.size());
    for (auto it = host_lru_.begin(); it != host_lru_.end(); ++it) {
      const int64_t n = static_cast<int64_t>(it->tokens.size());
      if (n > limit || n <= have || (host != host_lru_.end() && n <= static_cast<int64_t>(host->tokens.size()))) {
        continue;
      }
      if (StartsWith(tokens, it->tokens)) host = it;
    }
    if (host != host_lru_.end()) {
      const std::vector<int32_t> at = host->tokens;
      StatusOr<SequenceId> seq = RestoreFromHostLocked(host);  // may evict (and invalidate `host`)
      if (seq.ok()) {
        ++stats_.hits;
        ++stats_.host_hits;
        stats_.hit_tokens += at.size();
        return Restored{*seq, static_cast<int64_t>(at.size())};
      }
      // No room for it (the first tier is empty by now): a fresh sequence may still fit (it grows as it runs).
      if (seq.status().code() == absl::StatusCode::kResourceExhausted) break;
      // A checkpoint that cannot be imported serves nobody: drop it and look for the next one.
      NLOG(WARNING) << "prefix cache: dropping the host checkpoint at " << at.size() << " tokens: " << seq.status();
      if (auto again = FindHostLocked(at); again != host_lru_.end()) DropHostLocked(again, "it could not be imported");
      continue;
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
  SpillLocked(e);
  (void)model_->ReleaseSequence(e.seq);
  stats_.bytes -= e.bytes;
  --stats_.entries;
  ++stats_.evicted;
  NLOG(INFO) << "prefix cache: evicted the checkpoint at " << e.tokens.size() << " tokens from the backend's memory ("
             << MiB(e.bytes) << " MiB, " << why << "); " << stats_.entries << " left, " << MiB(stats_.bytes) << " of "
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

std::list<PrefixCache::HostEntry>::iterator PrefixCache::FindHostLocked(std::span<const int32_t> tokens) {
  return std::find_if(host_lru_.begin(), host_lru_.end(), [&](const HostEntry& e) {
    return e.tokens.size() == tokens.size() && std::equal(tokens.begin(), tokens.end(), e.tokens.begin());
  });
}

void PrefixCache::SpillLocked(const Entry& e) {
  if (page_tokens_ == 0) return;
  if (auto it = FindHostLocked(e.tokens); it != host_lru_.end()) {  // held already (a promoted checkpoint)
    host_lru_.splice(host_lru_.begin(), host_lru_, it);
    return;
  }
  const int64_t P = page_tokens_, whole = static_cast<int64_t>(e.tokens.size()) / P;
  // The leading pages held already (the same tokens up to their ends) are shared, not exported again.
  HostEntry h;
  h.tokens = e.tokens;
  std::vector<uint64_t> hashes(static_cast<size_t>(whole));
  uint64_t chain = kPageHashSeed;
  for (int64_t k = 0; k < whole; ++k) {
    const std::span<const int32_t> own = std::span<const int32_t>(e.tokens).subspan(static_cast<size_t>(k * P),
                                                                                  static_cast<size_t>(P));
    chain = HashTokens(chain, own);
    hashes[static_cast<size_t>(k)] = chain;
    if (static_cast<int64_t>(h.pages.size()) != k) continue;
    auto found = pages_.find(chain);
    if (found == pages_.end()) continue;
    const Page& pg = *found->second;
    const Page* parent = k == 0 ? nullptr : h.pages.back().get();
    if (pg.parent == parent && std::equal(own.begin(), own.end(), pg.tokens.begin(), pg.tokens.end())) {
      h.pages.push_back(found->second);
    }
  }
  const int64_t first = static_cast<int64_t>(h.pages.size());
  StatusOr<HostState> hs = model_->ExportSequence(e.seq, P, first);
  if (!hs.ok()) {
    NLOG(WARNING) << "prefix cache: the checkpoint at " << e.tokens.size()
                  << " tokens is dropped, not moved to host memory: " << hs.status();
    return;
  }
  int64_t added = hs->rest.size;
  for (int64_t k = first; k < whole; ++k) {
    auto pg = std::make_shared<Page>();
    pg->hash = hashes[static_cast<size_t>(k)];
    pg->parent = k == 0 ? nullptr : h.pages.back().get();
    pg->tokens.assign(e.tokens.begin() + k * P, e.tokens.begin() + (k + 1) * P);
    pg->bytes = std::move(hs->pages[static_cast<size_t>(k)]);
    pg->shared = pages_.emplace(pg->hash, pg).second;  // a collision keeps the page private
    added += pg->bytes.size;
    ++stats_.host_pages;
    h.pages.push_back(std::move(pg));
  }
  for (auto& pg : h.pages) ++pg->refs;
  h.rest = std::move(hs->rest);
  stats_.host_bytes += added;
  ++stats_.host_entries;
  ++stats_.host_stored;
  NLOG(INFO) << "prefix cache: moved the checkpoint at " << e.tokens.size() << " tokens to host memory ("
             << MiB(added) << " MiB new, " << first << " of " << whole << " pages shared); " << stats_.host_entries
             << " there, " << MiB(stats_.host_bytes) << " of " << MiB(options_.host_budget_bytes) << " MiB";
  host_lru_.push_front(std::move(h));
  EvictHostLocked();
}

void PrefixCache::EvictHostLocked() {
  while (!host_lru_.empty() && stats_.host_bytes > options_.host_budget_bytes) {
    DropHostLocked(std::prev(host_lru_.end()), "over the host byte budget");
  }
}

void PrefixCache::DropHostLocked(std::list<HostEntry>::iterator it, const char* why) {
  int64_t freed = it->rest.size;
  // Last page first: a page's parent is released only after it.
  for (auto pg = it->pages.rbegin(); pg != it->pages.rend(); ++pg) {
    if (--(*pg)->refs > 0) continue;
    freed += (*pg)->bytes.size;
    --stats_.host_pages;
    if ((*pg)->shared) pages_.erase((*pg)->hash);
  }
  stats_.host_bytes -= freed;
  --stats_.host_entries;
  ++stats_.host_evicted;
  NLOG(INFO) << "prefix cache: evicted the checkpoint at " << it->tokens.size() << " tokens from host memory ("
             << MiB(freed) << " MiB freed, " << why << "); " << stats_.host_entries << " left, "
             << MiB(stats_.host_bytes) << " of " << MiB(options_.host_budget_bytes) << " MiB";
  host_lru_.erase(it);
}

StatusOr<SequenceId> PrefixCache::RestoreFromHostLocked(std::list<HostEntry>::iterator it) {
  host_lru_.splice(host_lru_.begin(), host_lru_, it);
  HostState hs;
  hs.position = static_cast<int64_t>(it->tokens.size());
  hs.page_tokens = page_tokens_;
  for (const auto& pg : it->pages) hs.pages.push_back(pg->bytes);
  hs.rest = it->rest;
  std::vector<int32_t> tokens = it->tokens;  // `it` may go while the first tier makes room
  StatusOr<SequenceId> seq = model_->ImportSequence(hs);
  while (!seq.ok() && seq.status().code() == absl::StatusCode::kResourceExhausted && !lru_.empty()) {
    EvictOneLocked("the backend needs room for a running sequence");
    seq = model_->ImportSequence(hs);
  }
  if (!seq.ok()) return seq.status();
  // Promote: the imported sequence becomes the first tier's checkpoint when it fits there, and the caller
  // gets a copy; else the caller takes it.
  StatusOr<SequenceMemory> mem = model_->Memory(*seq);
  const int64_t bytes = mem.ok() ? std::max(mem->capacity_bytes, mem->fixed_bytes + mem->growing_bytes) : 0;
  if (!mem.ok() || bytes > options_.budget_bytes || options_.max_entries < 1) return seq;
  StatusOr<SequenceId> copy = model_->ForkSequence(*seq);
  if (!copy.ok()) return seq;
  InsertLocked(Entry{std::move(tokens), *seq, 0});
  return copy;
}

PrefixCacheStats PrefixCache::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

}  // namespace numoe
