// numoe-router: the front door.
#include <cstdio>

#include "common/args.h"

int main(int argc, char** argv) {
  numoe::ArgParser parser("numoe-router", "the front door: gRPC API + OpenAI-compatible REST gateway, tokenizer, load balancing.\nThe multi-process runtime is not implemented yet (issue #4).");
  int rc = 0;
  if (!parser.ParseOrExit(argc, argv, &rc)) return rc;
  std::fprintf(stderr, "numoe-router: not implemented yet (issue #4)\n");
  return 1;
}
