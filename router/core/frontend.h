// The transport-neutral request path shared by the REST gateway and the gRPC service: prompt checks and
// tokenizing, sending one choice to the balancer, and turning its token ids into text events (stop
// strings, EOS, max_tokens), with the token metrics.
//
// Ownership: Frontend borrows the tokenizer, balancer and metrics (they outlive it). Each started choice is
// a ChoiceRun kept alive by the balancer until its last event; the caller keeps a shared_ptr to cancel it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/sampling_limits.h"
#include "common/status.h"
#include "common/tokenizer/tokenizer.h"
#include "router/balancer/balancer.h"
#include "router/core/output_text.h"
#include "router/metrics/metrics.h"

namespace numoe::router {

struct ModelInfo {
  std::string id;          // served model name ("tiny-v4")
  int32_t vocab_size = 0;  // token ids must be below this (config.json vocab_size)
  int32_t max_context = 0; // prompt + generated tokens (max_position_embeddings or --max-model-len)
  int64_t created = 0;     // unix seconds, for /v1/models
};

struct FrontendOptions {
  int32_t default_max_tokens = 256;  // when a request gives none (capped by the context left)
  int32_t max_prompt_tokens = 0;     // longest prompt a request may send; 0 = the context limit only

  bool operator==(const FrontendOptions&) const = default;
};

// Sampling as requested; absent fields take the server defaults (temperature 1, top_p 1, top_k off,
// a random seed, min_p and the penalties off). The worker applies them (model/sampling.h has the order).
struct SamplingRequest {
  std::optional<double> temperature;
  std::optional<double> top_p;
  std::optional<int64_t> top_k;
  std::optional<uint64_t> seed;
  std::optional<double> min_p;
  std::optional<double> presence_penalty;
  std::optional<double> frequency_penalty;
  std::optional<double> repetition_penalty;
  std::vector<std::pair<int64_t, double>> logit_bias;  // (token id, bias)
  // Constrained output: a grammar spec (common/tokenizer/grammar.h) without "end"; the frontend adds the
  // end tokens (EOS and the stop token ids). Empty = none.
  std::string grammar;
};

// The choices to generate from one prompt: n independent samples (choice i with a seed derived from the
// seed and i), prefilled once by the worker when it can.
struct ChoiceSpec {
  std::vector<int32_t> prompt_ids;  // checked: each < vocab_size, length < max_context
  int32_t max_tokens = 0;           // resolved by ResolveMaxTokens (> 0)
  int32_t n = 1;                    // [1, kMaxChoices] (common/sampling_limits.h)
  int32_t logprobs = -1;            // -1 = none; else the chosen token's log-prob and this many top ones
  SamplingRequest sampling;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;
  OutputTextOptions text;  // eos_id is filled in by Start
  std::string request_id;
};

// One token with its log-probability (natural log of the softmax of the model's raw logits) and its bytes.
struct LogprobEntry {
  int32_t id = 0;
  std::string token;  // the token's bytes (may be part of a UTF-8 character)
  float logprob = 0.0f;
};
// The log-probs of one generated token: the chosen one and the most likely ones (most likely first).
struct TokenLogprobs {
  LogprobEntry chosen;
  std::vector<LogprobEntry> top;
};

// What a choice reports, in order: zero or more deltas, then one final event. A spec with n choices reports
// each one's events (tagged with `index`); a failure is one final event with the status, for all of them.
struct ChoiceEvent {
  int32_t index = 0;               // the choice within its spec, [0, n)
  std::vector<int32_t> token_ids;  // ids received since the previous event
  std::vector<TokenLogprobs> logprobs;  // with ChoiceSpec::logprobs >= 0: one per entry of token_ids
  std::string text;                // text released since the previous event
  bool final = false;
  std::string finish_reason;       // final and ok: "stop" or "length"
  Status status;                   // final: OK, or why the choice failed
  uint32_t prompt_tokens = 0;      // final: usage
  uint32_t completion_tokens = 0;  // final: usage
  uint32_t cached_tokens = 0;      // final: usage: of prompt_tokens, the ones restored from numoe-gpu's prefix cache
  std::string stop_string;         // final: the stop string that matched, if any
};

// Receives a choice's events; calls never overlap but may come from any thread.
class ChoiceSink {
 public:
  virtual ~ChoiceSink() = default;
  virtual void OnEvent(ChoiceEvent event) = 0;
};

class ChoiceRun;

class Frontend {
 public:
  Frontend(const tokenizer::Tokenizer& tok, ModelInfo model, Balancer& balancer, Metrics& metrics,
           FrontendOptions options);

  const ModelInfo& model() const { return model_; }
  const tokenizer::Tokenizer& tokenizer() const { return tok_; }
  const FrontendOptions& options() const { return options_; }

  // NotFound (param "model") unless `name` is the served model.
  Status CheckModel(const std::string& name) const;
  // Text -> ids (special-token strings in the text are recognised); BOS first when add_bos and the text
  // does not already start with it.
  StatusOr<std::vector<int32_t>> TokenizeText(std::string_view text, bool add_bos, const std::string& param) const;
  // Token ids given by a client: each in [0, vocab_size), at least one. Errors name `param`.
  StatusOr<std::vector<int32_t>> CheckTokenIds(std::span<const int64_t> ids, const std::string& param) const;
  // The prompt must hold at least one token, leave room for one new token and be at most max_prompt_tokens long
  // (when set); `requested` (if given) must fit in the context. Returns the max_tokens to use. Errors name
  // `prompt_param` or "max_tokens".
  StatusOr<int32_t> ResolveMaxTokens(size_t prompt_len, std::optional<int64_t> requested,
                                     const std::string& prompt_param) const;
  // Checks sampling ranges (temperature [0, 2], top_p (0, 1], top_k >= -1, min_p [0, 1], presence and
  // frequency penalties [-2, 2], repetition_penalty (0, 2], logit_bias: at most kMaxLogitBias, each bias in
  // [-100, 100]); errors name the field.
  static Status CheckSampling(const SamplingRequest& s);

  // Starts a spec's choices. InvalidArgument for a logit_bias id outside the vocabulary or n / logprobs out
  // of range; Unavailable / ResourceExhausted come from the balancer (nothing was started then).
  StatusOr<std::shared_ptr<ChoiceRun>> Start(ChoiceSpec spec, std::shared_ptr<ChoiceSink> sink);

 private:
  const tokenizer::Tokenizer& tok_;
  ModelInfo model_;
  Balancer& balancer_;
  Metrics& metrics_;
  FrontendOptions options_;
};

// One running spec: its n choices on one worker call (the balancer's observer). Cancel() when the client
// goes away. A choice that ends at a stop string here while others run keeps running on the worker (one
// call serves them all) and its further tokens are dropped; the call is stopped once every choice ended.
class ChoiceRun : public GenerationObserver {
 public:
  ChoiceRun(const tokenizer::Tokenizer& tok, ChoiceSpec spec, std::shared_ptr<ChoiceSink> sink, Metrics& metrics);
  void Cancel();
  void SetHandle(std::shared_ptr<GenerationHandle> handle);

  void OnResponse(const v1::WorkerGenerateResponse& response) override;
  void OnEnd(const Status& status, const std::string& finish_reason) override;

 private:
  using Clock = std::chrono::steady_clock;
  struct Choice {
    explicit Choice(OutputText t) : text(std::move(t)) {}
    OutputText text;
    Clock::time_point last_token;
    uint32_t generated = 0;
    uint32_t cached = 0;        // prompt tokens the worker reported restored from the prefix cache
    std::string worker_finish;  // the worker's finish_reason for this choice
    bool finished = false;      // its final event was sent
  };
  void StopWorker();
  // Sends a choice's final event; the last one releases the sink.
  void SendFinal(Choice& c, ChoiceEvent ev);

  const tokenizer::Tokenizer& tok_;
  const int32_t max_tokens_;
  const uint32_t prompt_tokens_;
  std::shared_ptr<ChoiceSink> sink_;
  Metrics& metrics_;
  const Clock::time_point start_;
  bool first_token_ = true;
  bool stopped_early_ = false;  // a choice ended at a stop string (the worker may still be generating it)
  std::vector<Choice> choices_;
  size_t open_choices_ = 0;
  bool finished_ = false;  // every final event was sent (observer calls are serialized: no lock needed)

  std::mutex handle_mu_;
  std::shared_ptr<GenerationHandle> handle_;
  bool cancel_pending_ = false;
  bool client_cancelled_ = false;
};

}  // namespace numoe::router
