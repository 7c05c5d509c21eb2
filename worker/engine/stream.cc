#include "worker/engine/stream.h"

namespace numoe::engine {

class RequestStream::Sink final : public TokenSink {
 public:
  explicit Sink(int32_t n) : open_choices_(n) {}
  void OnTokens(int32_t choice, std::span<const int32_t> tokens, std::span<const EmittedLogprobs> logprobs,
                std::string_view reason) override {
    Event e{.choice = choice,
            .tokens = std::vector<int32_t>(tokens.begin(), tokens.end()),
            .logprobs = std::vector<EmittedLogprobs>(logprobs.begin(), logprobs.end()),
            .choice_final = !reason.empty(),
            .finish_reason = std::string(reason)};
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (e.choice_final) e.final = --open_choices_ == 0;
    }
    Push(std::move(e));
  }
  void OnError(const Status& status) override { Push(Event{.final = true, .choice_final = true, .status = status}); }

  bool Pop(Event* e, bool block) {
    std::unique_lock<std::mutex> lk(mu_);
    if (block) cv_.wait(lk, [&] { return !events_.empty() || final_seen_; });
    if (events_.empty()) {
      if (!final_seen_) return false;
      *e = final_;
      return true;
    }
    *e = std::move(events_.front());
    events_.pop_front();
    return true;
  }
  bool ended() {
    std::lock_guard<std::mutex> lk(mu_);
    return final_seen_;
  }

 private:
  void Push(Event e) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (final_seen_) return;
      if (e.final) {
        final_seen_ = true;
        final_ = e;
        final_.tokens.clear();  // repeated finals carry no tokens
        final_.logprobs.clear();
      }
      events_.push_back(std::move(e));
    }
    cv_.notify_all();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Event> events_;
  int32_t open_choices_;
  bool final_seen_ = false;
  Event final_;
};

StatusOr<std::unique_ptr<RequestStream>> RequestStream::Open(Engine* engine, EngineRequest request) {
  auto s = std::unique_ptr<RequestStream>(new RequestStream());
  s->engine_ = engine;
  s->sink_ = std::make_shared<Sink>(request.n);
  ASSIGN_OR_RETURN(s->id_, engine->Submit(std::move(request), s->sink_));
  return s;
}

RequestStream::~RequestStream() {
  if (engine_ != nullptr && !sink_->ended()) engine_->Cancel(id_);
}

RequestStream::Event RequestStream::Next() {
  Event e;
  sink_->Pop(&e, /*block=*/true);
  return e;
}

bool RequestStream::TryNext(Event* event) { return sink_->Pop(event, /*block=*/false); }

StatusOr<std::vector<RequestStream::Result>> RequestStream::WaitAll() {
  std::vector<Result> out;
  for (;;) {
    Event e = Next();
    if (e.final && !e.status.ok()) return e.status;
    if (static_cast<size_t>(e.choice) >= out.size()) out.resize(static_cast<size_t>(e.choice) + 1);
    Result& r = out[static_cast<size_t>(e.choice)];
    r.tokens.insert(r.tokens.end(), e.tokens.begin(), e.tokens.end());
    r.logprobs.insert(r.logprobs.end(), e.logprobs.begin(), e.logprobs.end());
    if (e.choice_final) r.finish_reason = e.finish_reason;
    if (e.final) return out;
  }
}

StatusOr<RequestStream::Result> RequestStream::Wait() {
  ASSIGN_OR_RETURN(std::vector<Result> all, WaitAll());
  if (all.empty()) return Result{};
  return std::move(all.front());
}

}  // namespace numoe::engine
