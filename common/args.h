// A small command-line parser shared by every numoe binary.
//
//   ArgParser p("numoe inspect", "Describe a checkpoint or config without running it.");
//   std::string model; bool json = false;
//   p.AddString("model", "DIR", "checkpoint directory", &model);
//   p.AddFlag("json", "print JSON instead of text", &json);
//   if (int rc; !p.ParseOrExit(argc, argv, &rc)) return rc;   // prints --help / errors itself
//
// Accepts "--name value" and "--name=value". Unknown flags, missing values, bad numbers and values out
// of range are errors that name the flag. Every parser has --help.
//
// Enumerated options go through AddEnum<T> and the enum's name table (common/choices.h), so a bad value
// gets the one message "--NAME must be a, b or c (got 'x')".
//
// The parser also writes a command line back: every option remembers the value its variable had when it
// was added (the default) and reads the variable's current value, so ChangedArgv() lists the options
// whose value differs from the default. A daemon's flags file registers its flags once and derives its
// argv from the same registration (worker/service/worker_flags.h):
//   Config c; ArgParser p(...); AddFlags(p, &c);  c = wanted;  p.ChangedArgv()  // -> wanted as an argv
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/choices.h"
#include "common/status.h"

namespace numoe {

class ArgParser {
 public:
  ArgParser(std::string program, std::string summary);

  void AddFlag(const std::string& name, const std::string& help, bool* out);
  void AddString(const std::string& name, const std::string& metavar, const std::string& help, std::string* out,
                 bool required = false);
  void AddInt(const std::string& name, const std::string& metavar, const std::string& help, int64_t* out,
              int64_t min = INT64_MIN, int64_t max = INT64_MAX, bool required = false);
  // The same for config fields that are int or size_t (ports, thread counts, byte sizes).
  void AddInt(const std::string& name, const std::string& metavar, const std::string& help, int* out,
              int64_t min = INT32_MIN, int64_t max = INT32_MAX, bool required = false);
  void AddInt(const std::string& name, const std::string& metavar, const std::string& help, size_t* out,
              int64_t min = 0, int64_t max = INT64_MAX, bool required = false);
  void AddDouble(const std::string& name, const std::string& metavar, const std::string& help, double* out,
                 double min = -1e308, double max = 1e308, bool required = false);
  // "1,2,3" (non-negative integers) into `out`.
  void AddIntList(const std::string& name, const std::string& metavar, const std::string& help, std::vector<int>* out);
  // One of ChoiceTable<T>'s names; the metavar "a|b|c" comes from the table.
  template <typename T>
  void AddEnum(const std::string& name, const std::string& help, T* out) {
    AddValue(
        name, ChoiceMetavar<T>(), help,
        [out, name](const std::string& v) -> Status {
          ASSIGN_OR_RETURN(*out, ParseChoice<T>(v, "--" + name));
          return absl::OkStatus();
        },
        [out] { return std::string(ChoiceName(*out)); });
  }
  // Any other value: `set` parses and stores it (its errors name --name), `get` writes the current value
  // back as text that `set` accepts ("" = unset: not written, no default shown).
  void AddValue(const std::string& name, const std::string& metavar, const std::string& help,
                std::function<Status(const std::string&)> set, std::function<std::string()> get,
                bool required = false);
  // Free text appended to --help (examples, environment variables).
  void AddEpilog(const std::string& text) { epilog_ += text; }

  // Parses argv[first..argc). Returns an error naming the flag on bad input.
  Status Parse(int argc, char** argv, int first = 1);
  // Parse, print help (exit code 0) or the error plus a hint (exit code 2). Returns true to continue.
  bool ParseOrExit(int argc, char** argv, int* exit_code, int first = 1);

  bool help_requested() const { return help_requested_; }
  bool given(const std::string& name) const;
  std::string Help() const;
  // "--name value" (or "--name" for a flag that is set) for every option whose variable now differs from
  // its value when the option was added, in registration order. Parse(ChangedArgv()) on a parser over
  // default variables restores the current values.
  std::vector<std::string> ChangedArgv() const;
  // Every option's name, in registration order (tests check that a config sets them all).
  std::vector<std::string> names() const;

 private:
  struct Option {
    std::string name, metavar, help;
    bool is_flag = false;
    bool required = false;
    bool seen = false;
    std::string default_text;  // the value when added
    std::function<Status(const std::string&)> set;
    std::function<std::string()> get;
  };
  Option* Find(const std::string& name);
  std::string program_, summary_, epilog_;
  std::vector<Option> options_;
  bool help_requested_ = false;
};

// `config` as the argv that parses back to it: `add_flags(ArgParser&, Config*)` registers the flags onto a
// default Config, which then takes config's values, and ChangedArgv writes the fields that differ.
template <typename Config, typename AddFlags>
std::vector<std::string> ArgvOf(const Config& config, AddFlags add_flags) {
  Config bound;
  ArgParser p("argv", "");
  add_flags(p, &bound);
  bound = config;
  return p.ChangedArgv();
}

// Parses "1,2,3" into integers; errors name `what`.
StatusOr<std::vector<int64_t>> ParseIntList(const std::string& text, const std::string& what);

}  // namespace numoe
