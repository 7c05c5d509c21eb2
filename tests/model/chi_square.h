// Two-sample chi-square homogeneity test for the sampled-speculation tests: are two samples of token
// categories drawn from the same distribution?
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace numoe::test {

// Chi-square statistic of the 2 x C contingency table of `a` and `b` (category -> count). Categories
// seen fewer than 20 times in both samples together are pooled into one cell, so every expected count is
// >= 5 for equal sample sizes. *dof receives the degrees of freedom (cells - 1).
inline double ChiSquare(const std::map<int32_t, int>& a, const std::map<int32_t, int>& b, int* dof) {
  std::map<int32_t, std::pair<int, int>> t;
  int na = 0, nb = 0;
  for (auto [k, v] : a) {
    t[k].first += v;
    na += v;
  }
  for (auto [k, v] : b) {
    t[k].second += v;
    nb += v;
  }
  std::vector<std::pair<double, double>> cells;
  std::pair<double, double> rare{0, 0};
  for (auto& [k, v] : t) {
    if (v.first + v.second < 20) {
      rare.first += v.first;
      rare.second += v.second;
    } else {
      cells.emplace_back(v.first, v.second);
    }
  }
  if (rare.first + rare.second > 0) cells.push_back(rare);
  double chi = 0;
  const double n = na + nb;
  for (auto [x, y] : cells) {
    const double tot = x + y;
    const double ex = tot * na / n, ey = tot * nb / n;
    if (ex > 0) chi += (x - ex) * (x - ex) / ex;
    if (ey > 0) chi += (y - ey) * (y - ey) / ey;
  }
  *dof = static_cast<int>(cells.size()) - 1;
  return chi;
}

// The chi-square 0.999 quantile (Wilson-Hilferty; within 1% of the exact value for dof >= 3): the
// critical value at significance 0.001.
inline double ChiSquareCritical999(int dof) {
  const double k = dof, z = 3.0902;  // the standard normal 0.999 quantile
  const double t = 1.0 - 2.0 / (9.0 * k) + z * std::sqrt(2.0 / (9.0 * k));
  return k * t * t * t;
}

}  // namespace numoe::test
