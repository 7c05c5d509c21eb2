// A small thread-safe recorder of the last N latency samples, with percentiles (nearest rank).
#pragma once

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

namespace numoe::gpu {

class LatencyRecorder {
 public:
  explicit LatencyRecorder(size_t capacity = 8192) : samples_(capacity) {}

  void Add(double micros) {
    std::lock_guard<std::mutex> lk(mu_);
    samples_[next_ % samples_.size()] = micros;
    ++next_;
  }
  // p in [0, 100]; 0 when no samples.
  double Percentile(double p) const {
    std::vector<double> v;
    {
      std::lock_guard<std::mutex> lk(mu_);
      v.assign(samples_.begin(), samples_.begin() + static_cast<long>(std::min(next_, samples_.size())));
    }
    if (v.empty()) return 0.0;
    size_t k = static_cast<size_t>(p / 100.0 * static_cast<double>(v.size()));
    k = std::min(k, v.size() - 1);
    std::nth_element(v.begin(), v.begin() + static_cast<long>(k), v.end());
    return v[k];
  }
  uint64_t count() const {
    std::lock_guard<std::mutex> lk(mu_);
    return next_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<double> samples_;
  uint64_t next_ = 0;
};

}  // namespace numoe::gpu
