// Fuzzes tokenizer.json loading (common/tokenizer/tokenizer.h): Tokenizer::FromJson on the input, the bytes
// up to the first NUL as tokenizer.json and the rest as tokenizer_config.json. A tokenizer that loads must
// encode and decode a few short texts without failing (beyond the documented ResourceExhausted).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "common/tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const size_t nul = in.find('\0');
  const std::string_view json = in.substr(0, nul);
  const std::string_view config = nul == std::string_view::npos ? std::string_view() : in.substr(nul + 1);
  auto tok = numoe::tokenizer::Tokenizer::FromJson(json, "tokenizer.json", config);
  if (!tok.ok()) return 0;
  const numoe::tokenizer::Tokenizer& t = **tok;
  for (std::string_view text : {std::string_view("Hello, world!"), std::string_view(" \t\n  x1234 ÿ€😀"),
                                std::string_view("<｜User｜>hi<｜Assistant｜></think>"), std::string_view("")}) {
    for (bool special : {true, false}) {
      auto ids = t.Encode(text, {.allow_special = special});
      if (!ids.ok()) {
        if (ids.status().code() == absl::StatusCode::kResourceExhausted) continue;
        std::abort();  // kReplace never fails on bytes
      }
      for (int32_t id : *ids) {
        if (id < 0 || id >= t.vocab_size()) std::abort();
      }
      numoe::tokenizer::StreamDecoder dec(t);
      std::string streamed;
      for (int32_t id : *ids) streamed += dec.Add(id);
      streamed += dec.Finish();
      if (streamed != t.Decode(*ids)) std::abort();
    }
  }
  for (int32_t id = -1; id <= t.vocab_size(); id += 1 + t.vocab_size() / 64) {
    (void)t.IdToToken(id);
    (void)t.IdToBytes(id);
  }
  (void)t.special_ids();
  return 0;
}
