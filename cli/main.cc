// numoe: the command-line tool. A table of subcommands; each lives in its own file.
#include <cstdio>
#include <cstring>
#include <string>

#include "cli/commands.h"

namespace {

struct Subcommand {
  const char* name;
  const char* summary;
  int (*run)(int, char**);
};

constexpr Subcommand kSubcommands[] = {
    {"inspect", "describe a checkpoint (--model DIR) or a config (--config FILE)", numoe::cli::RunInspect},
    {"generate", "generate text in one process (worker + CPU backend linked together)", numoe::cli::RunGenerate},
    {"plan", "plan workers per NUMA node from the topology and the model's memory", numoe::cli::RunPlan},
    {"serve", "start numoe-gpu, the workers and the router", numoe::cli::RunServe},
    {"mkmodel", "write a random-weight checkpoint in the official format", numoe::cli::RunMkmodel},
};

void PrintUsage(FILE* out) {
  std::fprintf(out, "usage: numoe <command> [flags]   (numoe <command> --help for its flags)\n\ncommands:\n");
  for (const auto& s : kSubcommands) std::fprintf(out, "  %-10s %s\n", s.name, s.summary);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    PrintUsage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (const auto& s : kSubcommands) {
    if (std::strcmp(argv[1], s.name) == 0) {
      std::string prog = std::string("numoe ") + s.name;
      argv[1] = prog.data();
      return s.run(argc - 1, argv + 1);
    }
  }
  std::fprintf(stderr, "numoe: unknown command '%s'\n", argv[1]);
  PrintUsage(stderr);
  return 2;
}
