// Subcommands of numoe-bench. Each prints human lines and, last, one JSON object.
#pragma once

namespace numoe::bench {

int RunTokenizerBench(int argc, char** argv);  // bench/tokenizer_bench.cc
int RunExpertsBench(int argc, char** argv);    // bench/experts_bench.cc
int RunModelBench(int argc, char** argv);      // bench/model_bench.cc
int RunDecodeBench(int argc, char** argv);     // bench/decode_bench.cc
int RunCudaBench(int argc, char** argv);       // bench/cuda_bench.cc
int RunHopBench(int argc, char** argv);        // bench/hop_bench.cc
int RunSpecBench(int argc, char** argv);       // bench/spec_bench.cc
int RunPrefillBench(int argc, char** argv);    // bench/prefill_bench.cc
int RunPrefixBench(int argc, char** argv);     // bench/prefix_bench.cc
int RunSoakBench(int argc, char** argv);       // bench/soak_bench.cc

}  // namespace numoe::bench
