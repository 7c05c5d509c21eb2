// One model step, written once: draft -> forward -> verify -> rollback -> sample.
//
// Every caller that runs the model goes through RunModelStep: the worker's in-process executor
// (worker/engine/local_executor.h), numoe-gpu's worker sessions (gpu_service/session.h, one step per
// StepRequest off the shared-memory channel) and the one-process generation loop (model/generation.h).
// The callers differ only in how they name sequences and where the results go.
//
// Speculative decoding (model/spec.h has the verification rule). A decode item (sample set, the prompt fully
// consumed) may carry drafts in one of two ways:
//   - `drafts` > 0: the last `drafts` entries of `tokens` are proposals of a drafter that needs no
//     weights (n-gram, run by the worker): tokens = [last sampled token, d_0 .. d_{drafts-1}];
//   - `model_drafts` > 0 (tokens.size() == 1, drafts == 0): the model's own drafter (DSpark or MTP,
//     Capabilities::drafter) proposes up to that many tokens after tokens[0], with the distributions it
//     drew them from ([k, vocab] logits; a model drafter that returns none is an internal error, since
//     rejection sampling at temperature > 0 needs them).
// The target runs once over [last token, drafts], the drafts are verified left to right, the rejected
// positions are rolled back in every cache, and the item emits 1 + accepted tokens (StepOutput::counts).
// Either way the item occupies 1 + drafts (+ model_drafts) rows of the step's token budget.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/shm_channel.h"
#include "common/status.h"
#include "model/backend.h"
#include "model/sampling.h"

namespace numoe {

// One sequence's part of a step: its next tokens (a prompt chunk, or the last sampled token and drafts).
// `seq` names the sequence in the holder's handle space: the executor's handle in the worker's engine, the
// ModelBackend's SequenceId in RunModelStep.
struct StepItem {
  int64_t seq = 0;
  std::span<const int32_t> tokens;  // >= 1 tokens, each in [0, vocab)
  bool sample = false;              // pick a token from the logits of the last token
  bool logits = false;              // also return logits: the last row, or for a speculative item the rows
                                    // that chose the emitted tokens (see StepOutput::logits)
  bool all_logits = false;          // return the logits of every row of a prefill chunk (not speculative)
  int32_t drafts = 0;               // trailing draft tokens in `tokens` (needs sample)
  int32_t model_drafts = 0;         // drafts to ask the model drafter for (needs sample, tokens.size() == 1)

  int64_t rows() const { return static_cast<int64_t>(tokens.size()) + model_drafts; }
  bool speculative() const { return drafts > 0 || model_drafts > 0; }
};

struct StepOutput {
  // Per item: the first emitted token (the sampled id), or -1 where the item did not sample.
  std::vector<int32_t> tokens;
  // Per item: tokens emitted (0 without sample, 1 without drafts, 1 + accepted with drafts).
  std::vector<int32_t> counts;
  // The emitted tokens of every item, item after item (sum of counts entries); tokens[i] is the first
  // of item i's.
  std::vector<int32_t> emitted;
  // Per item: drafts verified (drafts or model_drafts actually proposed; a model drafter may propose
  // fewer) and accepted (counts[i] - 1 for a sampling item).
  std::vector<int32_t> drafted;
  std::vector<int32_t> accepted;
  // One entry per item that asked for logits (logits or all_logits), in item order, each whole rows of
  // `vocab` floats: every row with all_logits; for a speculative item the counts[i] rows that chose its
  // emitted tokens; else the last row.
  std::vector<std::vector<float>> logits;
  // Log-probs of the emitted tokens (model/sampling.h TopLogprobs: raw logits, before penalties and
  // temperature): empty when no item's sampler asks for them (SamplingParams::logprobs < 0), else one entry
  // per entry of `emitted`, in the same order (items that did not ask get default entries). A speculative
  // item's come from the verify rows that chose its tokens.
  std::vector<EmittedLogprobs> logprobs;
  // Per item: prompt tokens restored from the prefix cache at this step instead of computed (numoe-gpu's
  // sessions, model/prefix_step.h); 0 elsewhere.
  std::vector<int32_t> cached;

  // Sizes the per-item vectors for `n` items with nothing emitted (tokens -1) and clears the rest.
  void Reset(size_t n) {
    tokens.assign(n, -1);
    counts.assign(n, 0);
    drafted.assign(n, 0);
    accepted.assign(n, 0);
    cached.assign(n, 0);
    emitted.clear();
    logits.clear();
    logprobs.clear();
  }
};

// The most drafts one item may carry or ask for on a backend whose Capabilities set no lower bound (the
// same bound as SpecConfig's depth, ValidateSpec).
inline constexpr int64_t kMaxDraftsPerItem = 16;

// The most drafts one item may carry on a backend with these capabilities (0 when it cannot verify).
int64_t MaxDraftsPerItem(const Capabilities& caps);

// What numoe-gpu declared in a shared-memory channel's geometry (common/shm_channel.h), as Capabilities:
// both ends of the channel check items against these.
Capabilities ChannelCapabilities(const shm::Geometry& g);

// SamplingParams as they travel in a StepEntry: the logit bias goes separately (`biases`, num_bias pairs), and
// so does the grammar spec (`grammars`, grammar_bytes).
shm::WireSampling ToWireSampling(const SamplingParams& p);
SamplingParams FromWireSampling(const shm::WireSampling& w, std::span<const shm::WireBias> biases,
                                std::string_view grammar = {});

// The checks on one item, before anything runs: tokens present and in [0, vocab), and the speculative
// rules of the header comment against what the backend declares. Messages name the field and say what to
// change; codes: InvalidArgument, or FailedPrecondition for model drafts without a drafter loaded.
Status ValidateStepItem(const StepItem& item, const Capabilities& caps, int64_t vocab);
// Every item ("step item i: ..."), and each sequence at most once.
Status ValidateStepItems(std::span<const StepItem> items, const Capabilities& caps, int64_t vocab);

// Buffers one caller reuses from step to step (no allocation per step once warm).
struct StepScratch {
  std::vector<std::vector<int32_t>> feed;         // per item: [last token, drafts] of a model-drafted item
  std::vector<std::vector<float>> draft_logits;   // per item: [drafts, vocab] of the model drafter
  std::vector<int64_t> drafted;                   // per item: drafts verified
  std::vector<DraftRequest> draft_requests;
  std::vector<size_t> draft_owner;
  std::vector<DraftResult> draft_results;
  std::vector<SequenceStep> steps;
  std::vector<SequenceLogits> logits;
};

// Runs one step: validates the items (ValidateStepItems against model.capabilities()), drafts for the items
// that ask the model drafter (one batched Draft), runs one Forward over every item (speculative items with
// every row's logits), verifies each speculative item with its sampler (VerifyDrafts) and rolls back its
// rejected positions, samples the others. items[i].seq are the model's SequenceIds; samplers[i] is item i's
// sampler (may be null for an item that neither samples nor drafts). The samplers' histories are kept here
// (model/sampling.h): the tokens of an item whose sampler has not sampled yet are its prompt
// (ObservePrompt), and every emitted token is Accept()ed. On error the step's sequences are in an
// undefined state (the caller closes them).
Status RunModelStep(ModelBackend& model, ExpertBackend& experts, std::span<const StepItem> items,
                    std::span<Sampler* const> samplers, StepScratch* scratch, StepOutput* out);

}  // namespace numoe
