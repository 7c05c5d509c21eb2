// The balancing policy (pure) and the balancer's rules with in-process fake workers: affinity,
// least-outstanding, down/up, retry before the first token, failure mid-stream, queue and 429.
#include "router/balancer/balancer.h"

#include <gtest/gtest.h>

#include "router/balancer/policy.h"
#include "tests/unit/router/fake_worker_client.h"
#include "tests/support/status_matchers.h"

namespace numoe::router {
namespace {

using testing::FakeCluster;
using testing::FakeFactory;
using testing::RecordingObserver;

std::vector<WorkerLoad> Idle(int n) {
  std::vector<WorkerLoad> w(n);
  for (int i = 0; i < n; ++i) {
    w[i].id_hash = StableHash("127.0.0.1:" + std::to_string(9100 + i));
    w[i].up = true;
    w[i].has_slot = true;
  }
  return w;
}

TEST(Policy, PrefixHashLooksOnlyAtTheFirstNTokens) {
  std::vector<int32_t> a = {1, 2, 3, 4, 5, 6}, b = {1, 2, 3, 4, 9, 9}, c = {1, 2, 3, 5};
  EXPECT_EQ(PrefixHash(a, 4), PrefixHash(b, 4));
  EXPECT_NE(PrefixHash(a, 4), PrefixHash(c, 4));
  EXPECT_NE(PrefixHash(a, 5), PrefixHash(b, 5));
  EXPECT_EQ(PrefixHash(a, 0), 0u);
  EXPECT_EQ(PrefixHash({}, 4), 0u);
  EXPECT_EQ(PrefixHash(c, 64), PrefixHash(std::vector<int32_t>{1, 2, 3, 5}, 4));  // short prompts: all of it
}

TEST(Policy, AffinityIsStableAndSpreadsPrefixes) {
  auto w = Idle(4);
  PolicyOptions o;
  std::vector<int> hits(4, 0);
  for (int32_t p = 0; p < 400; ++p) {
    std::vector<int32_t> prompt = {p, p + 1, p + 2};
    uint64_t h = PrefixHash(prompt, o.prefix_tokens);
    auto first = ChooseWorker(w, h, o);
    ASSERT_TRUE(first);
    EXPECT_EQ(ChooseWorker(w, h, o), first);  // same prefix, same worker
    ++hits[*first];
  }
  for (int n : hits) EXPECT_GT(n, 60) << "rendezvous hashing should spread prefixes over all workers";
}

TEST(Policy, RendezvousMovesOnlyTheDownWorkersPrefixes) {
  auto w = Idle(4);
  PolicyOptions o;
  int moved = 0, moved_wrongly = 0;
  for (int32_t p = 0; p < 400; ++p) {
    std::vector<int32_t> prompt = {p, 7};
    uint64_t h = PrefixHash(prompt, o.prefix_tokens);
    size_t before = *ChooseWorker(w, h, o);
    auto down = w;
    down[2].up = false;
    size_t after = *ChooseWorker(down, h, o);
    if (before != after) {
      ++moved;
      if (before != 2) ++moved_wrongly;
    }
  }
  EXPECT_GT(moved, 0);
  EXPECT_EQ(moved_wrongly, 0);
}

TEST(Policy, LeastOutstandingWithoutAffinity) {
  auto w = Idle(3);
  w[0].outstanding_tokens = 500;
  w[1].outstanding_tokens = 100;
  w[2].outstanding_tokens = 300;
  PolicyOptions o;
  EXPECT_EQ(ChooseWorker(w, 0, o), 1u);
  w[1].has_slot = false;
  EXPECT_EQ(ChooseWorker(w, 0, o), 2u);
  w[2].excluded = true;
  EXPECT_EQ(ChooseWorker(w, 0, o), 0u);
  w[0].up = false;
  EXPECT_FALSE(ChooseWorker(w, 0, o));
  // Ties: fewer in-flight requests first.
  auto t = Idle(2);
  t[0].in_flight = 3;
  EXPECT_EQ(ChooseWorker(t, 0, o), 1u);
}

TEST(Policy, PreferredWorkerUnlessMuchBusier) {
  auto w = Idle(2);
  PolicyOptions o;
  o.busy_ratio = 2.0;
  o.busy_slack_tokens = 100;
  uint64_t h = PrefixHash(std::vector<int32_t>{42, 43}, o.prefix_tokens);
  size_t pref = *PreferredWorker(w, h);
  size_t other = 1 - pref;
  w[other].outstanding_tokens = 50;
  w[pref].outstanding_tokens = 200;  // limit = 50 * 2 + 100 = 200: not "much" busier yet
  EXPECT_EQ(ChooseWorker(w, h, o), pref);
  w[pref].outstanding_tokens = 201;
  EXPECT_EQ(ChooseWorker(w, h, o), other);
  w[pref].outstanding_tokens = 0;
  w[pref].has_slot = false;  // full: the other one
  EXPECT_EQ(ChooseWorker(w, h, o), other);
}

TEST(Policy, HostHashIgnoresThePort) {
  EXPECT_EQ(HostHash("10.0.0.1:9100"), HostHash("10.0.0.1:9101"));
  EXPECT_NE(HostHash("10.0.0.1:9100"), HostHash("10.0.0.2:9100"));
  EXPECT_EQ(HostHash("[::1]:5"), HostHash("[::1]:6"));
  EXPECT_NE(HostHash("[::1]:5"), HostHash("[::2]:5"));
  EXPECT_EQ(HostHash("gpu-box:7000"), HostHash("gpu-box:7001"));
  EXPECT_NE(HostHash("w0"), HostHash("w1"));  // no port: the address is the host
}

TEST(Policy, WorkersOfOneHostShareAffinityAndGoByLoad) {
  // Two hosts of two workers: a prefix sticks to one host; inside it the less loaded worker wins.
  std::vector<WorkerLoad> w(4);
  for (int i = 0; i < 4; ++i) {
    const std::string address = "10.0.0." + std::to_string(1 + i / 2) + ":" + std::to_string(9100 + i);
    w[i].id_hash = StableHash(address);
    w[i].group_hash = HostHash(address);
    w[i].up = w[i].has_slot = true;
  }
  PolicyOptions o;
  int per_host[2] = {0, 0};
  for (int32_t p = 0; p < 200; ++p) {
    const uint64_t h = PrefixHash(std::vector<int32_t>{p, 3, 5}, o.prefix_tokens);
    const size_t first = *ChooseWorker(w, h, o);
    const size_t host = first / 2, mate = host * 2 + (1 - first % 2);
    ++per_host[host];
    auto loaded = w;
    loaded[first].outstanding_tokens = 100;  // its mate is now the less loaded worker of that host
    EXPECT_EQ(ChooseWorker(loaded, h, o), mate) << "prefix " << p;
    loaded[mate].outstanding_tokens = 100;   // both busy, yet not "much busier" than the other host: stay
    EXPECT_EQ(*ChooseWorker(loaded, h, o) / 2, host) << "prefix " << p;
  }
  EXPECT_GT(per_host[0], 50);
  EXPECT_GT(per_host[1], 50);
  // One host: affinity never overrides the least loaded worker.
  std::vector<WorkerLoad> one(3);
  for (int i = 0; i < 3; ++i) {
    const std::string address = "127.0.0.1:" + std::to_string(9100 + i);
    one[i].id_hash = StableHash(address);
    one[i].group_hash = HostHash(address);
    one[i].up = one[i].has_slot = true;
    one[i].outstanding_tokens = 10 * (3 - i);
  }
  for (int32_t p = 0; p < 50; ++p) {
    EXPECT_EQ(ChooseWorker(one, PrefixHash(std::vector<int32_t>{p, 1}, o.prefix_tokens), o), 2u) << "prefix " << p;
  }
}

BalancerOptions Opts(int n) {
  BalancerOptions o;
  for (int i = 0; i < n; ++i) o.workers.push_back("w" + std::to_string(i));
  o.health_interval_s = 0;  // the test runs health rounds itself
  o.unhealthy_after = 1;
  o.policy.prefix_tokens = 0;
  return o;
}

v1::WorkerGenerateRequest Req(std::vector<int32_t> prompt, uint32_t max_new) {
  v1::WorkerGenerateRequest r;
  r.mutable_prompt_ids()->Assign(prompt.begin(), prompt.end());
  r.set_max_new_tokens(max_new);
  return r;
}

TEST(Balancer, WorkersStartDownAndComeUpOnHealthChecks) {
  auto cluster = std::make_shared<FakeCluster>();
  Balancer b(Opts(2), FakeFactory(cluster));
  EXPECT_EQ(b.up_count(), 0);
  auto r = b.Submit(Req({1, 2}, 3), std::make_shared<RecordingObserver>());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  b.CheckHealthNow();
  EXPECT_EQ(b.up_count(), 2);
  cluster->stats_ok["w1"] = false;
  b.CheckHealthNow();
  EXPECT_EQ(b.up_count(), 1);
  auto snap = b.Snapshot();
  EXPECT_TRUE(snap[0].up);
  EXPECT_FALSE(snap[1].up);
  cluster->stats_ok["w1"] = true;  // the worker rejoins
  b.CheckHealthNow();
  EXPECT_EQ(b.up_count(), 2);
}

TEST(Balancer, UnhealthyAfterNFailedChecks) {
  auto cluster = std::make_shared<FakeCluster>();
  auto o = Opts(1);
  o.unhealthy_after = 3;
  Balancer b(o, FakeFactory(cluster));
  b.CheckHealthNow();
  cluster->stats_ok["w0"] = false;
  b.CheckHealthNow();
  b.CheckHealthNow();
  EXPECT_EQ(b.up_count(), 1);
  b.CheckHealthNow();
  EXPECT_EQ(b.up_count(), 0);
}

TEST(Balancer, LeastOutstandingSpreadsConcurrentRequests) {
  auto cluster = std::make_shared<FakeCluster>();
  Balancer b(Opts(3), FakeFactory(cluster));
  b.CheckHealthNow();
  std::vector<std::shared_ptr<RecordingObserver>> obs;
  for (int i = 0; i < 6; ++i) {
    obs.push_back(std::make_shared<RecordingObserver>());
    ASSERT_OK(b.Submit(Req({1, 2, 3}, 10), obs.back()));
  }
  EXPECT_EQ(cluster->CallsTo("w0"), 2u);
  EXPECT_EQ(cluster->CallsTo("w1"), 2u);
  EXPECT_EQ(cluster->CallsTo("w2"), 2u);
  for (auto& c : cluster->Calls()) c->End();
  EXPECT_EQ(b.in_flight(), 0u);
}

TEST(Balancer, AffinitySendsAPrefixToOneWorker) {
  auto cluster = std::make_shared<FakeCluster>();
  auto o = Opts(3);
  o.policy.prefix_tokens = 3;
  Balancer b(o, FakeFactory(cluster));
  b.CheckHealthNow();
  for (int i = 0; i < 5; ++i) ASSERT_OK(b.Submit(Req({7, 8, 9, 100 + i}, 2), std::make_shared<RecordingObserver>()));
  std::set<std::string> used;
  for (auto& c : cluster->Calls()) used.insert(c->worker);
  EXPECT_EQ(used.size(), 1u);
  for (auto& c : cluster->Calls()) c->End();
}

TEST(Balancer, FailureBeforeTheFirstTokenIsRetriedOnAnotherWorker) {
  auto cluster = std::make_shared<FakeCluster>();
  Balancer b(Opts(2), FakeFactory(cluster));
  b.CheckHealthNow();
  auto obs = std::make_shared<RecordingObserver>();
  ASSERT_OK(b.Submit(Req({1, 2}, 4), obs));
  auto calls = cluster->Calls();
  ASSERT_EQ(calls.size(), 1u);
  const std::string first = calls[0]->worker;
  calls[0]->End(absl::UnavailableError("connection reset"));
  calls = cluster->Calls();
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_NE(calls[1]->worker, first);
  EXPECT_EQ(b.up_count(), 1);  // the transport failure marked the first one down
  calls[1]->Tokens({5, 6});
  calls[1]->End();
  EXPECT_TRUE(obs->ended);
  EXPECT_OK(obs->status);
  EXPECT_EQ(obs->ids, (std::vector<int32_t>{5, 6}));
}

TEST(Balancer, NoRetryWhenNoOtherWorkerIsUp) {
  auto cluster = std::make_shared<FakeCluster>();
  Balancer b(Opts(1), FakeFactory(cluster));
  b.CheckHealthNow();
  auto obs = std::make_shared<RecordingObserver>();
  ASSERT_OK(b.Submit(Req({1}, 4), obs));
  cluster->Calls()[0]->End(absl::UnavailableError("gone"));
  ASSERT_TRUE(obs->ended);
  EXPECT_EQ(obs->status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(cluster->Calls().size(), 1u);
}

TEST(Balancer, FailureAfterATokenIsNeverReplayed) {
  auto cluster = std::make_shared<FakeCluster>();
  Balancer b(Opts(2), FakeFactory(cluster));
  b.CheckHealthNow();
  auto obs = std::make_shared<RecordingObserver>();
  ASSERT_OK(b.Submit(Req({1}, 4), obs));
  auto call = cluster->Calls()[0];
  call->Tokens({9});
  call->End(absl::UnavailableError("socket closed"));
  ASSERT_TRUE(obs->ended);
  EXPECT_EQ(obs->status.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(obs->status.message().find("mid-stream"), absl::string_view::npos) << obs->status;
  EXPECT_EQ(cluster->Calls().size(), 1u);
  EXPECT_EQ(obs->ids, (std::vector<int32_t>{9}));
}

TEST(Balancer, BadRequestErrorsAreNotRetried) {
  auto cluster = std::make_shared<FakeCluster>();
  Balancer b(Opts(2), FakeFactory(cluster));
  b.CheckHealthNow();
  cluster->fail_generate["w0"] = absl::StatusCode::kInvalidArgument;
  cluster->fail_generate["w1"] = absl::StatusCode::kInvalidArgument;
  auto obs = std::make_shared<RecordingObserver>();
  ASSERT_OK(b.Submit(Req({1}, 4), obs));
  ASSERT_TRUE(obs->ended);
  EXPECT_EQ(obs->status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cluster->Calls().size(), 1u);
  EXPECT_EQ(b.up_count(), 2);  // a bad request says nothing about the worker's health
}

TEST(Balancer, RetriesAreBoundedByMaxAttempts) {
  auto cluster = std::make_shared<FakeCluster>();
  auto o = Opts(4);
  o.max_attempts = 2;
  Balancer b(o, FakeFactory(cluster));
  b.CheckHealthNow();
  for (int i = 0; i < 4; ++i) cluster->fail_generate["w" + std::to_string(i)] = absl::StatusCode::kResourceExhausted;
  auto obs = std::make_shared<RecordingObserver>();
  ASSERT_OK(b.Submit(Req({1}, 4), obs));
  ASSERT_TRUE(obs->ended);
  EXPECT_EQ(obs->status.code(), absl::StatusCode::kResourceExhausted);  // busy everywhere: 429, retry later
  EXPECT_EQ(cluster->Calls().size(), 2u);
  EXPECT_EQ(b.up_count(), 4);  // RESOURCE_EXHAUSTED is busy, not down
}

TEST(Balancer, QueueThen429) {
  auto cluster = std::make_shared<FakeCluster>();
  auto o = Opts(1);
  o.max_in_flight_per_worker = 1;
  o.max_queue = 2;
  Balancer b(o, FakeFactory(cluster));
  b.CheckHealthNow();
  std::vector<std::shared_ptr<RecordingObserver>> obs;
  for (int i = 0; i < 3; ++i) {
    obs.push_back(std::make_shared<RecordingObserver>());
    ASSERT_OK(b.Submit(Req({1}, 1), obs.back())) << i;
  }
  EXPECT_EQ(b.queued(), 2u);
  EXPECT_EQ(b.in_flight(), 1u);
  auto busy = b.Submit(Req({1}, 1), std::make_shared<RecordingObserver>());
  EXPECT_EQ(busy.status().code(), absl::StatusCode::kResourceExhausted);
  // Finishing the running one starts the next queued one, in order.
  cluster->Calls()[0]->End();
  EXPECT_TRUE(obs[0]->ended);
  EXPECT_EQ(b.queued(), 1u);
  ASSERT_EQ(cluster->Calls().size(), 2u);
  cluster->Calls()[1]->End();
  cluster->Calls()[2]->End();
  EXPECT_TRUE(obs[2]->ended);
  EXPECT_EQ(b.queued(), 0u);
  EXPECT_EQ(b.in_flight(), 0u);
}

TEST(Balancer, SlotsFollowTheWorkersMaxSequences) {
  auto cluster = std::make_shared<FakeCluster>();
  cluster->max_sequences["w0"] = 3;
  auto o = Opts(1);
  o.max_queue = 0;
  Balancer b(o, FakeFactory(cluster));
  b.CheckHealthNow();
  EXPECT_EQ(b.Snapshot()[0].slots, 6);  // 2 x max_sequences
  for (int i = 0; i < 6; ++i) ASSERT_OK(b.Submit(Req({1}, 1), std::make_shared<RecordingObserver>()));
  EXPECT_EQ(b.Submit(Req({1}, 1), std::make_shared<RecordingObserver>()).status().code(),
            absl::StatusCode::kResourceExhausted);
  for (auto& c : cluster->Calls()) c->End();
}

TEST(Balancer, CancelQueuedAndRunning) {
  auto cluster = std::make_shared<FakeCluster>();
  auto o = Opts(1);
  o.max_in_flight_per_worker = 1;
  Balancer b(o, FakeFactory(cluster));
  b.CheckHealthNow();
  auto running = std::make_shared<RecordingObserver>();
  auto queued = std::make_shared<RecordingObserver>();
  auto h1 = b.Submit(Req({1}, 5), running);
  auto h2 = b.Submit(Req({1}, 5), queued);
  ASSERT_OK(h1);
  ASSERT_OK(h2);
  (*h2)->Cancel();
  EXPECT_TRUE(queued->ended);
  EXPECT_EQ(queued->status.code(), absl::StatusCode::kCancelled);
  (*h1)->Cancel();
  EXPECT_TRUE(cluster->Calls()[0]->cancelled);
  EXPECT_TRUE(running->ended);
  EXPECT_EQ(running->status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(b.up_count(), 1);  // a cancel we asked for is not a worker failure
  (*h1)->Cancel();             // idempotent
  EXPECT_EQ(b.in_flight(), 0u);
}

TEST(Balancer, OutstandingWorkDropsAsTokensArrive) {
  auto cluster = std::make_shared<FakeCluster>();
  Balancer b(Opts(1), FakeFactory(cluster));
  b.CheckHealthNow();
  ASSERT_OK(b.Submit(Req({1, 2, 3, 4}, 10), std::make_shared<RecordingObserver>()));
  EXPECT_EQ(b.Snapshot()[0].outstanding_tokens, 14);
  cluster->Calls()[0]->Tokens({5});
  EXPECT_EQ(b.Snapshot()[0].outstanding_tokens, 9);
  cluster->Calls()[0]->End();
  EXPECT_EQ(b.Snapshot()[0].outstanding_tokens, 0);
}

TEST(Balancer, QueuedRequestsTimeOut) {
  auto cluster = std::make_shared<FakeCluster>();
  auto o = Opts(1);
  o.max_in_flight_per_worker = 1;
  o.queue_timeout_s = 0.01;
  Balancer b(o, FakeFactory(cluster));
  b.CheckHealthNow();
  auto queued = std::make_shared<RecordingObserver>();
  ASSERT_OK(b.Submit(Req({1}, 5), std::make_shared<RecordingObserver>()));
  ASSERT_OK(b.Submit(Req({1}, 5), queued));
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  b.CheckHealthNow();  // any event re-examines the queue
  EXPECT_TRUE(queued->ended);
  EXPECT_EQ(queued->status.code(), absl::StatusCode::kUnavailable);
  cluster->Calls()[0]->End();
}

}  // namespace
}  // namespace numoe::router
