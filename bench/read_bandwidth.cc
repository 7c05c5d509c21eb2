#include "bench/read_bandwidth.h"

#include <atomic>
#include <chrono>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/cpu_features.h"
#include "worker/experts/isa.h"

namespace numoe::bench {

const std::vector<ReadMethod>& AvailableReadMethods() {
  static const std::vector<ReadMethod> methods = [] {
    const CpuFeatures& f = GetCpuFeatures();
    Isa cap = Isa::kAmx;
    if (const char* env = std::getenv("NUMOE_ISA"); env != nullptr && *env != '\0') {
      if (auto isa = ParseIsa(env); isa.ok()) cap = *isa;  // an unknown value is SelectIsa's error to report
    }
    // The widest loads only: on the Emerald Rapids host no 256-bit loop beat the best 512-bit one at 2, 8 or
    // 16 threads, nor a 128-bit loop the best 256-bit one, so timing them would only lengthen every run.
    std::span<const ReadMethod> widest = GenericReadMethods();
    if (f.avx512f && (cap == Isa::kAvx512 || cap == Isa::kAmx)) {
      widest = Avx512ReadMethods();
    } else if (f.avx2 && cap != Isa::kGeneric) {
      widest = Avx2ReadMethods();
    }
    std::vector<ReadMethod> m(widest.begin(), widest.end());
    m.push_back(OldYardstickReadMethod());
    return m;
  }();
  return methods;
}

double SpanBytes(const std::vector<ReadSpan>& spans) {
  double total = 0;
  for (const ReadSpan& s : spans) total += static_cast<double>(s.bytes);
  return total;
}

double ReadPass(ThreadPool& pool, const ReadMethod& method, const std::vector<ReadSpan>& spans, uint64_t* sink) {
  // One slot per thread on its own cache line: threads writing neighbouring words would share a line.
  struct alignas(kCacheLine) Slot {
    uint64_t v = 0;
  };
  std::vector<Slot> sums(pool.size());
  const int n = pool.size();
  const auto t0 = std::chrono::steady_clock::now();
  for (const ReadSpan& span : spans) {
    // The loops read whole aligned blocks: bytes before the first 64-byte boundary and after the last
    // whole block are added one by one (by threads 0 and n - 1, or after a claimed pass by the caller).
    const size_t head = std::min(span.bytes, (64 - reinterpret_cast<uintptr_t>(span.data) % 64) % 64);
    const uint8_t* base = span.data + head;
    const size_t body = span.bytes - head;
    if (method.piece_bytes > 0) {
      const size_t aligned = body / kReadBlock * kReadBlock, piece = method.piece_bytes;
      const size_t pieces = (aligned + piece - 1) / piece;
      std::atomic<size_t> next{0};
      pool.RunOnAvailable([&](int t) {
        for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < pieces;) {
          sums[t].v += method.read(base + i * piece, std::min(piece, aligned - i * piece));
        }
      });
      for (size_t i = 0; i < head; ++i) sums[0].v += span.data[i];
      for (size_t i = aligned; i < body; ++i) sums[0].v += base[i];
      continue;
    }
    pool.RunOnAll([&](int t) {
      const size_t per = body / n / kReadBlock * kReadBlock;
      size_t len = per;
      uint64_t extra = 0;
      if (t == 0) {
        for (size_t i = 0; i < head; ++i) extra += span.data[i];
      }
      if (t == n - 1) {
        len = (body - per * t) / kReadBlock * kReadBlock;
        for (size_t i = per * t + len; i < body; ++i) extra += base[i];
      }
      sums[t].v += method.read(base + per * t, len) + extra;
    });
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const Slot& v : sums) *sink += v.v;
  return s;
}

std::string ReadChoice::Summary() const {
  std::string s;
  for (const Timing& t : timings) {
    char gbps[32];
    std::snprintf(gbps, sizeof(gbps), "%.2f", t.median_gbps);
    absl::StrAppend(&s, s.empty() ? "" : ", ", t.method->name, " ", gbps);
  }
  return s + " GB/s";
}

ReadChoice ChooseReadMethod(ThreadPool& pool, const std::vector<ReadSpan>& spans, int trials, uint64_t* sink) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<ReadMethod>& methods = AvailableReadMethods();
  ReadPass(pool, methods.front(), spans, sink);
  const double bytes = SpanBytes(spans);
  std::vector<std::vector<double>> gbps(methods.size());
  for (int trial = 0; trial < std::max(trials, 1); ++trial) {
    for (size_t i = 0; i < methods.size(); ++i) {
      gbps[i].push_back(bytes / ReadPass(pool, methods[i], spans, sink) / 1e9);
    }
  }
  ReadChoice choice;
  choice.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (size_t i = 0; i < methods.size(); ++i) {
    choice.timings.push_back({&methods[i], Median(gbps[i])});
    if (choice.best == nullptr || choice.timings.back().median_gbps > choice.best_gbps) {
      choice.best = &methods[i];
      choice.best_gbps = choice.timings.back().median_gbps;
    }
  }
  return choice;
}

}  // namespace numoe::bench
