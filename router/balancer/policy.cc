#include "router/balancer/policy.h"

#include <algorithm>
#include <string_view>

namespace numoe::router {
namespace {

// splitmix64 finalizer: spreads similar inputs over the whole range.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t StableHash(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return Mix(h);
}

uint64_t PrefixHash(std::span<const int32_t> prompt_ids, int n) {
  if (n <= 0 || prompt_ids.empty()) return 0;
  size_t count = std::min(prompt_ids.size(), static_cast<size_t>(n));
  uint64_t h = 0x51ed270b27c9e3a5ULL;
  for (size_t i = 0; i < count; ++i) h = Mix(h ^ static_cast<uint32_t>(prompt_ids[i]));
  return h == 0 ? 1 : h;
}

std::optional<size_t> PreferredWorker(std::span<const WorkerLoad> workers, uint64_t prefix_hash) {
  std::optional<size_t> best;
  uint64_t best_weight = 0;
  for (size_t i = 0; i < workers.size(); ++i) {
    const WorkerLoad& w = workers[i];
    if (!w.up || w.excluded) continue;
    uint64_t weight = Mix(prefix_hash ^ w.id_hash);
    if (!best || weight > best_weight) {
      best = i;
      best_weight = weight;
    }
  }
  return best;
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
    const WorkerLoad& l = workers[*least];
    if (w.outstanding_tokens < l.outstanding_tokens ||
        (w.outstanding_tokens == l.outstanding_tokens && w.in_flight < l.in_flight)) {
      least = i;
    }
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
