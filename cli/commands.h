// Subcommands of the `numoe` tool. Each takes the arguments after the subcommand name
// (argv[0] is "numoe <sub>") and returns the process exit code.
#pragma once

namespace numoe::cli {

int RunInspect(int argc, char** argv);   // cli/inspect.cc
int RunGenerate(int argc, char** argv);  // cli/generate.cc
int RunPlan(int argc, char** argv);      // cli/plan.cc
int RunServe(int argc, char** argv);     // cli/serve.cc
int RunMkmodel(int argc, char** argv);   // cli/mkmodel.cc

}  // namespace numoe::cli
