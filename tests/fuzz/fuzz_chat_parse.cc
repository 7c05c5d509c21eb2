// Fuzzes the output parser (router/chat/chat_encoding.h): generated text with reasoning, </think>, DSML tool
// calls and special tokens, through the strict ParseCompletion and the streaming parser the server uses
// (chat::StreamingOutputParser, and openai::ChatStreamParser on top of it). Byte 0: bit 0 thinking mode /
// reasoning start, bit 1 tools enabled; byte 1 seeds the chunking; the rest is the text.
// Properties: the streamed result does not depend on how the text is chunked, and the deltas' reasoning and
// content add up to message()'s.
#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "router/chat/chat_encoding.h"
#include "router/openai/chat.h"

namespace chat = numoe::chat;

namespace {

struct Streamed {
  chat::ParsedMessage message;
  std::string reasoning, content, finish;
};

Streamed Run(std::string_view text, chat::ParserStart start, bool tools, uint32_t seed) {
  chat::StreamingOutputParser parser(start, {.tools_enabled = tools,
                                             .make_call_id = [](int i) { return "call_" + std::to_string(i); }});
  Streamed s;
  auto add = [&](const chat::OutputDelta& d) {
    s.reasoning += d.reasoning_content;
    s.content += d.content;
  };
  size_t pos = 0;
  while (pos < text.size()) {
    size_t n = text.size() - pos;
    if (seed != 0) {
      seed = seed * 1103515245u + 12345u;
      n = std::min<size_t>(n, 1 + (seed >> 16) % 7);
    }
    add(parser.Feed(text.substr(pos, n)));
    pos += n;
  }
  add(parser.Finish());
  s.message = parser.message();
  s.finish = parser.FinishReason(false);
  return s;
}

bool Same(const chat::ParsedMessage& a, const chat::ParsedMessage& b) {
  if (a.reasoning_content != b.reasoning_content || a.content != b.content) return false;
  if (a.tool_calls.size() != b.tool_calls.size()) return false;
  for (size_t i = 0; i < a.tool_calls.size(); ++i) {
    if (a.tool_calls[i].name != b.tool_calls[i].name || a.tool_calls[i].arguments != b.tool_calls[i].arguments ||
        a.tool_calls[i].id != b.tool_calls[i].id)
      return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const bool thinking = (data[0] & 1) != 0;
  const bool tools = (data[0] & 2) != 0;
  const uint32_t seed = data[1];
  const std::string_view text(reinterpret_cast<const char*>(data) + 2, size - 2);

  (void)chat::ParseCompletion(text, thinking ? chat::ThinkingMode::kThinking : chat::ThinkingMode::kChat);

  const chat::ParserStart start = thinking ? chat::ParserStart::kReasoning : chat::ParserStart::kContent;
  const Streamed whole = Run(text, start, tools, 0);
  const Streamed chunked = Run(text, start, tools, seed | 1);
  if (!Same(whole.message, chunked.message) || whole.finish != chunked.finish) {
    std::fprintf(stderr, "the parse depends on the chunking\n");
    std::abort();
  }
  if (whole.reasoning != whole.message.reasoning_content || whole.content != whole.message.content ||
      chunked.reasoning != chunked.message.reasoning_content || chunked.content != chunked.message.content) {
    std::fprintf(stderr, "the deltas do not add up to the message\n");
    std::abort();
  }

  // The router's wrapper (OpenAI tool-call deltas), fed the same chunks.
  numoe::router::openai::ChatStreamParser p(thinking, tools, [] { return std::string("call_x"); });
  for (size_t pos = 0; pos < text.size(); pos += 5) (void)p.Add(text.substr(pos, 5));
  (void)p.Finish();
  (void)p.tool_calls();
  return 0;
}
