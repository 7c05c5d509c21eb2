// Monotonic time (std::chrono::steady_clock, not wall-clock time) for latencies, deadlines and rates.
#pragma once

#include <chrono>
#include <cstdint>

namespace numoe {

// Nanoseconds since an arbitrary fixed point (the clock's epoch); only differences mean anything.
inline int64_t SteadyNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace numoe
