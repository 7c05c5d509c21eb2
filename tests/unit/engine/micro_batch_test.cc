// Two micro-batches per worker (worker/engine/micro_batch_executor.h) on tiny-v4, over the worker's real
// data path: engine -> MicroBatchExecutor -> two RemoteExecutors -> two shared-memory channels -> two gpu
// WorkerSessions on one CpuModel that interleave at their expert calls (as numoe-gpu's CPU backend does),
// whose MoE comes back to one ReferenceExperts through one SerialExperts:
//   - greedy tokens equal the goldens (chunked prefill interleaved with decode), both micro-batches run in
//     the same steps, the two sessions' steps overlap on the model, and never two expert calls at once;
//   - sampled tokens (temperature, seeds, log-probs, n = 2 choices forked from one prefill) equal the one-batch
//     path's (one channel) bit for bit: the CPU backend is batch invariant;
//   - with speculation (n-gram drafts, the DSpark drafter) greedy still equals the goldens;
//   - Open balances the parts and passes a full part over; a part whose gpu session is gone makes the
//     executor unhealthy and the step UNAVAILABLE.
#include "worker/engine/micro_batch_executor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "backends/cpu/cpu_model.h"
#include "common/checkpoint.h"
#include "common/shm_channel.h"
#include "gpu_service/session.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"
#include "worker/engine/engine.h"
#include "worker/engine/remote_executor.h"
#include "worker/engine/stream.h"
#include "worker/experts/reference_experts.h"

namespace numoe::engine {
namespace {

using Tiny = test::TinyModel;
Tiny* LoadTiny(bool drafter = false) {
  auto tiny = test::TinyModel::Get({.drafter = drafter});
  if (!tiny.ok()) ADD_FAILURE() << tiny.status();
  return tiny.ok() ? *tiny : nullptr;
}

// Counts the expert calls in flight at once (the micro-batches must take turns) and makes each take a
// while, so the two sessions' steps are seen overlapping.
class Counting final : public ExpertBackend {
 public:
  explicit Counting(ExpertBackend* inner) : inner_(inner) {}
  Status RunRouted(const MoeRequest& r) override {
    const int now = ++in_flight_;
    int seen = max_in_flight.load();
    while (now > seen && !max_in_flight.compare_exchange_weak(seen, now)) {
    }
    std::this_thread::sleep_for(std::chrono::microseconds(300));
    Status st = inner_->RunRouted(r);
    --in_flight_;
    return st;
  }
  std::atomic<int> max_in_flight{0};

 private:
  ExpertBackend* inner_;
  std::atomic<int> in_flight_{0};
};

// numoe-gpu in this process: `parts` sessions on one model (steps interleaved at the expert calls), and
// this worker's end of each channel with its RemoteExecutor, all computing through one SerialExperts.
struct Stack {
  gpu::ModelHost host;
  std::vector<std::unique_ptr<gpu::WorkerSession>> sessions;
  std::vector<std::unique_ptr<shm::Channel>> worker_ends;
  std::unique_ptr<Counting> counting;
  std::unique_ptr<SerialExperts> serial;
  std::vector<std::unique_ptr<RemoteExecutor>> remotes;
  std::unique_ptr<MicroBatchExecutor> executor;

  ~Stack() {
    for (auto& s : sessions) s->Stop();
  }
};

std::unique_ptr<Stack> MakeStack(Tiny& t, size_t parts, bool spec, uint32_t max_seqs = 8) {
  auto s = std::make_unique<Stack>();
  s->host.model = t.model.get();
  s->host.interleaved_steps = true;  // the CPU backend's Capabilities
  const ModelConfig& cfg = t.ckpt->config();
  shm::Geometry geo{.hidden = static_cast<uint32_t>(cfg.hidden_size),
                    .top_k = static_cast<uint32_t>(cfg.num_experts_per_tok),
                    .max_rows = 48,
                    .max_seqs = max_seqs,
                    .vocab = static_cast<uint32_t>(cfg.vocab_size),
                    .logits_rows = 0,
                    .fork = 1};
  if (spec) {
    geo.drafter = SpecMethod::kDspark;
    geo.max_model_drafts = 16;
    geo.verify = 1;
  }
  s->counting = std::make_unique<Counting>(t.experts.get());
  s->serial = std::make_unique<SerialExperts>(s->counting.get());
  std::vector<Executor*> ex;
  for (size_t p = 0; p < parts; ++p) {
    auto gpu_end = shm::Channel::CreateAnonymous(geo);
    EXPECT_OK(gpu_end);
    if (!gpu_end.ok()) return nullptr;
    auto worker_end = (*gpu_end)->PeerEndpoint();
    EXPECT_OK(worker_end);
    if (!worker_end.ok()) return nullptr;
    s->sessions.push_back(std::make_unique<gpu::WorkerSession>(
        &s->host, gpu::SessionInfo{.lease = p + 1, .worker_id = absl::StrCat("mb", p)}, std::move(*gpu_end)));
    s->sessions.back()->Start(nullptr);
    s->worker_ends.push_back(std::move(*worker_end));
    s->remotes.push_back(std::make_unique<RemoteExecutor>(s->worker_ends.back().get(), s->serial.get()));
    ex.push_back(s->remotes.back().get());
  }
  s->executor = std::make_unique<MicroBatchExecutor>(ex, s->serial.get());
  return s;
}

void RunToEnd(Engine& engine, int max_steps = 20000) {
  for (int i = 0; i < max_steps; ++i) {
    if (!engine.StepOnce() && engine.stats().active == 0 && engine.stats().queued == 0) return;
  }
  ADD_FAILURE() << "engine did not finish within " << max_steps << " steps";
}

EngineRequest Greedy(const test::GoldenPrompt& g, int64_t new_tokens) {
  EngineRequest r;
  r.prompt = g.input_ids;
  r.max_new_tokens = new_tokens;
  r.ignore_eos = true;
  r.request_id = g.name;
  return r;
}

TEST(MicroBatches, GreedyEqualsTheGoldensWithBothMicroBatchesInEveryStep) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  auto s = MakeStack(*t, 2, false);
  ASSERT_NE(s, nullptr);
  Engine engine(s->executor.get(), EngineOptions{.max_seqs = 8, .max_step_tokens = 48, .prefill_chunk = 16});
  std::vector<std::unique_ptr<RequestStream>> streams;
  for (const auto& g : t->goldens) {
    auto st = RequestStream::Open(&engine, Greedy(g, static_cast<int64_t>(g.greedy.size())));
    ASSERT_OK(st);
    streams.push_back(std::move(*st));
  }
  RunToEnd(engine);
  for (size_t i = 0; i < streams.size(); ++i) {
    auto r = streams[i]->Wait();
    ASSERT_OK(r);
    EXPECT_EQ(r->tokens, t->goldens[i].greedy) << t->goldens[i].name;
  }
  EXPECT_GT(s->executor->split_steps(), 0) << "no step ran both micro-batches";
  for (auto& session : s->sessions) {
    EXPECT_GT(session->steps(), 0u) << session->info().worker_id;
    EXPECT_EQ(session->sequences(), 0) << session->info().worker_id;  // closes flushed when idle
  }
  EXPECT_GT(s->host.overlapped_steps.load(), 0u) << "the two sessions' steps never overlapped on the model";
  EXPECT_EQ(s->counting->max_in_flight.load(), 1) << "two expert calls ran at once";
  EXPECT_GT(s->serial->calls(), 0);
  EXPECT_GT(engine.stats().expert_seconds, 0);
  EXPECT_EQ(s->executor->open_in(0), 0);
  EXPECT_EQ(s->executor->open_in(1), 0);
}

// What a batch of sampled requests gives: every choice's tokens and log-probs.
struct Sampled {
  std::vector<int32_t> tokens;
  std::vector<EmittedLogprobs> logprobs;
};
std::vector<Sampled> RunSampled(Executor* ex, const Tiny& t) {
  Engine engine(ex, EngineOptions{.max_seqs = 8, .max_step_tokens = 48, .prefill_chunk = 16});
  std::vector<std::unique_ptr<RequestStream>> streams;
  for (size_t i = 0; i < 5; ++i) {
    EngineRequest r = Greedy(t.goldens[i % t.goldens.size()], 20);
    r.sampling.temperature = 0.9;
    r.sampling.top_p = 0.95;
    r.sampling.seed = 1000 + i;
    r.sampling.logprobs = static_cast<int32_t>(i % 3);
    r.n = i == 1 ? 2 : 1;  // two choices of one prompt: the second forked from the first's prefill
    auto st = RequestStream::Open(&engine, std::move(r));
    EXPECT_OK(st);
    if (st.ok()) streams.push_back(std::move(*st));
  }
  RunToEnd(engine);
  std::vector<Sampled> out;
  for (auto& st : streams) {
    auto all = st->WaitAll();
    EXPECT_OK(all);
    if (!all.ok()) continue;
    for (auto& c : *all) out.push_back(Sampled{c.tokens, c.logprobs});
  }
  return out;
}

TEST(MicroBatches, SampledTokensAndLogprobsEqualTheOneBatchPath) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  std::vector<Sampled> one, two;
  {
    auto s = MakeStack(*t, 1, false);
    ASSERT_NE(s, nullptr);
    one = RunSampled(s->remotes[0].get(), *t);  // the plain RemoteExecutor: one batch per step
  }
  {
    auto s = MakeStack(*t, 2, false);
    ASSERT_NE(s, nullptr);
    two = RunSampled(s->executor.get(), *t);
    EXPECT_GT(s->executor->split_steps(), 0);
  }
  ASSERT_EQ(one.size(), 6u);
  ASSERT_EQ(two.size(), one.size());
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_EQ(two[i].tokens, one[i].tokens) << "choice " << i;
    ASSERT_EQ(two[i].logprobs.size(), one[i].logprobs.size()) << "choice " << i;
    for (size_t k = 0; k < one[i].logprobs.size(); ++k) {
      EXPECT_EQ(two[i].logprobs[k].chosen.token, one[i].logprobs[k].chosen.token);
      EXPECT_EQ(two[i].logprobs[k].chosen.logprob, one[i].logprobs[k].chosen.logprob);  // bit for bit
      ASSERT_EQ(two[i].logprobs[k].top.size(), one[i].logprobs[k].top.size());
      for (size_t j = 0; j < one[i].logprobs[k].top.size(); ++j) {
        EXPECT_EQ(two[i].logprobs[k].top[j].token, one[i].logprobs[k].top[j].token);
        EXPECT_EQ(two[i].logprobs[k].top[j].logprob, one[i].logprobs[k].top[j].logprob);
      }
    }
  }
  EXPECT_FALSE(one[0].logprobs.empty() && one[1].logprobs.empty() && one[2].logprobs.empty());
}

TEST(MicroBatches, SpeculativeGreedyEqualsTheGoldens) {
  Tiny* t = LoadTiny(/*drafter=*/true);
  ASSERT_NE(t, nullptr);
  auto s = MakeStack(*t, 2, true);
  ASSERT_NE(s, nullptr);
  const int64_t kNew = 12;
  for (SpecMethod method : {SpecMethod::kNgram, SpecMethod::kDspark}) {
    EngineOptions o{.max_seqs = 8, .max_step_tokens = 48, .prefill_chunk = 16};
    o.spec = SpecConfig{.method = method, .depth = 3};
    Engine engine(s->executor.get(), o);
    std::vector<std::unique_ptr<RequestStream>> streams;
    for (size_t i = 0; i < 6; ++i) {
      // p2 (its continuation repeats: the n-gram drafts are accepted) and p0, alternately.
      auto st = RequestStream::Open(&engine, Greedy(t->goldens[i % 2 == 0 ? 2 : 0], kNew));
      ASSERT_OK(st);
      streams.push_back(std::move(*st));
    }
    RunToEnd(engine);
    for (size_t i = 0; i < streams.size(); ++i) {
      auto r = streams[i]->Wait();
      ASSERT_OK(r);
      const auto& g = t->goldens[i % 2 == 0 ? 2 : 0].greedy;
      EXPECT_EQ(r->tokens, std::vector<int32_t>(g.begin(), g.begin() + kNew)) << SpecMethodName(method) << " " << i;
    }
    EXPECT_GT(engine.stats().spec_drafted, 0) << SpecMethodName(method);
  }
  EXPECT_GT(s->executor->split_steps(), 0);
  EXPECT_EQ(s->counting->max_in_flight.load(), 1);
}

TEST(MicroBatches, OpenBalancesAndAGoneSessionBreaksTheExecutor) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  auto s = MakeStack(*t, 2, false, /*max_seqs=*/2);
  ASSERT_NE(s, nullptr);
  MicroBatchExecutor& ex = *s->executor;
  std::vector<ExecSeq> seqs;
  for (int i = 0; i < 4; ++i) {
    auto q = ex.Open(SamplingParams{});
    ASSERT_OK(q);
    seqs.push_back(*q);
  }
  EXPECT_EQ(ex.open_in(0), 2);
  EXPECT_EQ(ex.open_in(1), 2);
  EXPECT_EQ(ex.Open(SamplingParams{}).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_OK(ex.Close(seqs[0]));
  auto again = ex.Open(SamplingParams{});  // the part with room
  ASSERT_OK(again);
  EXPECT_EQ(ex.open_in(0), 2);
  EXPECT_EQ(ex.Close(12345).code(), absl::StatusCode::kNotFound);

  // A step over sequences of both parts, then part 1's session goes away: the next such step is UNAVAILABLE.
  const std::vector<int32_t>& p = t->goldens[0].input_ids;
  std::vector<StepItem> items;
  for (ExecSeq q : {seqs[1], seqs[2], seqs[3], *again}) {
    items.push_back(StepItem{.seq = q, .tokens = std::span<const int32_t>(p.data(), 4), .sample = true});
  }
  StepOutput out;
  ASSERT_OK(ex.Step(items, &out));
  ASSERT_EQ(out.tokens.size(), 4u);
  EXPECT_EQ(out.emitted.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(out.tokens[i], out.tokens[0]) << "the same prompt, greedy";
  EXPECT_TRUE(ex.healthy());
  s->sessions[1]->Stop();
  Status st = ex.Step(items, &out);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_FALSE(ex.healthy());
}

}  // namespace
}  // namespace numoe::engine
