#include "model/prefix_step.h"

#include <algorithm>
#include <set>
#include <utility>

namespace numoe {

namespace {

// Computes tokens (a prompt's, at the sequence's position) in forwards of at most max_rows rows; the
// sampler observes them as prompt.
Status ForwardRange(ModelBackend& model, ExpertBackend& experts, SequenceId seq, std::span<const int32_t> tokens,
                    int64_t max_rows, Sampler* sampler) {
  if (tokens.empty()) return absl::OkStatus();
  if (sampler != nullptr && !sampler->generating()) sampler->ObservePrompt(tokens);
  const size_t piece = max_rows > 0 ? static_cast<size_t>(max_rows) : tokens.size();
  std::vector<SequenceLogits> logits;
  for (size_t at = 0; at < tokens.size(); at += piece) {
    SequenceStep st{seq, tokens.subspan(at, std::min(piece, tokens.size() - at)), false};
    RETURN_IF_ERROR(model.Forward({&st, 1}, &experts, &logits));
  }
  return absl::OkStatus();
}

// Restores the deepest checkpoint of a probing sequence's history at or before `limit`.
Status Restore(ModelBackend& model, PrefixCache* cache, int64_t limit, CachedSequence* s, Sampler* sampler) {
  int64_t position = 0;
  if (cache != nullptr) {
    ASSIGN_OR_RETURN(PrefixCache::Restored r, cache->Restore(s->history, limit));
    s->model_seq = r.seq;
    position = r.position;
  } else {
    ASSIGN_OR_RETURN(s->model_seq, model.CreateSequence());
  }
  s->probing = false;
  s->cached = position;
  if (sampler != nullptr && !sampler->generating() && position > 0) {
    sampler->ObservePrompt(std::span<const int32_t>(s->history).first(static_cast<size_t>(position)));
  }
  return absl::OkStatus();
}

}  // namespace

StatusOr<CachedSequence> OpenCachedSequence(ModelBackend& model, PrefixCache* cache) {
  CachedSequence s;
  if (cache != nullptr) {
    s.probing = true;
  } else {
    ASSIGN_OR_RETURN(s.model_seq, model.CreateSequence());
  }
  return s;
}

void ReleaseCachedSequence(ModelBackend& model, PrefixCache* cache, CachedSequence* seq) {
  if (seq->model_seq < 0) return;
  if (cache != nullptr && seq->settled) {
    cache->Adopt(seq->model_seq, std::move(seq->history));
  } else {
    (void)model.ReleaseSequence(seq->model_seq);
  }
  seq->model_seq = -1;
  seq->history.clear();
}

Status MaterializeCachedSequence(ModelBackend& model, ExpertBackend& experts, PrefixCache* cache, int64_t max_rows,
                                 CachedSequence* seq, Sampler* sampler) {
  if (!seq->probing) return absl::OkStatus();
  const int64_t end = static_cast<int64_t>(seq->history.size());
  RETURN_IF_ERROR(Restore(model, cache, end, seq, sampler));
  seq->settled = false;
  RETURN_IF_ERROR(ForwardRange(model, experts, seq->model_seq,
                               std::span<const int32_t>(seq->history).subspan(static_cast<size_t>(seq->cached)),
                               max_rows, sampler));
  seq->settled = true;
  return absl::OkStatus();
}

StatusOr<CachedSequence> ForkCachedSequence(ModelBackend& model, ExpertBackend& experts, PrefixCache* cache,
                                            int64_t max_rows, CachedSequence* parent, Sampler* parent_sampler) {
  RETURN_IF_ERROR(MaterializeCachedSequence(model, experts, cache, max_rows, parent, parent_sampler));
  CachedSequence child;
  const SequenceId from = parent->model_seq;
  auto fork = [&]() { return model.ForkSequence(from); };
  ASSIGN_OR_RETURN(child.model_seq, cache != nullptr ? cache->MakeRoom(fork) : fork());
  child.history = parent->history;
  child.prompt_done = parent->prompt_done;
  child.settled = parent->settled;
  child.cached = parent->cached;
  return child;
}

Status RunCachedStep(ModelBackend& model, ExpertBackend& experts, PrefixCache* cache, int64_t max_rows,
                     std::span<StepItem> items, std::span<CachedSequence* const> seqs,
                     std::span<Sampler* const> samplers, StepScratch* scratch, StepOutput* out,
                     std::vector<int32_t>* cached) {
  const size_t n = items.size();
  if (seqs.size() != n || samplers.size() != n) {
    return absl::InvalidArgumentError("RunCachedStep: items, sequences and samplers differ in number");
  }
  const Capabilities caps = model.capabilities();
  for (size_t i = 0; i < n; ++i) {
    if (Status st = ValidateStepItem(items[i], caps, model.vocab_size()); !st.ok()) {
      return Status(st.code(), absl::StrCat("step item ", i, ": ", st.message()));
    }
  }
  cached->assign(n, 0);
  const int64_t interval = cache != nullptr ? cache->options().checkpoint_tokens : 0;
  std::vector<StepItem> run;
  std::vector<Sampler*> run_samplers;
  std::vector<size_t> run_index;
  std::vector<int64_t> store_after(n, -1);  // a checkpoint to take at the item's end once the step ran
  for (size_t i = 0; i < n; ++i) {
    CachedSequence& s = *seqs[i];
    StepItem it = items[i];
    const bool spec = it.speculative();
    const bool last = it.sample || it.logits || it.all_logits;
    const int64_t n_item = static_cast<int64_t>(it.tokens.size());
    if (!spec) s.history.insert(s.history.end(), it.tokens.begin(), it.tokens.end());
    const int64_t end = static_cast<int64_t>(s.history.size());
    int64_t from = end - n_item;  // the position the computation starts at
    if (s.probing) {
      if (!last && cache != nullptr && cache->Extends(s.history)) continue;  // read on: nothing to compute yet
      const int64_t limit = it.all_logits ? end - n_item : (last ? end - 1 : end);
      RETURN_IF_ERROR(Restore(model, cache, limit, &s, samplers[i]));
      (*cached)[i] = static_cast<int32_t>(s.cached);
      from = s.cached;
    }
    s.settled = false;
    const bool prompt = !spec && !s.prompt_done && !it.all_logits;
    std::vector<int64_t> cuts;
    std::set<int64_t> stores;
    if (end - n_item > from) cuts.push_back(end - n_item);
    if (prompt && cache != nullptr) {
      if (interval > 0) {
        for (int64_t p = (from / interval + 1) * interval; p < end; p += interval) {
          cuts.push_back(p);
          stores.insert(p);
        }
        if (end % interval == 0 && end > from) store_after[i] = end;
      }
      if (it.sample && end - 1 > from) {
        cuts.push_back(end - 1);
        stores.insert(end - 1);
      } else if (it.sample && end - 1 == from && from > 0) {
        (void)cache->Store(s.model_seq, std::span<const int32_t>(s.history).first(static_cast<size_t>(from)));
      }
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    int64_t at = from;
    const std::span<const int32_t> hist(s.history);
    for (int64_t cut : cuts) {
      RETURN_IF_ERROR(ForwardRange(model, experts, s.model_seq,
                                   hist.subspan(static_cast<size_t>(at), static_cast<size_t>(cut - at)), max_rows,
                                   samplers[i]));
      if (stores.count(cut) != 0) (void)cache->Store(s.model_seq, hist.first(static_cast<size_t>(cut)));
      at = cut;
    }
    it.seq = s.model_seq;
    if (!spec) it.tokens = it.tokens.subspan(static_cast<size_t>(at - (end - n_item)));
    if (it.tokens.empty()) {  // everything was restored (a chunk that neither samples nor returns logits)
      s.settled = true;
      continue;
    }
    run.push_back(it);
    run_samplers.push_back(samplers[i]);
    run_index.push_back(i);
  }

  StepOutput sub;
  if (!run.empty()) RETURN_IF_ERROR(RunModelStep(model, experts, run, run_samplers, scratch, &sub));
  out->Reset(n);
  out->emitted = std::move(sub.emitted);
  out->logits = std::move(sub.logits);
  out->logprobs = std::move(sub.logprobs);
  size_t offset = 0;
  for (size_t k = 0; k < run.size(); ++k) {
    const size_t i = run_index[k];
    out->tokens[i] = sub.tokens[k];
    out->counts[i] = sub.counts[k];
    out->drafted[i] = sub.drafted[k];
    out->accepted[i] = sub.accepted[k];
    CachedSequence& s = *seqs[i];
    const StepItem& it = run[k];
    if (it.speculative()) {
      // Only accepted tokens stay: the last sampled one and the accepted drafts (the bonus token is not fed yet).
      s.history.push_back(it.tokens[0]);
      for (int32_t a = 0; a < sub.accepted[k]; ++a) s.history.push_back(out->emitted[offset + static_cast<size_t>(a)]);
    }
    offset += static_cast<size_t>(std::max(sub.counts[k], 0));
    // A speculative step's rejected tokens are rolled back by now: settled, it may become a checkpoint.
    s.settled = !it.speculative() || (cache != nullptr && model.Settle(s.model_seq).ok());
    if (it.sample) s.prompt_done = true;
    if (store_after[i] >= 0 && cache != nullptr) (void)cache->Store(s.model_seq, s.history);
  }
  out->cached = *cached;
  for (size_t i = 0; i < n; ++i) {
    if (seqs[i]->model_seq >= 0) items[i].seq = seqs[i]->model_seq;
  }
  return absl::OkStatus();
}

}  // namespace numoe
