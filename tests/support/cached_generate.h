// One request through the prefix cache's step (model/prefix_step.h) on any backend: what the prefix-cache
// tests of the CPU backend (tests/model) and the CUDA backend (tests/gpu) run, cold (no cache) and warm.
#pragma once

#include <cstdint>
#include <vector>

#include "model/backend.h"
#include "model/prefix_cache.h"

namespace numoe::test {

// The decode steps' drafts: none, given (taken from an oracle), or the model's own drafter's.
enum class Drafts { kNone, kGiven, kModel };

struct CachedOutcome {
  std::vector<int32_t> tokens;  // emitted
  std::vector<float> logits;    // every logits row returned, in order
  int64_t cached = 0;           // prompt tokens restored from the cache
};

// One request through RunCachedStep (`cache` null: the cache off): the prompt in chunks of `chunk` (0 =
// whole), then `steps` decode steps. With Drafts::kGiven each decode step carries up to 3 drafts taken from
// `oracle` (the cold greedy continuation) with every third one corrupted, so some are accepted and some
// rejected; with Drafts::kModel the model's drafter proposes 3. Speculative steps return no logits.
// stop_after_chunks >= 0 releases the sequence after that many prompt chunks (a client that went away) and
// returns what it had. A failed step is a test failure (EXPECT) and ends the request.
// True when every id can be fed to `model` (an id the head emits past the embedding's vocabulary cannot).
bool Feedable(const ModelBackend& model, const std::vector<int32_t>& tokens);

CachedOutcome GenerateCached(ModelBackend& model, ExpertBackend& experts, PrefixCache* cache,
                             const std::vector<int32_t>& prompt, int64_t chunk, int64_t steps,
                             Drafts drafts = Drafts::kNone, const std::vector<int32_t>& oracle = {},
                             int64_t stop_after_chunks = -1);

}  // namespace numoe::test
