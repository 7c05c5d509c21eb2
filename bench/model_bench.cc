#include <cstdio>

#include "bench/commands.h"
#include "common/args.h"

namespace numoe::bench {

int RunModelBench(int argc, char** argv) {
  ArgParser parser(argv[0], "Not implemented yet.");
  int rc = 0;
  if (!parser.ParseOrExit(argc, argv, &rc)) return rc;
  std::fprintf(stderr, "%s: not implemented yet\n", argv[0]);
  return 1;
}

}  // namespace numoe::bench
