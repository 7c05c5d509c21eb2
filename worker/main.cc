// numoe-worker: one per NUMA node: holds the routed experts and computes them on the CPU.
#include <cstdio>

#include "common/args.h"

int main(int argc, char** argv) {
  numoe::ArgParser parser("numoe-worker", "one per NUMA node: holds the routed experts and computes them on the CPU.\nThe multi-process runtime is not implemented yet (issue #4).");
  int rc = 0;
  if (!parser.ParseOrExit(argc, argv, &rc)) return rc;
  std::fprintf(stderr, "numoe-worker: not implemented yet (issue #4)\n");
  return 1;
}
