#include "router/openai/response.h"

#include <random>

#include "absl/strings/str_cat.h"
#include "common/tokenizer/utf8.h"
#include "router/core/errors.h"

namespace numoe::router::openai {

using nlohmann::json;

ApiError ToApiError(const Status& status) {
  ApiError e;
  e.message = std::string(status.message());
  e.param = ParamOf(status);
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
      e.http_status = 400;
      e.type = "invalid_request_error";
      break;
    case absl::StatusCode::kUnauthenticated:
      e.http_status = 401;
      e.type = "authentication_error";
      e.code = "invalid_api_key";
      break;
    case absl::StatusCode::kNotFound:
      e.http_status = 404;
      e.type = "invalid_request_error";
      e.code = e.param == "model" ? "model_not_found" : "not_found";
      break;
    case absl::StatusCode::kOutOfRange:
      e.http_status = 413;
      e.type = "invalid_request_error";
      e.code = "request_too_large";
      break;
    case absl::StatusCode::kResourceExhausted:
      e.http_status = 429;
      e.type = "server_overloaded";
      e.code = "queue_full";
      e.retry_after_s = 1;
      break;
    case absl::StatusCode::kUnavailable:
      e.http_status = 503;
      e.type = "service_unavailable";
      e.code = "no_worker";
      e.retry_after_s = 1;
      break;
    case absl::StatusCode::kDeadlineExceeded:
      e.http_status = 504;
      e.type = "timeout";
      e.code = "request_timeout";
      break;
    default:
      e.http_status = 500;
      e.type = "internal_error";
      break;
  }
  if (e.message.empty()) e.message = absl::StatusCodeToString(status.code());
  return e;
}

json ErrorJson(const ApiError& e) {
  json err = {{"message", e.message},
              {"type", e.type},
              {"param", e.param.empty() ? json(nullptr) : json(e.param)},
              {"code", e.code.empty() ? json(nullptr) : json(e.code)}};
  return json{{"error", std::move(err)}};
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string SseData(const std::string& payload) { return absl::StrCat("data: ", payload, "\n\n"); }

std::string NewId(const std::string& prefix) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id = prefix + "-";
  for (int i = 0; i < 24; ++i) id += kHex[rng() & 15];
  return id;
}

json UsageJson(uint64_t prompt_tokens, uint64_t completion_tokens, uint64_t cached_tokens) {
  return json{{"prompt_tokens", prompt_tokens},
              {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}},
              {"completion_tokens", completion_tokens},
              {"total_tokens", prompt_tokens + completion_tokens}};
}

namespace {
json NullIfEmpty(const std::string& s) { return s.empty() ? json(nullptr) : json(s); }

json Bytes(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

// A token as text: its bytes when they are valid UTF-8, else "bytes:\xNN..." (as OpenAI shows a token that is
// part of a character), so every token has its own distinct text (completions' top_logprobs are keyed by it).
std::string TokenText(const std::string& raw) {
  if (tokenizer::FindInvalidUtf8(raw) == std::string::npos) return raw;
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "bytes:";
  for (unsigned char c : raw) {
    out += "\\x";
    out += kHex[c >> 4];
    out += kHex[c & 15];
  }
  return out;
}

// Characters in a token's bytes: the bytes that start a UTF-8 sequence (a character split over two tokens
// counts in the token holding its first byte).
size_t CharCount(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80 ? 1 : 0;
  return n;
}
}  // namespace

json ChatLogprobsJson(const std::vector<TokenLogprobs>& logprobs) {
  json content = json::array();
  for (const TokenLogprobs& lp : logprobs) {
    json top = json::array();
    for (const LogprobEntry& t : lp.top) {
      top.push_back({{"token", TokenText(t.token)}, {"logprob", t.logprob}, {"bytes", Bytes(t.token)}});
    }
    content.push_back({{"token", TokenText(lp.chosen.token)},
                       {"logprob", lp.chosen.logprob},
                       {"bytes", Bytes(lp.chosen.token)},
                       {"top_logprobs", std::move(top)}});
  }
  return json{{"content", std::move(content)}, {"refusal", nullptr}};
}

json CompletionLogprobsJson(const std::vector<TokenLogprobs>& logprobs, size_t* text_offset) {
  json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(), offsets = json::array();
  for (const TokenLogprobs& lp : logprobs) {
    tokens.push_back(TokenText(lp.chosen.token));
    token_logprobs.push_back(lp.chosen.logprob);
    json top = json::object();
    for (const LogprobEntry& t : lp.top) top[TokenText(t.token)] = t.logprob;
    top_logprobs.push_back(std::move(top));
    offsets.push_back(*text_offset);
    *text_offset += CharCount(lp.chosen.token);
  }
  return json{{"tokens", std::move(tokens)},
              {"token_logprobs", std::move(token_logprobs)},
              {"top_logprobs", std::move(top_logprobs)},
              {"text_offset", std::move(offsets)}};
}

json CompletionChoiceJson(size_t index, const ChoiceResult& c) {
  size_t offset = 0;
  json j = {{"index", index},
            {"text", c.text},
            {"logprobs", c.logprobs ? CompletionLogprobsJson(*c.logprobs, &offset) : json(nullptr)},
            {"finish_reason", NullIfEmpty(c.finish_reason)},
            {"stop_reason", NullIfEmpty(c.stop_reason)}};
  if (c.token_ids) j["token_ids"] = *c.token_ids;
  return j;
}

json ChatChoiceJson(size_t index, const ChoiceResult& c, bool thinking) {
  json message = {{"role", "assistant"}};
  // OpenAI sends content null when the turn is only tool calls.
  message["content"] = (c.text.empty() && !c.tool_calls.empty()) ? json(nullptr) : json(c.text);
  if (thinking || !c.reasoning_content.empty()) message["reasoning_content"] = c.reasoning_content;
  if (!c.tool_calls.empty()) message["tool_calls"] = c.tool_calls;
  json j = {{"index", index},
            {"message", std::move(message)},
            {"logprobs", c.logprobs ? ChatLogprobsJson(*c.logprobs) : json(nullptr)},
            {"finish_reason", NullIfEmpty(c.finish_reason)},
            {"stop_reason", NullIfEmpty(c.stop_reason)}};
  if (c.token_ids) j["token_ids"] = *c.token_ids;
  return j;
}

json ResponseJson(const std::string& object, const std::string& id, int64_t created, const std::string& model,
                  json choices, uint64_t prompt_tokens, uint64_t completion_tokens, uint64_t cached_tokens) {
  return json{{"id", id},
              {"object", object},
              {"created", created},
              {"model", model},
              {"choices", std::move(choices)},
              {"usage", UsageJson(prompt_tokens, completion_tokens, cached_tokens)}};
}

json ChunkJson(const std::string& object, const std::string& id, int64_t created, const std::string& model,
               json choices, std::optional<json> usage) {
  json j = {{"id", id}, {"object", object}, {"created", created}, {"model", model}, {"choices", std::move(choices)}};
  if (usage) j["usage"] = std::move(*usage);
  return j;
}

json CompletionChunkChoice(size_t index, const std::string& text, const std::string& finish_reason,
                           const std::vector<int32_t>* token_ids, const std::string& stop_reason, json logprobs) {
  json j = {{"index", index},
            {"text", text},
            {"logprobs", std::move(logprobs)},
            {"finish_reason", NullIfEmpty(finish_reason)}};
  if (!finish_reason.empty()) j["stop_reason"] = NullIfEmpty(stop_reason);
  if (token_ids != nullptr) j["token_ids"] = *token_ids;
  return j;
}

json ChatChunkChoice(size_t index, json delta, const std::string& finish_reason, const std::vector<int32_t>* token_ids,
                     const std::string& stop_reason, json logprobs) {
  json j = {{"index", index},
            {"delta", std::move(delta)},
            {"logprobs", std::move(logprobs)},
            {"finish_reason", NullIfEmpty(finish_reason)}};
  if (!finish_reason.empty()) j["stop_reason"] = NullIfEmpty(stop_reason);
  if (token_ids != nullptr) j["token_ids"] = *token_ids;
  return j;
}

}  // namespace numoe::router::openai
