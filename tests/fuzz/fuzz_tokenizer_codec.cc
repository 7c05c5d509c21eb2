// Fuzzes encode/decode of arbitrary bytes with the fixture tokenizer (tests/data/tiny-v4/tokenizer.json).
// Input: byte 0 = options (bit 0 allow_special, bit 1 invalid_utf8 kError, bit 2 skip_special_tokens), the
// rest is the text, and also, read as little-endian int32 ids, a sequence to decode.
// Properties: Encode never fails on bytes with kReplace; with kError it fails exactly on invalid UTF-8;
// valid UTF-8 decodes back to itself; every id is in the vocabulary; the stream decoder's pieces add up to
// Decode.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/tokenizer/tokenizer.h"
#include "common/tokenizer/utf8.h"
#include "tests/support/fixtures.h"

namespace tk = numoe::tokenizer;

namespace {

const tk::Tokenizer& Fixture() {
  static const tk::Tokenizer* tok = [] {
    auto t = tk::Tokenizer::Load(numoe::test::TinyDir());
    if (!t.ok()) {
      std::fprintf(stderr, "fixture tokenizer: %s\n", t.status().ToString().c_str());
      std::abort();
    }
    return t->release();
  }();
  return *tok;
}

std::string Streamed(const tk::Tokenizer& t, const std::vector<int32_t>& ids, bool skip) {
  tk::StreamDecoder dec(t, skip);
  std::string out;
  for (int32_t id : ids) out += dec.Add(id);
  return out + dec.Finish();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const tk::Tokenizer& t = Fixture();
  const uint8_t flags = data[0];
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  tk::EncodeOptions opt;
  opt.allow_special = (flags & 1) != 0;
  opt.invalid_utf8 = (flags & 2) != 0 ? tk::InvalidUtf8::kError : tk::InvalidUtf8::kReplace;
  const bool skip = (flags & 4) != 0;
  const bool valid = tk::FindInvalidUtf8(text) == std::string_view::npos;

  auto ids = t.Encode(text, opt);
  if (!ids.ok()) {
    if (ids.status().code() == absl::StatusCode::kResourceExhausted) return 0;
    if (opt.invalid_utf8 == tk::InvalidUtf8::kError && !valid) return 0;
    std::fprintf(stderr, "Encode failed: %s\n", ids.status().ToString().c_str());
    std::abort();
  }
  if (opt.invalid_utf8 == tk::InvalidUtf8::kError && !valid) std::abort();  // must have been refused
  for (int32_t id : *ids) {
    if (id < 0 || id >= t.vocab_size()) std::abort();
  }
  const std::string decoded = t.Decode(*ids);
  if (valid && decoded != text) {
    std::fprintf(stderr, "valid UTF-8 does not round-trip\n");
    std::abort();
  }
  if (Streamed(t, *ids, skip) != t.Decode(*ids, skip)) std::abort();
  (void)t.PreTokenize(text, opt);

  // The bytes as arbitrary ids (outside the vocabulary included).
  std::vector<int32_t> raw(text.size() / 4);
  if (!raw.empty()) std::memcpy(raw.data(), text.data(), raw.size() * 4);
  const std::string d = t.Decode(raw, skip);
  if (tk::FindInvalidUtf8(d) != std::string_view::npos) std::abort();  // Decode always returns UTF-8
  if (Streamed(t, raw, skip) != d) std::abort();
  return 0;
}
