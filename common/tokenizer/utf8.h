// UTF-8 helpers shared by the tokenizer, its stream decoder and the chat-output parser.
//
// "Lossy" decoding follows the Unicode "maximal subpart" practice (the same rule as Rust's
// String::from_utf8_lossy, which Hugging Face tokenizers use when decoding): every maximal prefix of a
// well-formed sequence that is cut short, and every byte that can start no sequence, becomes one U+FFFD.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace numoe::tokenizer {

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

// Length of the well-formed sequence starting at s[pos], or 0 when the bytes there are not one
// (invalid lead byte, bad continuation, or the sequence runs past the end).
size_t Utf8SequenceLength(std::string_view s, size_t pos);

// Byte offset of the first byte that is not part of a well-formed UTF-8 sequence, or npos when the
// whole string is valid.
size_t FindInvalidUtf8(std::string_view s);

// Appends `bytes` to *out with ill-formed subsequences replaced by U+FFFD.
// When `final` is false, a trailing sequence that is incomplete but could still become valid is left
// out and its length returned, so the caller can retry once more bytes arrive. With `final` true the
// whole input is consumed (an incomplete tail becomes one U+FFFD) and the return value is 0.
size_t AppendUtf8Lossy(std::string_view bytes, bool final, std::string* out);

// Decodes the code point at s[pos] (s must be valid there); *len receives its byte length.
char32_t DecodeCodePoint(std::string_view s, size_t pos, size_t* len);

// Appends the UTF-8 encoding of cp to *out.
void AppendCodePoint(char32_t cp, std::string* out);

// Unicode White_Space property (the set Oniguruma's and Rust's \s use; unlike PCRE2's UCP \s it
// excludes U+180E).
bool IsUnicodeWhiteSpace(char32_t cp);

}  // namespace numoe::tokenizer
