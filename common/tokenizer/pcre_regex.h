// A PCRE2 (8-bit, UTF + UCP, JIT when available) regular expression, compiled once and matched from
// many threads. Compiled code is immutable; everything a match writes lives in a MatchScratch, which
// each thread must own (the tokenizer keeps a pool of them).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace numoe::tokenizer {

// Per-thread match state: a match-data block, a match context and its JIT stack.
class MatchScratch {
 public:
  MatchScratch();
  ~MatchScratch();
  MatchScratch(const MatchScratch&) = delete;
  MatchScratch& operator=(const MatchScratch&) = delete;

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

class Regex {
  struct Passkey {};  // only Compile() constructs a Regex

 public:
  explicit Regex(Passkey);
  // Compiles `pattern` (Oniguruma/HF syntax as used in tokenizer.json). `literal` treats it as plain text.
  // `\s` / `\S` are rewritten to the Unicode White_Space set so they agree with Oniguruma (PCRE2's UCP
  // `\s` also matches U+180E). Errors name `what` and the PCRE2 message with its offset.
  static StatusOr<std::unique_ptr<Regex>> Compile(std::string_view pattern, bool literal, const std::string& what);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends the [start, end) byte ranges of successive non-empty, non-overlapping matches in `subject`
  // (offsets relative to subject). `subject` must be valid UTF-8: it is not re-checked.
  // Lookarounds never see past the ends of `subject`.
  Status FindAll(std::string_view subject, MatchScratch* scratch, std::vector<std::pair<size_t, size_t>>* out) const;

  // True when the regex matches starting exactly at subject[0] (an anchored match).
  bool MatchesAtStart(std::string_view subject, MatchScratch* scratch) const;

  const std::string& what() const { return what_; }
  bool jit() const { return jit_; }

 private:
  struct Code;
  std::unique_ptr<Code> code_;
  std::string what_;
  bool jit_ = false;
};

}  // namespace numoe::tokenizer
