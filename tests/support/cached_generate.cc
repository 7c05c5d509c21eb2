#include "tests/support/cached_generate.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <span>
#include <utility>

#include "model/prefix_step.h"
#include "model/sampling.h"
#include "model/step.h"

namespace numoe::test {

bool Feedable(const ModelBackend& model, const std::vector<int32_t>& tokens) {
  for (int32_t t : tokens) {
    if (t >= model.vocab_size()) return false;
  }
  return true;
}

CachedOutcome GenerateCached(ModelBackend& model, ExpertBackend& experts, PrefixCache* cache,
                             const std::vector<int32_t>& prompt, int64_t chunk, int64_t steps, Drafts drafts,
                             const std::vector<int32_t>& oracle, int64_t stop_after_chunks) {
  CachedOutcome r;
  auto opened = OpenCachedSequence(model, cache);
  EXPECT_TRUE(opened.ok()) << opened.status();
  if (!opened.ok()) return r;
  CachedSequence seq = std::move(*opened);
  Sampler sampler(SamplingParams{});
  StepScratch scratch;
  StepOutput out;
  std::vector<int32_t> cached;
  CachedSequence* seqs[1] = {&seq};
  Sampler* samplers[1] = {&sampler};
  size_t fed = 0;
  int64_t chunks = 0;
  while (fed < prompt.size()) {
    if (stop_after_chunks >= 0 && chunks == stop_after_chunks) {  // the client went away
      ReleaseCachedSequence(model, cache, &seq);
      return r;
    }
    const size_t n = chunk > 0 ? std::min<size_t>(static_cast<size_t>(chunk), prompt.size() - fed) : prompt.size();
    const bool completes = fed + n == prompt.size();
    StepItem it{.tokens = std::span<const int32_t>(prompt).subspan(fed, n), .sample = completes, .logits = completes};
    Status st = RunCachedStep(model, experts, cache, 0, {&it, 1}, seqs, samplers, &scratch, &out, &cached);
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) return r;
    r.cached += cached[0];
    fed += n;
    ++chunks;
    for (const auto& l : out.logits) r.logits.insert(r.logits.end(), l.begin(), l.end());
    if (completes) r.tokens.push_back(out.tokens[0]);
  }
  std::vector<int32_t> feed;
  for (int64_t s = 0; s < steps; ++s) {
    feed.assign(1, r.tokens.back());
    StepItem it{.sample = true, .logits = drafts == Drafts::kNone};  // speculative items return no logits
    if (drafts == Drafts::kGiven) {
      for (size_t k = 0; k < 3 && r.tokens.size() + k < oracle.size(); ++k) {
        int32_t d = oracle[r.tokens.size() + k];
        if ((r.tokens.size() + k) % 3 == 2) d = (d + 1) % static_cast<int32_t>(model.vocab_size());
        feed.push_back(d);
      }
      it.drafts = static_cast<int32_t>(feed.size() - 1);
    } else if (drafts == Drafts::kModel) {
      it.model_drafts = 3;
    }
    it.tokens = feed;
    Status st = RunCachedStep(model, experts, cache, 0, {&it, 1}, seqs, samplers, &scratch, &out, &cached);
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) return r;
    r.tokens.insert(r.tokens.end(), out.emitted.begin(), out.emitted.end());
    for (const auto& l : out.logits) r.logits.insert(r.logits.end(), l.begin(), l.end());
  }
  ReleaseCachedSequence(model, cache, &seq);
  return r;
}

}  // namespace numoe::test
