#include "common/tokenizer/utf8.h"

namespace numoe::tokenizer {
namespace {

// For a lead byte: total sequence length and the allowed range of the second byte (Unicode Table 3-7).
struct LeadInfo {
  uint8_t len;  // 0 = cannot start a sequence
  uint8_t lo, hi;
};

constexpr LeadInfo Lead(uint8_t b) {
  if (b < 0x80) return {1, 0, 0};
  if (b >= 0xC2 && b <= 0xDF) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b >= 0xE1 && b <= 0xEF) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b >= 0xF1 && b <= 0xF3) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};
}

// Examines the sequence at s[pos]. Returns the number of bytes that form a valid (possibly cut short)
// prefix and sets *complete when they form a whole sequence. A return of 0 means s[pos] starts nothing.
size_t ScanSequence(std::string_view s, size_t pos, bool* complete) {
  const auto b = static_cast<uint8_t>(s[pos]);
  const LeadInfo info = Lead(b);
  *complete = false;
  if (info.len == 0) return 0;
  if (info.len == 1) {
    *complete = true;
    return 1;
  }
  size_t i = 1;
  for (; i < info.len; ++i) {
    if (pos + i >= s.size()) return i;  // cut short by the end of the input
    const auto c = static_cast<uint8_t>(s[pos + i]);
    const uint8_t lo = i == 1 ? info.lo : 0x80;
    const uint8_t hi = i == 1 ? info.hi : 0xBF;
    if (c < lo || c > hi) return i;  // bad continuation: the maximal subpart ends before it
  }
  *complete = true;
  return i;
}

}  // namespace

size_t Utf8SequenceLength(std::string_view s, size_t pos) {
  bool complete = false;
  const size_t n = ScanSequence(s, pos, &complete);
  return complete ? n : 0;
}

size_t FindInvalidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = Utf8SequenceLength(s, i);
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

size_t AppendUtf8Lossy(std::string_view bytes, bool final, std::string* out) {
  size_t i = 0;
  size_t run = 0;  // start of the pending run of valid bytes, copied in one append
  while (i < bytes.size()) {
    if (static_cast<uint8_t>(bytes[i]) < 0x80) {
      ++i;
      continue;
    }
    bool complete = false;
    const size_t n = ScanSequence(bytes, i, &complete);
    if (complete) {
      i += n;
      continue;
    }
    out->append(bytes.data() + run, i - run);
    if (n > 0 && i + n == bytes.size() && !final) return n;  // hold the incomplete tail
    out->append(kReplacementChar);
    i += n == 0 ? 1 : n;
    run = i;
  }
  out->append(bytes.data() + run, i - run);
  return 0;
}

char32_t DecodeCodePoint(std::string_view s, size_t pos, size_t* len) {
  const auto b0 = static_cast<uint8_t>(s[pos]);
  if (b0 < 0x80) {
    *len = 1;
    return b0;
  }
  const size_t n = Lead(b0).len;
  *len = n == 0 ? 1 : n;
  if (n < 2 || pos + n > s.size()) return 0xFFFD;
  char32_t cp = b0 & (0x7F >> n);
  for (size_t i = 1; i < n; ++i) cp = (cp << 6) | (static_cast<uint8_t>(s[pos + i]) & 0x3F);
  return cp;
}

void AppendCodePoint(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool IsUnicodeWhiteSpace(char32_t cp) {
  if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  switch (cp) {
    case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

}  // namespace numoe::tokenizer
