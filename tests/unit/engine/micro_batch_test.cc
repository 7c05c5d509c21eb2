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

// With `lane`: one more session, the prefill lane, sharing session 0's sequences (as numoe-gpu makes it for
// RegisterRequest::share_sequences_with), every executor taking keys from a range of its own, the lane's
// expert calls through SerialExperts::lane() in pieces of `piece_rows`.
std::unique_ptr<Stack> MakeStack(Tiny& t, size_t parts, bool spec, uint32_t max_seqs = 8, bool lane = false,
                                 int64_t piece_rows = 0) {
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
  s->serial = std::make_unique<SerialExperts>(s->counting.get(), cfg.hidden_size, piece_rows);
  std::vector<Executor*> ex;
  for (size_t p = 0; p < parts + (lane ? 1 : 0); ++p) {
    const bool is_lane = p == parts;
    auto gpu_end = shm::Channel::CreateAnonymous(geo);
    EXPECT_OK(gpu_end);
    if (!gpu_end.ok()) return nullptr;
    auto worker_end = (*gpu_end)->PeerEndpoint();
    EXPECT_OK(worker_end);
    if (!worker_end.ok()) return nullptr;
    s->sessions.push_back(std::make_unique<gpu::WorkerSession>(
        &s->host,
        gpu::SessionInfo{.lease = p + 1, .worker_id = is_lane ? "lane" : absl::StrCat("mb", p), .background = is_lane},
        std::move(*gpu_end), lane && p > 0 ? s->sessions.front()->table() : nullptr));
    s->sessions.back()->Start(nullptr);
    s->worker_ends.push_back(std::move(*worker_end));
    s->remotes.push_back(std::make_unique<RemoteExecutor>(
        s->worker_ends.back().get(), is_lane ? s->serial->lane() : s->serial.get(),
        lane ? (static_cast<ExecSeq>(p) << 40) + 1 : 1));
    if (!is_lane) ex.push_back(s->remotes.back().get());
  }
  s->executor = std::make_unique<MicroBatchExecutor>(ex, s->serial.get(), lane ? s->remotes.back().get() : nullptr);
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

// Runs every golden prompt greedily through `engine` to its end and checks each against its golden tokens.
void ExpectGreedyGoldens(Engine& engine, const Tiny& t, const std::string& what = "") {
  std::vector<std::unique_ptr<RequestStream>> streams;
  for (const auto& g : t.goldens) {
    auto st = RequestStream::Open(&engine, Greedy(g, static_cast<int64_t>(g.greedy.size())));
    ASSERT_OK(st);
    streams.push_back(std::move(*st));
  }
  RunToEnd(engine);
  for (size_t i = 0; i < streams.size(); ++i) {
    auto r = streams[i]->Wait();
    ASSERT_OK(r) << what;
    EXPECT_EQ(r->tokens, t.goldens[i].greedy) << t.goldens[i].name << ", " << what;
  }
}

TEST(MicroBatches, GreedyEqualsTheGoldensWithBothMicroBatchesInEveryStep) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  auto s = MakeStack(*t, 2, false);
  ASSERT_NE(s, nullptr);
  Engine engine(s->executor.get(), EngineOptions{.max_seqs = 8, .max_step_tokens = 48, .prefill_chunk = 16});
  ExpectGreedyGoldens(engine, *t);
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
std::vector<Sampled> RunSampled(Executor* ex, const Tiny& t, int64_t lane_tokens = 0) {
  Engine engine(ex, EngineOptions{.max_seqs = 8, .max_step_tokens = 48, .prefill_chunk = 16,
                                  .prefill_lane_tokens = lane_tokens});
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

// `got` equals `want` bit for bit: tokens, chosen logprobs and every top alternative.
void ExpectSameSampled(const std::vector<Sampled>& got, const std::vector<Sampled>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i].tokens) << "choice " << i;
    ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size()) << "choice " << i;
    for (size_t k = 0; k < want[i].logprobs.size(); ++k) {
      EXPECT_EQ(got[i].logprobs[k].chosen.token, want[i].logprobs[k].chosen.token);
      EXPECT_EQ(got[i].logprobs[k].chosen.logprob, want[i].logprobs[k].chosen.logprob);  // bit for bit
      ASSERT_EQ(got[i].logprobs[k].top.size(), want[i].logprobs[k].top.size());
      for (size_t j = 0; j < want[i].logprobs[k].top.size(); ++j) {
        EXPECT_EQ(got[i].logprobs[k].top[j].token, want[i].logprobs[k].top[j].token);
        EXPECT_EQ(got[i].logprobs[k].top[j].logprob, want[i].logprobs[k].top[j].logprob);
      }
    }
  }
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
  ExpectSameSampled(two, one);
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

// The prefill lane: prompts of at least `lane_tokens` prefill in the lane's session, beside the decode steps.
// Greedy equals the goldens for every chunking and lane threshold (the CPU backend is batch invariant), the
// lane ran, and every sequence is freed at the end.
TEST(PrefillLane, GreedyEqualsTheGoldensForEveryChunking) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  for (int64_t piece_rows : {0, 3}) {
    for (int64_t chunk : {0, 5, 16}) {
      for (int64_t lane_tokens : {1, 12}) {
        const std::string what = absl::StrCat("chunk ", chunk, ", lane for ", lane_tokens, "+ tokens, pieces of ",
                                              piece_rows, " rows");
        auto s = MakeStack(*t, 2, false, 8, /*lane=*/true, piece_rows);
        ASSERT_NE(s, nullptr);
        Engine engine(s->executor.get(), EngineOptions{.max_seqs = 8, .max_step_tokens = 48, .prefill_chunk = chunk,
                                                       .prefill_lane_tokens = lane_tokens});
        ExpectGreedyGoldens(engine, *t, what);
        EXPECT_GT(s->executor->lane_steps(), 0) << what;
        EXPECT_EQ(engine.stats().lane_steps, s->executor->lane_steps()) << what;
        EXPECT_GT(s->sessions.back()->steps(), 0u) << what;
        EXPECT_EQ(s->sessions.front()->sequences(), 0) << what;  // the shared table, counted by its first session
        EXPECT_EQ(s->sessions.back()->sequences(), 0) << what;   // (the lane's share is not counted twice)
        EXPECT_EQ(s->sessions.front()->table()->size.load(), 0) << what;
        EXPECT_EQ(s->counting->max_in_flight.load(), 1) << "two expert calls ran at once, " << what;
        if (piece_rows > 0) {
          EXPECT_GT(s->serial->pieces(), s->executor->lane_steps()) << what;
        }
      }
    }
  }
}

// A stream decoding while a longer prompt arrives: the prompt prefills in the lane while the stream's decode
// steps go on (steps beside the lane), and both outputs equal those without the lane.
TEST(PrefillLane, DecodeGoesOnWhileALongPromptPrefills) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  const test::GoldenPrompt& shortp = t->goldens[0];
  EngineRequest longr = Greedy(t->goldens[1], 8);
  for (int k = 0; k < 3; ++k) longr.prompt.insert(longr.prompt.end(), t->goldens[1 + k % 2].input_ids.begin(),
                                                   t->goldens[1 + k % 2].input_ids.end());
  const int64_t threshold = static_cast<int64_t>(shortp.input_ids.size()) + 1;
  ASSERT_GE(static_cast<int64_t>(longr.prompt.size()), threshold);
  auto run = [&](int64_t lane_tokens, int64_t* beside) {
    auto s = MakeStack(*t, 1, false, 8, /*lane=*/true, /*piece_rows=*/4);
    EXPECT_NE(s, nullptr);
    Engine engine(s->executor.get(), EngineOptions{.max_seqs = 8, .max_step_tokens = 48, .prefill_chunk = 6,
                                                   .prefill_lane_tokens = lane_tokens});
    auto a = RequestStream::Open(&engine, Greedy(shortp, static_cast<int64_t>(shortp.greedy.size())));
    EXPECT_OK(a);
    for (int i = 0; i < 3; ++i) engine.StepOnce();  // the stream is decoding
    auto b = RequestStream::Open(&engine, longr);
    EXPECT_OK(b);
    RunToEnd(engine);
    *beside = engine.stats().steps_beside_lane;
    auto ra = (*a)->Wait();
    auto rb = (*b)->Wait();
    EXPECT_OK(ra);
    EXPECT_OK(rb);
    EXPECT_EQ(ra->tokens, shortp.greedy);
    return rb->tokens;
  };
  int64_t beside_off = 0, beside_on = 0;
  const std::vector<int32_t> off = run(0, &beside_off);
  const std::vector<int32_t> on = run(threshold, &beside_on);
  EXPECT_EQ(on, off) << "the lane changed the long prompt's tokens";
  EXPECT_EQ(off.size(), 8u);
  EXPECT_EQ(beside_off, 0);
  EXPECT_GT(beside_on, 0) << "no decode step ran while the long prompt prefilled in the lane";
}

TEST(PrefillLane, SampledTokensAndLogprobsEqualTheOneBatchPath) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  std::vector<Sampled> one, lane;
  {
    auto s = MakeStack(*t, 1, false);
    ASSERT_NE(s, nullptr);
    one = RunSampled(s->remotes[0].get(), *t);
  }
  {
    auto s = MakeStack(*t, 1, false, 8, /*lane=*/true, /*piece_rows=*/4);
    ASSERT_NE(s, nullptr);
    lane = RunSampled(s->executor.get(), *t, /*lane_tokens=*/1);
    EXPECT_GT(s->executor->lane_steps(), 0);
  }
  ASSERT_EQ(one.size(), 6u);
  ExpectSameSampled(lane, one);
}

// A sequence in the lane's step is refused by Step, Fork and Close until the lane step ends; a sequence is
// handed back to its part afterwards (it decodes there); a gone lane breaks the executor, and the shared
// table frees the sequences once no session holds it.
TEST(PrefillLane, HandOverRefusalsAndAGoneLane) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  auto s = MakeStack(*t, 1, false, 8, /*lane=*/true);
  ASSERT_NE(s, nullptr);
  MicroBatchExecutor& ex = *s->executor;
  ASSERT_TRUE(ex.has_prefill_lane());
  auto a = ex.Open(SamplingParams{});
  auto b = ex.Open(SamplingParams{});
  ASSERT_OK(a);
  ASSERT_OK(b);
  const std::vector<int32_t>& p = t->goldens[0].input_ids;
  std::vector<StepItem> lane_items{StepItem{.seq = *a, .tokens = std::span<const int32_t>(p.data(), p.size()),
                                            .sample = true}};
  ASSERT_OK(ex.StartLaneStep(lane_items));
  EXPECT_EQ(ex.StartLaneStep(lane_items).code(), absl::StatusCode::kFailedPrecondition);  // one at a time
  EXPECT_EQ(ex.Close(*a).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ex.Fork(*a, SamplingParams{}).status().code(), absl::StatusCode::kFailedPrecondition);
  StepOutput out;
  std::vector<StepItem> decode{StepItem{.seq = *a, .tokens = std::span<const int32_t>(p.data(), 1), .sample = true}};
  EXPECT_EQ(ex.Step(decode, &out).code(), absl::StatusCode::kFailedPrecondition);
  // The other sequence steps in its part meanwhile.
  std::vector<StepItem> other{StepItem{.seq = *b, .tokens = std::span<const int32_t>(p.data(), p.size()),
                                       .sample = true}};
  ASSERT_OK(ex.Step(other, &out));
  const int32_t b_first = out.tokens[0];
  StepOutput lane_out;
  ASSERT_OK(ex.FinishLaneStep(&lane_out));
  ASSERT_EQ(lane_out.tokens.size(), 1u);
  EXPECT_EQ(lane_out.tokens[0], t->goldens[0].greedy[0]);
  EXPECT_EQ(b_first, t->goldens[0].greedy[0]);
  // Back in its part: its next token decodes there, in numoe-gpu's one table.
  const int32_t next = lane_out.tokens[0];
  std::vector<StepItem> step{StepItem{.seq = *a, .tokens = std::span<const int32_t>(&next, 1), .sample = true}};
  ASSERT_OK(ex.Step(step, &out));
  EXPECT_EQ(out.tokens[0], t->goldens[0].greedy[1]);
  EXPECT_EQ(s->sessions.front()->table()->size.load(), 2);

  // The lane's session goes away: the executor is unhealthy, the next lane step fails UNAVAILABLE.
  s->sessions.back()->Stop();
  ASSERT_OK(ex.StartLaneStep(lane_items = {StepItem{.seq = *b, .tokens = std::span<const int32_t>(&next, 1),
                                                    .sample = true}}));
  EXPECT_EQ(ex.FinishLaneStep(&lane_out).code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(ex.healthy());
  // The decode session still holds the table (its sequences are its); once it goes too, they are freed.
  std::weak_ptr<gpu::SequenceTable> table = s->sessions.front()->table();
  EXPECT_EQ(table.lock()->size.load(), 2);
  s->sessions.front()->Stop();
  EXPECT_EQ(table.lock()->size.load(), 0);
}

// Holds every expert call until released (a lane's step stays in flight).
class Gate final : public ExpertBackend {
 public:
  explicit Gate(ExpertBackend* inner) : inner_(inner) {}
  Status RunRouted(const MoeRequest& r) override {
    entered.store(true);
    while (!open.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return inner_->RunRouted(r);
  }
  std::atomic<bool> entered{false}, open{false};

 private:
  ExpertBackend* inner_;
};

// numoe-gpu itself refuses a step that names a sequence another session of the table is stepping (a worker
// that broke the hand-over rule cannot make two lanes touch one sequence), and the refused step leaves the
// conversation intact.
TEST(PrefillLane, NumoeGpuRefusesASequenceAnotherLaneSteps) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  auto s = MakeStack(*t, 1, false, 8, /*lane=*/true);
  ASSERT_NE(s, nullptr);
  Gate gate(t->experts.get());
  RemoteExecutor a(s->worker_ends[0].get(), &gate, 1);  // session 0's channel, a gated expert backend
  RemoteExecutor& b = *s->remotes[1];                  // the lane's
  auto seq = a.Open(SamplingParams{});
  ASSERT_OK(seq);
  const std::vector<int32_t>& p = t->goldens[0].input_ids;
  std::vector<StepItem> items{StepItem{.seq = *seq, .tokens = std::span<const int32_t>(p.data(), p.size()),
                                       .sample = true}};
  StepOutput out_a;
  Status st_a;
  std::thread in_flight([&] { st_a = a.Step(items, &out_a); });
  while (!gate.entered.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  // The lane is told the sequence is open (as a hand-over would) while session 0's step holds it.
  ASSERT_OK(b.Adopt(SeqHandoff{.seq = *seq, .opened = true}));
  const int32_t tok = p[0];
  std::vector<StepItem> other{StepItem{.seq = *seq, .tokens = std::span<const int32_t>(&tok, 1), .sample = true}};
  StepOutput out_b;
  Status st_b = b.Step(other, &out_b);
  EXPECT_EQ(st_b.code(), absl::StatusCode::kInvalidArgument) << st_b;
  EXPECT_NE(st_b.message().find("another lane's step"), std::string::npos) << st_b;
  EXPECT_TRUE(b.healthy());
  gate.open.store(true);
  in_flight.join();
  ASSERT_OK(st_a);
  EXPECT_EQ(out_a.tokens[0], t->goldens[0].greedy[0]);
  // Once that step ended, the lane may step it.
  const int32_t next = out_a.tokens[0];
  other[0].tokens = std::span<const int32_t>(&next, 1);
  ASSERT_OK(b.Step(other, &out_b));
  EXPECT_EQ(out_b.tokens[0], t->goldens[0].greedy[1]);
}

}  // namespace
}  // namespace numoe::engine
