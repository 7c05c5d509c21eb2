#include "worker/engine/stream.h"

namespace numoe::engine {

class RequestStream::Sink final : public TokenSink {
 public:
  void OnTokens(std::span<const int32_t> tokens, std::string_view reason) override {
    Push(Event{.tokens = std::vector<int32_t>(tokens.begin(), tokens.end()),
               .final = !reason.empty(),
               .finish_reason = std::string(reason)});
  }
  void OnError(const Status& status) override { Push(Event{.final = true, .status = status}); }

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
      }
      events_.push_back(std::move(e));
    }
    cv_.notify_all();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Event> events_;
  bool final_seen_ = false;
  Event final_;
};

StatusOr<std::unique_ptr<RequestStream>> RequestStream::Open(Engine* engine, EngineRequest request) {
  auto s = std::unique_ptr<RequestStream>(new RequestStream());
  s->engine_ = engine;
  s->sink_ = std::make_shared<Sink>();
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

StatusOr<RequestStream::Result> RequestStream::Wait() {
  Result r;
  for (;;) {
    Event e = Next();
    r.tokens.insert(r.tokens.end(), e.tokens.begin(), e.tokens.end());
    if (!e.final) continue;
    if (!e.status.ok()) return e.status;
    r.finish_reason = e.finish_reason;
    return r;
  }
}

}  // namespace numoe::engine
