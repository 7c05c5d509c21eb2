// JSON text exactly as Python's `json.dumps(value, ensure_ascii=False)` writes it, which is what the
// DeepSeek V4 encoder puts into prompts (tool schemas, response formats, non-string tool arguments):
//   separators ", " and ": ", object keys in their stored order (use nlohmann::ordered_json and never
//   re-sort), non-ASCII as raw UTF-8, only \" \\ \n \r \t \b \f escaped plus other C0 controls as \u00xx
//   (lowercase hex), integers in decimal, floats as Python repr (1e2 -> 100.0, 1e16 -> 1e+16,
//   0.0001 -> 0.0001, 1e-05), NaN / Infinity / -Infinity as Python writes them.
#pragma once

#include <string>
#include <string_view>

#include "nlohmann/json.hpp"

namespace numoe::chat {

std::string PythonJsonDumps(const nlohmann::ordered_json& value);
// The body of a JSON string literal (no quotes), escaped as above. Escaping is per character, so
// escaping the pieces of a string and concatenating gives the escape of the whole.
void AppendPythonJsonEscaped(std::string_view text, std::string* out);
// Python repr() of a float.
std::string PythonFloatRepr(double v);

}  // namespace numoe::chat
