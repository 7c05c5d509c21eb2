// The worker's continuous-batching engine.
//
// Requests wait in a bounded queue (Submit answers RESOURCE_EXHAUSTED when it is full); up to max_seqs
// of them run at once. Every step carries, within a budget of max_step_tokens tokens:
//   1. one decode token for every running sequence that has finished its prompt (its last sampled token),
//      offered in a rotating order so a budget smaller than the running sequences starves nobody,
//   2. with speculative decoding (EngineOptions::spec), drafts for those decode items from what is left:
//      each sequence at most its depth, never more than could still be emitted (max_new_tokens, the
//      context limit); n-gram drafts are proposed here from prompt + generated, DSpark/MTP drafts are asked
//      of the executor's model drafter (StepItem::model_drafts),
//   3. then prompt chunks of sequences still in prefill, oldest first, each at most prefill_chunk tokens,
// so long prompts are prefilled in chunks interleaved with the decode of the others (no sequence stalls
// behind a long prompt), and any max_seqs x depth runs: a tight budget just drafts less. A sequence
// samples only in the step that completes its prompt and after. A speculative item emits 1 + accepted
// tokens (the executor verifies and rolls back); they pass the stop logic one by one, the first that ends
// the request drops the rest, and the kept ones reach the sink in one OnTokens call. With spec.adaptive a
// sequence's depth moves +1 after a fully accepted step and -1 after a step with none kept, in [1, depth].
// The prefill lane (EngineOptions::prefill_lane_tokens, with an executor that has one: numoe-worker
// --prefill-lane-tokens): a prompt of at least that many tokens (of a request with n = 1) is not chunked
// into the steps above but into the lane's steps, oldest first, each chunk at most prefill_chunk tokens
// (else max_step_tokens), within max_step_tokens per lane step, one lane step at a time, running on the
// executor's lane beside the decode steps (Executor::StartLaneStep); a finished lane step is taken at the
// start of the next iteration (its sequences' first tokens go through the stop logic as any step's), so a
// decode token never waits for a prompt chunk's pass. The sequence decodes in the steps above once its prompt
// is done. A request cancelled while its chunk is in the lane is closed when the lane step ends.
// Stop conditions per request: EOS (unless ignore_eos), any of stop_token_ids (the stop token is emitted,
// then finish_reason "stop"), max_new_tokens or the context limit ("length"). Cancel() drops a request
// wherever it is, and its sequence is closed in the executor (freed in numoe-gpu).
//
// n choices (EngineRequest::n): n sequences of one prompt, choice i sampling with ChoiceSeed(seed, i)
// (model/sampling.h). The prompt is prefilled once when the executor forks (its model's Capabilities::fork, ExecutorLimits::model) and the
// choices are admitted together: choice 0 prefills all but the last prompt token, then the others are forked
// from it (Executor::Fork) and all n feed the last token and sample, each its own way from there. A choice
// admitted after choice 0 passed that point, or without fork, prefills the prompt itself.
//
// Ownership and threads: the engine owns the scheduling thread (Start/Stop) and drives the executor
// only from it. Submit, Cancel and stats() are thread-safe. A request's TokenSink is called on the
// scheduling thread, never concurrently for one request, and must not block; every accepted request ends
// with exactly one OnTokens carrying a finish_reason or one OnError (OnError(CANCELLED) after Cancel).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_set>
#include <vector>

#include "common/status.h"
#include "model/sampling.h"
#include "worker/engine/executor.h"

namespace numoe::engine {

struct EngineOptions {
  int64_t max_seqs = 16;          // sequences running at once
  int64_t max_step_tokens = 512;  // tokens per step, decode and prefill together (>= 1)
  int64_t prefill_chunk = 256;    // prompt tokens of one sequence per step; 0 = as many as the budget allows
  int64_t max_queue = 256;        // requests waiting beyond the running ones
  int64_t eos_token_id = 1;
  int64_t max_context = 0;        // prompt + generated tokens per sequence; 0 = unlimited
  // Speculative decoding. kNgram drafts here (NgramPropose over prompt + generated); kDspark / kMtp ask
  // the executor's model drafter (must equal ExecutorLimits::drafter()). spec.depth is the server's depth;
  // with spec.adaptive each sequence moves its own depth in [1, spec.depth] by its recent acceptance.
  // Drafts never run past max_new_tokens or max_context, and a step's drafts share max_step_tokens
  // with the decode tokens and prompt chunks (every decoding sequence gets its one token first, then
  // drafts, then prompt chunks), so any max_seqs x depth runs: a tight budget just drafts less.
  SpecConfig spec;
  // Prompts of at least this many tokens prefill in the executor's prefill lane, beside the decode steps
  // (header comment); 0 = never, as without a lane.
  int64_t prefill_lane_tokens = 0;
};
// Errors name the option.
Status ValidateEngineOptions(const EngineOptions& o);

// A speculative-decoding setting against what the executor's model declares (ExecutorLimits::model): the
// one rule of model/spec_policy.h (CheckSpecAgainstModel), worded for numoe-gpu. An Engine given a spec
// that fails it serves without speculation (and logs why).
Status CheckSpec(const SpecConfig& spec, const ExecutorLimits& limits);

struct EngineRequest {
  std::vector<int32_t> prompt;  // non-empty, ids in [0, vocab)
  int64_t max_new_tokens = 16;  // >= 0 (0: finishes at once with "length")
  SamplingParams sampling;      // logprobs >= 0: every token comes with its log-probs (TokenSink::OnTokens)
  int32_t n = 1;                // choices, in [1, kMaxChoices] (header comment)
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;
  std::string request_id;  // for logs
};

// Receives one request's events (see the header comment for the threading contract).
class TokenSink {
 public:
  virtual ~TokenSink() = default;
  // New tokens of choice `choice` (0 .. n-1; one per step, or 1 + accepted drafts with speculative decoding),
  // with one EmittedLogprobs each when the request asked (sampling.logprobs >= 0; else empty). A non-empty
  // finish_reason ("stop" | "length") marks the choice's last call; its sequence is already closed by then.
  // max_new_tokens == 0 ends each choice with no tokens. The request is over once every choice finished.
  virtual void OnTokens(int32_t choice, std::span<const int32_t> tokens, std::span<const EmittedLogprobs> logprobs,
                        std::string_view finish_reason) = 0;
  // The request failed or was cancelled (CANCELLED): the last call, for every choice.
  virtual void OnError(const Status& status) = 0;
  // Once per choice, before its first OnTokens: how many of its prompt tokens the executor restored from
  // its prefix cache instead of computing them (0 without one).
  virtual void OnPromptCached(int32_t choice, int64_t cached_tokens) {
    (void)choice;
    (void)cached_tokens;
  }
};

using RequestId = uint64_t;

struct EngineStats {
  int64_t active = 0;   // running sequences
  int64_t queued = 0;   // waiting requests
  int64_t max_seqs = 0;
  int64_t tokens_generated = 0;
  int64_t prompt_tokens = 0;      // prompt tokens processed
  int64_t steps = 0;
  double decode_tokens_per_s = 0.0;  // generated tokens per second over the last ~5 s
  int64_t outstanding_tokens = 0;    // unprocessed prompt tokens + tokens still to generate
  // Speculative decoding (zero without): the drafter, verify steps (one per sequence per step that
  // carried drafts), draft tokens verified and accepted. Mean accepted length = accepted / verify steps.
  SpecMethod spec_method = SpecMethod::kNone;
  int64_t spec_verify_steps = 0;
  int64_t spec_drafted = 0;
  int64_t spec_accepted = 0;
  // The prefill lane: lane steps run, and steps run while a lane step was in flight (beside it).
  int64_t lane_steps = 0;
  int64_t steps_beside_lane = 0;
  // Seconds inside the routed experts (computed or simulated) since start (Executor::expert_seconds).
  double expert_seconds = 0;
  // The prefix cache behind the executor: prompt tokens of this engine's requests looked up in it and
  // restored from it, the bytes its first tier holds (-1: none) and its host tier (-1: none), and the
  // checkpoints evicted from each (Executor::prefix_cache).
  int64_t prefix_queried_tokens = 0;
  int64_t prefix_hit_tokens = 0;
  int64_t prefix_cache_bytes = -1;
  int64_t prefix_host_bytes = -1;
  int64_t prefix_evicted = 0;
  int64_t prefix_host_evicted = 0;
};

// What one step carried (tests and debug logs).
struct StepTrace {
  int64_t decode_tokens = 0;
  int64_t prefill_tokens = 0;
  int64_t sequences = 0;
  int64_t largest_prefill_chunk = 0;
  int64_t draft_tokens = 0;  // drafts verified in this step (rows beyond the decode tokens)
  int64_t forks = 0;         // sequences forked before this step (n choices sharing one prefill)
  int64_t lane_tokens = 0;   // prompt tokens handed to the prefill lane in this iteration
  int64_t lane_steps = 0;    // lane steps started in this iteration (0 or 1)
};

class Engine {
 public:
  // `executor` (not owned) must outlive the engine. Options are clamped to the executor's limits.
  Engine(Executor* executor, const EngineOptions& options);
  ~Engine();  // Stop()
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  void Start();
  // Ends every request with UNAVAILABLE, closes their sequences and joins the thread. Idempotent.
  void Stop();

  // Validates (INVALID_ARGUMENT naming the field), then queues its n choices (RESOURCE_EXHAUSTED when the
  // queue is full, UNAVAILABLE when stopped or the executor is broken).
  StatusOr<RequestId> Submit(EngineRequest request, std::shared_ptr<TokenSink> sink);
  // Cancels a queued or running request; unknown or finished ids are ignored.
  void Cancel(RequestId id);

  EngineStats stats() const;
  const EngineOptions& options() const { return options_; }
  bool healthy() const { return executor_->healthy(); }

  // Runs one scheduling iteration on the caller's thread (for tests; do not mix with Start()).
  // Returns false when there was nothing to run.
  bool StepOnce();
  StepTrace last_step() const;

 private:
  struct Request;
  struct Group;
  struct PrefixTally {
    int64_t queried = 0, hit = 0;
  };
  // Applies a step's output to its items' requests (prompt fed, tokens through the stop logic, sinks called);
  // returns the tokens emitted.
  int64_t TakeOutput(std::span<const StepItem> items, const std::vector<Request*>& owners, StepOutput& out,
                     StepTrace* trace, SpecStats* spec, PrefixTally* prefix);
  // Whether `r`'s prompt chunks go to the prefill lane.
  bool UsesLane(const Request& r) const;
  // Takes the lane step's output (waiting for it); returns the tokens emitted.
  int64_t FinishLane(StepTrace* trace, SpecStats* spec, PrefixTally* prefix, int64_t* prompt_tokens);
  // Starts a lane step over the oldest waiting lane prompts, if any.
  void StartLane(StepTrace* trace);
  void Loop();
  bool HasWorkLocked() const;
  void Admit();
  void Fail(Request& r, const Status& status);
  void CloseSequence(Request& r);
  // Admits one request taken off the queue (opens its sequence, or marks it to be forked).
  void AdmitOne(Request& r, const std::unordered_set<RequestId>& cancels);
  // Forks the choices waiting for their leader once it has prefilled all but the last prompt token.
  int64_t RunForks();
  void UpdateRateLocked();
  // Drafts `r` may carry this step with `budget` rows left (>= 0).
  int64_t DraftsFor(const Request& r, int64_t budget) const;

  Executor* executor_;
  EngineOptions options_;
  int64_t vocab_ = 0;
  int64_t max_drafts_ = 0;  // spec.depth, within the executor's max_model_drafts

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Request>> queue_;  // guarded by mu_
  std::unordered_set<RequestId> cancels_;       // guarded by mu_
  bool stopping_ = false;                       // guarded by mu_
  RequestId next_id_ = 1;                       // guarded by mu_
  EngineStats stats_;                           // guarded by mu_
  StepTrace trace_;                             // guarded by mu_
  std::deque<std::pair<double, int64_t>> rate_window_;  // (seconds, tokens_generated), guarded by mu_

  // Scheduling thread only.
  std::vector<std::unique_ptr<Request>> running_;
  std::vector<StepItem> items_;
  std::vector<Request*> item_owner_;
  StepOutput out_;
  size_t rotate_ = 0;  // first running sequence offered a decode slot (fairness under a tight budget)
  // The prefill lane's step in flight (lane_busy_): its items and their requests.
  bool lane_on_ = false;
  bool lane_busy_ = false;
  std::vector<StepItem> lane_items_;
  std::vector<Request*> lane_owner_;
  StepOutput lane_out_;
  std::thread thread_;
};

}  // namespace numoe::engine
