// Internal to numoe_deploy: the plan's explanation in sentences (plan_explain.cc), and the two small
// helpers it shares with planner.cc.
#pragma once

#include <cstdint>
#include <string>

#include "deploy/planner.h"

namespace numoe::deploy {

// Fills plan.explanation: why each node runs what it runs, what numoe-gpu holds, the bandwidth bound on
// speed and, when the description gives DIMMs, what a fuller population would change. MakePlan calls it
// once the workers are placed.
void Explain(Plan& plan);

// ceil(bytes x fraction).
int64_t CeilTimes(int64_t bytes, double fraction);
// "1 stage", "2 stages".
std::string Plural(int64_t n, const std::string& word);

}  // namespace numoe::deploy
