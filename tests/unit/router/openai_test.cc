// OpenAI request parsing and validation (every field, prompt shapes, a small fuzz), response and SSE shapes,
// error mapping, stop strings on detokenized text, and the metrics text.
#include <algorithm>
#include <random>
#include <sstream>

#include <gtest/gtest.h>

#include "router/core/errors.h"
#include "router/core/output_text.h"
#include "router/metrics/metrics.h"
#include "router/openai/request.h"
#include "router/openai/response.h"
#include "tests/support/status_matchers.h"

namespace numoe::router {
namespace {

using nlohmann::json;
using openai::ParseChatRequest;
using openai::ParseCompletionRequest;
using openai::ParseJsonBody;

StatusOr<openai::CompletionRequest> Completion(const std::string& body) {
  auto j = ParseJsonBody(body);
  if (!j.ok()) return j.status();
  return ParseCompletionRequest(*j);
}

StatusOr<openai::ChatRequest> Chat(const std::string& body) {
  auto j = ParseJsonBody(body);
  if (!j.ok()) return j.status();
  return ParseChatRequest(*j);
}

// The status is InvalidArgument naming `param`, and the message mentions `needle`.
void ExpectBad(const Status& s, const std::string& param, const std::string& needle = "") {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(ParamOf(s), param) << s;
  if (!needle.empty()) {
    EXPECT_NE(s.message().find(needle), absl::string_view::npos) << s;
  }
}

TEST(Request, PromptShapes) {
  auto r = Completion(R"({"prompt": "hi"})");
  ASSERT_OK(r);
  ASSERT_EQ(r->prompts.size(), 1u);
  EXPECT_EQ(std::get<std::string>(r->prompts[0]), "hi");

  r = Completion(R"({"prompt": [1, 2, 3]})");
  ASSERT_OK(r);
  ASSERT_EQ(r->prompts.size(), 1u);
  EXPECT_EQ(std::get<std::vector<int64_t>>(r->prompts[0]), (std::vector<int64_t>{1, 2, 3}));

  r = Completion(R"({"prompt": ["a", "b", "c"]})");
  ASSERT_OK(r);
  ASSERT_EQ(r->prompts.size(), 3u);
  EXPECT_EQ(std::get<std::string>(r->prompts[2]), "c");

  r = Completion(R"({"prompt": [[1], [2, 3]]})");
  ASSERT_OK(r);
  ASSERT_EQ(r->prompts.size(), 2u);
  EXPECT_EQ(std::get<std::vector<int64_t>>(r->prompts[1]), (std::vector<int64_t>{2, 3}));

  ExpectBad(Completion(R"({"prompt": []})").status(), "prompt", "empty");
  ExpectBad(Completion(R"({"prompt": ["a", 3]})").status(), "prompt[1]");
  ExpectBad(Completion(R"({"prompt": [1, "a"]})").status(), "prompt[1]", "integer");
  ExpectBad(Completion(R"({"prompt": [[1], [1.5]]})").status(), "prompt[1][0]", "integer");
  ExpectBad(Completion(R"({"prompt": 5})").status(), "prompt", "string or an array");
  ExpectBad(Completion(R"({"max_tokens": 5})").status(), "prompt", "required");
  std::string many = R"({"prompt": [)";
  for (int i = 0; i < 65; ++i) many += std::string(i ? "," : "") + "\"x\"";
  ExpectBad(Completion(many + "]}").status(), "prompt", "at most 64");
}

TEST(Request, FieldsAndDefaults) {
  auto r = Completion(R"({"prompt": "x"})");
  ASSERT_OK(r);
  EXPECT_EQ(r->common.model, "");
  EXPECT_FALSE(r->common.max_tokens);
  EXPECT_FALSE(r->common.sampling.temperature);
  EXPECT_FALSE(r->common.stream);
  EXPECT_TRUE(r->common.skip_special_tokens);
  EXPECT_TRUE(r->add_special_tokens);

  r = Completion(R"({"model": "m", "prompt": "x", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 4,
                     "seed": 18446744073709551615, "stop": ["a", "b"], "stream": true,
                     "stream_options": {"include_usage": true}, "ignore_eos": true, "return_token_ids": true,
                     "stop_token_ids": [3], "n": 1, "user": "someone", "presence_penalty": 0,
                     "logprobs": null, "echo": false})");
  ASSERT_OK(r);
  EXPECT_EQ(r->common.model, "m");
  EXPECT_EQ(*r->common.max_tokens, 7);
  EXPECT_EQ(*r->common.sampling.temperature, 0.0);
  EXPECT_EQ(*r->common.sampling.top_p, 0.5);
  EXPECT_EQ(*r->common.sampling.top_k, 4);
  EXPECT_EQ(*r->common.sampling.seed, 18446744073709551615ull);
  EXPECT_EQ(r->common.stop, (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(r->common.stream && r->common.include_usage && r->common.ignore_eos && r->common.return_token_ids);
  EXPECT_EQ(r->common.stop_token_ids, (std::vector<int64_t>{3}));

  r = Completion(R"({"prompt": "x", "stop": "end", "seed": -1})");
  ASSERT_OK(r);
  EXPECT_EQ(r->common.stop, (std::vector<std::string>{"end"}));
  EXPECT_EQ(*r->common.sampling.seed, ~uint64_t{0});
  EXPECT_EQ(r->common.n, 1);
  EXPECT_EQ(r->common.logprobs, -1);

  // The sampling extras.
  r = Completion(R"({"prompt": "x", "n": 4, "logprobs": 3, "presence_penalty": 0.5, "frequency_penalty": -1,
                     "repetition_penalty": 1.2, "min_p": 0.05, "logit_bias": {"7": -100, "12": 2.5}})");
  ASSERT_OK(r);
  EXPECT_EQ(r->common.n, 4);
  EXPECT_EQ(r->common.logprobs, 3);
  EXPECT_EQ(*r->common.sampling.presence_penalty, 0.5);
  EXPECT_EQ(*r->common.sampling.frequency_penalty, -1.0);
  EXPECT_EQ(*r->common.sampling.repetition_penalty, 1.2);
  EXPECT_EQ(*r->common.sampling.min_p, 0.05);
  auto bias = r->common.sampling.logit_bias;
  std::sort(bias.begin(), bias.end());
  EXPECT_EQ(bias, (std::vector<std::pair<int64_t, double>>{{7, -100.0}, {12, 2.5}}));
  r = Completion(R"({"prompt": "x", "logprobs": 0})");
  ASSERT_OK(r);
  EXPECT_EQ(r->common.logprobs, 0);
  auto chat = Chat(R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 20, "n": 2})");
  ASSERT_OK(chat);
  EXPECT_EQ(chat->common.logprobs, 20);
  EXPECT_EQ(chat->common.n, 2);
  chat = Chat(R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true})");
  ASSERT_OK(chat);
  EXPECT_EQ(chat->common.logprobs, 0);
  chat = Chat(R"({"messages": [{"role": "user", "content": "x"}], "logprobs": false})");
  ASSERT_OK(chat);
  EXPECT_EQ(chat->common.logprobs, -1);
}

TEST(Response, LogprobsInOpenAIShapes) {
  std::vector<TokenLogprobs> lps(2);
  lps[0].chosen = LogprobEntry{5, "Hi", -0.25f};
  lps[0].top = {LogprobEntry{5, "Hi", -0.25f}, LogprobEntry{9, "\xc3", -1.5f}};
  lps[1].chosen = LogprobEntry{9, "\xc3", -2.0f};
  const json chat = openai::ChatLogprobsJson(lps);
  EXPECT_EQ(chat, json::parse(R"({"content": [
      {"token": "Hi", "logprob": -0.25, "bytes": [72, 105],
       "top_logprobs": [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105]},
                        {"token": "bytes:\\xc3", "logprob": -1.5, "bytes": [195]}]},
      {"token": "bytes:\\xc3", "logprob": -2.0, "bytes": [195], "top_logprobs": []}], "refusal": null})"));
  size_t offset = 3;
  const json comp = openai::CompletionLogprobsJson(lps, &offset);
  EXPECT_EQ(comp, json::parse(R"({"tokens": ["Hi", "bytes:\\xc3"], "token_logprobs": [-0.25, -2.0],
                                   "top_logprobs": [{"Hi": -0.25, "bytes:\\xc3": -1.5}, {}],
                                   "text_offset": [3, 5]})"));
  EXPECT_EQ(offset, 6u);
}

TEST(Request, EveryBadFieldIsNamed) {
  struct Case {
    const char* body;
    const char* param;
    const char* needle;
  };
  const Case cases[] = {
      {R"({"prompt": "x", "max_tokens": "5"})", "max_tokens", "integer"},
      {R"({"prompt": "x", "max_tokens": 1.5})", "max_tokens", "integer"},
      {R"({"prompt": "x", "max_tokens": 0})", "max_tokens", "at least 1"},
      {R"({"prompt": "x", "max_tokens": -3})", "max_tokens", "at least 1"},
      {R"({"prompt": "x", "temperature": "hot"})", "temperature", "number"},
      {R"({"prompt": "x", "temperature": 2.5})", "temperature", "[0, 2]"},
      {R"({"prompt": "x", "temperature": -0.1})", "temperature", "[0, 2]"},
      {R"({"prompt": "x", "top_p": 0})", "top_p", "(0, 1]"},
      {R"({"prompt": "x", "top_p": 1.01})", "top_p", "(0, 1]"},
      {R"({"prompt": "x", "top_k": -2})", "top_k", "top_k"},
      {R"({"prompt": "x", "top_k": 2.5})", "top_k", "integer"},
      {R"({"prompt": "x", "seed": "1"})", "seed", "integer"},
      {R"({"prompt": "x", "stop": 3})", "stop", "string"},
      {R"({"prompt": "x", "stop": ["a", 3]})", "stop[1]", "string"},
      {R"({"prompt": "x", "stream": "yes"})", "stream", "boolean"},
      {R"({"prompt": "x", "stream_options": {"include_usage": true}})", "stream_options", "stream"},
      {R"({"prompt": "x", "stream": true, "stream_options": {"include_usage": 1}})", "stream_options.include_usage",
       "boolean"},
      {R"({"prompt": "x", "n": 0})", "n", "n must be in [1, 16]"},
      {R"({"prompt": "x", "n": 17})", "n", "n must be in [1, 16] (got 17)"},
      {R"({"prompt": "x", "n": 1.5})", "n", "integer"},
      {R"({"prompt": "x", "best_of": 3})", "best_of", "not supported"},
      {R"({"prompt": "x", "logprobs": 21})", "logprobs", "logprobs must be in [0, 20]"},
      {R"({"prompt": "x", "logprobs": -1})", "logprobs", "[0, 20]"},
      {R"({"prompt": "x", "logprobs": true})", "logprobs", "integer"},
      {R"({"prompt": "x", "echo": true})", "echo", "not supported"},
      {R"({"prompt": "x", "suffix": "tail"})", "suffix", "not supported"},
      {R"({"prompt": "x", "presence_penalty": 2.5})", "presence_penalty", "presence_penalty must be in [-2, 2]"},
      {R"({"prompt": "x", "presence_penalty": "high"})", "presence_penalty", "number"},
      {R"({"prompt": "x", "frequency_penalty": -3})", "frequency_penalty", "frequency_penalty must be in [-2, 2]"},
      {R"({"prompt": "x", "repetition_penalty": 0})", "repetition_penalty", "repetition_penalty must be in (0, 2]"},
      {R"({"prompt": "x", "repetition_penalty": 2.5})", "repetition_penalty", "(0, 2]"},
      {R"({"prompt": "x", "min_p": 1.1})", "min_p", "min_p must be in [0, 1]"},
      {R"({"prompt": "x", "logit_bias": [1]})", "logit_bias", "object"},
      {R"({"prompt": "x", "logit_bias": {"abc": 1}})", "logit_bias", "token id"},
      {R"({"prompt": "x", "logit_bias": {"5": "up"}})", "logit_bias", "number"},
      {R"({"prompt": "x", "logit_bias": {"5": 100.5}})", "logit_bias", "[-100, 100]"},
      {R"({"prompt": "x", "ignore_eos": 1})", "ignore_eos", "boolean"},
      {R"({"prompt": "x", "return_token_ids": "true"})", "return_token_ids", "boolean"},
      {R"({"prompt": "x", "stop_token_ids": [1, "2"]})", "stop_token_ids[1]", "integer"},
      {R"({"prompt": "x", "model": 5})", "model", "string"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.body);
    ExpectBad(Completion(c.body).status(), c.param, c.needle);
  }
  ExpectBad(Completion("{\"prompt\": ").status(), "", "not valid JSON");
  ExpectBad(Completion("[]").status(), "", "object");
  ExpectBad(Completion("").status(), "", "not valid JSON");
  ExpectBad(Completion(std::string(100, '[') + std::string(100, ']')).status(), "", "nests");
}

TEST(Request, ChatMessagesAndOptions) {
  auto r = Chat(R"({"messages": [{"role": "system", "content": "S"},
                                 {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                 {"role": "assistant", "content": null, "reasoning_content": "R",
                                  "tool_calls": [{"id": "c1", "type": "function",
                                                  "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
                                 {"role": "tool", "tool_call_id": "c1", "content": "42"}],
                    "thinking": {"type": "enabled"}, "reasoning_effort": "high", "max_completion_tokens": 9,
                    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"})");
  ASSERT_OK(r);
  ASSERT_EQ(r->messages.size(), 4u);
  EXPECT_EQ(r->messages[1].content, "a\nb");
  EXPECT_FALSE(r->messages[2].has_content);
  EXPECT_EQ(r->messages[2].reasoning_content, "R");
  ASSERT_EQ(r->messages[2].tool_calls.size(), 1u);
  EXPECT_EQ(r->messages[2].tool_calls[0].name, "f");
  EXPECT_EQ(r->messages[2].tool_calls[0].arguments, "{\"x\": 1}");
  EXPECT_EQ(r->messages[3].tool_call_id, "c1");
  EXPECT_TRUE(r->thinking);
  EXPECT_EQ(*r->reasoning_effort, "high");
  EXPECT_EQ(*r->common.max_tokens, 9);
  EXPECT_TRUE(r->tools.is_array());

  r = Chat(R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"thinking": true}})");
  ASSERT_OK(r);
  EXPECT_TRUE(r->thinking);
  r = Chat(R"({"messages": [{"role": "user", "content": "x"}], "thinking": false})");
  ASSERT_OK(r);
  EXPECT_FALSE(r->thinking);

  ExpectBad(Chat(R"({"model": "m"})").status(), "messages", "required");
  ExpectBad(Chat(R"({"messages": []})").status(), "messages", "empty");
  ExpectBad(Chat(R"({"messages": {}})").status(), "messages", "array");
  ExpectBad(Chat(R"({"messages": [5]})").status(), "messages[0]", "object");
  ExpectBad(Chat(R"({"messages": [{"content": "x"}]})").status(), "messages[0].role", "required");
  ExpectBad(Chat(R"({"messages": [{"role": "wizard", "content": "x"}]})").status(), "messages[0].role", "wizard");
  ExpectBad(Chat(R"({"messages": [{"role": "user"}]})").status(), "messages[0].content", "required");
  ExpectBad(Chat(R"({"messages": [{"role": "user", "content": 5}]})").status(), "messages[0].content");
  ExpectBad(Chat(R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})").status(),
            "messages[0].content[0].type", "text");
  ExpectBad(Chat(R"({"messages": [{"role": "user", "content": "x"}], "thinking": "on"})").status(), "thinking");
  ExpectBad(Chat(R"({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "maybe"}})").status(),
            "thinking.type");
  ExpectBad(Chat(R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})").status(),
            "tools[0].function");
  ExpectBad(Chat(R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})").status(),
            "tool_choice");
  ExpectBad(Chat(R"({"messages": [{"role": "user", "content": "x"}], "logprobs": 3})").status(), "logprobs", "boolean");
  ExpectBad(Chat(R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})").status(), "top_logprobs",
            "needs");
  ExpectBad(Chat(R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21})").status(),
            "top_logprobs", "[0, 20]");
  ExpectBad(Chat(R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}})").status(),
            "response_format.type");
  ExpectBad(Chat(R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema",
                     "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "a"}}}})").status(),
            "response_format.json_schema.schema", "unsupported keyword 'pattern'");
  ExpectBad(Chat(R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
                     "tool_choice": {"type": "function", "function": {"name": "g"}}})").status(),
            "tool_choice.function.name", "not in tools");
  {
    auto ok = Chat(R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema",
                       "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"b": {"type": "integer"},
                       "a": {"type": "string"}}, "required": ["b"]}}}})");
    ASSERT_TRUE(ok.ok()) << ok.status();
    // The grammar keeps the schema's key order (the client's), which is the order properties are written in.
    EXPECT_EQ(ok->common.sampling.grammar,
              R"({"type":"json_schema","schema":{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}},"required":["b"]}})");
    auto forced = Chat(R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
                           "tool_choice": "required"})");
    ASSERT_TRUE(forced.ok()) << forced.status();
    EXPECT_TRUE(forced->tool_choice_required);
  }
  ExpectBad(Chat(R"({"messages": [{"role": "assistant", "content": "x", "prefix": true},
                                  {"role": "user", "content": "y"}]})")
                .status(),
            "messages[0].prefix");
  ExpectBad(Chat(R"({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]})")
                .status(),
            "messages[0].tool_calls");
}

// Random mutations of valid bodies must give a request or an error, never a crash or an exception.
TEST(Request, FuzzNeverCrashes) {
  const std::vector<std::string> seeds = {
      R"({"model": "m", "prompt": ["a", "b"], "max_tokens": 5, "stop": ["x"], "stream": true, "seed": 3})",
      R"({"prompt": [[1, 2], [3]], "temperature": 0.5, "top_p": 0.9, "top_k": 5, "logprobs": null})",
      R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "thinking": {"type": "enabled"},
          "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})",
      R"({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
                       {"role": "tool", "content": "r"}], "chat_template_kwargs": {"enable_thinking": true}})",
  };
  const std::string alphabet = "{}[]\":,0123456789-.eE truefalsnul\\x\xff\xc3";
  std::mt19937 rng(1234);
  int parsed = 0, errors = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    std::string s = seeds[iter % seeds.size()];
    int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits && !s.empty(); ++e) {
      size_t pos = rng() % s.size();
      switch (rng() % 3) {
        case 0:
          s[pos] = alphabet[rng() % alphabet.size()];
          break;
        case 1:
          s.erase(pos, 1 + rng() % 3);
          break;
        default:
          s.insert(pos, 1, alphabet[rng() % alphabet.size()]);
      }
    }
    auto j = ParseJsonBody(s);
    if (!j.ok()) {
      ++errors;
      EXPECT_EQ(j.status().code(), absl::StatusCode::kInvalidArgument);
      continue;
    }
    auto c = ParseCompletionRequest(*j);
    auto h = ParseChatRequest(*j);
    parsed += c.ok() + h.ok();
    for (const Status& st : {c.status(), h.status()}) {
      if (!st.ok()) {
        EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_FALSE(st.message().empty());
      }
    }
  }
  EXPECT_GT(parsed, 100);
  EXPECT_GT(errors, 100);
}

TEST(Response, ErrorMapping) {
  struct Case {
    Status status;
    int http;
    const char* type;
    const char* code;
    int retry_after;
  };
  const Case cases[] = {
      {InvalidParam("top_p", "bad"), 400, "invalid_request_error", "", 0},
      {absl::UnauthenticatedError("no key"), 401, "authentication_error", "invalid_api_key", 0},
      {WithParam(absl::NotFoundError("no model"), "model"), 404, "invalid_request_error", "model_not_found", 0},
      {absl::NotFoundError("no path"), 404, "invalid_request_error", "not_found", 0},
      {absl::OutOfRangeError("big"), 413, "invalid_request_error", "request_too_large", 0},
      {absl::ResourceExhaustedError("full"), 429, "server_overloaded", "queue_full", 1},
      {absl::UnavailableError("none"), 503, "service_unavailable", "no_worker", 1},
      {absl::DeadlineExceededError("slow"), 504, "timeout", "request_timeout", 0},
      {absl::InternalError("bug"), 500, "internal_error", "", 0},
  };
  for (const Case& c : cases) {
    openai::ApiError e = openai::ToApiError(c.status);
    EXPECT_EQ(e.http_status, c.http) << c.status;
    EXPECT_EQ(e.type, c.type);
    EXPECT_EQ(e.code, c.code);
    EXPECT_EQ(e.retry_after_s, c.retry_after);
    json j = openai::ErrorJson(e);
    ASSERT_TRUE(j["error"].is_object());
    EXPECT_EQ(j["error"]["message"], std::string(c.status.message()));
    EXPECT_TRUE(j["error"].contains("param"));
    EXPECT_TRUE(j["error"].contains("code"));
  }
  json j = openai::ErrorJson(openai::ToApiError(InvalidParam("top_p", "top_p must be in (0, 1]")));
  EXPECT_EQ(j, json::parse(R"({"error": {"message": "top_p must be in (0, 1]", "type": "invalid_request_error",
                                          "param": "top_p", "code": null}})"));
}

TEST(Response, ShapesAndSseFraming) {
  EXPECT_EQ(openai::SseData("{\"a\":1}"), "data: {\"a\":1}\n\n");
  EXPECT_EQ(std::string(openai::kSseDone), "data: [DONE]\n\n");
  EXPECT_EQ(openai::NewId("cmpl").rfind("cmpl-", 0), 0u);
  EXPECT_EQ(openai::NewId("cmpl").size(), 5u + 24u);
  EXPECT_NE(openai::NewId("x"), openai::NewId("x"));

  std::vector<int32_t> ids = {1, 2};
  json chunk = openai::ChunkJson("text_completion", "cmpl-1", 7, "m",
                                 json::array({openai::CompletionChunkChoice(0, "hi", "", &ids)}));
  EXPECT_EQ(chunk, json::parse(R"({"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
      "choices": [{"index": 0, "text": "hi", "logprobs": null, "finish_reason": null, "token_ids": [1, 2]}]})"));
  json last = openai::ChatChunkChoice(0, json::object(), "stop", nullptr, "");
  EXPECT_EQ(last, json::parse(R"({"index": 0, "delta": {}, "logprobs": null, "finish_reason": "stop",
                                  "stop_reason": null})"));
  json usage = openai::ChunkJson("chat.completion.chunk", "c", 1, "m", json::array(), openai::UsageJson(3, 4));
  EXPECT_EQ(usage["usage"], json::parse(R"({"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0},
                                          "completion_tokens": 4, "total_tokens": 7})"));
  EXPECT_EQ(openai::UsageJson(9, 1, 8)["prompt_tokens_details"]["cached_tokens"], 8);
  EXPECT_TRUE(usage["choices"].empty());

  openai::ChoiceResult c;
  c.text = "answer";
  c.reasoning_content = "why";
  c.finish_reason = "stop";
  c.stop_reason = "\n";
  json chat = openai::ChatChoiceJson(0, c, true);
  EXPECT_EQ(chat["message"], json::parse(R"({"role": "assistant", "content": "answer", "reasoning_content": "why"})"));
  EXPECT_EQ(chat["stop_reason"], "\n");
  c.text.clear();
  c.tool_calls = json::array({{{"id", "call_1"}, {"type", "function"}, {"function", {{"name", "f"}, {"arguments", "{}"}}}}});
  chat = openai::ChatChoiceJson(0, c, false);
  EXPECT_TRUE(chat["message"]["content"].is_null());  // OpenAI: null content when the turn is only tool calls
  EXPECT_EQ(chat["message"]["tool_calls"][0]["id"], "call_1");

  json resp = openai::ResponseJson("text_completion", "cmpl-2", 5, "m", json::array(), 10, 3);
  EXPECT_EQ(resp["usage"]["total_tokens"], 13);
  // Invalid UTF-8 never makes serialisation throw.
  EXPECT_NO_THROW(openai::Dump(json("bad \xff\xfe bytes")));
}

std::unique_ptr<tokenizer::Tokenizer> Tok() {
  auto t = tokenizer::Tokenizer::Load(std::string(NUMOE_TEST_DATA) + "/tiny-v4");
  EXPECT_OK(t);
  return t.ok() ? std::move(*t) : nullptr;
}

// Feeds ids one at a time and returns the concatenated text.
std::string Feed(OutputText& out, const std::vector<int32_t>& ids) {
  std::string text;
  for (int32_t id : ids) text += out.Add(std::span<const int32_t>(&id, 1)).text;
  if (!out.stopped()) text += out.Finish();
  return text;
}

TEST(OutputText, StopStringsOnText) {
  auto tok = Tok();
  ASSERT_TRUE(tok);
  auto ids = tok->Encode("Hello, world! Goodbye, world!");
  ASSERT_OK(ids);
  {
    OutputText out(*tok, {.stop = {"bye"}});
    EXPECT_EQ(Feed(out, *ids), "Hello, world! Good");
    EXPECT_TRUE(out.stopped());
    EXPECT_EQ(out.matched_stop(), "bye");
  }
  {
    OutputText out(*tok, {.stop = {"world", "Hello"}});
    EXPECT_EQ(Feed(out, *ids), "");  // the earliest match wins
    EXPECT_EQ(out.matched_stop(), "Hello");
  }
  {
    OutputText out(*tok, {.stop = {"o, w"}, .include_stop_in_output = true});
    EXPECT_EQ(Feed(out, *ids), "Hello, w");
  }
  {
    OutputText out(*tok, {.stop = {"absent", ""}});
    EXPECT_EQ(Feed(out, *ids), "Hello, world! Goodbye, world!");
    EXPECT_FALSE(out.stopped());
  }
  // Held back while a stop string might still start: no text is sent that is later cut.
  {
    OutputText out(*tok, {.stop = {"world!X"}});
    std::string sent;
    for (int32_t id : *ids) sent += out.Add(std::span<const int32_t>(&id, 1)).text;
    EXPECT_EQ(sent, "Hello, world! Goodbye, ");  // "world!" is held: it may continue as "world!X"
    EXPECT_EQ(out.Finish(), "world!");
  }
}

TEST(OutputText, EosIsNotTextAndUtf8IsNeverSplit) {
  auto tok = Tok();
  ASSERT_TRUE(tok);
  auto ids = tok->Encode("héllo 世界");
  ASSERT_OK(ids);
  std::vector<int32_t> with_eos = *ids;
  with_eos.push_back(tok->special_ids().eos);
  OutputText out(*tok, {.eos_id = tok->special_ids().eos});
  std::string text;
  for (int32_t id : with_eos) {
    std::string piece = out.Add(std::span<const int32_t>(&id, 1)).text;
    // Every piece is whole UTF-8: no byte starts with a continuation byte.
    if (!piece.empty()) {
      EXPECT_NE(static_cast<unsigned char>(piece[0]) & 0xC0, 0x80);
    }
    text += piece;
  }
  text += out.Finish();
  EXPECT_EQ(text, "héllo 世界");
  // A stop string made of multi-byte characters.
  OutputText cut(*tok, {.stop = {"世"}});
  EXPECT_EQ(Feed(cut, *ids), "héllo ");
  // skip_special_tokens drops specials such as BOS.
  OutputText skip(*tok, {.skip_special_tokens = true});
  std::vector<int32_t> with_bos = {tok->special_ids().bos};
  with_bos.insert(with_bos.end(), ids->begin(), ids->end());
  EXPECT_EQ(Feed(skip, with_bos), "héllo 世界");
}

TEST(Metrics, PrometheusText) {
  Metrics m;
  m.CountRequest("/v1/completions", "200");
  m.CountRequest("/v1/completions", "200");
  m.CountRequest("/v1/chat/completions", "400");
  m.AddPromptTokens(12);
  m.AddGenerationTokens(5);
  m.ObserveTimeToFirstToken(0.003);
  m.ObserveTimeToFirstToken(2.0);
  m.ObserveInterTokenLatency(0.012);
  // Worker gauges come from fake Stats answers: one worker drafting with DSpark, one without speculation.
  v1::WorkerStats a;
  a.set_active_sequences(3);
  a.set_queued_sequences(1);
  a.set_spec_method("dspark");
  a.set_spec_verify_steps(8);
  a.set_spec_drafted(40);
  a.set_spec_accepted(10);
  a.set_expert_seconds(12.5);
  // Its numoe-gpu's prefix cache with a host tier; b's numoe-gpu has no cache, c's one without a host tier.
  a.set_prefix_queried_tokens(100);
  a.set_prefix_hit_tokens(60);
  a.set_prefix_cache_bytes(4096);
  a.set_prefix_host_bytes(8192);
  a.set_prefix_evicted(3);
  a.set_prefix_host_evicted(1);
  v1::WorkerStats b;
  b.set_spec_method("none");
  b.set_prefix_cache_bytes(-1);
  b.set_prefix_host_bytes(-1);
  v1::WorkerStats c;
  c.set_prefix_cache_bytes(512);
  c.set_prefix_host_bytes(-1);
  c.set_prefix_evicted(2);
  std::string t = m.Render({WorkerGaugeFromStats("127.0.0.1:9101", true, a), WorkerGaugeFromStats("h\"x", false, b),
                            WorkerGaugeFromStats("c", true, c)});
  for (const char* line : {
           "# TYPE numoe_requests_total counter",
           "numoe_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 2\n",
           "numoe_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"} 1\n",
           "numoe_prompt_tokens_total 12\n",
           "numoe_generation_tokens_total 5\n",
           "# TYPE numoe_time_to_first_token_seconds histogram",
           "numoe_time_to_first_token_seconds_bucket{le=\"0.001\"} 0\n",
           "numoe_time_to_first_token_seconds_bucket{le=\"0.005\"} 1\n",
           "numoe_time_to_first_token_seconds_bucket{le=\"2.5\"} 2\n",
           "numoe_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2\n",
           "numoe_time_to_first_token_seconds_sum 2.003000\n",
           "numoe_time_to_first_token_seconds_count 2\n",
           "numoe_inter_token_latency_seconds_bucket{le=\"0.015\"} 1\n",
           "numoe_inter_token_latency_seconds_count 1\n",
           "numoe_worker_active_sequences{worker=\"127.0.0.1:9101\"} 3\n",
           "numoe_worker_queued_sequences{worker=\"127.0.0.1:9101\"} 1\n",
           "numoe_worker_up{worker=\"127.0.0.1:9101\"} 1\n",
           "numoe_worker_up{worker=\"h\\\"x\"} 0\n",
           "# TYPE numoe_worker_expert_seconds_total counter",
           "numoe_worker_expert_seconds_total{worker=\"127.0.0.1:9101\"} 12.500000\n",
           "numoe_worker_expert_seconds_total{worker=\"h\\\"x\"} 0.000000\n",
           "# TYPE numoe_spec_drafted_tokens_total counter",
           "numoe_spec_drafted_tokens_total{worker=\"127.0.0.1:9101\",drafter=\"dspark\"} 40\n",
           "# TYPE numoe_spec_accepted_tokens_total counter",
           "numoe_spec_accepted_tokens_total{worker=\"127.0.0.1:9101\",drafter=\"dspark\"} 10\n",
           "# TYPE numoe_spec_verify_steps_total counter",
           "numoe_spec_verify_steps_total{worker=\"127.0.0.1:9101\",drafter=\"dspark\"} 8\n",
           "# TYPE numoe_spec_mean_accepted_length gauge",
           "numoe_spec_mean_accepted_length{worker=\"127.0.0.1:9101\",drafter=\"dspark\"} 1.2500\n",
           "# TYPE numoe_prefix_cache_queried_tokens_total counter",
           "numoe_prefix_cache_queried_tokens_total{worker=\"127.0.0.1:9101\"} 100\n",
           "# TYPE numoe_prefix_cache_hit_tokens_total counter",
           "numoe_prefix_cache_hit_tokens_total{worker=\"127.0.0.1:9101\"} 60\n",
           "# TYPE numoe_prefix_cache_bytes gauge",
           "numoe_prefix_cache_bytes{worker=\"127.0.0.1:9101\",tier=\"backend\"} 4096\n",
           "numoe_prefix_cache_bytes{worker=\"127.0.0.1:9101\",tier=\"host\"} 8192\n",
           "numoe_prefix_cache_bytes{worker=\"c\",tier=\"backend\"} 512\n",
           "# TYPE numoe_prefix_cache_evictions_total counter",
           "numoe_prefix_cache_evictions_total{worker=\"127.0.0.1:9101\",tier=\"backend\"} 3\n",
           "numoe_prefix_cache_evictions_total{worker=\"127.0.0.1:9101\",tier=\"host\"} 1\n",
           "numoe_prefix_cache_evictions_total{worker=\"c\",tier=\"backend\"} 2\n",
       }) {
    EXPECT_NE(t.find(line), std::string::npos) << line << "\n" << t;
  }
  EXPECT_EQ(t.back(), '\n');
  // A worker without speculation has no numoe_spec_* series.
  EXPECT_EQ(t.find("numoe_spec_drafted_tokens_total{worker=\"h"), std::string::npos) << t;
  EXPECT_EQ(t.find("drafter=\"none\""), std::string::npos) << t;
  // A worker whose numoe-gpu has no prefix cache has no numoe_prefix_cache_* series, one without a host tier
  // no tier="host" lines.
  EXPECT_EQ(t.find("numoe_prefix_cache_bytes{worker=\"h"), std::string::npos) << t;
  EXPECT_EQ(t.find("numoe_prefix_cache_queried_tokens_total{worker=\"h"), std::string::npos) << t;
  EXPECT_EQ(t.find("{worker=\"c\",tier=\"host\"}"), std::string::npos) << t;
  // Every non-comment line is "name{labels} value" or "name value".
  std::istringstream in(t);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    EXPECT_EQ(line.rfind("numoe_", 0), 0u) << line;
    EXPECT_NE(line.rfind(' '), std::string::npos) << line;
  }
}

}  // namespace
}  // namespace numoe::router
