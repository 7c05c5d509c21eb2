// One HTTP request/response exchange as the REST gateway sees it, independent of Boost.Beast, so the
// gateway's logic is unit-tested without sockets (tests use a recording fake; http_server.cc has the real
// one).
#pragma once

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace numoe::router {

struct HttpRequest {
  std::string method;                         // "GET", "POST", ...
  std::string target;                         // path and query, e.g. "/v1/models?x=1"
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;

  std::string path() const { return target.substr(0, target.find('?')); }
  std::string header(const std::string& lower_name) const {
    auto it = headers.find(lower_name);
    return it == headers.end() ? std::string() : it->second;
  }
};

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

// Thread-safe: any method may be called from any thread. Exactly one of these happens: one Respond(), or
// a series of SendEvent() closed by EndEvents(). Calls after the exchange completed are ignored.
class HttpExchange {
 public:
  virtual ~HttpExchange() = default;
  // A whole response.
  virtual void Respond(int status, const std::string& content_type, std::string body, HttpHeaders headers = {}) = 0;
  // Server-sent events: the first call sends "200 OK, text/event-stream" headers; `event` is the full SSE
  // frame ("data: ...\n\n").
  virtual void SendEvent(std::string event) = 0;
  virtual void EndEvents() = 0;
  // `fn` runs once (on some thread) if the client disconnects before the exchange completed. Set it
  // before starting work that must be cancelled; if the client is already gone it runs at once. The
  // exchange drops `fn` when the response completes (it may own the request that owns the exchange).
  virtual void OnClientGone(std::function<void()> fn) = 0;
};

}  // namespace numoe::router
