// One model step with the prefix cache (model/prefix_cache.h): RunModelStep over sequences whose prompts
// may resume from a checkpoint. numoe-gpu's WorkerSession runs every step through it when the cache is on.
//
// A sequence opened with the cache on starts without model state (`probing`): while some checkpoint lies
// deeper along the prompt read so far (PrefixCache::Extends), its prompt chunks only extend `history`
// and the step computes nothing for them. At the chunk that diverges, or the prompt's last chunk, the
// deepest checkpoint at or before it is restored (one token before the end at most when the chunk samples
// or returns logits) and the tokens after it are computed: the ones before this chunk in extra forwards
// of at most `max_rows` rows, the rest as the step's item. The item reports the tokens restored in
// `cached`.
//
// Checkpoints a step takes for a prompt chunk (never for a speculative item, whose rejected tokens are
// rolled back first; a sequence's tokens are all accepted ones): one token before the prompt's end, at every
// multiple of PrefixCacheOptions::checkpoint_tokens, each by splitting the chunk's forward there (rows are
// computed independently, so the logits do not change). ReleaseCachedSequence adopts a finished
// sequence as the end-of-answer checkpoint.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "model/backend.h"
#include "model/prefix_cache.h"
#include "model/sampling.h"
#include "model/step.h"

namespace numoe {

struct CachedSequence {
  SequenceId model_seq = -1;     // -1 while probing
  std::vector<int32_t> history;  // the tokens its state has consumed (or, probing, read so far)
  bool probing = false;
  bool prompt_done = false;  // a step sampled from it (what follows is decode)
  bool settled = true;       // its state is exactly `history` after non-speculative steps (adoptable)
  int64_t cached = 0;        // prompt tokens restored from a checkpoint
};

// A new sequence: probing with a cache, else a fresh model sequence.
StatusOr<CachedSequence> OpenCachedSequence(ModelBackend& model, PrefixCache* cache);
// Frees the sequence: a settled one goes to the cache as a checkpoint (PrefixCache::Adopt).
void ReleaseCachedSequence(ModelBackend& model, PrefixCache* cache, CachedSequence* seq);
// Gives a probing sequence its state (restore, then compute up to history.size()); a no-op otherwise.
// Its sampler observes the prompt tokens computed here.
Status MaterializeCachedSequence(ModelBackend& model, ExpertBackend& experts, PrefixCache* cache, int64_t max_rows,
                                 CachedSequence* seq, Sampler* sampler);
// A copy of `parent` (materialized first): ModelBackend::ForkSequence.
StatusOr<CachedSequence> ForkCachedSequence(ModelBackend& model, ExpertBackend& experts, PrefixCache* cache,
                                            int64_t max_rows, CachedSequence* parent, Sampler* parent_sampler);

// RunModelStep (model/step.h) with the cache; items[i].seq is ignored (seqs[i] names the sequence) and
// rewritten to the model's id. `cached` gets, per item, the prompt tokens restored at this step.
// max_rows bounds the rows of one forward (0 = none). `out` is per item as RunModelStep's.
Status RunCachedStep(ModelBackend& model, ExpertBackend& experts, PrefixCache* cache, int64_t max_rows,
                     std::span<StepItem> items, std::span<CachedSequence* const> seqs,
                     std::span<Sampler* const> samplers, StepScratch* scratch, StepOutput* out,
                     std::vector<int32_t>* cached);

}  // namespace numoe
