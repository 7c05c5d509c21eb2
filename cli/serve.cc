#include <cstdio>

#include "cli/commands.h"
#include "common/args.h"

namespace numoe::cli {

int RunServe(int argc, char** argv) {
  ArgParser parser(argv[0], "Not implemented yet.");
  int rc = 0;
  if (!parser.ParseOrExit(argc, argv, &rc)) return rc;
  std::fprintf(stderr, "%s: not implemented yet\n", argv[0]);
  return 1;
}

}  // namespace numoe::cli
