// numoe-gpu: one per host.
#include <cstdio>

#include "common/args.h"

int main(int argc, char** argv) {
  numoe::ArgParser parser("numoe-gpu", "one per host: attention, norms, gates, shared experts, caches and sampling.\nThe multi-process runtime is not implemented yet (issue #4).");
  int rc = 0;
  if (!parser.ParseOrExit(argc, argv, &rc)) return rc;
  std::fprintf(stderr, "numoe-gpu: not implemented yet (issue #4)\n");
  return 1;
}
