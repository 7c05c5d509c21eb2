// numoe-bench: benchmarks with JSON output (the last line of each run is one JSON object).
#include <cstdio>
#include <cstring>
#include <string>

#include "bench/commands.h"

namespace {

struct Bench {
  const char* name;
  const char* summary;
  int (*run)(int, char**);
};

constexpr Bench kBenches[] = {
    {"tokenizer", "tokenizer encode MB/s on a 1 MB text", numoe::bench::RunTokenizerBench},
    {"experts", "routed-expert kernel GB/s vs the machine's read bandwidth", numoe::bench::RunExpertsBench},
    {"model", "one-process prefill and decode tokens/s (CPU backend)", numoe::bench::RunModelBench},
    {"decode", "end-to-end decode tokens/s through numoe serve vs the memory-bandwidth bound", numoe::bench::RunDecodeBench},
    {"cuda", "CUDA decode step on V4-Flash-shaped weights vs the memory-bandwidth floor", numoe::bench::RunCudaBench},
    {"prefix", "the prefix cache over a multi-turn conversation: TTFT cold vs warm per turn, hit rate", numoe::bench::RunPrefixBench},
    {"spec", "speculative vs plain decode tokens/s, accepted length, vs the experts-read prediction", numoe::bench::RunSpecBench},
    {"prefill", "time to first token and prefill tokens/s of long prompts through numoe serve vs the compute bound", numoe::bench::RunPrefillBench},
    {"hop", "layer-hop round trip over the shared-memory data plane, p50/p99 in us", numoe::bench::RunHopBench},
    {"soak", "numoe serve under a mixed load for S seconds: errors, and RSS/fds/threads growth per process", numoe::bench::RunSoakBench},
};

void PrintUsage(FILE* out) {
  std::fprintf(out, "usage: numoe-bench <benchmark> [flags]   (numoe-bench <benchmark> --help)\n\nbenchmarks:\n");
  for (const auto& b : kBenches) std::fprintf(out, "  %-10s %s\n", b.name, b.summary);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    PrintUsage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (const auto& b : kBenches) {
    if (std::strcmp(argv[1], b.name) == 0) {
      std::string prog = std::string("numoe-bench ") + b.name;
      argv[1] = prog.data();
      return b.run(argc - 1, argv + 1);
    }
  }
  std::fprintf(stderr, "numoe-bench: unknown benchmark '%s'\n", argv[1]);
  PrintUsage(stderr);
  return 2;
}
