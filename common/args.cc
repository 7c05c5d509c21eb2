#include "common/args.h"

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace numoe {

namespace {

// Parses an integer flag value in [min, max]; errors name the flag.
StatusOr<int64_t> ParseIntFlag(const std::string& name, const std::string& v, int64_t min, int64_t max) {
  int64_t x = 0;
  if (!absl::SimpleAtoi(v, &x)) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": '", v, "' is not an integer"));
  }
  if (x < min || x > max) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", x, " is out of range [", min, ", ", max, "]"));
  }
  return x;
}

// The shortest text that parses back to exactly `x` (so a written-back argv restores the same double).
std::string DoubleText(double x) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof(buf), x);
  return std::string(buf, r.ptr);
}

template <typename Int>
void AddIntOf(ArgParser* p, const std::string& name, const std::string& metavar, const std::string& help, Int* out,
              int64_t min, int64_t max, bool required) {
  p->AddValue(
      name, metavar, help,
      [out, min, max, name](const std::string& v) -> Status {
        ASSIGN_OR_RETURN(int64_t x, ParseIntFlag(name, v, min, max));
        *out = static_cast<Int>(x);
        return absl::OkStatus();
      },
      [out] { return std::to_string(*out); }, required);
}

}  // namespace

ArgParser::ArgParser(std::string program, std::string summary)
    : program_(std::move(program)), summary_(std::move(summary)) {}

void ArgParser::AddValue(const std::string& name, const std::string& metavar, const std::string& help,
                         std::function<Status(const std::string&)> set, std::function<std::string()> get,
                         bool required) {
  Option o;
  o.name = name;
  o.metavar = metavar;
  o.help = help;
  o.required = required;
  o.default_text = get();
  o.set = std::move(set);
  o.get = std::move(get);
  options_.push_back(std::move(o));
}

void ArgParser::AddFlag(const std::string& name, const std::string& help, bool* out) {
  AddValue(
      name, "", help,
      [out](const std::string&) {
        *out = true;
        return absl::OkStatus();
      },
      [out] { return std::string(*out ? "true" : ""); });
  options_.back().is_flag = true;
}

void ArgParser::AddString(const std::string& name, const std::string& metavar, const std::string& help,
                          std::string* out, bool required) {
  AddValue(
      name, metavar, help,
      [out](const std::string& v) {
        *out = v;
        return absl::OkStatus();
      },
      [out] { return *out; }, required);
}

void ArgParser::AddInt(const std::string& name, const std::string& metavar, const std::string& help, int64_t* out,
                       int64_t min, int64_t max, bool required) {
  AddIntOf(this, name, metavar, help, out, min, max, required);
}

void ArgParser::AddInt(const std::string& name, const std::string& metavar, const std::string& help, int* out,
                       int64_t min, int64_t max, bool required) {
  AddIntOf(this, name, metavar, help, out, std::max<int64_t>(min, INT32_MIN), std::min<int64_t>(max, INT32_MAX),
           required);
}

void ArgParser::AddInt(const std::string& name, const std::string& metavar, const std::string& help, size_t* out,
                       int64_t min, int64_t max, bool required) {
  AddIntOf(this, name, metavar, help, out, std::max<int64_t>(min, 0), max, required);
}

void ArgParser::AddDouble(const std::string& name, const std::string& metavar, const std::string& help, double* out,
                          double min, double max, bool required) {
  AddValue(
      name, metavar, help,
      [out, min, max, name](const std::string& v) -> Status {
        double x = 0;
        if (!absl::SimpleAtod(v, &x) || !std::isfinite(x)) {
          return absl::InvalidArgumentError(absl::StrCat("--", name, ": '", v, "' is not a finite number"));
        }
        if (x < min || x > max) {
          return absl::InvalidArgumentError(
              absl::StrCat("--", name, ": ", v, " is out of range [", min, ", ", max, "]"));
        }
        *out = x;
        return absl::OkStatus();
      },
      [out] { return DoubleText(*out); }, required);
}

void ArgParser::AddIntList(const std::string& name, const std::string& metavar, const std::string& help,
                           std::vector<int>* out) {
  AddValue(
      name, metavar, help,
      [out, name](const std::string& v) -> Status {
        ASSIGN_OR_RETURN(std::vector<int64_t> list, ParseIntList(v, "--" + name));
        std::vector<int> parsed;
        for (int64_t x : list) {
          if (x < 0 || x > INT32_MAX) {
            return absl::InvalidArgumentError(
                absl::StrCat("--", name, ": ", x, " is out of range [0, ", INT32_MAX, "]"));
          }
          parsed.push_back(static_cast<int>(x));
        }
        *out = std::move(parsed);
        return absl::OkStatus();
      },
      [out] { return absl::StrJoin(*out, ","); });
}

std::vector<std::string> ArgParser::names() const {
  std::vector<std::string> out;
  for (const Option& o : options_) out.push_back(o.name);
  return out;
}

std::vector<std::string> ArgParser::ChangedArgv() const {
  std::vector<std::string> argv;
  for (const Option& o : options_) {
    const std::string now = o.get();
    if (now == o.default_text) continue;
    argv.push_back("--" + o.name);
    if (!o.is_flag) argv.push_back(now);
  }
  return argv;
}

ArgParser::Option* ArgParser::Find(const std::string& name) {
  for (auto& o : options_) {
    if (o.name == name) return &o;
  }
  return nullptr;
}

bool ArgParser::given(const std::string& name) const {
  for (const auto& o : options_) {
    if (o.name == name) return o.seen;
  }
  return false;
}

Status ArgParser::Parse(int argc, char** argv, int first) {
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      help_requested_ = true;
      return absl::OkStatus();
    }
    if (arg.rfind("--", 0) != 0 || arg.size() == 2) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
    }
    std::string name = arg.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    Option* o = Find(name);
    if (o == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    if (o->is_flag) {
      if (has_value) return absl::InvalidArgumentError(absl::StrCat("--", name, " takes no value"));
    } else if (!has_value) {
      if (i + 1 >= argc) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value (", o->metavar, ")"));
      }
      value = argv[++i];
    }
    RETURN_IF_ERROR(o->set(value));
    o->seen = true;
  }
  for (const auto& o : options_) {
    if (o.required && !o.seen) return absl::InvalidArgumentError(absl::StrCat("--", o.name, " is required"));
  }
  return absl::OkStatus();
}

bool ArgParser::ParseOrExit(int argc, char** argv, int* exit_code, int first) {
  Status s = Parse(argc, argv, first);
  if (help_requested_) {
    std::fputs(Help().c_str(), stdout);
    *exit_code = 0;
    return false;
  }
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n(run '%s --help' for usage)\n", program_.c_str(), std::string(s.message()).c_str(),
                 program_.c_str());
    *exit_code = 2;
    return false;
  }
  return true;
}

std::string ArgParser::Help() const {
  std::ostringstream os;
  os << "usage: " << program_ << " [flags]\n\n" << summary_ << "\n\nflags:\n";
  for (const auto& o : options_) {
    std::string head = "  --" + o.name + (o.metavar.empty() ? "" : " " + o.metavar);
    os << head;
    if (head.size() < 28) {
      os << std::string(28 - head.size(), ' ');
    } else {
      os << "\n" << std::string(28, ' ');
    }
    os << o.help;
    if (o.required) {
      os << " (required)";
    } else if (!o.default_text.empty() && !o.is_flag) {
      os << " (default: " << o.default_text << ")";
    }
    os << "\n";
  }
  os << "  --help                    show this help\n";
  if (!epilog_.empty()) os << "\n" << epilog_ << "\n";
  return os.str();
}

StatusOr<std::vector<int64_t>> ParseIntList(const std::string& text, const std::string& what) {
  std::vector<int64_t> out;
  if (text.empty()) return absl::InvalidArgumentError(absl::StrCat(what, ": empty list"));
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(part, &v)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": '", std::string(part), "' is not an integer"));
    }
    out.push_back(v);
  }
  return out;
}

}  // namespace numoe
