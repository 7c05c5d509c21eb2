#include "common/tokenizer/pcre_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/tokenizer/utf8.h"

namespace numoe::tokenizer {
namespace {

// Unicode White_Space, as a character-class body. Oniguruma (used by HF tokenizers) gives `\s` this
// meaning; PCRE2 with UCP adds U+180E, so we spell the class out to match tokenizer.json's intent.
constexpr std::string_view kWhiteSpaceSet =
    "\\x{09}-\\x{0d}\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}";

std::string RewriteWhiteSpace(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 64);
  bool in_class = false;
  size_t class_body_start = 0;  // index in p of the first byte of the class body
  for (size_t i = 0; i < p.size();) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char d = p[i + 1];
      if (d == 'Q') {  // \Q...\E is literal text: copy it untouched
        const size_t end = p.find("\\E", i + 2);
        const size_t stop = end == std::string_view::npos ? p.size() : end + 2;
        out.append(p.substr(i, stop - i));
        i = stop;
        continue;
      }
      if (d == 's') {
        if (in_class) {
          out.append(kWhiteSpaceSet);
        } else {
          out.append("[").append(kWhiteSpaceSet).append("]");
        }
      } else if (d == 'S' && !in_class) {
        out.append("[^").append(kWhiteSpaceSet).append("]");
      } else {
        out.push_back(c);
        out.push_back(d);
      }
      i += 2;
      continue;
    }
    if (!in_class) {
      if (c == '[') {
        in_class = true;
        class_body_start = i + 1;
        if (class_body_start < p.size() && p[class_body_start] == '^') ++class_body_start;
      }
    } else if (c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // POSIX class [:name:]
      const size_t end = p.find(":]", i + 2);
      const size_t stop = end == std::string_view::npos ? p.size() : end + 2;
      out.append(p.substr(i, stop - i));
      i = stop;
      continue;
    } else if (c == ']' && i != class_body_start) {
      in_class = false;
    }
    out.push_back(c);
    ++i;
  }
  return out;
}

constexpr uint32_t kOvectorPairs = 16;

}  // namespace

struct Regex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

struct MatchScratch::Impl {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  ~Impl() {
    pcre2_match_data_free(data);
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(jit_stack);
  }
};

MatchScratch::MatchScratch() : impl_(std::make_unique<Impl>()) {
  impl_->data = pcre2_match_data_create(kOvectorPairs, nullptr);
  impl_->context = pcre2_match_context_create(nullptr);
  // The default JIT stack is 32 KiB on the machine stack; long runs of one character class can need
  // more, so each scratch carries a growable one (up to 8 MiB). Overflow falls back to the interpreter.
  impl_->jit_stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
  NCHECK(impl_->data != nullptr && impl_->context != nullptr) << "PCRE2 allocation failed";
  if (impl_->jit_stack != nullptr) pcre2_jit_stack_assign(impl_->context, nullptr, impl_->jit_stack);
}

MatchScratch::~MatchScratch() = default;

Regex::Regex(Passkey) {}
Regex::~Regex() = default;

StatusOr<std::unique_ptr<Regex>> Regex::Compile(std::string_view pattern, bool literal, const std::string& what) {
  auto re = std::make_unique<Regex>(Passkey{});
  re->what_ = what;
  re->code_ = std::make_unique<Code>();
  const std::string text = literal ? std::string(pattern) : RewriteWhiteSpace(pattern);
  int error = 0;
  PCRE2_SIZE error_offset = 0;
  // PCRE2_LITERAL admits no UCP (there are no classes in plain text to widen).
  const uint32_t options = literal ? (PCRE2_UTF | PCRE2_LITERAL) : (PCRE2_UTF | PCRE2_UCP);
  re->code_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), options, &error,
                                  &error_offset, nullptr);
  if (re->code_->code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return absl::InvalidArgumentError(absl::StrCat(what, ": cannot compile regex \"", std::string(pattern), "\": ",
                                                   reinterpret_cast<const char*>(message), " (at offset ",
                                                   error_offset, ")"));
  }
  re->jit_ = pcre2_jit_compile(re->code_->code, PCRE2_JIT_COMPLETE) == 0;
  return re;
}

Status Regex::FindAll(std::string_view subject, MatchScratch* scratch,
                      std::vector<std::pair<size_t, size_t>>* out) const {
  MatchScratch::Impl& s = scratch->impl();
  const auto* subj = reinterpret_cast<PCRE2_SPTR>(subject.data());
  const size_t n = subject.size();
  size_t start = 0;
  while (start <= n) {
    int rc = pcre2_match(code_->code, subj, n, start, PCRE2_NO_UTF_CHECK, s.data, s.context);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      rc = pcre2_match(code_->code, subj, n, start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, s.data, s.context);
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      return absl::ResourceExhaustedError(absl::StrCat(what_, ": regex match failed at byte ", start, " of a ",
                                                       n, "-byte piece: ",
                                                       reinterpret_cast<const char*>(message)));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(s.data);
    const size_t b = ov[0];
    const size_t e = ov[1];
    if (e <= b) {  // empty match: step over one character, as Oniguruma's find_iter does
      if (b >= n) break;
      size_t len = 1;
      DecodeCodePoint(subject, b, &len);
      start = b + len;
      continue;
    }
    out->emplace_back(b, e);
    start = e;
  }
  return absl::OkStatus();
}

bool Regex::MatchesAtStart(std::string_view subject, MatchScratch* scratch) const {
  MatchScratch::Impl& s = scratch->impl();
  const int rc = pcre2_match(code_->code, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), 0,
                             PCRE2_NO_UTF_CHECK | PCRE2_ANCHORED, s.data, s.context);
  return rc >= 0;
}

}  // namespace numoe::tokenizer
