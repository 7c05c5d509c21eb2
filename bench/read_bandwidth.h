// Streaming-read bandwidth helpers shared by the benchmarks that compare a speed against the memory's: the
// routed-expert kernels (experts_bench.cc) and end-to-end decode (decode_bench.cc). Moved unchanged from
// experts_bench.cc so that both measure the machine's bandwidth the same way.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "common/thread_pool.h"

namespace numoe::bench {

// The largest cache of CPU 0 (bytes; 32 MiB when sysfs does not say): read buffers are sized past it.
inline int64_t LastLevelCacheBytes() {
  int64_t best = 0;
  for (int index = 0; index < 8; ++index) {
    std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
    std::string s;
    if (!(f >> s) || s.empty()) continue;
    int64_t v = std::atoll(s.c_str());
    if (s.back() == 'K') v <<= 10;
    if (s.back() == 'M') v <<= 20;
    best = std::max(best, v);
  }
  return best > 0 ? best : (32 << 20);
}

inline double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// One streaming pass over [data, data + bytes): every thread sums its contiguous share with 8 independent
// 64-bit lanes (vectorised loads), prefetching ahead like the kernel does. Returns seconds.
inline double ReadPass(ThreadPool& pool, const uint8_t* data, size_t bytes, uint64_t* sink) {
  std::vector<uint64_t> sums(pool.size() * 8, 0);
  const auto t0 = std::chrono::steady_clock::now();
  pool.RunOnAll([&](int t) {
    const size_t per = bytes / pool.size() / 64 * 64;
    const uint8_t* p = data + per * t;
    const size_t n = (t == pool.size() - 1) ? bytes - per * t : per;
    uint64_t acc[8] = {};
    for (size_t i = 0; i + 64 <= n; i += 64) {
      __builtin_prefetch(p + i + 2048, 0, 3);
      uint64_t v[8];
      std::memcpy(v, p + i, 64);
      for (int j = 0; j < 8; ++j) acc[j] += v[j];
    }
    for (int j = 0; j < 8; ++j) sums[t * 8 + j] = acc[j];
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (uint64_t v : sums) *sink += v;
  return s;
}

}  // namespace numoe::bench
