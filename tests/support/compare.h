// Comparing float results in tests.
#pragma once

#include <cmath>
#include <vector>

namespace numoe::test {

// The largest |a[i] - b[i]|; infinity when the sizes differ, and a NaN anywhere counts as the worst, so a
// bound on it also catches missing rows and non-finite output.
inline float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  float worst = a.size() == b.size() ? 0.0f : INFINITY;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const float d = std::fabs(a[i] - b[i]);
    if (!(d <= worst)) worst = d;
  }
  return worst;
}

}  // namespace numoe::test
