// Fuzzes the chat encoder (router/chat/chat_encoding.h): a JSON body as the router parses it
// (openai::ParseJsonBody) whose "messages" and "tools" go through AttachRequestTools and EncodeMessages,
// as the official encoder's input. Byte 0 picks the options (thinking mode, encoder profile, drop_thinking,
// add_bos, a reasoning effort); the rest is the body. The prompt's start state must be computable.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "router/chat/chat_encoding.h"
#include "router/openai/request.h"

namespace chat = numoe::chat;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t flags = data[0];
  auto body = numoe::router::openai::ParseJsonBody(std::string_view(reinterpret_cast<const char*>(data) + 1, size - 1));
  if (!body.ok()) return 0;
  chat::EncodeOptions opt;
  opt.thinking_mode = (flags & 1) != 0 ? chat::ThinkingMode::kThinking : chat::ThinkingMode::kChat;
  opt.profile = (flags & 2) != 0 ? chat::EncoderProfile::kFlash0731 : chat::EncoderProfile::kPreview;
  opt.drop_thinking = (flags & 4) != 0;
  opt.add_bos = (flags & 8) != 0;
  static constexpr const char* kEfforts[] = {nullptr, "low", "medium", "high", "max", "none", "ultra", "bogus"};
  const char* effort = kEfforts[(flags >> 4) & 7];
  auto mapped = chat::MapReasoningEffort(effort == nullptr ? std::nullopt : std::optional<std::string_view>(effort),
                                         opt.profile);
  if (mapped.ok()) opt.reasoning_effort = *mapped;

  chat::Json messages = body->contains("messages") ? (*body)["messages"] : chat::Json::array();
  if (body->contains("tools")) {
    if (!chat::AttachRequestTools(&messages, (*body)["tools"]).ok()) return 0;
  }
  auto prompt = chat::EncodeMessages(messages, opt);
  if (!prompt.ok()) return 0;
  (void)chat::StartStateForPrompt(*prompt);
  return 0;
}
