#include "router/chat/py_json.h"

#include <charconv>
#include <cmath>
#include <cstdlib>

namespace numoe::chat {
namespace {

void Dump(const nlohmann::ordered_json& v, std::string* out) {
  using T = nlohmann::ordered_json::value_t;
  switch (v.type()) {
    case T::null:
    case T::discarded:
    case T::binary:  // never produced by parsing JSON text
      out->append("null");
      return;
    case T::boolean:
      out->append(v.get<bool>() ? "true" : "false");
      return;
    case T::number_integer:
      out->append(std::to_string(v.get<int64_t>()));
      return;
    case T::number_unsigned:
      out->append(std::to_string(v.get<uint64_t>()));
      return;
    case T::number_float:
      out->append(PythonFloatRepr(v.get<double>()));
      return;
    case T::string:
      out->push_back('"');
      AppendPythonJsonEscaped(v.get_ref<const std::string&>(), out);
      out->push_back('"');
      return;
    case T::array: {
      out->push_back('[');
      bool first = true;
      for (const auto& e : v) {
        if (!first) out->append(", ");
        first = false;
        Dump(e, out);
      }
      out->push_back(']');
      return;
    }
    case T::object: {
      out->push_back('{');
      bool first = true;
      for (const auto& [key, e] : v.items()) {
        if (!first) out->append(", ");
        first = false;
        out->push_back('"');
        AppendPythonJsonEscaped(key, out);
        out->append("\": ");
        Dump(e, out);
      }
      out->push_back('}');
      return;
    }
  }
}

}  // namespace

void AppendPythonJsonEscaped(std::string_view text, std::string* out) {
  static constexpr char kHex[] = "0123456789abcdef";
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      case '\b': out->append("\\b"); break;
      case '\f': out->append("\\f"); break;
      default:
        if (u < 0x20) {
          out->append("\\u00");
          out->push_back(kHex[u >> 4]);
          out->push_back(kHex[u & 15]);
        } else {
          out->push_back(c);
        }
    }
  }
}

std::string PythonFloatRepr(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  if (v == 0) return std::signbit(v) ? "-0.0" : "0.0";
  // Shortest round-trip digits (the same digits Python's repr uses), then Python's layout rule:
  // exponent in [-4, 16) -> positional with at least one fractional digit, else d.ddde+XX.
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<size_t>(res.ptr - buf));  // e.g. "-1.2345e+02"
  std::string out;
  if (sci.front() == '-') {
    out.push_back('-');
    sci.remove_prefix(1);
  }
  const size_t epos = sci.find('e');
  std::string digits;
  for (const char c : sci.substr(0, epos)) {
    if (c != '.') digits.push_back(c);
  }
  const int exp = std::atoi(std::string(sci.substr(epos + 1)).c_str());
  if (exp < -4 || exp >= 16) {
    out.push_back(digits[0]);
    if (digits.size() > 1) {
      out.push_back('.');
      out.append(digits, 1, std::string::npos);
    }
    out.push_back('e');
    out.push_back(exp < 0 ? '-' : '+');
    const int a = std::abs(exp);
    if (a < 10) out.push_back('0');
    out.append(std::to_string(a));
    return out;
  }
  if (exp < 0) {
    out.append("0.");
    out.append(static_cast<size_t>(-exp - 1), '0');
    out.append(digits);
    return out;
  }
  const auto int_len = static_cast<size_t>(exp + 1);
  if (digits.size() <= int_len) {
    out.append(digits);
    out.append(int_len - digits.size(), '0');
    out.append(".0");
  } else {
    out.append(digits, 0, int_len);
    out.push_back('.');
    out.append(digits, int_len, std::string::npos);
  }
  return out;
}

std::string PythonJsonDumps(const nlohmann::ordered_json& value) {
  std::string out;
  Dump(value, &out);
  return out;
}

}  // namespace numoe::chat
