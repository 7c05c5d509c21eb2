// The prefix cache: exact reuse of a sequence's model state across requests that share a token prefix.
//
// V4's state is not a plain KV cache (window rings, compressed CSA/HCA entries, the compressors' pending
// partial blocks, the indexer's keys, the MTP/DSpark drafter rings: docs/dsv4-architecture.md), and no
// part of it can be rebuilt approximately without changing the logits. So a checkpoint is the whole state
// of a sequence at one position, held by the backend as a parked sequence (ModelBackend::ForkSequence
// makes the copy; a finished sequence is adopted as it is, without a copy), with the token ids it
// consumed. A request resumes from the deepest checkpoint whose tokens are a prefix of its own: the
// backend forks the checkpoint into a new sequence and the caller computes only the rest. On the CPU
// backend rows are computed independently of the chunking, so the logits equal a cold prefill bit for bit.
//
// Where checkpoints come from is the caller's policy (numoe-gpu's WorkerSession: gpu_service/session.h):
// one token before the end of each prompt (an exact repeat then computes one token), every
// `checkpoint_tokens` inside a long prompt, and the end of each answer (the next turn's prefix).
// Speculative steps leave none of their own: a sequence is stored only at a position every token of which was
// accepted (after a speculative step, once ModelBackend::Settle made its rollback final).
//
// Memory, in two tiers, each LRU and bounded in bytes:
//  1. the backend's own memory (host RAM for the CPU backend, GPU memory for CUDA): checkpoints are parked
//     sequences (ModelBackend::Memory capacity counts), within `budget_bytes`.
//  2. host RAM (`host_budget_bytes`, 0 = none; pinned on CUDA): a checkpoint the first tier evicts is
//     exported there (ModelBackend::ExportSequence) instead of dropped. A lookup whose deepest match lies
//     there imports it (ModelBackend::ImportSequence) and promotes it to the first tier when it fits (the
//     host copy stays: evicting it again costs nothing). In this tier the compressed history (CSA/HCA
//     entries, the indexer's keys: appended per absolute position and never rewritten) lives in pages of
//     `page_tokens` positions aligned to absolute positions and keyed by a hash chain over the tokens up to
//     the page's end (common/hash.h HashTokens), verified token for token against the page before it: two
//     checkpoints of one conversation (turn 1's and turn 2's ends) hold the pages of their common prefix
//     once, refcounted, and the bytes count them once. The rest of a checkpoint (window rings, pending
//     blocks, drafter rings, the history past its last whole page) is its own.
// Every eviction is logged. Running sequences are never evicted: a restored sequence is a copy that owes
// nothing to its checkpoint.
// Thread-safety: every method may be called from any thread; calls that touch the model (Restore, Store,
// Adopt, eviction) must be made by the thread that holds the model (numoe-gpu's forward lock). stats() needs
// nothing.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "model/backend.h"

namespace numoe {

struct PrefixCacheOptions {
  int64_t budget_bytes = int64_t{4} << 30;  // the checkpoints' memory bound
  int64_t checkpoint_tokens = 2048;         // a checkpoint every this many tokens of a long prompt (0 = none)
  int64_t min_tokens = 1;                   // shorter prefixes are not stored
  // The most checkpoints held: each is a sequence of the backend, and a backend with a fixed number of
  // sequence slots (CUDA) needs most of them for running sequences.
  int64_t max_entries = 256;
  // The host tier's bound (0 = no host tier; a backend without Capabilities::export_align has none either).
  int64_t host_budget_bytes = 0;
  // The host tier's page: the smallest multiple of the backend's export_align >= this. 256 positions on V4
  // hold whole entries of every compress rate (64 CSA and indexer entries, 2 HCA), and bound what a
  // checkpoint keeps of its own past the last shared page; much smaller pages only add hash lookups.
  int64_t page_tokens = 256;
};
// The options' bounds: budgets >= 0, checkpoint_tokens >= 0, min_tokens >= 1, page_tokens >= 1. Messages name
// the flag.
Status ValidatePrefixCacheOptions(const PrefixCacheOptions& o);

struct PrefixCacheStats {
  uint64_t queried_tokens = 0;  // prompt tokens looked up (the prompt's length at each lookup)
  uint64_t hit_tokens = 0;      // of them restored from a checkpoint instead of computed
  uint64_t lookups = 0, hits = 0;
  uint64_t stored = 0;          // checkpoints taken (copies and adoptions)
  uint64_t evicted = 0;         // from the first tier (exported to the host tier or dropped)
  int64_t entries = 0;          // first tier (the backend's memory)
  int64_t bytes = 0;            // held by the first tier's checkpoints now
  int64_t budget_bytes = 0;
  // The host tier: checkpoints, their bytes (shared pages once), pages held (shared ones once), its bound,
  // checkpoints exported into it, dropped from it, and restored from it.
  int64_t host_entries = 0;
  int64_t host_bytes = 0;
  int64_t host_pages = 0;
  int64_t host_budget_bytes = 0;
  int64_t page_tokens = 0;      // the host tier's page (0 = no host tier)
  uint64_t host_stored = 0;
  uint64_t host_evicted = 0;
  uint64_t host_hits = 0;
};

class PrefixCache {
 public:
  PrefixCache(ModelBackend* model, const PrefixCacheOptions& options);
  ~PrefixCache();  // releases every checkpoint's sequence
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  const PrefixCacheOptions& options() const { return options_; }

  // True when a checkpoint lies deeper than `prefix` along it (some checkpoint's tokens start with
  // `prefix` and are longer): a caller reading a prompt chunk by chunk may wait for more before restoring.
  bool Extends(std::span<const int32_t> prefix) const;

  struct Restored {
    SequenceId seq = 0;     // a new sequence of the model
    int64_t position = 0;   // its position: tokens[0, position) are in its state (0 on a miss)
  };
  // A new sequence holding the state after the deepest checkpoint C <= limit whose tokens are
  // tokens[0, C), or a fresh sequence (position 0) when none is. Counts tokens.size() as queried and C as hit.
  StatusOr<Restored> Restore(std::span<const int32_t> tokens, int64_t limit);

  // Stores a copy of `seq`'s state; `tokens` are the tokens it consumed (its position is tokens.size()).
  // A checkpoint of the same tokens already held is only refreshed. A failed copy (e.g. out of memory) is
  // logged and returned; the sequence is unchanged either way.
  Status Store(SequenceId seq, std::span<const int32_t> tokens);
  // Takes `seq` over as a checkpoint (the caller is done with it: no copy), or releases it when the same
  // tokens are held already, it is too short, or its position is not tokens.size().
  void Adopt(SequenceId seq, std::vector<int32_t> tokens);

  PrefixCacheStats stats() const;

  // Runs `make` (a CreateSequence or ForkSequence of the model); while it fails with RESOURCE_EXHAUSTED
  // (a backend out of sequence slots or memory) and checkpoints are held, evicts the least recently used
  // one and tries again: cached state always yields to running sequences.
  StatusOr<SequenceId> MakeRoom(const std::function<StatusOr<SequenceId>()>& make);

 private:
  struct Entry {
    std::vector<int32_t> tokens;
    SequenceId seq = 0;
    int64_t bytes = 0;
  };
  // A host page: the history of positions [k·P, (k+1)·P) of the checkpoints whose tokens up to (k+1)·P are
  // `hash`'s; `parent` is page k-1 (held while this one is), `tokens` this page's own, for the check that
  // makes sharing exact.
  struct Page {
    uint64_t hash = 0;
    const Page* parent = nullptr;
    std::vector<int32_t> tokens;
    HostBytes bytes;
    int64_t refs = 0;     // host entries holding it
    bool shared = false;  // in pages_ (false: a hash collision kept it private)
  };
  struct HostEntry {
    std::vector<int32_t> tokens;
    std::vector<std::shared_ptr<Page>> pages;
    HostBytes rest;
  };
  // Under mu_: the entry with exactly these tokens, or end().
  std::list<Entry>::iterator FindLocked(std::span<const int32_t> tokens);
  std::list<HostEntry>::iterator FindHostLocked(std::span<const int32_t> tokens);
  void InsertLocked(Entry e);
  void EvictLocked();
  // Drops the first tier's least recently used checkpoint, exporting it to the host tier first when there is one.
  void EvictOneLocked(const char* why);
  void SpillLocked(const Entry& e);
  void EvictHostLocked();
  void DropHostLocked(std::list<HostEntry>::iterator it, const char* why);
  // Imports the host checkpoint `it` (deeper than any first-tier match): the new sequence for the caller, the
  // checkpoint promoted to the first tier when it fits.
  StatusOr<SequenceId> RestoreFromHostLocked(std::list<HostEntry>::iterator it);

  ModelBackend* model_;
  PrefixCacheOptions options_;
  int64_t page_tokens_ = 0;  // the host tier's page (0 = no host tier)
  mutable std::mutex mu_;
  std::list<Entry> lru_;  // most recently used first
  std::list<HostEntry> host_lru_;  // most recently used first
  std::unordered_map<uint64_t, std::shared_ptr<Page>> pages_;  // shared host pages by chain hash
  PrefixCacheStats stats_;
};

}  // namespace numoe
