#include "router/core/api_keys.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace numoe::router {

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  const size_t n = std::max(a.size(), b.size());
  // volatile: the compiler may not turn the loop into an early-exit memcmp.
  volatile unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff = diff | static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

StatusOr<std::vector<std::string>> ParseApiKeys(absl::string_view text, const std::string& source) {
  std::vector<std::string> keys;
  int line_no = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line_no;
    absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty() || line[0] == '#') continue;
    for (char c : line) {
      if (absl::ascii_isspace(static_cast<unsigned char>(c))) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ":", line_no, ": a key may not contain whitespace (one key per line)"));
      }
      if (static_cast<unsigned char>(c) < 0x21 || static_cast<unsigned char>(c) > 0x7e) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ":", line_no, ": a key must be printable ASCII (it travels in an HTTP header)"));
      }
    }
    keys.emplace_back(line);
  }
  if (keys.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": no key in the file (one key per line; '#' starts a comment)"));
  }
  return keys;
}

StatusOr<std::vector<std::string>> LoadApiKeyFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::InvalidArgumentError(absl::StrCat("--api-key-file ", path, ": cannot open the file"));
  std::stringstream ss;
  ss << f.rdbuf();
  if (f.bad()) return absl::InvalidArgumentError(absl::StrCat("--api-key-file ", path, ": cannot read the file"));
  return ParseApiKeys(ss.str(), absl::StrCat("--api-key-file ", path));
}

ApiKeys::ApiKeys(std::vector<std::string> keys) {
  for (auto& k : keys) {
    if (!k.empty()) keys_.push_back(std::move(k));
  }
}

bool ApiKeys::Matches(absl::string_view key) const {
  bool found = false;
  for (const std::string& k : keys_) found |= ConstantTimeEquals(k, key);
  return found;
}

Status ApiKeys::Check(absl::string_view authorization, absl::string_view x_api_key,
                      absl::string_view how_to_send) const {
  if (keys_.empty()) return absl::OkStatus();
  if (authorization.empty() && x_api_key.empty()) {
    return absl::UnauthenticatedError(absl::StrCat("missing API key: ", how_to_send));
  }
  constexpr absl::string_view kBearer = "Bearer ";
  bool ok = false;
  if (authorization.size() > kBearer.size() && authorization.substr(0, kBearer.size()) == kBearer) {
    ok |= Matches(authorization.substr(kBearer.size()));
  }
  if (!x_api_key.empty()) ok |= Matches(x_api_key);
  if (!ok) return absl::UnauthenticatedError("invalid API key");
  return absl::OkStatus();
}

bool IsLoopbackHost(const std::string& host) {
  if (host == "localhost" || host == "::1" || host == "[::1]") return true;
  // 127.0.0.0/8, written as a dotted quad.
  std::vector<absl::string_view> parts = absl::StrSplit(host, '.');
  if (parts.size() != 4 || parts[0] != "127") return false;
  for (absl::string_view p : parts) {
    if (p.empty() || p.size() > 3) return false;
    for (char c : p) {
      if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
    }
  }
  return true;
}

}  // namespace numoe::router
