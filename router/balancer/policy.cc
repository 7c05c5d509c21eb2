#include "router/balancer/policy.h"

#include <algorithm>
#include <string_view>

#include "common/hash.h"

namespace numoe::router {

uint64_t StableHash(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return SplitMix64(h);
}

uint64_t PrefixHash(std::span<const int32_t> prompt_ids, int n) {
  if (n <= 0 || prompt_ids.empty()) return 0;
  size_t count = std::min(prompt_ids.size(), static_cast<size_t>(n));
  const uint64_t h = HashTokens(0x51ed270b27c9e3a5ULL, prompt_ids.first(count));
  return h == 0 ? 1 : h;
}

uint64_t HostHash(std::string_view address) {
  std::string_view host = address;
  if (!host.empty() && host.front() == '[') {
    const size_t close = host.find(']');
    if (close != std::string_view::npos) host = host.substr(0, close + 1);
  } else if (const size_t colon = host.rfind(':'); colon != std::string_view::npos &&
                                                  host.find(':') == colon) {  // one colon: host:port
    host = host.substr(0, colon);
  }
  return StableHash(host);
}

namespace {

uint64_t GroupKey(const WorkerLoad& w) { return w.group_hash != 0 ? w.group_hash : w.id_hash; }

// Less outstanding work, then fewer requests in flight (ties: the lower index, the one seen first).
bool LessLoaded(const WorkerLoad& a, const WorkerLoad& b) {
  return a.outstanding_tokens < b.outstanding_tokens ||
         (a.outstanding_tokens == b.outstanding_tokens && a.in_flight < b.in_flight);
}

}  // namespace

std::optional<size_t> PreferredWorker(std::span<const WorkerLoad> workers, uint64_t prefix_hash) {
  std::optional<uint64_t> group;
  uint64_t best_weight = 0;
  for (const WorkerLoad& w : workers) {
    if (!w.up || w.excluded) continue;
    const uint64_t weight = SplitMix64(prefix_hash ^ GroupKey(w));
    if (!group || weight > best_weight) {
      group = GroupKey(w);
      best_weight = weight;
    }
  }
  if (!group) return std::nullopt;
  std::optional<size_t> first, best;
  for (size_t i = 0; i < workers.size(); ++i) {
    const WorkerLoad& w = workers[i];
    if (!w.up || w.excluded || GroupKey(w) != *group) continue;
    if (!first) first = i;
    if (w.has_slot && (!best || LessLoaded(w, workers[*best]))) best = i;
  }
  return best ? best : first;
}

std::optional<size_t> ChooseWorker(std::span<const WorkerLoad> workers, uint64_t prefix_hash,
                                   const PolicyOptions& options) {
  std::optional<size_t> least;
  for (size_t i = 0; i < workers.size(); ++i) {
    const WorkerLoad& w = workers[i];
    if (!w.up || w.excluded || !w.has_slot) continue;
    if (!least) {
      least = i;
      continue;
    }
    if (LessLoaded(w, workers[*least])) least = i;
  }
  if (!least) return std::nullopt;
  if (prefix_hash == 0 || options.prefix_tokens <= 0) return least;
  std::optional<size_t> preferred = PreferredWorker(workers, prefix_hash);
  if (!preferred || !workers[*preferred].has_slot) return least;
  double limit = static_cast<double>(workers[*least].outstanding_tokens) * options.busy_ratio +
                 static_cast<double>(options.busy_slack_tokens);
  if (static_cast<double>(workers[*preferred].outstanding_tokens) > limit) return least;
  return preferred;
}

}  // namespace numoe::router
