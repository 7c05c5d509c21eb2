#include "router/core/frontend.h"

#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include <nlohmann/json.hpp>
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
  if (prompt_len == 0) {  // e.g. "" with add_special_tokens false: a worker needs at least one token
    return InvalidParam(prompt_param, absl::StrCat(prompt_param, ": the prompt is empty (it encodes to no tokens)"));
  }
  if (options_.max_prompt_tokens > 0 && static_cast<int64_t>(prompt_len) > options_.max_prompt_tokens) {
    return InvalidParam(prompt_param, absl::StrCat("the prompt has ", prompt_len, " tokens; this server accepts at most ",
                                                   options_.max_prompt_tokens, " (--max-prompt-tokens) (",
                                                   prompt_param, ")"));
  }
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
  if (s.min_p && !(std::isfinite(*s.min_p) && *s.min_p >= 0 && *s.min_p <= 1)) {
    return InvalidParam("min_p", absl::StrCat("min_p must be in [0, 1] (got ", *s.min_p, ")"));
  }
  for (const auto& [name, v] : {std::pair{"presence_penalty", s.presence_penalty},
                                std::pair{"frequency_penalty", s.frequency_penalty}}) {
    if (v && !(std::isfinite(*v) && *v >= -2 && *v <= 2)) {
      return InvalidParam(name, absl::StrCat(name, " must be in [-2, 2] (got ", *v, ")"));
    }
  }
  if (s.repetition_penalty && !(std::isfinite(*s.repetition_penalty) && *s.repetition_penalty > 0 &&
                                *s.repetition_penalty <= 2)) {
    return InvalidParam("repetition_penalty",
                        absl::StrCat("repetition_penalty must be in (0, 2] (got ", *s.repetition_penalty, ")"));
  }
  if (s.logit_bias.size() > kMaxLogitBias) {
    return InvalidParam("logit_bias", absl::StrCat("logit_bias has ", s.logit_bias.size(), " entries; at most ",
                                                   kMaxLogitBias));
  }
  for (const auto& [id, bias] : s.logit_bias) {
    if (!(std::isfinite(bias) && std::abs(bias) <= kMaxLogitBiasValue)) {
      return InvalidParam("logit_bias", absl::StrCat("logit_bias[\"", id, "\"] must be in [-100, 100] (got ", bias, ")"));
    }
  }
  return absl::OkStatus();
}

StatusOr<std::shared_ptr<ChoiceRun>> Frontend::Start(ChoiceSpec spec, std::shared_ptr<ChoiceSink> sink) {
  if (spec.n < 1 || spec.n > kMaxChoices) {
    return InvalidParam("n", absl::StrCat("n must be in [1, ", kMaxChoices, "] (got ", spec.n, ")"));
  }
  if (spec.logprobs < -1 || spec.logprobs > kMaxTopLogprobs) {
    return InvalidParam("top_logprobs", absl::StrCat("top_logprobs must be in [0, ", kMaxTopLogprobs, "] (got ",
                                                     spec.logprobs, ")"));
  }
  RETURN_IF_ERROR(CheckSampling(spec.sampling));
  for (const auto& [id, bias] : spec.sampling.logit_bias) {
    if (id < 0 || id >= model_.vocab_size) {
      return InvalidParam("logit_bias", absl::StrCat("logit_bias: token id ", id, " is out of range [0, ",
                                                     model_.vocab_size, ")"));
    }
  }
  v1::WorkerGenerateRequest req;
  req.mutable_prompt_ids()->Assign(spec.prompt_ids.begin(), spec.prompt_ids.end());
  req.set_max_new_tokens(static_cast<uint32_t>(spec.max_tokens));
  v1::WorkerSampling* s = req.mutable_sampling();
  s->set_temperature(static_cast<float>(spec.sampling.temperature.value_or(1.0)));
  s->set_top_p(static_cast<float>(spec.sampling.top_p.value_or(1.0)));
  s->set_top_k(static_cast<int32_t>(std::max<int64_t>(0, spec.sampling.top_k.value_or(0))));
  s->set_min_p(static_cast<float>(spec.sampling.min_p.value_or(0.0)));
  s->set_presence_penalty(static_cast<float>(spec.sampling.presence_penalty.value_or(0.0)));
  s->set_frequency_penalty(static_cast<float>(spec.sampling.frequency_penalty.value_or(0.0)));
  s->set_repetition_penalty(static_cast<float>(spec.sampling.repetition_penalty.value_or(1.0)));
  for (const auto& [id, bias] : spec.sampling.logit_bias) {
    (*s->mutable_logit_bias())[static_cast<int32_t>(id)] = static_cast<float>(bias);
  }
  if (!spec.sampling.grammar.empty()) {
    nlohmann::json g = nlohmann::json::parse(spec.sampling.grammar, nullptr, /*allow_exceptions=*/false);
    if (!g.is_object()) return absl::InternalError("sampling.grammar is not a JSON object");
    nlohmann::json end = nlohmann::json::array();
    if (tok_.special_ids().eos >= 0) end.push_back(tok_.special_ids().eos);
    for (int32_t id : spec.stop_token_ids) end.push_back(id);
    g["end"] = std::move(end);
    s->set_grammar(g.dump());
  }
  req.set_n(static_cast<uint32_t>(spec.n));
  req.set_logprobs(spec.logprobs >= 0);
  req.set_top_logprobs(static_cast<uint32_t>(std::max(0, spec.logprobs)));
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
    : tok_(tok),
      max_tokens_(spec.max_tokens),
      prompt_tokens_(static_cast<uint32_t>(spec.prompt_ids.size())),
      sink_(std::move(sink)),
      metrics_(metrics),
      start_(Clock::now()) {
  for (int32_t i = 0; i < spec.n; ++i) choices_.emplace_back(OutputText(tok, spec.text));
  open_choices_ = choices_.size();
}

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

void ChoiceRun::OnResponse(const v1::WorkerGenerateResponse& response) {
  if (finished_ || response.index() >= choices_.size()) return;
  Choice& c = choices_[response.index()];
  if (!response.finish_reason().empty()) c.worker_finish = response.finish_reason();
  if (response.cached_tokens() > 0) c.cached = static_cast<uint32_t>(std::min<uint64_t>(response.cached_tokens(), prompt_tokens_));
  std::span<const int32_t> ids(response.token_ids().data(), response.token_ids_size());
  if (c.finished || ids.empty()) return;
  const auto now = Clock::now();
  if (first_token_) {
    first_token_ = false;
    metrics_.ObserveTimeToFirstToken(std::chrono::duration<double>(now - start_).count());
  } else if (c.generated > 0) {
    metrics_.ObserveInterTokenLatency(std::chrono::duration<double>(now - c.last_token).count());
  }
  c.last_token = now;
  // A worker must not exceed max_tokens; if one does, the extra ids are dropped here.
  size_t take = std::min<size_t>(ids.size(), static_cast<size_t>(max_tokens_ - static_cast<int32_t>(c.generated)));
  ids = ids.first(take);
  c.generated += static_cast<uint32_t>(ids.size());
  metrics_.AddGenerationTokens(ids.size());

  OutputText::Step step = c.text.Add(ids);
  ChoiceEvent ev;
  ev.index = static_cast<int32_t>(response.index());
  ev.token_ids.assign(ids.begin(), ids.end());
  for (size_t k = 0; k < ids.size() && static_cast<int>(k) < response.logprobs_size(); ++k) {
    const v1::WorkerTokenLogprobs& lp = response.logprobs(static_cast<int>(k));
    TokenLogprobs out;
    out.chosen = LogprobEntry{ids[k], std::string(tok_.IdToBytes(ids[k])), lp.logprob()};
    for (int j = 0; j < lp.top_ids_size() && j < lp.top_logprobs_size(); ++j) {
      const int32_t id = lp.top_ids(j);
      out.top.push_back(LogprobEntry{id, std::string(tok_.IdToBytes(id)), lp.top_logprobs(j)});
    }
    ev.logprobs.push_back(std::move(out));
  }
  ev.text = std::move(step.text);
  const bool at_limit = c.generated >= static_cast<uint32_t>(max_tokens_);
  if (!step.stopped && !at_limit) {
    sink_->OnEvent(std::move(ev));
    return;
  }
  // Finished here: stop string matched, or max_tokens reached (the worker's final message may lag).
  if (!step.stopped) {
    ev.text += c.text.Finish();
  }
  ev.final = true;
  ev.finish_reason = (step.stopped || c.text.stopped()) ? "stop" : "length";
  ev.stop_string = c.text.matched_stop();
  ev.prompt_tokens = prompt_tokens_;
  ev.completion_tokens = c.generated;
  ev.cached_tokens = c.cached;
  stopped_early_ |= step.stopped;
  SendFinal(c, std::move(ev));
  // The worker call serves every choice: stop it once none is left, if a stop string ended one early.
  if (finished_ && stopped_early_) StopWorker();
}

void ChoiceRun::OnEnd(const Status& status, const std::string& finish_reason) {
  if (finished_) return;
  if (!status.ok()) {
    bool by_client = false;
    {
      std::lock_guard<std::mutex> lock(handle_mu_);
      by_client = client_cancelled_;
    }
    if (!by_client) NLOG(WARNING) << "choice failed: " << status;
    ChoiceEvent ev;
    ev.final = true;
    ev.status = by_client ? absl::CancelledError("the client went away") : status;
    ev.prompt_tokens = prompt_tokens_;
    for (const Choice& c : choices_) ev.completion_tokens += c.generated;
    if (!choices_.empty()) ev.cached_tokens = choices_[0].cached;
    finished_ = true;
    std::shared_ptr<ChoiceSink> sink = std::move(sink_);
    sink->OnEvent(std::move(ev));
    return;
  }
  for (size_t i = 0; i < choices_.size(); ++i) {
    Choice& c = choices_[i];
    if (c.finished) continue;
    ChoiceEvent ev;
    ev.index = static_cast<int32_t>(i);
    ev.final = true;
    ev.prompt_tokens = prompt_tokens_;
    ev.completion_tokens = c.generated;
    ev.cached_tokens = c.cached;
    ev.text = c.text.Finish();
    const std::string& worker_finish = c.worker_finish.empty() ? finish_reason : c.worker_finish;
    if (c.text.stopped()) {
      ev.finish_reason = "stop";
      ev.stop_string = c.text.matched_stop();
    } else if (worker_finish == "length" || c.generated >= static_cast<uint32_t>(max_tokens_)) {
      ev.finish_reason = "length";
    } else {
      ev.finish_reason = "stop";
    }
    SendFinal(c, std::move(ev));
  }
}

void ChoiceRun::SendFinal(Choice& c, ChoiceEvent ev) {
  c.finished = true;
  if (--open_choices_ > 0) {
    sink_->OnEvent(std::move(ev));
    return;
  }
  finished_ = true;
  // The sink is released with the last final event: it usually owns this run (a reference cycle otherwise).
  std::shared_ptr<ChoiceSink> sink = std::move(sink_);
  sink->OnEvent(std::move(ev));
}

}  // namespace numoe::router
