#include "worker/service/worker_service.h"

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <mutex>

#include "common/grpc_status.h"

namespace numoe::worker {

StatusOr<engine::EngineRequest> ToEngineRequest(const v1::WorkerGenerateRequest& request, int64_t default_max_tokens) {
  engine::EngineRequest r;
  r.prompt.assign(request.prompt_ids().begin(), request.prompt_ids().end());
  r.max_new_tokens = request.max_new_tokens() == 0 ? default_max_tokens : request.max_new_tokens();
  const v1::WorkerSampling& s = request.sampling();
  r.sampling.temperature = s.temperature();
  r.sampling.top_p = s.top_p() == 0.0f ? 1.0 : s.top_p();
  r.sampling.top_k = s.top_k();
  r.sampling.seed = s.seed();
  r.sampling.min_p = s.min_p();
  r.sampling.presence_penalty = s.presence_penalty();
  r.sampling.frequency_penalty = s.frequency_penalty();
  r.sampling.repetition_penalty = s.repetition_penalty() == 0.0f ? 1.0 : s.repetition_penalty();
  if (s.logit_bias_size() > static_cast<int>(kMaxLogitBias)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.logit_bias has ", s.logit_bias_size(), " entries; at most ", kMaxLogitBias));
  }
  for (const auto& [token, bias] : s.logit_bias()) r.sampling.logit_bias.emplace_back(token, bias);
  r.sampling.grammar = s.grammar();
  std::sort(r.sampling.logit_bias.begin(), r.sampling.logit_bias.end());  // a map's order is unspecified
  if (request.top_logprobs() > static_cast<uint32_t>(kMaxTopLogprobs)) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_logprobs must be in [0, ", kMaxTopLogprobs, "] (got ", request.top_logprobs(), ")"));
  }
  if (request.top_logprobs() > 0 && !request.logprobs()) {
    return absl::InvalidArgumentError("top_logprobs needs logprobs");
  }
  r.sampling.logprobs = request.logprobs() ? static_cast<int32_t>(request.top_logprobs()) : -1;
  if (request.n() > static_cast<uint32_t>(kMaxChoices)) {
    return absl::InvalidArgumentError(absl::StrCat("n must be in [1, ", kMaxChoices, "] (got ", request.n(), ")"));
  }
  r.n = request.n() == 0 ? 1 : static_cast<int32_t>(request.n());
  r.ignore_eos = request.ignore_eos();
  r.stop_token_ids.assign(request.stop_token_ids().begin(), request.stop_token_ids().end());
  r.request_id = request.request_id();
  return r;
}

namespace {

// One Generate stream. The engine's scheduling thread feeds it through Sink; gRPC's threads call the
// On* reactions. Both sides meet under mu_. Lifetime: gRPC deletes nothing; OnDone deletes the reactor
// after detaching the sink, which the engine may still hold (then its calls are dropped).
class GenerateReactor final : public grpc::ServerWriteReactor<v1::WorkerGenerateResponse> {
 public:
  GenerateReactor(engine::Engine* engine, const v1::WorkerGenerateRequest& request, int64_t default_max_tokens)
      : engine_(engine), sink_(std::make_shared<Sink>(this)) {
    auto req = ToEngineRequest(request, default_max_tokens);
    if (!req.ok()) {
      FinishNow(req.status());
      return;
    }
    open_choices_ = req->n;
    auto id = engine_->Submit(std::move(*req), sink_);
    if (!id.ok()) {
      FinishNow(id.status());
      return;
    }
    std::lock_guard<std::mutex> lk(mu_);
    id_ = *id;
    submitted_ = true;
    if (cancelled_) engine_->Cancel(id_);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lk(mu_);
    writing_ = false;
    if (!ok) {  // the stream broke: stop generating for nobody
      if (submitted_) engine_->Cancel(id_);
      if (!finished_) {
        finished_ = true;
        Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the stream to the client broke"));
      }
      return;
    }
    MaybeWriteLocked();
  }

  void OnCancel() override {
    std::lock_guard<std::mutex> lk(mu_);
    cancelled_ = true;
    if (submitted_) engine_->Cancel(id_);  // the engine answers with OnError(CANCELLED) -> Finish
  }

  void OnDone() override {
    sink_->Detach();
    delete this;
  }

 private:
  class Sink final : public engine::TokenSink {
   public:
    explicit Sink(GenerateReactor* r) : r_(r) {}
    void OnTokens(int32_t choice, std::span<const int32_t> tokens, std::span<const EmittedLogprobs> logprobs,
                  std::string_view reason) override {
      std::lock_guard<std::mutex> lk(mu_);
      if (r_ != nullptr) r_->Push(choice, tokens, logprobs, reason);
    }
    void OnError(const Status& status) override {
      std::lock_guard<std::mutex> lk(mu_);
      if (r_ != nullptr) r_->PushError(status);
    }
    void OnPromptCached(int32_t choice, int64_t cached_tokens) override {
      std::lock_guard<std::mutex> lk(mu_);
      if (r_ != nullptr) r_->PushCached(choice, cached_tokens);
    }
    void Detach() {
      std::lock_guard<std::mutex> lk(mu_);
      r_ = nullptr;
    }

   private:
    std::mutex mu_;
    GenerateReactor* r_;
  };

  void FinishNow(const Status& status) {
    std::lock_guard<std::mutex> lk(mu_);
    finished_ = true;
    Finish(ToGrpcStatus(status));
  }

  void Push(int32_t choice, std::span<const int32_t> tokens, std::span<const EmittedLogprobs> logprobs,
            std::string_view reason) {
    std::lock_guard<std::mutex> lk(mu_);
    // Coalesce into the not-yet-started last response of the same choice when the client reads slower than
    // we produce.
    if (pending_.empty() || !pending_.back().finish_reason().empty() ||
        pending_.back().index() != static_cast<uint32_t>(choice)) {
      pending_.emplace_back();
      pending_.back().set_index(static_cast<uint32_t>(choice));
    }
    v1::WorkerGenerateResponse& r = pending_.back();
    if (auto c = cached_.find(choice); c != cached_.end()) {  // the choice's first message
      r.set_cached_tokens(static_cast<uint64_t>(c->second));
      cached_.erase(c);
    }
    for (int32_t t : tokens) r.add_token_ids(t);
    for (const EmittedLogprobs& lp : logprobs) {
      v1::WorkerTokenLogprobs* out = r.add_logprobs();
      out->set_logprob(lp.chosen.logprob);
      for (const TokenLogprob& t : lp.top) {
        out->add_top_ids(t.token);
        out->add_top_logprobs(t.logprob);
      }
    }
    if (!reason.empty()) {
      r.set_finish_reason(std::string(reason));
      if (--open_choices_ <= 0) {
        final_ = grpc::Status::OK;
        final_ready_ = true;
      }
    }
    MaybeWriteLocked();
  }

  void PushCached(int32_t choice, int64_t cached_tokens) {
    std::lock_guard<std::mutex> lk(mu_);
    cached_[choice] = cached_tokens;
  }

  void PushError(const Status& status) {
    std::lock_guard<std::mutex> lk(mu_);
    final_ = ToGrpcStatus(status);
    final_ready_ = true;
    MaybeWriteLocked();
  }

  void MaybeWriteLocked() {
    if (finished_ || writing_) return;
    if (!pending_.empty()) {
      current_ = std::move(pending_.front());
      pending_.pop_front();
      writing_ = true;
      StartWrite(&current_);
      return;
    }
    if (final_ready_) {
      finished_ = true;
      Finish(final_);
    }
  }

  engine::Engine* engine_;
  std::shared_ptr<Sink> sink_;
  std::mutex mu_;
  engine::RequestId id_ = 0;
  bool submitted_ = false, cancelled_ = false;
  int32_t open_choices_ = 1;  // choices that have not finished yet
  std::map<int32_t, int64_t> cached_;  // per choice, until its first message: prompt tokens restored from the prefix cache
  std::deque<v1::WorkerGenerateResponse> pending_;
  v1::WorkerGenerateResponse current_;
  bool writing_ = false, final_ready_ = false, finished_ = false;
  grpc::Status final_;
};

}  // namespace

grpc::ServerWriteReactor<v1::WorkerGenerateResponse>* WorkerGrpcService::Generate(
    grpc::CallbackServerContext*, const v1::WorkerGenerateRequest* request) {
  return new GenerateReactor(engine_, *request, options_.default_max_tokens);
}

grpc::ServerUnaryReactor* WorkerGrpcService::Stats(grpc::CallbackServerContext* ctx, const v1::WorkerStatsRequest*,
                                                   v1::WorkerStats* response) {
  const engine::EngineStats s = engine_->stats();
  response->set_worker_id(options_.worker_id);
  for (int n : options_.numa_nodes) response->add_numa_nodes(n);
  response->set_active_sequences(static_cast<uint32_t>(s.active));
  response->set_queued_sequences(static_cast<uint32_t>(s.queued));
  response->set_max_sequences(static_cast<uint32_t>(s.max_seqs));
  response->set_decode_tokens_per_s(s.decode_tokens_per_s);
  response->set_tokens_generated(static_cast<uint64_t>(s.tokens_generated));
  response->set_prompt_tokens(static_cast<uint64_t>(s.prompt_tokens));
  response->set_outstanding_tokens(static_cast<uint64_t>(s.outstanding_tokens));
  response->set_steps(static_cast<uint64_t>(s.steps));
  response->set_max_step_tokens(static_cast<uint32_t>(engine_->options().max_step_tokens));
  response->set_queue_capacity(static_cast<uint32_t>(engine_->options().max_queue));
  response->set_spec_method(SpecMethodName(s.spec_method));
  response->set_spec_verify_steps(static_cast<uint64_t>(s.spec_verify_steps));
  response->set_spec_drafted(static_cast<uint64_t>(s.spec_drafted));
  response->set_spec_accepted(static_cast<uint64_t>(s.spec_accepted));
  response->set_expert_seconds(s.expert_seconds);
  response->set_prefix_queried_tokens(static_cast<uint64_t>(s.prefix_queried_tokens));
  response->set_prefix_hit_tokens(static_cast<uint64_t>(s.prefix_hit_tokens));
  response->set_prefix_cache_bytes(s.prefix_cache_bytes);
  response->set_prefix_host_bytes(s.prefix_host_bytes);
  response->set_prefix_evicted(static_cast<uint64_t>(s.prefix_evicted));
  response->set_prefix_host_evicted(static_cast<uint64_t>(s.prefix_host_evicted));
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace numoe::worker
