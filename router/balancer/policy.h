// The balancing rule, as one pure function so it can be tested exhaustively without workers.
//
// Least outstanding work with prefix affinity:
//   1. Candidates are the workers that are up, have a free slot and were not tried before by this request.
//   2. The prompt's first `prefix_tokens` ids are hashed; rendezvous (highest-random-weight) hashing of that
//      key against each up worker's group picks a preferred group, and its least loaded candidate is the
//      preferred worker. A group is the workers that share one prefix cache: numoe-gpu holds the cache for
//      every worker of its host, so the group is the host of the worker's address. On one host affinity
//      therefore never overrides the least loaded worker (a burst of chats that share a system prompt
//      spreads over all workers instead of queueing on one); across hosts it keeps a prefix on the host that
//      has it cached. Rendezvous keeps the mapping stable: when a group goes down only its own prefixes move,
//      and they come back when it rejoins.
//   3. The preferred worker is chosen unless it is "much busier" than the least loaded candidate:
//        load(preferred) > load(min) * busy_ratio + busy_slack_tokens
//      or it has no free slot. Then the least loaded candidate wins (ties: fewer in-flight requests, then
//      the lower index).
// Load is outstanding work in tokens: prompt tokens not yet prefilled plus tokens still to generate, of the
// requests this router has in flight on the worker.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace numoe::router {

struct PolicyOptions {
  // Number of leading prompt ids hashed for affinity; 0 turns affinity off.
  int prefix_tokens = 64;
  // "Much busier" = more than busy_ratio x the least load plus busy_slack_tokens.
  double busy_ratio = 2.0;
  int64_t busy_slack_tokens = 2048;

  bool operator==(const PolicyOptions&) const = default;
};

struct WorkerLoad {
  uint64_t id_hash = 0;     // stable hash of the worker's address
  uint64_t group_hash = 0;  // the rendezvous key: HostHash of its address (0: a group of its own, id_hash)
  bool up = false;
  bool has_slot = false;  // in-flight requests below the worker's limit
  bool excluded = false;  // already tried by this request
  int64_t outstanding_tokens = 0;
  int64_t in_flight = 0;
};

// Hash of the first `n` ids (all of them when shorter); 0 for an empty prompt or n == 0 (no affinity).
uint64_t PrefixHash(std::span<const int32_t> prompt_ids, int n);

// Stable 64-bit hash of a string (FNV-1a then a mixer); used for worker ids.
uint64_t StableHash(std::string_view s);
// StableHash of the host part of a worker address ("host:port", "[v6]:port"; an address without a port is
// its own host).
uint64_t HostHash(std::string_view address);

// The index of the worker to use, or nullopt when no candidate exists.
std::optional<size_t> ChooseWorker(std::span<const WorkerLoad> workers, uint64_t prefix_hash,
                                   const PolicyOptions& options);

// The preferred worker among the up, non-excluded workers: the rendezvous-preferred group's least loaded
// worker with a free slot (or, when none has one, the group's first); nullopt if there are none.
std::optional<size_t> PreferredWorker(std::span<const WorkerLoad> workers, uint64_t prefix_hash);

}  // namespace numoe::router
