// Prometheus metrics of numoe-router, rendered in the text exposition format (version 0.0.4).
//
// Series (all prefixed numoe_):
//   numoe_requests_total{endpoint,status}          counter: finished requests by endpoint ("/v1/completions",
//                                                  "grpc:Generate", ...) and status (HTTP code or gRPC code name)
//   numoe_prompt_tokens_total                       counter: prompt tokens of admitted generations
//   numoe_generation_tokens_total                   counter: tokens received from workers
//   numoe_time_to_first_token_seconds               histogram: admission -> first token of a choice
//   numoe_inter_token_latency_seconds               histogram: gap between consecutive token messages
//   numoe_worker_active_sequences{worker}           gauge: from the worker's last Stats answer
//   numoe_worker_queued_sequences{worker}           gauge: from the worker's last Stats answer
//   numoe_worker_up{worker}                         gauge: 1 when the last health check passed
//   numoe_worker_expert_seconds_total{worker}       counter: seconds the worker spent in MoE calls (routed
//                                                   experts, computed or simulated), from its last Stats answer
//   numoe_prefix_cache_queried_tokens_total{worker} counter: prompt tokens of the worker's requests looked up in
//                                                   numoe-gpu's prefix cache (workers with one only)
//   numoe_prefix_cache_hit_tokens_total{worker}     counter: of them, the ones restored instead of computed
//   numoe_prefix_cache_bytes{worker,tier}           gauge: bytes the cache holds (tier "backend": the backend's own
//                                                   memory; "host": the host-RAM tier, where numoe-gpu has one;
//                                                   shared by the workers of one numoe-gpu)
//   numoe_prefix_cache_evictions_total{worker,tier} counter: checkpoints evicted from each tier since numoe-gpu
//                                                   started (backend: moved to the host tier or dropped; host:
//                                                   dropped)
//   numoe_spec_drafted_tokens_total{worker,drafter}  counter: draft tokens the worker's verifier checked
//   numoe_spec_accepted_tokens_total{worker,drafter} counter: draft tokens it kept
//   numoe_spec_verify_steps_total{worker,drafter}    counter: verify steps (one per sequence per step with drafts)
//   numoe_spec_mean_accepted_length{worker,drafter}  gauge: accepted / verify steps since the worker started
//                                                   (0 before the first); drafter = the worker's --spec
//                                                   (dspark, mtp, ngram); workers without speculation have no
//                                                   numoe_spec_* lines
// Worker gauges are not stored here: the caller passes a snapshot at render time, so they can never go stale.
//
// Thread-safety: every method may be called from any thread at once (counters under one mutex, histogram
// buckets are atomics).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "numoe/v1/worker.pb.h"

namespace numoe::router {

// A cumulative histogram with fixed upper bounds (seconds). Observe() is lock-free.
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void Observe(double value);
  // Appends the _bucket/_sum/_count lines of `name` to `out`.
  void Render(const std::string& name, std::string* out) const;
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }

 private:
  std::vector<double> bounds_;
  std::vector<std::atomic<uint64_t>> buckets_;  // non-cumulative counts, one per bound, plus +Inf
  std::atomic<uint64_t> count_{0};
  std::atomic<uint64_t> sum_micros_{0};  // sum kept in integer microseconds: atomics on doubles need CAS loops
};

// One worker's gauges at render time.
struct WorkerGauge {
  std::string worker;  // host:port
  bool up = false;
  uint64_t active_sequences = 0;
  uint64_t queued_sequences = 0;
  double expert_seconds = 0;  // cumulative since the worker started
  // Speculative decoding, cumulative since the worker started ("none" or empty: no numoe_spec_* lines).
  std::string spec_method;
  uint64_t spec_verify_steps = 0;
  uint64_t spec_drafted = 0;
  uint64_t spec_accepted = 0;
  // numoe-gpu's prefix cache: this worker's prompt tokens looked up and restored, cumulative; the bytes the
  // first tier holds (-1: no cache, no numoe_prefix_cache_* lines) and the host tier (-1: none, no tier="host"
  // lines); checkpoints evicted from each tier, cumulative.
  uint64_t prefix_queried_tokens = 0;
  uint64_t prefix_hit_tokens = 0;
  int64_t prefix_cache_bytes = -1;
  int64_t prefix_host_bytes = -1;
  uint64_t prefix_evicted = 0;
  uint64_t prefix_host_evicted = 0;
};

// The gauges of one worker from its last Stats answer.
WorkerGauge WorkerGaugeFromStats(const std::string& worker, bool up, const v1::WorkerStats& stats);

class Metrics {
 public:
  Metrics();

  void CountRequest(const std::string& endpoint, const std::string& status);
  void AddPromptTokens(uint64_t n) { prompt_tokens_.fetch_add(n, std::memory_order_relaxed); }
  void AddGenerationTokens(uint64_t n) { generation_tokens_.fetch_add(n, std::memory_order_relaxed); }
  void ObserveTimeToFirstToken(double seconds) { ttft_.Observe(seconds); }
  void ObserveInterTokenLatency(double seconds) { itl_.Observe(seconds); }

  uint64_t requests(const std::string& endpoint, const std::string& status) const;

  // The whole exposition text (ends with a newline).
  std::string Render(const std::vector<WorkerGauge>& workers) const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, std::string>, uint64_t> requests_;
  std::atomic<uint64_t> prompt_tokens_{0};
  std::atomic<uint64_t> generation_tokens_{0};
  Histogram ttft_;
  Histogram itl_;
};

// Escapes a label value per the exposition format (backslash, double quote, newline).
std::string EscapeLabelValue(const std::string& value);

}  // namespace numoe::router
