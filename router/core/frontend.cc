#include "router/core/frontend.h"

#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "router/core/errors.h"

namespace numoe::router {

Frontend::Frontend(const tokenizer::Tokenizer& tok, ModelInfo model, Balancer& balancer, Metrics& metrics,
                   FrontendOptions options)
    : tok_(tok), model_(std::move(model)), balancer_(balancer), metrics_(metrics), options_(options) {}

Status Frontend::CheckModel(const std::string& name) const {
  if (name == model_.id) return absl::OkStatus();
  return WithParam(absl::NotFoundError(absl::StrCat("The model '", name, "' does not exist; this server serves '",
                                                    model_.id, "' (see /v1/models)")),
                   "model");
}

StatusOr<std::vector<int32_t>> Frontend::TokenizeText(std::string_view text, bool add_bos,
                                                      const std::string& param) const {
  auto ids = tok_.Encode(text);
  if (!ids.ok()) return InvalidParam(param, absl::StrCat(param, ": ", ids.status().message()));
  std::vector<int32_t> out;
  const int32_t bos = tok_.special_ids().bos;
  if (add_bos && bos >= 0 && (ids->empty() || ids->front() != bos)) out.push_back(bos);
  out.insert(out.end(), ids->begin(), ids->end());
  for (int32_t id : out) {
    if (id >= model_.vocab_size) {
      return InvalidParam(param, absl::StrCat(param, ": the tokenizer produced id ", id,
                                              ", which is not below the model's vocab_size ", model_.vocab_size));
    }
  }
  return out;
}

StatusOr<std::vector<int32_t>> Frontend::CheckTokenIds(std::span<const int64_t> ids, const std::string& param) const {
  if (ids.empty()) return InvalidParam(param, absl::StrCat(param, ": the prompt is empty (give at least one token)"));
  std::vector<int32_t> out;
  out.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= model_.vocab_size) {
      return InvalidParam(param, absl::StrCat(param, "[", i, "]: token id ", ids[i], " is out of range [0, ",
                                              model_.vocab_size, ")"));
    }
    out.push_back(static_cast<int32_t>(ids[i]));
  }
  return out;
}

StatusOr<int32_t> Frontend::ResolveMaxTokens(size_t prompt_len, std::optional<int64_t> requested,
                                             const std::string& prompt_param) const {
  const int64_t ctx = model_.max_context;
  if (static_cast<int64_t>(prompt_len) >= ctx) {
    return InvalidParam(prompt_param,
                        absl::StrCat("This model's maximum context length is ", ctx, " tokens; the prompt has ",
                                     prompt_len, " tokens, which leaves no room to generate (", prompt_param, ")"));
  }
  const int64_t room = ctx - static_cast<int64_t>(prompt_len);
  if (requested) {
    if (*requested < 1) return InvalidParam("max_tokens", absl::StrCat("max_tokens must be at least 1 (got ", *requested, ")"));
    if (*requested > room) {
      return InvalidParam("max_tokens",
                          absl::StrCat("This model's maximum context length is ", ctx, " tokens; the prompt has ",
                                       prompt_len, " tokens and max_tokens is ", *requested, " (at most ", room,
                                       " fit)"));
    }
    return static_cast<int32_t>(*requested);
  }
  return static_cast<int32_t>(std::min<int64_t>(options_.default_max_tokens, room));
}

Status Frontend::CheckSampling(const SamplingRequest& s) {
  if (s.temperature && !(std::isfinite(*s.temperature) && *s.temperature >= 0 && *s.temperature <= 2)) {
    return InvalidParam("temperature", absl::StrCat("temperature must be in [0, 2] (got ", *s.temperature, ")"));
  }
  if (s.top_p && !(std::isfinite(*s.top_p) && *s.top_p > 0 && *s.top_p <= 1)) {
    return InvalidParam("top_p", absl::StrCat("top_p must be in (0, 1] (got ", *s.top_p, ")"));
  }
  if (s.top_k && (*s.top_k < -1 || *s.top_k > (1 << 30))) {
    return InvalidParam("top_k", absl::StrCat("top_k must be -1 or 0 (off) or a positive count (got ", *s.top_k, ")"));
  }
  return absl::OkStatus();
}

StatusOr<std::shared_ptr<ChoiceRun>> Frontend::Start(ChoiceSpec spec, std::shared_ptr<ChoiceSink> sink) {
  v1::WorkerGenerateRequest req;
  req.mutable_prompt_ids()->Assign(spec.prompt_ids.begin(), spec.prompt_ids.end());
  req.set_max_new_tokens(static_cast<uint32_t>(spec.max_tokens));
  v1::WorkerSampling* s = req.mutable_sampling();
  s->set_temperature(static_cast<float>(spec.sampling.temperature.value_or(1.0)));
  s->set_top_p(static_cast<float>(spec.sampling.top_p.value_or(1.0)));
  s->set_top_k(static_cast<int32_t>(std::max<int64_t>(0, spec.sampling.top_k.value_or(0))));
  if (spec.sampling.seed) {
    s->set_seed(*spec.sampling.seed);
  } else {
    thread_local std::mt19937_64 rng{std::random_device{}()};
    s->set_seed(rng());
  }
  req.set_ignore_eos(spec.ignore_eos);
  req.mutable_stop_token_ids()->Assign(spec.stop_token_ids.begin(), spec.stop_token_ids.end());
  req.set_request_id(spec.request_id);
  spec.text.eos_id = spec.ignore_eos ? -1 : tok_.special_ids().eos;
  const size_t prompt_len = spec.prompt_ids.size();

  auto run = std::make_shared<ChoiceRun>(tok_, std::move(spec), std::move(sink), metrics_);
  ASSIGN_OR_RETURN(auto handle, balancer_.Submit(std::move(req), run));
  metrics_.AddPromptTokens(prompt_len);
  run->SetHandle(std::move(handle));
  return run;
}

ChoiceRun::ChoiceRun(const tokenizer::Tokenizer& tok, ChoiceSpec spec, std::shared_ptr<ChoiceSink> sink,
                     Metrics& metrics)
    : max_tokens_(spec.max_tokens),
      prompt_tokens_(static_cast<uint32_t>(spec.prompt_ids.size())),
      sink_(std::move(sink)),
      metrics_(metrics),
      text_(tok, std::move(spec.text)),
      start_(Clock::now()) {}

void ChoiceRun::SetHandle(std::shared_ptr<GenerationHandle> handle) {
  bool cancel = false;
  {
    std::lock_guard<std::mutex> lock(handle_mu_);
    handle_ = handle;
    cancel = cancel_pending_;
  }
  if (cancel) handle->Cancel();
}

void ChoiceRun::StopWorker() {
  std::shared_ptr<GenerationHandle> h;
  {
    std::lock_guard<std::mutex> lock(handle_mu_);
    h = handle_;
    if (!h) cancel_pending_ = true;  // tokens arrived before Start stored the handle
  }
  if (h) h->Cancel();
}

void ChoiceRun::Cancel() {
  {
    std::lock_guard<std::mutex> lock(handle_mu_);
    client_cancelled_ = true;
  }
  StopWorker();
}

void ChoiceRun::OnTokens(std::span<const int32_t> ids) {
  if (finished_ || ids.empty()) return;
  const auto now = Clock::now();
  if (generated_ == 0) {
    metrics_.ObserveTimeToFirstToken(std::chrono::duration<double>(now - start_).count());
  } else {
    metrics_.ObserveInterTokenLatency(std::chrono::duration<double>(now - last_token_).count());
  }
  last_token_ = now;
  // A worker must not exceed max_tokens; if one does, the extra ids are dropped here.
  size_t take = std::min<size_t>(ids.size(), static_cast<size_t>(max_tokens_ - static_cast<int32_t>(generated_)));
  ids = ids.first(take);
  generated_ += static_cast<uint32_t>(ids.size());
  metrics_.AddGenerationTokens(ids.size());

  OutputText::Step step = text_.Add(ids);
  ChoiceEvent ev;
  ev.token_ids.assign(ids.begin(), ids.end());
  ev.text = std::move(step.text);
  const bool at_limit = generated_ >= static_cast<uint32_t>(max_tokens_);
  if (!step.stopped && !at_limit) {
    sink_->OnEvent(std::move(ev));
    return;
  }
  // Finished here: stop string matched, or max_tokens reached (the worker's final message may lag).
  if (!step.stopped) {
    ev.text += text_.Finish();
  }
  finished_ = true;
  ev.final = true;
  ev.finish_reason = (step.stopped || text_.stopped()) ? "stop" : "length";
  ev.stop_string = text_.matched_stop();
  ev.prompt_tokens = prompt_tokens_;
  ev.completion_tokens = generated_;
  SendFinal(std::move(ev));
  if (step.stopped) StopWorker();
}

void ChoiceRun::OnEnd(const Status& status, const std::string& finish_reason) {
  if (finished_) return;
  finished_ = true;
  ChoiceEvent ev;
  ev.final = true;
  ev.prompt_tokens = prompt_tokens_;
  ev.completion_tokens = generated_;
  if (!status.ok()) {
    bool by_client = false;
    {
      std::lock_guard<std::mutex> lock(handle_mu_);
      by_client = client_cancelled_;
    }
    ev.status = by_client ? absl::CancelledError("the client went away") : status;
    if (!by_client) NLOG(WARNING) << "choice failed: " << status;
    SendFinal(std::move(ev));
    return;
  }
  ev.text = text_.Finish();
  if (text_.stopped()) {
    ev.finish_reason = "stop";
    ev.stop_string = text_.matched_stop();
  } else if (finish_reason == "length" || generated_ >= static_cast<uint32_t>(max_tokens_)) {
    ev.finish_reason = "length";
  } else {
    ev.finish_reason = "stop";
  }
  SendFinal(std::move(ev));
}

void ChoiceRun::SendFinal(ChoiceEvent ev) {
  // The sink is released with the final event: it usually owns this run (a reference cycle otherwise).
  std::shared_ptr<ChoiceSink> sink = std::move(sink_);
  sink->OnEvent(std::move(ev));
}

}  // namespace numoe::router
