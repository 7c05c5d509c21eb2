#include "common/args.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace numoe {

ArgParser::ArgParser(std::string program, std::string summary)
    : program_(std::move(program)), summary_(std::move(summary)) {}

void ArgParser::AddFlag(const std::string& name, const std::string& help, bool* out) {
  Option o;
  o.name = name;
  o.help = help;
  o.is_flag = true;
  o.set = [out](const std::string&) {
    *out = true;
    return absl::OkStatus();
  };
  options_.push_back(std::move(o));
}

void ArgParser::AddString(const std::string& name, const std::string& metavar, const std::string& help,
                          std::string* out, bool required) {
  Option o;
  o.name = name;
  o.metavar = metavar;
  o.help = help;
  o.required = required;
  if (!out->empty()) o.default_text = *out;
  o.set = [out](const std::string& v) {
    *out = v;
    return absl::OkStatus();
  };
  options_.push_back(std::move(o));
}

void ArgParser::AddInt(const std::string& name, const std::string& metavar, const std::string& help, int64_t* out,
                       int64_t min, int64_t max, bool required) {
  Option o;
  o.name = name;
  o.metavar = metavar;
  o.help = help;
  o.required = required;
  o.default_text = std::to_string(*out);
  o.set = [out, min, max, name](const std::string& v) -> Status {
    int64_t x = 0;
    if (!absl::SimpleAtoi(v, &x)) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": '", v, "' is not an integer"));
    }
    if (x < min || x > max) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", x, " is out of range [", min, ", ", max, "]"));
    }
    *out = x;
    return absl::OkStatus();
  };
  options_.push_back(std::move(o));
}

void ArgParser::AddDouble(const std::string& name, const std::string& metavar, const std::string& help, double* out,
                          double min, double max, bool required) {
  Option o;
  o.name = name;
  o.metavar = metavar;
  o.help = help;
  o.required = required;
  std::ostringstream os;
  os << *out;
  o.default_text = os.str();
  o.set = [out, min, max, name](const std::string& v) -> Status {
    double x = 0;
    if (!absl::SimpleAtod(v, &x) || !std::isfinite(x)) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": '", v, "' is not a finite number"));
    }
    if (x < min || x > max) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", v, " is out of range [", min, ", ", max, "]"));
    }
    *out = x;
    return absl::OkStatus();
  };
  options_.push_back(std::move(o));
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
