#include "router/http/messages_job.h"

namespace numoe::router {

namespace an = anthropic;

struct MessagesJob::Sink : ChoiceSink {
  explicit Sink(std::shared_ptr<MessagesJob> job) : job(std::move(job)) {}
  void OnEvent(ChoiceEvent event) override { job->OnEvent(std::move(event)); }
  std::shared_ptr<MessagesJob> job;
};

void RespondAnthropicError(HttpExchange& exchange, const Status& status) {
  an::ApiError e = an::ToApiError(status);
  HttpHeaders headers;
  if (e.retry_after_s > 0) headers.emplace_back("Retry-After", std::to_string(e.retry_after_s));
  exchange.Respond(e.http_status, "application/json", an::Dump(an::ErrorJson(e)), std::move(headers));
}

MessagesJob::MessagesJob(Config config, std::shared_ptr<HttpExchange> exchange)
    : config_(std::move(config)),
      exchange_(std::move(exchange)),
      parser_(config_.thinking, config_.tools, an::NewToolUseId),
      builder_({.id = config_.id, .model = config_.model,
                .disable_parallel_tool_use = config_.disable_parallel_tool_use}) {}

void MessagesJob::Start(Frontend& frontend, ChoiceSpec spec) {
  auto self = shared_from_this();
  exchange_->OnClientGone([self] { self->Cancel(); });
  {
    std::lock_guard<std::mutex> lock(mu_);
    input_tokens_ = spec.prompt_ids.size();
  }
  auto run = frontend.Start(std::move(spec), std::make_shared<Sink>(self));
  std::lock_guard<std::mutex> lock(mu_);
  if (!run.ok()) {
    if (!done_) {
      done_ = true;
      SendErrorLocked(run.status());
    }
    return;
  }
  if (done_) {  // the client left meanwhile
    (*run)->Cancel();
    return;
  }
  run_ = *run;
}

void MessagesJob::Cancel() {
  std::shared_ptr<ChoiceRun> run;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    run = std::move(run_);
  }
  if (run) run->Cancel();
}

void MessagesJob::SendEventsLocked(const std::vector<an::Json>& events) {
  for (const an::Json& e : events) exchange_->SendEvent(an::SseEvent(e));
}

void MessagesJob::SendErrorLocked(const Status& status) {
  if (!started_) {
    RespondAnthropicError(*exchange_, status);
    return;
  }
  exchange_->SendEvent(an::SseEvent(an::ErrorJson(an::ToApiError(status))));
  exchange_->EndEvents();
}

void MessagesJob::OnEvent(ChoiceEvent ev) {
  std::lock_guard<std::mutex> lock(mu_);
  if (done_) return;
  if (ev.final && !ev.status.ok()) {
    done_ = true;
    run_.reset();
    if (ev.status.code() != absl::StatusCode::kCancelled) SendErrorLocked(ev.status);
    return;
  }
  output_tokens_ += ev.token_ids.size();
  if (!begun_) {
    begun_ = true;
    std::vector<an::Json> start = builder_.Start(input_tokens_);
    if (config_.stream) {
      started_ = true;
      SendEventsLocked(start);
    }
  }
  openai::ChatDelta d = parser_.Add(ev.text);
  if (ev.final) d.Append(parser_.Finish());
  std::vector<an::Json> events = builder_.Add(d);
  if (config_.stream) SendEventsLocked(events);
  if (!ev.final) return;
  done_ = true;
  run_.reset();  // finished: only the reference goes
  const int calls = parser_.tool_calls();
  builder_.set_cache_read_input_tokens(ev.cached_tokens);
  events = builder_.Finish(an::StopReason(ev.finish_reason, ev.stop_string, calls), ev.stop_string, output_tokens_,
                           calls);
  if (config_.stream) {
    SendEventsLocked(events);
    exchange_->EndEvents();
  } else {
    exchange_->Respond(200, "application/json", an::Dump(builder_.Message()));
  }
}

}  // namespace numoe::router
