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
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

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
  void AddDouble(const std::string& name, const std::string& metavar, const std::string& help, double* out,
                 double min = -1e308, double max = 1e308, bool required = false);
  // Free text appended to --help (examples, environment variables).
  void AddEpilog(const std::string& text) { epilog_ += text; }

  // Parses argv[first..argc). Returns an error naming the flag on bad input.
  Status Parse(int argc, char** argv, int first = 1);
  // Parse, print help (exit code 0) or the error plus a hint (exit code 2). Returns true to continue.
  bool ParseOrExit(int argc, char** argv, int* exit_code, int first = 1);

  bool help_requested() const { return help_requested_; }
  bool given(const std::string& name) const;
  std::string Help() const;

 private:
  struct Option {
    std::string name, metavar, help;
    bool is_flag = false;
    bool required = false;
    bool seen = false;
    std::string default_text;
    std::function<Status(const std::string&)> set;
  };
  Option* Find(const std::string& name);
  std::string program_, summary_, epilog_;
  std::vector<Option> options_;
  bool help_requested_ = false;
};

// Parses "1,2,3" into integers; errors name `what`.
StatusOr<std::vector<int64_t>> ParseIntList(const std::string& text, const std::string& what);

}  // namespace numoe
