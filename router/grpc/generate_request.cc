#include "router/grpc/generate_request.h"

#include <algorithm>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "router/core/errors.h"
#include "router/openai/chat.h"

namespace numoe::router {
namespace {

// Proto chat -> the OpenAI-shaped request the chat encoder takes.
openai::ChatRequest ToChatRequest(const v1::Chat& chat) {
  openai::ChatRequest req;
  req.thinking = chat.thinking();
  if (!chat.reasoning_effort().empty()) req.reasoning_effort = chat.reasoning_effort();
  for (const auto& m : chat.messages()) {
    openai::ChatMessage msg;
    msg.role = m.role();
    msg.content = m.content();
    msg.has_content = true;
    msg.reasoning_content = m.reasoning_content();
    req.messages.push_back(std::move(msg));
  }
  return req;
}

}  // namespace

StatusOr<GenerateCall> PrepareGenerate(const Frontend& fe, const openai::ChatEncoder& chat,
                                       const v1::GenerateRequest& req) {
  RETURN_IF_ERROR(fe.CheckModel(req.model().empty() ? fe.model().id : req.model()));
  GenerateCall call;
  ChoiceSpec& spec = call.spec;
  std::vector<int32_t> ids;
  std::string param = "prompt";
  switch (req.prompt_case()) {
    case v1::GenerateRequest::kText: {
      param = "text";
      ASSIGN_OR_RETURN(ids, fe.TokenizeText(req.text(), /*add_bos=*/true, param));
      break;
    }
    case v1::GenerateRequest::kTokenIds: {
      param = "token_ids";
      std::vector<int64_t> raw(req.token_ids().ids().begin(), req.token_ids().ids().end());
      ASSIGN_OR_RETURN(ids, fe.CheckTokenIds(raw, param));
      break;
    }
    case v1::GenerateRequest::kChat: {
      param = "chat";
      if (req.chat().messages_size() == 0) return InvalidParam("chat.messages", "chat.messages is empty");
      ASSIGN_OR_RETURN(auto prompt, chat.Encode(ToChatRequest(req.chat())));
      ids = std::move(prompt.ids);
      call.chat = true;
      call.starts_in_reasoning = prompt.starts_in_reasoning;
      call.tools = prompt.tools;
      break;
    }
    default:
      return InvalidParam("prompt", "prompt: set one of text, token_ids or chat");
  }
  std::optional<int64_t> max_tokens;
  if (req.max_tokens() > 0) max_tokens = req.max_tokens();
  ASSIGN_OR_RETURN(spec.max_tokens, fe.ResolveMaxTokens(ids.size(), max_tokens, param));
  spec.prompt_ids = std::move(ids);
  if (req.has_sampling()) {
    const auto& s = req.sampling();
    if (s.has_temperature()) spec.sampling.temperature = s.temperature();
    if (s.has_top_p()) spec.sampling.top_p = s.top_p();
    if (s.has_top_k()) spec.sampling.top_k = s.top_k();
    if (s.has_seed()) spec.sampling.seed = s.seed();
    if (s.has_min_p()) spec.sampling.min_p = s.min_p();
    if (s.has_presence_penalty()) spec.sampling.presence_penalty = s.presence_penalty();
    if (s.has_frequency_penalty()) spec.sampling.frequency_penalty = s.frequency_penalty();
    if (s.has_repetition_penalty()) spec.sampling.repetition_penalty = s.repetition_penalty();
    for (const auto& [id, bias] : s.logit_bias()) spec.sampling.logit_bias.emplace_back(id, bias);
    std::sort(spec.sampling.logit_bias.begin(), spec.sampling.logit_bias.end());  // a map's order is unspecified
  }
  RETURN_IF_ERROR(Frontend::CheckSampling(spec.sampling));
  if (req.n() > static_cast<uint32_t>(kMaxChoices)) {
    return InvalidParam("n", absl::StrCat("n must be in [1, ", kMaxChoices, "] (got ", req.n(), ")"));
  }
  spec.n = req.n() == 0 ? 1 : static_cast<int32_t>(req.n());
  if (req.top_logprobs() > static_cast<uint32_t>(kMaxTopLogprobs)) {
    return InvalidParam("top_logprobs", absl::StrCat("top_logprobs must be in [0, ", kMaxTopLogprobs, "] (got ",
                                                     req.top_logprobs(), ")"));
  }
  if (req.top_logprobs() > 0 && !req.logprobs()) return InvalidParam("top_logprobs", "top_logprobs needs logprobs");
  spec.logprobs = req.logprobs() ? static_cast<int32_t>(req.top_logprobs()) : -1;
  spec.ignore_eos = req.ignore_eos();
  std::vector<int64_t> stop_ids(req.stop_token_ids().begin(), req.stop_token_ids().end());
  if (!stop_ids.empty()) {
    ASSIGN_OR_RETURN(spec.stop_token_ids, fe.CheckTokenIds(stop_ids, "stop_token_ids"));
  }
  spec.text.stop.assign(req.stop().begin(), req.stop().end());
  spec.text.include_stop_in_output = req.include_stop_str_in_output();
  spec.text.skip_special_tokens = call.chat ? false : req.skip_special_tokens();
  spec.request_id = req.request_id();
  return call;
}

StatusOr<std::vector<int32_t>> PrepareTokenize(const Frontend& fe, const v1::TokenizeRequest& req) {
  RETURN_IF_ERROR(fe.CheckModel(req.model().empty() ? fe.model().id : req.model()));
  auto ids = fe.tokenizer().Encode(req.text());
  if (!ids.ok()) return InvalidParam("text", ids.status().message());
  return std::move(*ids);
}

}  // namespace numoe::router
