// The read-bandwidth yardstick (bench/read_bandwidth.h): every loop reads every byte of any span, and the
// chosen loop is not slower than an independent read of the same buffer on the same threads.
#include "bench/read_bandwidth.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string_view>
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

// What every loop but the old one returns (read_methods.h), in scalar code: the two 64-bit halves, summed,
// of the xor of all 16-byte words.
uint64_t ScalarFold(const uint8_t* p, size_t bytes) {
  uint64_t lo = 0, hi = 0;
  for (size_t i = 0; i + 16 <= bytes; i += 16) {
    uint64_t v[2];
    std::memcpy(v, p + i, 16);
    lo ^= v[0];
    hi ^= v[1];
  }
  return lo + hi;
}

bool IsOldLoop(const ReadMethod& m) { return std::string_view(m.name) == OldYardstickReadMethod().name; }

std::unique_ptr<uint8_t, FreeDeleter> RandomBuffer(size_t bytes, uint64_t seed) {
  auto buf = Buffer(bytes, 0);
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i + 8 <= bytes; i += 8) {
    const uint64_t v = rng();
    std::memcpy(buf.get() + i, &v, 8);
  }
  return buf;
}

// Every loop (single- or multi-stream, any ISA, in pieces of tile groups or not) returns the scalar fold of
// the bytes it is given, for lengths that do and do not fill whole stream groups: a loop that skipped or
// double-read a line, or split its streams wrongly, would differ.
TEST(ReadBandwidth, EveryLoopReturnsTheScalarFold) {
  const size_t most = 2 * kKernelPieceBytes + 7 * kReadBlock;
  auto buf = RandomBuffer(most, 7);
  int multi_stream = 0;
  for (const ReadMethod& m : AvailableReadMethods()) {
    if (IsOldLoop(m)) continue;
    SCOPED_TRACE(m.name);
    multi_stream += std::string_view(m.name).find("-s") != std::string_view::npos;
    for (size_t bytes : {size_t{0}, kReadBlock, 2 * kReadBlock, 7 * kReadBlock, 69 * kReadBlock, 4 * kKernelTileBytes,
                         4 * kKernelTileBytes + 3 * kReadBlock, kKernelPieceBytes, most}) {
      SCOPED_TRACE(bytes);
      EXPECT_EQ(m.read(buf.get(), bytes), ScalarFold(buf.get(), bytes));
    }
  }
  EXPECT_GE(multi_stream, 1) << "the multi-stream loop (the kernel's four tile streams) is missing";
}

// A pass of a method that claims pieces (piece_bytes > 0) reads each piece once, whichever thread claims
// it, and the unaligned ends byte by byte: its checksum is the sum of the pieces' folds and those bytes, on
// a span of several pieces with a partial last one; and a changed byte at a piece or tile-group boundary
// changes it.
TEST(ReadBandwidth, ClaimedPiecesCoverTheSpan) {
  ThreadPool pool(3);
  const size_t offset = 13;
  const size_t bytes = 2 * kKernelPieceBytes + 4 * kKernelTileBytes + 5 * kReadBlock + 100;
  auto buf = RandomBuffer(bytes + offset, 11);
  const uint8_t* span = buf.get() + offset;
  const std::vector<ReadSpan> spans = {{span, bytes}};
  const size_t head = 64 - offset, body = bytes - head, aligned = body / kReadBlock * kReadBlock;
  int claimed = 0;
  for (const ReadMethod& m : AvailableReadMethods()) {
    if (m.piece_bytes == 0) continue;
    SCOPED_TRACE(m.name);
    ++claimed;
    ASSERT_EQ(m.piece_bytes % kReadBlock, 0u);
    uint64_t expected = 0;
    for (size_t i = 0; i < head; ++i) expected += span[i];
    for (size_t at = 0; at < aligned; at += m.piece_bytes) {
      expected += ScalarFold(span + head + at, std::min(m.piece_bytes, aligned - at));
    }
    for (size_t i = head + aligned; i < bytes; ++i) expected += span[i];
    const uint64_t base = Checksum(pool, m, spans);
    EXPECT_EQ(base, expected);
    for (size_t at : {head - 1, head + m.piece_bytes - 1, head + m.piece_bytes, head + 4 * kKernelTileBytes - 64,
                      head + 4 * kKernelTileBytes, head + 2 * m.piece_bytes + 64, bytes - 101, bytes - 1}) {
      SCOPED_TRACE(at);
      buf.get()[offset + at] ^= 0x10;
      EXPECT_NE(base, Checksum(pool, m, spans));
      buf.get()[offset + at] ^= 0x10;
    }
  }
  EXPECT_GE(claimed, 1) << "no method reads like the kernel";
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
// hits both). 5% is left for the noise of a shared machine, and three rounds (below).
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
  // Up to three rounds of 7 interleaved pairs; the first round that meets the bound passes. A VM's read rate
  // moves by 10% and more between passes (CI on a 2-vCPU Zen 3: 13.2 against 14.7 GB/s in one round, with the
  // chosen loop 17.0 at start-up), while a loop that really reads slower (the old yardstick, 0.62-0.69x of the
  // best on the GPU host) fails every round.
  std::vector<double> ours, reference;
  for (int round = 0; round < 3; ++round) {
    ours.clear();
    reference.clear();
    for (int i = 0; i < 7; ++i) {
      ours.push_back(static_cast<double>(bytes) / ReadPass(pool, *choice.best, spans, &sink) / 1e9);
      reference.push_back(static_cast<double>(bytes) / ReferencePass(pool, buf.get(), bytes, &sink) / 1e9);
    }
    if (Median(ours) >= 0.95 * Median(reference)) break;
    std::printf("round %d: %s %.2f GB/s, memchr %.2f GB/s\n", round + 1, choice.best->name, Median(ours),
                Median(reference));
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
