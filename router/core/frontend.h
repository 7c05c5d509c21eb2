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

  bool operator==(const FrontendOptions&) const = default;
};

// Sampling as requested; absent fields take the server defaults (temperature 1, top_p 1, top_k off,
// a random seed).
struct SamplingRequest {
  std::optional<double> temperature;
  std::optional<double> top_p;
  std::optional<int64_t> top_k;
  std::optional<uint64_t> seed;
};

// One choice to generate.
struct ChoiceSpec {
  std::vector<int32_t> prompt_ids;  // checked: each < vocab_size, length < max_context
  int32_t max_tokens = 0;           // resolved by ResolveMaxTokens (> 0)
  SamplingRequest sampling;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;
  OutputTextOptions text;  // eos_id is filled in by Start
  std::string request_id;
};

// What a choice reports, in order: zero or more deltas, then one final event.
struct ChoiceEvent {
  std::vector<int32_t> token_ids;  // ids received since the previous event
  std::string text;                // text released since the previous event
  bool final = false;
  std::string finish_reason;       // final and ok: "stop" or "length"
  Status status;                   // final: OK, or why the choice failed
  uint32_t prompt_tokens = 0;      // final: usage
  uint32_t completion_tokens = 0;  // final: usage
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
  // The prompt must leave room for one new token; `requested` (if given) must fit in the context.
  // Returns the max_tokens to use. Errors name `prompt_param` or "max_tokens".
  StatusOr<int32_t> ResolveMaxTokens(size_t prompt_len, std::optional<int64_t> requested,
                                     const std::string& prompt_param) const;
  // Checks sampling ranges (temperature [0, 2], top_p (0, 1], top_k >= -1); errors name the field.
  static Status CheckSampling(const SamplingRequest& s);

  // Starts a choice. Unavailable / ResourceExhausted come from the balancer (nothing was started then).
  StatusOr<std::shared_ptr<ChoiceRun>> Start(ChoiceSpec spec, std::shared_ptr<ChoiceSink> sink);

 private:
  const tokenizer::Tokenizer& tok_;
  ModelInfo model_;
  Balancer& balancer_;
  Metrics& metrics_;
  FrontendOptions options_;
};

// One running choice (the balancer's observer). Cancel() when the client goes away.
class ChoiceRun : public GenerationObserver {
 public:
  ChoiceRun(const tokenizer::Tokenizer& tok, ChoiceSpec spec, std::shared_ptr<ChoiceSink> sink, Metrics& metrics);
  void Cancel();
  void SetHandle(std::shared_ptr<GenerationHandle> handle);

  void OnTokens(std::span<const int32_t> ids) override;
  void OnEnd(const Status& status, const std::string& finish_reason) override;

 private:
  using Clock = std::chrono::steady_clock;
  void StopWorker();
  void SendFinal(ChoiceEvent ev);

  const int32_t max_tokens_;
  const uint32_t prompt_tokens_;
  std::shared_ptr<ChoiceSink> sink_;
  Metrics& metrics_;
  OutputText text_;
  const Clock::time_point start_;
  Clock::time_point last_token_;
  uint32_t generated_ = 0;
  bool finished_ = false;  // the final event was sent (observer calls are serialized: no lock needed)

  std::mutex handle_mu_;
  std::shared_ptr<GenerationHandle> handle_;
  bool cancel_pending_ = false;
  bool client_cancelled_ = false;
};

}  // namespace numoe::router
