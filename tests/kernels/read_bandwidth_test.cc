// The read-bandwidth yardstick (bench/read_bandwidth.h): every loop reads every byte of any span, and the
// chosen loop is not slower than an independent read of the same buffer on the same threads.
#include "bench/read_bandwidth.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

namespace numoe::bench {
namespace {

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};

std::unique_ptr<uint8_t, FreeDeleter> Buffer(size_t bytes, uint8_t fill) {
  std::unique_ptr<uint8_t, FreeDeleter> p(static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) & ~size_t{63})));
  std::memset(p.get(), fill, bytes);
  return p;
}

uint64_t Checksum(ThreadPool& pool, const ReadMethod& m, const std::vector<ReadSpan>& spans) {
  uint64_t sink = 0;
  ReadPass(pool, m, spans, &sink);
  return sink;
}

// Changing any one byte, at the unaligned head, in the middle, in the tail past the last whole block, or at
// a thread boundary, changes what every loop returns: none skips bytes (a fast yardstick that reads less
// would be no yardstick).
TEST(ReadBandwidth, EveryLoopReadsEveryByte) {
  ThreadPool pool(3);
  const size_t bytes = 3 * kReadBlock * 7 + 100, offset = 13;  // unaligned start, partial last block
  auto buf = Buffer(bytes + offset, 0x5a);
  const std::vector<ReadSpan> spans = {{buf.get() + offset, bytes}, {buf.get(), 1}};
  ASSERT_GE(AvailableReadMethods().size(), 2u);
  for (const ReadMethod& m : AvailableReadMethods()) {
    SCOPED_TRACE(m.name);
    const uint64_t base = Checksum(pool, m, spans);
    EXPECT_EQ(base, Checksum(pool, m, spans));
    for (size_t at : {size_t{0}, size_t{offset}, size_t{offset + 1}, size_t{offset + 51}, offset + bytes / 3,
                      offset + bytes / 2 + 17, offset + bytes - 101, offset + bytes - 1}) {
      SCOPED_TRACE(at);
      buf.get()[at] ^= 0x10;
      EXPECT_NE(base, Checksum(pool, m, spans));
      buf.get()[at] ^= 0x10;
    }
  }
}

// The independent reference: glibc's memchr for a byte the buffer lacks, which glibc implements with the
// widest loads it finds on the CPU, on each thread's contiguous share.
double ReferencePass(ThreadPool& pool, const uint8_t* data, size_t bytes, uint64_t* sink) {
  std::vector<const void*> found(pool.size());
  const auto t0 = std::chrono::steady_clock::now();
  pool.RunOnAll([&](int t) {
    const size_t per = bytes / pool.size();
    found[t] = std::memchr(data + per * t, 0, t == pool.size() - 1 ? bytes - per * t : per);
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const void* f : found) *sink += f != nullptr;
  return s;
}

// The yardstick must be the fastest read the threads can do: not slower than the reference on a buffer past
// the last-level cache, medians of passes interleaved with the reference's (so a change in the machine's load
// hits both). 5% is left for the noise of a shared machine.
TEST(ReadBandwidth, ChosenLoopIsNotSlowerThanAnIndependentRead) {
  const int threads = std::max(1, std::min(2, static_cast<int>(std::thread::hardware_concurrency())));
  ThreadPool pool(threads);
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(2 * LastLevelCacheBytes(), int64_t{256} << 20));
  auto buf = Buffer(bytes, 1);
  const std::vector<ReadSpan> spans = {{buf.get(), bytes}};
  uint64_t sink = 0;
  const ReadChoice choice = ChooseReadMethod(pool, spans, 3, &sink);
  ASSERT_NE(choice.best, nullptr);
  ASSERT_EQ(choice.timings.size(), AvailableReadMethods().size());
  for (const auto& t : choice.timings) EXPECT_LE(t.median_gbps, choice.best_gbps) << t.method->name;
  std::vector<double> ours, reference;
  for (int i = 0; i < 7; ++i) {
    ours.push_back(static_cast<double>(bytes) / ReadPass(pool, *choice.best, spans, &sink) / 1e9);
    reference.push_back(static_cast<double>(bytes) / ReferencePass(pool, buf.get(), bytes, &sink) / 1e9);
  }
  volatile uint64_t keep = sink;  // keeps the sums alive
  (void)keep;
  EXPECT_GE(Median(ours), 0.95 * Median(reference))
      << choice.best->name << " " << Median(ours) << " GB/s, memchr " << Median(reference) << " GB/s on " << threads
      << " threads (" << choice.Summary() << ")";
  std::printf("%s %.2f GB/s, memchr %.2f GB/s, %d threads, %.0f MiB\n", choice.best->name, Median(ours),
              Median(reference), threads, bytes / 1048576.0);
}

}  // namespace
}  // namespace numoe::bench
