#include "bench/serve_client.h"

#include <filesystem>
#include <fstream>
#include <iterator>

#include "nlohmann/json.hpp"

namespace numoe::bench {

namespace fs = std::filesystem;
using json = nlohmann::json;

StreamResult StreamCompletion(int port, const std::vector<int32_t>& prompt, int64_t max_tokens, double timeout_s) {
  StreamResult r;
  const json body = {{"prompt", prompt},         {"max_tokens", max_tokens},  {"ignore_eos", true},
                     {"temperature", 0.0},       {"stream", true},            {"return_token_ids", true},
                     {"stream_options", {{"include_usage", true}}}};
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  SseClient client;
  r.sent = Clock::now();
  r.status = client.Open(port, "/v1/completions", body.dump(), deadline);
  if (!r.status.ok()) return r;
  for (;;) {
    auto next = client.Next(deadline);
    if (!next.ok()) {
      r.status = next.status();
      return r;
    }
    const auto now = Clock::now();
    if (!next->has_value() || **next == "[DONE]") break;
    const json chunk = json::parse(**next, nullptr, /*allow_exceptions=*/false);
    if (chunk.is_discarded()) {
      r.status = absl::DataLossError("unparsable SSE event: " + (*next)->substr(0, 200));
      return r;
    }
    if (chunk.contains("error")) {
      r.status = absl::InternalError("error event: " + chunk["error"].dump());
      return r;
    }
    if (!chunk.contains("choices") || chunk["choices"].empty()) {  // the usage chunk
      if (chunk.contains("usage") && chunk["usage"].contains("prompt_tokens_details")) {
        r.cached_tokens = chunk["usage"]["prompt_tokens_details"].value("cached_tokens", int64_t{0});
      }
      continue;
    }
    const json& c = chunk["choices"][0];
    int n = 0;
    if (c.contains("token_ids") && c["token_ids"].is_array()) {
      n = static_cast<int>(c["token_ids"].size());
      for (const auto& id : c["token_ids"]) r.token_ids.push_back(id.get<int32_t>());
    }
    if (c.contains("finish_reason") && c["finish_reason"].is_string()) r.finish_reason = c["finish_reason"];
    if (n > 0) {
      r.events.push_back({now, n});
      r.tokens += n;
    }
  }
  return r;
}

// ---- numoe serve as a child ---------------------------------------------------------------------------------


StatusOr<int> FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError("socket() failed");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  if (!ok) return absl::InternalError("no free loopback port");
  return static_cast<int>(ntohs(a.sin_port));
}


std::string TailOf(const std::string& path, size_t bytes) {
  std::ifstream f(path, std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return s.size() > bytes ? "..." + s.substr(s.size() - bytes) : s;
}


std::string BinDir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}


std::string Fmt(double v, int digits) {
  char b[64];
  std::snprintf(b, sizeof(b), "%.*f", digits, v);
  return b;
}


}  // namespace numoe::bench
