#include "model/step.h"

#include <algorithm>
#include <set>

#include "model/spec.h"

namespace numoe {

int64_t MaxDraftsPerItem(const Capabilities& caps) {
  if (!caps.verify) return 0;
  if (caps.max_spec_tokens > 0) return std::min(kMaxDraftsPerItem, caps.max_spec_tokens - 1);
  return kMaxDraftsPerItem;
}

Capabilities ChannelCapabilities(const shm::Geometry& g) {
  return Capabilities{.verify = g.verify != 0,
                      .drafter = g.drafter,
                      .max_spec_tokens = g.max_model_drafts > 0 ? int64_t{g.max_model_drafts} + 1 : 0,
                      .fork = g.fork != 0};
}

shm::WireSampling ToWireSampling(const SamplingParams& p) {
  return shm::WireSampling{.temperature = p.temperature,
                           .top_p = p.top_p,
                           .top_k = p.top_k,
                           .seed = p.seed,
                           .min_p = p.min_p,
                           .presence_penalty = p.presence_penalty,
                           .frequency_penalty = p.frequency_penalty,
                           .repetition_penalty = p.repetition_penalty,
                           .logprobs = p.logprobs,
                           .num_bias = static_cast<int32_t>(p.logit_bias.size()),
                           .grammar_bytes = static_cast<int32_t>(p.grammar.size())};
}

SamplingParams FromWireSampling(const shm::WireSampling& w, std::span<const shm::WireBias> biases,
                                std::string_view grammar) {
  SamplingParams p{.temperature = w.temperature,
                   .top_p = w.top_p,
                   .top_k = w.top_k,
                   .seed = w.seed,
                   .min_p = w.min_p,
                   .presence_penalty = w.presence_penalty,
                   .frequency_penalty = w.frequency_penalty,
                   .repetition_penalty = w.repetition_penalty,
                   .logprobs = w.logprobs};
  for (const shm::WireBias& b : biases) p.logit_bias.emplace_back(b.token, b.bias);
  p.grammar = std::string(grammar);
  return p;
}

Status ValidateStepItem(const StepItem& item, const Capabilities& caps, int64_t vocab) {
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (item.tokens.empty()) return bad("no tokens");
  for (size_t k = 0; k < item.tokens.size(); ++k) {
    const int32_t t = item.tokens[k];
    if (t < 0 || t >= vocab) return bad("token ", k, " = ", t, " is out of range [0, ", vocab, ")");
  }
  if (item.drafts < 0 || item.model_drafts < 0) {
    return bad("drafts (", item.drafts, ") and model_drafts (", item.model_drafts, ") must be >= 0");
  }
  if (!item.speculative()) return absl::OkStatus();
  const char* field = item.drafts > 0 ? "drafts" : "model_drafts";
  const int64_t count = item.drafts > 0 ? item.drafts : item.model_drafts;
  if (item.drafts > 0 && item.model_drafts > 0) {
    return bad("both drafts and model_drafts are set; an item carries drafts or asks the model drafter, not both");
  }
  if (!item.sample) return bad(field, " without the sample flag (drafts need sample: only a decode item drafts)");
  if (item.logits) {
    return bad(field, " with the logits flag: a speculative item may not ask for logits (all_logits returns every row)");
  }
  if (item.drafts > 0 && static_cast<int64_t>(item.tokens.size()) <= item.drafts) {
    return bad("drafts ", item.drafts, " must be < num_tokens ", item.tokens.size(),
               " (the last sampled token comes first): needs at least ", int64_t{item.drafts} + 1, " tokens");
  }
  if (!caps.verify) return bad(field, " set, but this backend cannot verify drafts");
  if (item.model_drafts > 0) {
    if (caps.drafter == SpecMethod::kNone) {
      return absl::FailedPreconditionError(
          absl::StrCat("model_drafts ", item.model_drafts, " but the model has no drafter loaded"));
    }
    if (item.tokens.size() != 1) {
      return bad("model_drafts needs num_tokens 1: exactly 1 token, the last sampled one (got ", item.tokens.size(),
                 ")");
    }
  }
  if (const int64_t limit = MaxDraftsPerItem(caps); count > limit) {
    return bad(field, " ", count, " exceeds the limit of ", limit, " drafts per item (max_model_drafts)");
  }
  return absl::OkStatus();
}

Status ValidateStepItems(std::span<const StepItem> items, const Capabilities& caps, int64_t vocab) {
  std::set<int64_t> seen;
  for (size_t i = 0; i < items.size(); ++i) {
    if (Status st = ValidateStepItem(items[i], caps, vocab); !st.ok()) {
      return Status(st.code(), absl::StrCat("step item ", i, ": ", st.message()));
    }
    if (!seen.insert(items[i].seq).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("step item ", i, ": sequence ", items[i].seq, " appears twice in one step"));
    }
  }
  return absl::OkStatus();
}

namespace {

// Asks the model drafter for every item with model_drafts (one batched Draft) and fills scratch->feed
// ([last token, drafts]) and scratch->draft_logits for them. A drafter may propose fewer than asked, never more.
Status DraftForItems(ModelBackend& model, ExpertBackend& experts, std::span<const StepItem> items,
                     std::span<Sampler* const> samplers, int64_t vocab, StepScratch* s) {
  s->draft_requests.clear();
  s->draft_owner.clear();
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].model_drafts == 0) continue;
    s->draft_requests.push_back(DraftRequest{.seq = items[i].seq,
                                             .next_token = items[i].tokens[0],
                                             .depth = items[i].model_drafts,
                                             .sampler = samplers[i]});
    s->draft_owner.push_back(i);
  }
  if (s->draft_requests.empty()) return absl::OkStatus();
  s->draft_results.clear();
  RETURN_IF_ERROR(model.Draft(s->draft_requests, &experts, &s->draft_results));
  if (s->draft_results.size() != s->draft_requests.size()) {
    return absl::InternalError(absl::StrCat("the drafter returned ", s->draft_results.size(), " results for ",
                                            s->draft_requests.size(), " requests"));
  }
  for (size_t j = 0; j < s->draft_results.size(); ++j) {
    const size_t i = s->draft_owner[j];
    const DraftResult& d = s->draft_results[j];
    const size_t k = std::min(d.tokens.size(), static_cast<size_t>(items[i].model_drafts));
    // Rejection sampling needs q, the distribution each draft was drawn from: a model drafter must return it.
    if (d.logits.size() < k * static_cast<size_t>(vocab)) {
      return absl::InternalError(
          absl::StrCat("the drafter returned ", d.logits.size(), " logits for ", k, " drafts of vocab ", vocab));
    }
    s->feed[i].assign(1, items[i].tokens[0]);
    s->feed[i].insert(s->feed[i].end(), d.tokens.begin(), d.tokens.begin() + static_cast<std::ptrdiff_t>(k));
    s->draft_logits[i].assign(d.logits.begin(), d.logits.begin() + static_cast<std::ptrdiff_t>(k * vocab));
    s->drafted[i] = static_cast<int64_t>(k);
  }
  return absl::OkStatus();
}

}  // namespace

Status RunModelStep(ModelBackend& model, ExpertBackend& experts, std::span<const StepItem> items,
                    std::span<Sampler* const> samplers, StepScratch* scratch, StepOutput* out) {
  const int64_t V = model.vocab_size();
  const size_t n = items.size();
  RETURN_IF_ERROR(ValidateStepItems(items, model.capabilities(), V));
  if (samplers.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("RunModelStep: ", samplers.size(), " samplers for ", n, " items"));
  }
  for (size_t i = 0; i < n; ++i) {
    if (samplers[i] == nullptr && (items[i].sample || items[i].speculative())) {
      return absl::InvalidArgumentError(absl::StrCat("step item ", i, ": samples or drafts without a sampler"));
    }
  }
  StepScratch& s = *scratch;
  s.feed.resize(n);
  s.draft_logits.resize(n);
  s.drafted.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    s.feed[i].clear();
    s.draft_logits[i].clear();
    s.drafted[i] = items[i].drafts;
  }
  for (size_t i = 0; i < n; ++i) {
    if (samplers[i] != nullptr && !samplers[i]->generating()) samplers[i]->ObservePrompt(items[i].tokens);
  }
  RETURN_IF_ERROR(DraftForItems(model, experts, items, samplers, V, &s));
  bool want_logprobs = false;
  for (size_t i = 0; i < n; ++i) {
    if (samplers[i] == nullptr) continue;
    // The drafter counted its drafts for their successors' penalties; verification recounts them.
    if (items[i].model_drafts > 0) samplers[i]->ClearDrafts();
    want_logprobs |= samplers[i]->params().logprobs >= 0 && items[i].sample;
  }

  s.steps.clear();
  for (size_t i = 0; i < n; ++i) {
    const StepItem& item = items[i];
    SequenceStep st{.seq = item.seq, .tokens = item.model_drafts > 0 ? std::span<const int32_t>(s.feed[i]) : item.tokens};
    st.speculative = s.drafted[i] > 0;
    st.all_logits = st.speculative || item.all_logits;
    s.steps.push_back(st);
  }
  RETURN_IF_ERROR(model.Forward(s.steps, &experts, &s.logits));
  if (s.logits.size() != n) {
    return absl::InternalError(absl::StrCat("the model returned ", s.logits.size(), " logit sets for ", n, " sequences"));
  }

  out->Reset(n);
  for (size_t i = 0; i < n; ++i) {
    const StepItem& item = items[i];
    const SequenceLogits& lg = s.logits[i];
    const int64_t fed = static_cast<int64_t>(s.steps[i].tokens.size());
    const int64_t want_rows = s.steps[i].all_logits ? fed : 1;
    if (lg.rows != want_rows || lg.logits.size() != static_cast<size_t>(lg.rows * V)) {
      return absl::InternalError(absl::StrCat("the model returned ", lg.rows, " logit rows (", lg.logits.size(),
                                              " floats) for a step of ", fed, " tokens that needs ", want_rows));
    }
    const float* last = lg.logits.data() + (lg.rows - 1) * V;
    if (item.all_logits || item.logits) {
      out->logits.emplace_back(item.all_logits ? lg.logits.data() : last, lg.logits.data() + lg.rows * V);
    }
    if (const int64_t k = s.drafted[i]; k > 0) {
      // Rows [rows - k - 1, rows): after the last non-draft token, then after each draft.
      const float* target = lg.logits.data() + (lg.rows - k - 1) * V;
      const std::span<const int32_t> drafts = s.steps[i].tokens.subspan(static_cast<size_t>(fed - k));
      const Verdict v = VerifyDrafts(*samplers[i], drafts, s.draft_logits[i], target, V);
      out->tokens[i] = v.tokens.front();
      out->counts[i] = static_cast<int32_t>(v.tokens.size());
      out->drafted[i] = static_cast<int32_t>(k);
      out->accepted[i] = static_cast<int32_t>(v.accepted);
      out->emitted.insert(out->emitted.end(), v.tokens.begin(), v.tokens.end());
      if (want_logprobs) {
        const int32_t top = samplers[i]->params().logprobs;
        for (size_t j = 0; j < v.tokens.size(); ++j) {
          out->logprobs.emplace_back();
          if (top >= 0) TopLogprobs(target + static_cast<int64_t>(j) * V, V, v.tokens[j], top, &out->logprobs.back());
        }
      }
      if (k > v.accepted) RETURN_IF_ERROR(model.Rollback(item.seq, k - v.accepted));
      continue;
    }
    if (item.sample) {
      out->tokens[i] = samplers[i]->Sample(last, V);
      samplers[i]->Accept(out->tokens[i]);
      out->counts[i] = 1;
      out->emitted.push_back(out->tokens[i]);
      if (want_logprobs) {
        out->logprobs.emplace_back();
        const int32_t top = samplers[i]->params().logprobs;
        if (top >= 0) TopLogprobs(last, V, out->tokens[i], top, &out->logprobs.back());
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace numoe
