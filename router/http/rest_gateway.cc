#include "router/http/rest_gateway.h"

#include <atomic>
#include <chrono>
#include <mutex>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "router/anthropic/messages.h"
#include "router/core/errors.h"
#include "router/http/messages_job.h"
#include "router/openai/chat.h"
#include "router/openai/request.h"
#include "router/openai/response.h"

namespace numoe::router {

using nlohmann::json;
namespace oa = openai;
namespace an = anthropic;

namespace {

int64_t UnixNow() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Counts numoe_requests_total{endpoint,status} once, when the response status is known.
class MeteredExchange : public HttpExchange {
 public:
  MeteredExchange(std::shared_ptr<HttpExchange> inner, Metrics& metrics, std::string endpoint)
      : inner_(std::move(inner)), metrics_(metrics), endpoint_(std::move(endpoint)) {}
  void Respond(int status, const std::string& content_type, std::string body, HttpHeaders headers) override {
    Count(status);
    inner_->Respond(status, content_type, std::move(body), std::move(headers));
  }
  void SendEvent(std::string event) override {
    Count(200);
    inner_->SendEvent(std::move(event));
  }
  void EndEvents() override { inner_->EndEvents(); }
  void OnClientGone(std::function<void()> fn) override { inner_->OnClientGone(std::move(fn)); }

 private:
  void Count(int status) {
    if (!counted_.exchange(true)) metrics_.CountRequest(endpoint_, std::to_string(status));
  }
  std::shared_ptr<HttpExchange> inner_;
  Metrics& metrics_;
  std::string endpoint_;
  std::atomic<bool> counted_{false};
};

void RespondJson(HttpExchange& ex, int status, const json& body, HttpHeaders headers = {}) {
  ex.Respond(status, "application/json", oa::Dump(body), std::move(headers));
}

// One (chat) completion request with one or more choices: collects them for a whole response, or turns
// their events into SSE chunks. Choice events arrive on worker threads; one mutex orders them.
class CompletionJob : public std::enable_shared_from_this<CompletionJob> {
 public:
  struct Config {
    bool chat = false;
    bool stream = false;
    bool include_usage = false;
    bool return_token_ids = false;
    bool logprobs = false;  // choices carry log-probs
    size_t n = 1;           // choices per spec (their indices are spec * n + choice)
    bool thinking = false;  // chat: the prompt starts the output in reasoning
    bool tools = false;
    std::string model;
    std::string id;  // response id, also the workers' request_id prefix
  };

  CompletionJob(Config config, std::shared_ptr<HttpExchange> exchange, size_t n_choices)
      : config_(std::move(config)),
        exchange_(std::move(exchange)),
        id_(config_.id.empty() ? oa::NewId(config_.chat ? "chatcmpl" : "cmpl") : config_.id),
        created_(UnixNow()),
        choices_(n_choices),
        remaining_(n_choices) {
    for (auto& c : choices_) {
      if (config_.chat) c.parser = std::make_unique<oa::ChatStreamParser>(config_.thinking, config_.tools);
    }
  }

  const std::string& id() const { return id_; }

  // Starts every choice; on an admission error cancels the ones started and answers with the error.
  void Start(Frontend& frontend, std::vector<ChoiceSpec> specs) {
    auto self = shared_from_this();
    exchange_->OnClientGone([self] { self->CancelAll(); });
    for (size_t i = 0; i < specs.size(); ++i) {
      // Usage counts each prompt once, however many choices it has.
      choices_[i * config_.n].prompt_tokens = specs[i].prompt_ids.size();
      for (size_t j = 0; j < config_.n && config_.return_token_ids; ++j) {
        choices_[i * config_.n + j].prompt_ids = specs[i].prompt_ids;
      }
      auto sink = std::make_shared<Sink>(self, i * config_.n);
      auto run = frontend.Start(std::move(specs[i]), sink);
      if (!run.ok()) {
        Fail(run.status());
        return;
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (done_) {  // failed, finished or cancelled meanwhile
        (*run)->Cancel();
        return;
      }
      runs_.push_back(*run);
    }
  }

 private:
  // One spec's events: its choice i is the job's choice base + i.
  struct Sink : ChoiceSink {
    Sink(std::shared_ptr<CompletionJob> job, size_t base) : job(std::move(job)), base(base) {}
    void OnEvent(ChoiceEvent event) override {
      const size_t index = base + static_cast<size_t>(std::max(0, event.index));
      job->OnEvent(index, std::move(event));
    }
    std::shared_ptr<CompletionJob> job;
    size_t base;
  };

  struct Choice {
    uint64_t prompt_tokens = 0;
    uint64_t completion_tokens = 0;
    uint64_t cached_tokens = 0;
    std::vector<int32_t> prompt_ids;  // with return_token_ids: sent once (vLLM's prompt_token_ids)
    bool prompt_ids_sent = false;     // completions streaming: the choice's first chunk went out
    bool role_sent = false;
    bool done = false;
    oa::ChoiceResult result;
    std::vector<int32_t> ids;
    std::vector<TokenLogprobs> logprobs;
    size_t text_offset = 0;  // completions log-probs: characters of the tokens so far
    std::unique_ptr<oa::ChatStreamParser> parser;
    int tool_index = 0;
  };

  void CancelAll() {
    std::vector<std::shared_ptr<ChoiceRun>> runs;
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
      runs.swap(runs_);
    }
    for (auto& r : runs) r->Cancel();
  }

  void Fail(const Status& status) {
    std::vector<std::shared_ptr<ChoiceRun>> runs;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (done_) return;
      done_ = true;
      runs.swap(runs_);
      SendErrorLocked(status);
    }
    for (auto& r : runs) r->Cancel();
  }

  void SendErrorLocked(const Status& status) {
    oa::ApiError e = oa::ToApiError(status);
    if (!stream_started_) {
      HttpHeaders headers;
      if (e.retry_after_s > 0) headers.emplace_back("Retry-After", std::to_string(e.retry_after_s));
      RespondJson(*exchange_, e.http_status, oa::ErrorJson(e), std::move(headers));
      return;
    }
    json err = oa::ErrorJson(e);
    err["error"]["code"] = e.http_status;  // vLLM puts the HTTP status in code for stream errors
    exchange_->SendEvent(oa::SseData(oa::Dump(err)));
    exchange_->SendEvent(oa::kSseDone);
    exchange_->EndEvents();
  }

  // `prompt_ids`: vLLM sends prompt_token_ids with the first chunk (chat: on the chunk, completions: on
  // the choice).
  void SendChunkLocked(json choice, const std::vector<int32_t>* prompt_ids = nullptr) {
    const char* object = config_.chat ? "chat.completion.chunk" : "text_completion";
    if (prompt_ids != nullptr && !config_.chat) choice["prompt_token_ids"] = *prompt_ids;
    json chunk = oa::ChunkJson(object, id_, created_, config_.model, json::array({std::move(choice)}));
    if (prompt_ids != nullptr && config_.chat) chunk["prompt_token_ids"] = *prompt_ids;
    if (config_.include_usage) chunk["usage"] = nullptr;  // OpenAI: null on every chunk but the last
    stream_started_ = true;
    exchange_->SendEvent(oa::SseData(oa::Dump(chunk)));
  }

  // Applies the chat parser's delta to a choice (accumulating, or streaming it). Returns whether `ids` and
  // `logprobs` (null = none) went out with a chunk.
  bool ChatDeltaLocked(size_t index, Choice& c, oa::ChatDelta d, const std::vector<int32_t>* ids, json logprobs,
                       bool final) {
    if (!config_.stream) {
      c.result.reasoning_content += d.reasoning;
      c.result.text += d.content;
      for (auto& tc : d.tool_calls) {
        size_t ti = tc.value("index", size_t{0});
        while (ti >= c.result.tool_calls.size()) {
          c.result.tool_calls.push_back(
              json{{"id", ""}, {"type", "function"}, {"function", {{"name", ""}, {"arguments", ""}}}});
        }
        json& call = c.result.tool_calls[ti];
        if (tc.contains("id") && tc["id"].is_string()) call["id"] = tc["id"];
        if (tc.contains("function") && tc["function"].is_object()) {
          const json& f = tc["function"];
          json& fn = call["function"];
          if (f.contains("name") && f["name"].is_string()) fn["name"] = f["name"];
          if (f.contains("arguments") && f["arguments"].is_string()) {
            fn["arguments"] = fn["arguments"].get<std::string>() + f["arguments"].get<std::string>();
          }
        }
      }
      return false;
    }
    bool pending_ids = (ids != nullptr && !ids->empty()) || !logprobs.is_null();
    if (!c.role_sent) {
      c.role_sent = true;
      SendChunkLocked(oa::ChatChunkChoice(index, json{{"role", "assistant"}, {"content", ""}}, "", nullptr),
                      config_.return_token_ids ? &c.prompt_ids : nullptr);
    }
    // One chunk per kind of delta keeps each chunk in the shape clients expect.
    auto send = [&](json delta) {
      SendChunkLocked(oa::ChatChunkChoice(index, std::move(delta), "", pending_ids ? ids : nullptr, "",
                                          pending_ids ? std::move(logprobs) : json(nullptr)));
      pending_ids = false;
    };
    if (!d.reasoning.empty()) send(json{{"reasoning_content", d.reasoning}});
    if (!d.content.empty()) send(json{{"content", d.content}});
    if (!d.tool_calls.empty()) send(json{{"tool_calls", d.tool_calls}});
    if (pending_ids && !final) send(json::object());  // ids whose text is still held back
    return !pending_ids;
  }

  void OnEvent(size_t index, ChoiceEvent ev) {
    std::vector<std::shared_ptr<ChoiceRun>> to_cancel;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (done_) return;
      Choice& c = choices_[index];
      if (ev.final && !ev.status.ok()) {
        done_ = true;
        to_cancel.swap(runs_);
        if (ev.status.code() != absl::StatusCode::kCancelled) SendErrorLocked(ev.status);
      } else {
        OnDataLocked(index, c, ev);
        if (ev.final) {
          c.done = true;
          if (--remaining_ == 0) {
            FinishLocked();
            to_cancel.swap(runs_);  // all finished: Cancel is a no-op, this only drops the references
          }
        }
      }
    }
    for (auto& r : to_cancel) r->Cancel();
  }

  void OnDataLocked(size_t index, Choice& c, const ChoiceEvent& ev) {
    c.completion_tokens += ev.token_ids.size();
    if (ev.final) c.cached_tokens = ev.cached_tokens;
    const std::vector<int32_t>* ids = config_.return_token_ids ? &ev.token_ids : nullptr;
    std::string finish = ev.final ? ev.finish_reason : "";
    if (!config_.stream && config_.return_token_ids) c.ids.insert(c.ids.end(), ev.token_ids.begin(), ev.token_ids.end());
    if (!config_.stream && config_.logprobs) c.logprobs.insert(c.logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
    const bool chunk_logprobs = config_.stream && config_.logprobs && !ev.logprobs.empty();
    if (config_.chat) {
      oa::ChatDelta d = c.parser->Add(ev.text);
      if (ev.final) {
        d.Append(c.parser->Finish());
        if (c.parser->tool_calls() > 0 && finish == "stop") finish = "tool_calls";
      }
      json lp = chunk_logprobs ? oa::ChatLogprobsJson(ev.logprobs) : json(nullptr);
      const bool had_lp = !lp.is_null();
      bool ids_sent = ChatDeltaLocked(index, c, std::move(d), ids, lp, ev.final);
      if (ev.final) {
        c.result.finish_reason = finish;
        c.result.stop_reason = ev.stop_string;
        if (config_.stream) {
          const bool unsent = !ids_sent && ((ids != nullptr && !ids->empty()) || had_lp);
          SendChunkLocked(oa::ChatChunkChoice(index, json::object(), finish, unsent && ids != nullptr ? ids : nullptr,
                                              ev.stop_string,
                                              unsent && had_lp ? oa::ChatLogprobsJson(ev.logprobs) : json(nullptr)));
        }
      }
      return;
    }
    if (!config_.stream) {
      c.result.text += ev.text;
      if (ev.final) {
        c.result.finish_reason = finish;
        c.result.stop_reason = ev.stop_string;
      }
      return;
    }
    if (!ev.text.empty() || (ids != nullptr && !ids->empty()) || chunk_logprobs || ev.final) {
      const bool first = config_.return_token_ids && !c.prompt_ids_sent;
      c.prompt_ids_sent = true;
      SendChunkLocked(oa::CompletionChunkChoice(
                          index, ev.text, finish, ids, ev.stop_string,
                          chunk_logprobs ? oa::CompletionLogprobsJson(ev.logprobs, &c.text_offset) : json(nullptr)),
                      first ? &c.prompt_ids : nullptr);
    }
  }

  void FinishLocked() {
    done_ = true;
    uint64_t prompt = 0, completion = 0, cached = 0;
    for (const Choice& c : choices_) {
      prompt += c.prompt_tokens;
      completion += c.completion_tokens;
      if (c.prompt_tokens > 0) cached += c.cached_tokens;  // the prompt's first choice carries its usage
    }
    if (config_.stream) {
      if (config_.include_usage) {
        const char* object = config_.chat ? "chat.completion.chunk" : "text_completion";
        json chunk = oa::ChunkJson(object, id_, created_, config_.model, json::array(), oa::UsageJson(prompt, completion, cached));
        exchange_->SendEvent(oa::SseData(oa::Dump(chunk)));
      }
      exchange_->SendEvent(oa::kSseDone);
      exchange_->EndEvents();
      return;
    }
    json choices = json::array();
    for (size_t i = 0; i < choices_.size(); ++i) {
      Choice& c = choices_[i];
      if (config_.return_token_ids) c.result.token_ids = c.ids;
      if (config_.logprobs) c.result.logprobs = c.logprobs;
      choices.push_back(config_.chat ? oa::ChatChoiceJson(i, c.result, config_.thinking)
                                     : oa::CompletionChoiceJson(i, c.result));
      if (config_.return_token_ids && !config_.chat) choices.back()["prompt_token_ids"] = c.prompt_ids;
    }
    json body = oa::ResponseJson(config_.chat ? "chat.completion" : "text_completion", id_, created_, config_.model,
                                 std::move(choices), prompt, completion, cached);
    // vLLM: a chat response's prompt_token_ids are the encoded prompt (chat template applied), once.
    if (config_.return_token_ids && config_.chat) body["prompt_token_ids"] = choices_[0].prompt_ids;
    RespondJson(*exchange_, 200, body);
  }

  const Config config_;
  std::shared_ptr<HttpExchange> exchange_;
  const std::string id_;
  const int64_t created_;

  std::mutex mu_;
  std::vector<Choice> choices_;
  std::vector<std::shared_ptr<ChoiceRun>> runs_;
  size_t remaining_;
  bool done_ = false;            // the response is complete (or the client left): ignore further events
  bool stream_started_ = false;  // SSE headers went out: errors become error events
};

// Fields shared by completions and chat: checks and the per-choice spec.
StatusOr<ChoiceSpec> MakeSpec(const Frontend& fe, const oa::CommonParams& p, std::vector<int32_t> prompt_ids,
                              const std::string& prompt_param, const std::string& request_id) {
  ChoiceSpec spec;
  ASSIGN_OR_RETURN(spec.max_tokens, fe.ResolveMaxTokens(prompt_ids.size(), p.max_tokens, prompt_param));
  spec.prompt_ids = std::move(prompt_ids);
  spec.n = p.n;
  spec.logprobs = p.logprobs;
  spec.sampling = p.sampling;
  spec.ignore_eos = p.ignore_eos;
  if (!p.stop_token_ids.empty()) {
    ASSIGN_OR_RETURN(spec.stop_token_ids, fe.CheckTokenIds(p.stop_token_ids, "stop_token_ids"));
  }
  spec.text.stop = p.stop;
  spec.text.include_stop_in_output = p.include_stop_str_in_output;
  spec.text.skip_special_tokens = p.skip_special_tokens;
  spec.request_id = request_id;
  return spec;
}

}  // namespace

void RespondError(HttpExchange& exchange, const Status& status) {
  oa::ApiError e = oa::ToApiError(status);
  HttpHeaders headers;
  if (e.retry_after_s > 0) headers.emplace_back("Retry-After", std::to_string(e.retry_after_s));
  if (e.http_status == 401) headers.emplace_back("WWW-Authenticate", "Bearer");
  RespondJson(exchange, e.http_status, oa::ErrorJson(e), std::move(headers));
}

RestGateway::RestGateway(Frontend& frontend, const openai::ChatEncoder& chat, Balancer& balancer, Metrics& metrics,
                         RestGatewayOptions options)
    : frontend_(frontend), chat_(chat), balancer_(balancer), metrics_(metrics), options_(std::move(options)) {}

namespace {

struct Route {
  const char* path;
  const char* method;
};
constexpr Route kRoutes[] = {{"/v1/completions", "POST"},
                             {"/v1/chat/completions", "POST"},
                             {"/v1/messages", "POST"},
                             {"/v1/messages/count_tokens", "POST"},
                             {"/tokenize", "POST"},
                             {"/detokenize", "POST"},
                             {"/v1/models", "GET"},
                             {"/health", "GET"},
                             {"/metrics", "GET"}};

// The Anthropic surface answers errors in Anthropic's shape.
bool IsAnthropicPath(const std::string& path) {
  return path == "/v1/messages" || absl::StartsWith(path, "/v1/messages/");
}

}  // namespace

std::string RestGateway::EndpointLabel(const std::string& path) {
  for (const Route& r : kRoutes) {
    if (path == r.path) return r.path;
  }
  return "other";
}

void RestGateway::Handle(const HttpRequest& request, std::shared_ptr<HttpExchange> raw_exchange) {
  const std::string path = request.path();
  auto exchange = std::make_shared<MeteredExchange>(std::move(raw_exchange), metrics_, EndpointLabel(path));
  const bool anthropic = IsAnthropicPath(path);
  auto fail = [&](const Status& s) {
    if (anthropic) {
      RespondAnthropicError(*exchange, s);
    } else {
      RespondError(*exchange, s);
    }
  };
  if (!options_.api_keys.empty() && path != "/health") {
    // "Authorization: Bearer <key>" (OpenAI clients) or "x-api-key: <key>" (Anthropic clients), anywhere.
    Status auth = options_.api_keys.Check(request.header("authorization"), request.header("x-api-key"),
                                          "send the header 'Authorization: Bearer <key>' or 'x-api-key: <key>'");
    if (!auth.ok()) return fail(auth);
  }
  for (const Route& r : kRoutes) {
    if (path != r.path) continue;
    if (request.method != r.method && !(request.method == "HEAD" && std::string(r.method) == "GET")) {
      const std::string msg = absl::StrCat(request.method, " is not allowed on ", path, "; use ", r.method);
      const std::string body = anthropic ? an::Dump(an::ErrorJson({405, "invalid_request_error", msg, 0}))
                                         : oa::Dump(oa::ErrorJson({405, "invalid_request_error", "method_not_allowed",
                                                                   "", msg}));
      exchange->Respond(405, "application/json", body, {{"Allow", r.method}});
      return;
    }
    if (path == "/v1/completions") return Completions(request, exchange);
    if (path == "/v1/chat/completions") return ChatCompletions(request, exchange);
    if (path == "/v1/messages") return Messages(request, exchange, /*count_only=*/false);
    if (path == "/v1/messages/count_tokens") return Messages(request, exchange, /*count_only=*/true);
    if (path == "/tokenize") return Tokenize(request, exchange);
    if (path == "/detokenize") return Detokenize(request, exchange);
    if (path == "/v1/models") return Models(exchange);
    if (path == "/health") return Health(exchange);
    return MetricsText(exchange);
  }
  fail(absl::NotFoundError(absl::StrCat("no such endpoint: ", request.method, " ", path,
                                        " (endpoints: /v1/completions, /v1/chat/completions, /v1/messages, "
                                        "/v1/messages/count_tokens, /tokenize, /detokenize, /v1/models, /health, "
                                        "/metrics)")));
}

void RestGateway::Completions(const HttpRequest& request, const std::shared_ptr<HttpExchange>& exchange) {
  auto fail = [&](const Status& s) { RespondError(*exchange, s); };
  auto body = oa::ParseJsonBody(request.body);
  if (!body.ok()) return fail(body.status());
  auto req = oa::ParseCompletionRequest(*body);
  if (!req.ok()) return fail(req.status());
  const std::string model = req->common.model.empty() ? frontend_.model().id : req->common.model;
  if (Status s = frontend_.CheckModel(model); !s.ok()) return fail(s);

  std::vector<ChoiceSpec> specs;
  const std::string rid = oa::NewId("cmpl");
  for (size_t i = 0; i < req->prompts.size(); ++i) {
    const std::string param = req->prompts.size() == 1 ? "prompt" : absl::StrCat("prompt[", i, "]");
    StatusOr<std::vector<int32_t>> ids;
    if (const auto* text = std::get_if<std::string>(&req->prompts[i])) {
      ids = frontend_.TokenizeText(*text, req->add_special_tokens, param);
    } else {
      ids = frontend_.CheckTokenIds(std::get<std::vector<int64_t>>(req->prompts[i]), param);
    }
    if (!ids.ok()) return fail(ids.status());
    auto spec = MakeSpec(frontend_, req->common, std::move(*ids), param, absl::StrCat(rid, "-", i));
    if (!spec.ok()) return fail(spec.status());
    specs.push_back(std::move(*spec));
  }
  CompletionJob::Config config;
  config.stream = req->common.stream;
  config.include_usage = req->common.include_usage;
  config.return_token_ids = req->common.return_token_ids;
  config.logprobs = req->common.logprobs >= 0;
  config.n = static_cast<size_t>(req->common.n);
  config.model = model;
  config.id = rid;
  auto job = std::make_shared<CompletionJob>(config, exchange, specs.size() * config.n);
  job->Start(frontend_, std::move(specs));
}

void RestGateway::ChatCompletions(const HttpRequest& request, const std::shared_ptr<HttpExchange>& exchange) {
  auto fail = [&](const Status& s) { RespondError(*exchange, s); };
  auto body = oa::ParseJsonBody(request.body);
  if (!body.ok()) return fail(body.status());
  auto req = oa::ParseChatRequest(*body);
  if (!req.ok()) return fail(req.status());
  const std::string model = req->common.model.empty() ? frontend_.model().id : req->common.model;
  if (Status s = frontend_.CheckModel(model); !s.ok()) return fail(s);
  auto prompt = chat_.Encode(*req);
  if (!prompt.ok()) return fail(prompt.status());
  std::vector<ChoiceSpec> specs;
  oa::CommonParams common = req->common;
  common.skip_special_tokens = false;  // the output parser needs </think> and the DSML markers
  common.sampling.grammar = prompt->grammar;
  const std::string rid = oa::NewId("chatcmpl");
  auto spec = MakeSpec(frontend_, common, std::move(prompt->ids), "messages", rid);
  if (!spec.ok()) return fail(spec.status());
  specs.push_back(std::move(*spec));
  CompletionJob::Config config;
  config.chat = true;
  config.stream = req->common.stream;
  config.include_usage = req->common.include_usage;
  config.return_token_ids = req->common.return_token_ids;
  config.logprobs = req->common.logprobs >= 0;
  config.n = static_cast<size_t>(req->common.n);
  config.thinking = prompt->starts_in_reasoning;
  config.tools = prompt->tools;
  config.model = model;
  config.id = rid;
  auto job = std::make_shared<CompletionJob>(config, exchange, config.n);
  job->Start(frontend_, std::move(specs));
}

void RestGateway::Messages(const HttpRequest& request, const std::shared_ptr<HttpExchange>& exchange,
                           bool count_only) {
  auto fail = [&](const Status& s) { RespondAnthropicError(*exchange, s); };
  auto body = oa::ParseJsonBody(request.body);
  if (!body.ok()) return fail(body.status());
  auto req = an::ParseMessagesRequest(*body, count_only);
  if (!req.ok()) return fail(req.status());
  const oa::CommonParams& common = req->chat.common;
  const std::string model = common.model.empty() ? frontend_.model().id : common.model;
  if (Status s = frontend_.CheckModel(model); !s.ok()) return fail(s);
  auto prompt = chat_.Encode(req->chat);
  if (!prompt.ok()) return fail(prompt.status());
  if (count_only) {
    exchange->Respond(200, "application/json", an::Dump(an::Json{{"input_tokens", prompt->ids.size()}}));
    return;
  }
  oa::CommonParams params = common;
  params.skip_special_tokens = false;  // the output parser needs </think> and the DSML markers
  params.sampling.grammar = prompt->grammar;
  MessagesJob::Config config;
  config.id = an::NewMessageId();
  auto spec = MakeSpec(frontend_, params, std::move(prompt->ids), "messages", config.id);
  if (!spec.ok()) return fail(spec.status());
  config.stream = common.stream;
  config.thinking = prompt->starts_in_reasoning;
  config.tools = prompt->tools;
  config.disable_parallel_tool_use = req->disable_parallel_tool_use;
  config.model = model;
  auto job = std::make_shared<MessagesJob>(std::move(config), exchange);
  job->Start(frontend_, std::move(*spec));
}

void RestGateway::Tokenize(const HttpRequest& request, const std::shared_ptr<HttpExchange>& exchange) {
  auto fail = [&](const Status& s) { RespondError(*exchange, s); };
  auto body = oa::ParseJsonBody(request.body);
  if (!body.ok()) return fail(body.status());
  std::string model;
  bool return_strs = false;
  for (Status s : {oa::ReadString(*body, "model", &model), oa::ReadBool(*body, "return_token_strs", &return_strs)}) {
    if (!s.ok()) return fail(s);
  }
  if (Status s = frontend_.CheckModel(model.empty() ? frontend_.model().id : model); !s.ok()) return fail(s);
  const oa::Json* messages = oa::Field(*body, "messages");
  const oa::Json* prompt = oa::Field(*body, "prompt");
  StatusOr<std::vector<int32_t>> ids;
  if (messages != nullptr && prompt != nullptr) {
    return fail(InvalidParam("prompt", "give either 'prompt' or 'messages', not both"));
  } else if (messages != nullptr) {
    // Exactly what a chat completion with the same fields would send to a worker.
    auto req = oa::ParseChatRequest(*body);
    if (!req.ok()) return fail(req.status());
    auto encoded = chat_.Encode(*req);
    if (!encoded.ok()) return fail(encoded.status());
    ids = std::move(encoded->ids);
  } else if (prompt != nullptr) {
    // Exactly what a completion with this prompt would send (BOS first unless add_special_tokens is false).
    if (!prompt->is_string()) return fail(oa::TypeError("prompt", "a string", *prompt));
    bool add_special = true;
    if (Status s = oa::ReadBool(*body, "add_special_tokens", &add_special); !s.ok()) return fail(s);
    ids = frontend_.TokenizeText(prompt->get<std::string>(), add_special, "prompt");
  } else {
    return fail(InvalidParam("prompt", "'prompt' (a string) or 'messages' (a chat) is required"));
  }
  if (!ids.ok()) return fail(ids.status());
  json out = {{"count", ids->size()}, {"max_model_len", frontend_.model().max_context}, {"tokens", *ids},
              {"token_strs", nullptr}};
  if (return_strs) {
    json strs = json::array();
    for (int32_t id : *ids) strs.push_back(frontend_.tokenizer().IdToToken(id).value_or(""));
    out["token_strs"] = std::move(strs);
  }
  RespondJson(*exchange, 200, out);
}

void RestGateway::Detokenize(const HttpRequest& request, const std::shared_ptr<HttpExchange>& exchange) {
  auto fail = [&](const Status& s) { RespondError(*exchange, s); };
  auto body = oa::ParseJsonBody(request.body);
  if (!body.ok()) return fail(body.status());
  std::string model;
  if (Status s = oa::ReadString(*body, "model", &model); !s.ok()) return fail(s);
  if (Status s = frontend_.CheckModel(model.empty() ? frontend_.model().id : model); !s.ok()) return fail(s);
  const oa::Json* tokens = oa::Field(*body, "tokens");
  if (tokens == nullptr) return fail(InvalidParam("tokens", "'tokens' (an array of token ids) is required"));
  if (!tokens->is_array()) return fail(oa::TypeError("tokens", "an array of token ids", *tokens));
  std::vector<int64_t> raw;
  for (size_t i = 0; i < tokens->size(); ++i) {
    auto id = oa::AsInt((*tokens)[i], absl::StrCat("tokens[", i, "]"));
    if (!id.ok()) return fail(id.status());
    raw.push_back(*id);
  }
  std::vector<int32_t> ids;
  if (!raw.empty()) {
    auto checked = frontend_.CheckTokenIds(raw, "tokens");
    if (!checked.ok()) return fail(checked.status());
    ids = std::move(*checked);
  }
  // Special tokens are kept, as vLLM's /detokenize does.
  RespondJson(*exchange, 200, json{{"prompt", frontend_.tokenizer().Decode(ids)}});
}

void RestGateway::Models(const std::shared_ptr<HttpExchange>& exchange) {
  const ModelInfo& m = frontend_.model();
  json model = {{"id", m.id},
                {"object", "model"},
                {"created", m.created},
                {"owned_by", "numoe"},
                {"root", m.id},
                {"parent", nullptr},
                {"max_model_len", m.max_context},
                {"vocab_size", m.vocab_size}};
  RespondJson(*exchange, 200, json{{"object", "list"}, {"data", json::array({model})}});
}

void RestGateway::Health(const std::shared_ptr<HttpExchange>& exchange) {
  auto workers = balancer_.Snapshot();
  int up = 0;
  json list = json::array();
  for (const auto& w : workers) {
    up += w.up ? 1 : 0;
    list.push_back({{"address", w.address}, {"up", w.up}, {"in_flight", w.in_flight}});
  }
  json body = {{"status", up > 0 ? "ok" : "unavailable"},
               {"workers_up", up},
               {"workers", static_cast<int>(workers.size())},
               {"queued", balancer_.queued()},
               {"worker_list", std::move(list)}};
  RespondJson(*exchange, up > 0 ? 200 : 503, body);
}

void RestGateway::MetricsText(const std::shared_ptr<HttpExchange>& exchange) {
  std::vector<WorkerGauge> gauges;
  for (const auto& w : balancer_.Snapshot()) {
    gauges.push_back(WorkerGaugeFromStats(w.address, w.up, w.stats));
  }
  exchange->Respond(200, "text/plain; version=0.0.4; charset=utf-8", metrics_.Render(gauges));
}

}  // namespace numoe::router
