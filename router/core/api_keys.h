// API keys of the router, checked in one place for REST (Authorization: Bearer, Anthropic's x-api-key) and
// gRPC (metadata "authorization: Bearer <key>").
//
// Keys come from --api-key (or $NUMOE_API_KEY) and --api-key-file: one key per line; blank lines and lines
// starting with '#' are ignored, surrounding whitespace is stripped, a key may not contain whitespace.
// Comparisons take time that depends on the lengths only, never on how many leading bytes match, and every
// key is compared (no early exit on a match), so response times do not reveal a key byte by byte.
#pragma once

#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/status.h"

namespace numoe::router {

// Whether a == b, in time that depends on max(a.size(), b.size()) only.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

// The keys of a key file's text; errors name `source` and the 1-based line ("keys.txt:3: ...").
StatusOr<std::vector<std::string>> ParseApiKeys(absl::string_view text, const std::string& source);
// Reads and parses a key file; errors start with "--api-key-file <path>".
StatusOr<std::vector<std::string>> LoadApiKeyFile(const std::string& path);

class ApiKeys {
 public:
  ApiKeys() = default;
  explicit ApiKeys(std::vector<std::string> keys);

  // No keys: authentication is off.
  bool empty() const { return keys_.empty(); }
  size_t size() const { return keys_.size(); }
  // Whether `key` is one of the keys (each compared in constant time).
  bool Matches(absl::string_view key) const;

  // The check of one request. `authorization` is the Authorization header or metadata ("Bearer <key>"),
  // `x_api_key` Anthropic's header ("" when absent or not applicable). OK when authentication is off or
  // either carries a valid key; else Unauthenticated, "missing API key: <how_to_send>" when both are
  // empty, "invalid API key" otherwise.
  Status Check(absl::string_view authorization, absl::string_view x_api_key, absl::string_view how_to_send) const;

 private:
  std::vector<std::string> keys_;
};

// Whether `host` (a --host value) only accepts connections from this machine (127.0.0.0/8, ::1, localhost).
bool IsLoopbackHost(const std::string& host);

}  // namespace numoe::router
