// The read-bandwidth yardstick: every speed claim of numoe-bench (experts, decode, spec) is a ratio to it,
// measured in the same run, on the same threads and the same memory.
//
// It is meant to be the fastest streaming read those threads can do, so a ratio means "fraction of what the
// memory gives": ChooseReadMethod times every read loop this CPU can run (read/read_methods.h: the widest
// vector loads, several accumulators, with and without software prefetch, non-temporal loads, several
// streams per thread in lock step, and the decode kernel's own way of reading: read/read_streams.h) on the
// buffer itself and keeps the one with the highest median; the benchmarks name it ("read_method"). A
// kernel ratio above 1 therefore means a broken yardstick, and numoe-bench experts fails on one.
// NUMOE_ISA=generic|avx2 leaves out the wider loops (the same switch that keeps the kernels off them).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "bench/read/read_methods.h"
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

// A buffer the yardstick reads (any address and size: the read loops get its aligned whole blocks).
struct ReadSpan {
  const uint8_t* data = nullptr;
  size_t bytes = 0;
};

// The read loops timed: those of the widest loads this CPU and OS can run (and NUMOE_ISA allows), then the
// old yardstick's loop (which can win only where it really is the fastest read).
const std::vector<ReadMethod>& AvailableReadMethods();

// One timed pass of `method` over every span in turn: each of the pool's threads reads a contiguous
// 1/size() share of the span (one RunOnAll per span), or, for a method with piece_bytes, the threads claim
// the span's pieces in turn (one RunOnAvailable per span). Returns seconds; adds the loops' results (and the
// unaligned bytes at the ends, one by one) into *sink.
double ReadPass(ThreadPool& pool, const ReadMethod& method, const std::vector<ReadSpan>& spans, uint64_t* sink);
double SpanBytes(const std::vector<ReadSpan>& spans);

struct ReadChoice {
  struct Timing {
    const ReadMethod* method;
    double median_gbps;
  };
  const ReadMethod* best = nullptr;  // highest median
  double best_gbps = 0;              // its median
  std::vector<Timing> timings;       // every method, in AvailableReadMethods() order
  double seconds = 0;                // ChooseReadMethod's own time (every pass, the faulting one included)
  std::string Summary() const;       // "avx512-x4 30.1, avx512-x4-nt 29.8, ... GB/s"
};

// Times every available method `trials` times over `spans` (round robin, so a change in the machine's load
// hits all methods alike) after one untimed pass that faults the pages in, and picks the highest median.
ReadChoice ChooseReadMethod(ThreadPool& pool, const std::vector<ReadSpan>& spans, int trials, uint64_t* sink);

}  // namespace numoe::bench
