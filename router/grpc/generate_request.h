// numoe.v1.Inference requests -> the checked work the router runs: the gRPC service's validation without
// the gRPC server around it, so the service (inference_service.cc), the unit tests and the fuzz target
// (tests/fuzz/) call the one function.
//
// Errors are InvalidArgument naming the proto field (param "text", "token_ids", "chat.messages", "n",
// "top_logprobs", "stop_token_ids", sampling fields, ...) or NotFound for an unknown model.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "numoe/v1/inference.pb.h"
#include "router/core/frontend.h"

namespace numoe::router {

namespace openai {
class ChatEncoder;
}

// A validated Generate call.
struct GenerateCall {
  ChoiceSpec spec;
  bool chat = false;                 // a chat prompt: each choice's text goes through the chat output parser
  bool starts_in_reasoning = false;  // chat: the prompt ends with <think>
  bool tools = false;                // chat: tools were rendered
};
StatusOr<GenerateCall> PrepareGenerate(const Frontend& fe, const openai::ChatEncoder& chat,
                                       const v1::GenerateRequest& req);

// A Tokenize call: the text's ids (no BOS added, special-token strings recognised).
StatusOr<std::vector<int32_t>> PrepareTokenize(const Frontend& fe, const v1::TokenizeRequest& req);

}  // namespace numoe::router
