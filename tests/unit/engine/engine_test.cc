// The worker's batching engine on tiny-v4: greedy tokens equal the transformers goldens with chunked
// prefill interleaved with decode (LocalExecutor, and RemoteExecutor over a real shared-memory channel to
// a gpu session in this process); token budgets and max_seqs hold on every step; stop conditions;
// cancellation frees the sequence; a full queue answers RESOURCE_EXHAUSTED; bad requests name the field;
// sampling with temperature gives GenerateBatch's tokens.
#include "worker/engine/engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <thread>

#include "common/checkpoint.h"
#include "common/shm_channel.h"
#include "backends/cpu/cpu_model.h"
#include "worker/experts/reference_experts.h"
#include "model/generation.h"
#include "gpu_service/session.h"
#include "tests/support/fixtures.h"
#include "worker/engine/local_executor.h"
#include "worker/engine/remote_executor.h"
#include "worker/engine/stream.h"
#include "tests/support/status_matchers.h"

namespace numoe::engine {
namespace {

// tiny-v4 with its goldens (the shared tests/support fixture).
using Tiny = test::TinyModel;
Tiny* LoadTiny() {
  auto tiny = test::TinyModel::Get();
  if (!tiny.ok()) ADD_FAILURE() << tiny.status();
  return tiny.ok() ? *tiny : nullptr;
}

// Wraps an executor and checks/records what the engine asks of it.
class Recorder final : public Executor {
 public:
  explicit Recorder(Executor* inner) : inner_(inner) {}
  StatusOr<ExecSeq> Open(const SamplingParams& s) override {
    auto r = inner_->Open(s);
    if (r.ok()) max_open = std::max(max_open, ++open);
    return r;
  }
  Status Close(ExecSeq seq) override {
    --open;
    return inner_->Close(seq);
  }
  Status Step(std::span<const StepItem> items, StepOutput* out) override {
    int64_t total = 0, decode = 0, prefill = 0;
    for (const StepItem& it : items) {
      total += static_cast<int64_t>(it.tokens.size());
      largest_item = std::max<int64_t>(largest_item, static_cast<int64_t>(it.tokens.size()));
      (it.tokens.size() == 1 && it.sample ? decode : prefill) += 1;
    }
    largest_step = std::max(largest_step, total);
    if (decode > 0 && prefill > 0) ++mixed_steps;
    ++steps;
    return inner_->Step(items, out);
  }
  Status Flush() override { return inner_->Flush(); }
  bool healthy() const override { return inner_->healthy(); }
  ExecutorLimits limits() const override { return inner_->limits(); }

  Executor* inner_;
  int64_t open = 0, max_open = 0, steps = 0, largest_step = 0, largest_item = 0, mixed_steps = 0;
};

EngineRequest GreedyRequest(const test::GoldenPrompt& g) {
  EngineRequest r;
  r.prompt = g.input_ids;
  r.max_new_tokens = static_cast<int64_t>(g.greedy.size());
  r.ignore_eos = true;
  r.request_id = g.name;
  return r;
}

// Drives the engine on this thread until every stream has ended.
void RunToEnd(Engine& engine, int max_steps = 100000) {
  for (int i = 0; i < max_steps; ++i) {
    if (!engine.StepOnce()) {
      if (engine.stats().active == 0 && engine.stats().queued == 0) return;
    }
  }
  ADD_FAILURE() << "engine did not finish within " << max_steps << " steps";
}

TEST(Engine, GreedyMatchesGoldensWithChunkedPrefillInterleavedWithDecode) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  LocalExecutor local(t->model.get(), t->experts.get());
  Recorder rec(&local);
  Engine engine(&rec, EngineOptions{.max_seqs = 4, .max_step_tokens = 40, .prefill_chunk = 24});
  std::vector<std::unique_ptr<RequestStream>> streams;
  for (const auto& g : t->goldens) {
    auto s = RequestStream::Open(&engine, GreedyRequest(g));
    ASSERT_OK(s);
    streams.push_back(std::move(*s));
  }
  RunToEnd(engine);
  for (size_t i = 0; i < streams.size(); ++i) {
    auto r = streams[i]->Wait();
    ASSERT_OK(r);
    EXPECT_EQ(r->tokens, t->goldens[i].greedy) << t->goldens[i].name;
    EXPECT_EQ(r->finish_reason, "length");
  }
  EXPECT_LE(rec.largest_step, 40);
  EXPECT_LE(rec.largest_item, 24);
  EXPECT_GT(rec.mixed_steps, 0) << "no step carried decode tokens and prefill chunks together";
  EXPECT_EQ(rec.open, 0);
  EXPECT_EQ(local.open_sequences(), 0);
  const EngineStats st = engine.stats();
  EXPECT_EQ(st.tokens_generated, 4 * 32);
  EXPECT_EQ(st.prompt_tokens, 37 + 250 + 1 + 150);
  EXPECT_EQ(st.outstanding_tokens, 0);
}

TEST(Engine, MaxSeqsAndBudgetHoldWhenOversubscribed) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  LocalExecutor local(t->model.get(), t->experts.get());
  Recorder rec(&local);
  // A budget smaller than the running sequences: decode slots rotate, nobody starves.
  Engine engine(&rec, EngineOptions{.max_seqs = 3, .max_step_tokens = 2, .prefill_chunk = 0});
  std::vector<std::unique_ptr<RequestStream>> streams;
  for (int rep = 0; rep < 2; ++rep) {
    for (const auto& g : t->goldens) {
      if (g.input_ids.size() > 40) continue;  // short prompts keep this test quick
      EngineRequest r = GreedyRequest(g);
      r.max_new_tokens = 6;
      auto s = RequestStream::Open(&engine, r);
      ASSERT_OK(s);
      streams.push_back(std::move(*s));
    }
  }
  RunToEnd(engine);
  EXPECT_LE(rec.max_open, 3);
  EXPECT_EQ(rec.max_open, 3);
  EXPECT_LE(rec.largest_step, 2);
  size_t k = 0;
  for (int rep = 0; rep < 2; ++rep) {
    for (const auto& g : t->goldens) {
      if (g.input_ids.size() > 40) continue;
      auto r = streams[k++]->Wait();
      ASSERT_OK(r);
      EXPECT_EQ(r->tokens, std::vector<int32_t>(g.greedy.begin(), g.greedy.begin() + 6)) << g.name;
    }
  }
}

TEST(Engine, StopConditions) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  const test::GoldenPrompt& g = t->goldens[0];
  LocalExecutor local(t->model.get(), t->experts.get());

  // EOS = the golden's 4th token: stops there ("stop", the EOS included) unless ignore_eos.
  Engine eos_engine(&local, EngineOptions{.max_seqs = 4, .eos_token_id = g.greedy[3]});
  EngineRequest a = GreedyRequest(g);
  a.ignore_eos = false;
  auto sa = RequestStream::Open(&eos_engine, a);
  ASSERT_OK(sa);
  EngineRequest b = GreedyRequest(g);  // ignore_eos: runs to max_new_tokens
  b.max_new_tokens = 8;
  auto sb = RequestStream::Open(&eos_engine, b);
  ASSERT_OK(sb);
  RunToEnd(eos_engine);
  auto ra = (*sa)->Wait();
  ASSERT_OK(ra);
  const size_t first_eos = std::find(g.greedy.begin(), g.greedy.end(), g.greedy[3]) - g.greedy.begin();
  EXPECT_EQ(ra->tokens, std::vector<int32_t>(g.greedy.begin(), g.greedy.begin() + first_eos + 1));
  EXPECT_EQ(ra->finish_reason, "stop");
  auto rb = (*sb)->Wait();
  ASSERT_OK(rb);
  EXPECT_EQ(rb->tokens, std::vector<int32_t>(g.greedy.begin(), g.greedy.begin() + 8));
  EXPECT_EQ(rb->finish_reason, "length");

  // Stop token ids (EOS ignored), and max_new_tokens = 0.
  Engine engine(&local, EngineOptions{});
  EngineRequest c = GreedyRequest(g);
  c.stop_token_ids = {g.greedy[5]};
  auto sc = RequestStream::Open(&engine, c);
  ASSERT_OK(sc);
  EngineRequest d = GreedyRequest(g);
  d.max_new_tokens = 0;
  auto sd = RequestStream::Open(&engine, d);
  ASSERT_OK(sd);
  RunToEnd(engine);
  auto rc = (*sc)->Wait();
  ASSERT_OK(rc);
  const size_t first_stop = std::find(g.greedy.begin(), g.greedy.end(), g.greedy[5]) - g.greedy.begin();
  EXPECT_EQ(rc->tokens, std::vector<int32_t>(g.greedy.begin(), g.greedy.begin() + first_stop + 1));
  EXPECT_EQ(rc->finish_reason, "stop");
  auto rd = (*sd)->Wait();
  ASSERT_OK(rd);
  EXPECT_TRUE(rd->tokens.empty());
  EXPECT_EQ(rd->finish_reason, "length");
  EXPECT_EQ(local.open_sequences(), 0);
}

TEST(Engine, ContextLimitEndsWithLength) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  LocalExecutor local(t->model.get(), t->experts.get());
  const test::GoldenPrompt& g = t->goldens[0];  // 37 tokens
  Engine engine(&local, EngineOptions{.max_context = 40});
  auto s = RequestStream::Open(&engine, GreedyRequest(g));
  ASSERT_OK(s);
  RunToEnd(engine);
  auto r = (*s)->Wait();
  ASSERT_OK(r);
  EXPECT_EQ(r->tokens.size(), 3u);
  EXPECT_EQ(r->finish_reason, "length");
  EngineRequest too_long = GreedyRequest(t->goldens[1]);  // 250 tokens
  auto bad = engine.Submit(too_long, nullptr);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("context limit"), std::string::npos);
}

TEST(Engine, CancellationFreesTheSequence) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  LocalExecutor local(t->model.get(), t->experts.get());
  Recorder rec(&local);
  Engine engine(&rec, EngineOptions{});
  engine.Start();
  EngineRequest r = GreedyRequest(t->goldens[0]);
  r.max_new_tokens = 1000;  // far more than the test waits for
  {
    auto s = RequestStream::Open(&engine, r);
    ASSERT_OK(s);
    RequestStream::Event e = (*s)->Next();
    ASSERT_FALSE(e.final) << e.status;
    EXPECT_EQ(e.tokens, std::vector<int32_t>{t->goldens[0].greedy[0]});
  }  // the reader goes away: the request is cancelled
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while ((engine.stats().active > 0 || rec.open > 0) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(engine.stats().active, 0);
  EXPECT_EQ(engine.stats().outstanding_tokens, 0);
  engine.Stop();
  EXPECT_EQ(local.open_sequences(), 0);
  EXPECT_LT(engine.stats().tokens_generated, 1000);

  // Cancelling a queued (not yet admitted) request ends it with CANCELLED.
  Engine idle(&local, EngineOptions{});
  auto q = RequestStream::Open(&idle, GreedyRequest(t->goldens[2]));
  ASSERT_OK(q);
  idle.Cancel((*q)->id());
  idle.StepOnce();
  EXPECT_EQ((*q)->Wait().status().code(), absl::StatusCode::kCancelled);
}

TEST(Engine, FullQueueIsResourceExhausted) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  LocalExecutor local(t->model.get(), t->experts.get());
  Engine engine(&local, EngineOptions{.max_seqs = 1, .max_queue = 2});
  std::vector<std::unique_ptr<RequestStream>> streams;
  for (int i = 0; i < 2; ++i) {  // nothing is admitted until a step runs: both wait in the queue
    auto s = RequestStream::Open(&engine, GreedyRequest(t->goldens[2]));
    ASSERT_OK(s);
    streams.push_back(std::move(*s));
  }
  auto full = RequestStream::Open(&engine, GreedyRequest(t->goldens[2]));
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted) << full.status();
  EXPECT_EQ(engine.stats().queued, 2);
  // Admission makes room again.
  engine.StepOnce();
  EXPECT_EQ(engine.stats().queued, 1);
  EXPECT_EQ(engine.stats().active, 1);
  auto again = RequestStream::Open(&engine, GreedyRequest(t->goldens[2]));
  EXPECT_OK(again);
  engine.Stop();
}

TEST(Engine, BadRequestsNameTheField) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  LocalExecutor local(t->model.get(), t->experts.get());
  Engine engine(&local, EngineOptions{});
  auto expect = [&](EngineRequest r, const std::string& field) {
    auto s = engine.Submit(std::move(r), nullptr);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(s.status().message().find(field), std::string::npos) << s.status();
  };
  EngineRequest r = GreedyRequest(t->goldens[0]);
  r.prompt.clear();
  expect(r, "prompt_ids");
  r = GreedyRequest(t->goldens[0]);
  r.prompt[3] = 1024;
  expect(r, "prompt_ids[3]");
  r = GreedyRequest(t->goldens[0]);
  r.max_new_tokens = -1;
  expect(r, "max_new_tokens");
  r = GreedyRequest(t->goldens[0]);
  r.sampling.top_p = 0.0;
  expect(r, "sampling.top_p");
  r = GreedyRequest(t->goldens[0]);
  r.stop_token_ids = {5, -2};
  expect(r, "stop_token_ids[1]");
}

TEST(Engine, SampledTokensEqualGenerateBatch) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  std::vector<GenerateRequest> batch;
  std::vector<std::unique_ptr<RequestStream>> streams;
  LocalExecutor local(t->model.get(), t->experts.get());
  Engine engine(&local, EngineOptions{.max_step_tokens = 64, .prefill_chunk = 16});
  for (size_t i = 0; i < t->goldens.size(); ++i) {
    GenerateRequest g;
    g.prompt = t->goldens[i].input_ids;
    g.max_new_tokens = 12;
    g.ignore_eos = true;
    g.sampling = SamplingParams{.temperature = 0.9, .top_p = 0.95, .top_k = 50, .seed = 1000 + i};
    batch.push_back(g);
    EngineRequest r;
    r.prompt = g.prompt;
    r.max_new_tokens = g.max_new_tokens;
    r.ignore_eos = true;
    r.sampling = g.sampling;
    auto s = RequestStream::Open(&engine, r);
    ASSERT_OK(s);
    streams.push_back(std::move(*s));
  }
  RunToEnd(engine);
  auto expected = GenerateBatch(*t->model, *t->experts, batch);
  ASSERT_OK(expected);
  for (size_t i = 0; i < streams.size(); ++i) {
    auto r = streams[i]->Wait();
    ASSERT_OK(r);
    EXPECT_EQ(r->tokens, (*expected)[i].tokens) << i;
  }
}

// The whole data path in one process: engine -> RemoteExecutor -> shared-memory channel -> a gpu
// WorkerSession running CpuModel, whose MoE goes back over the channel to ReferenceExperts.
TEST(Engine, RemoteExecutorOverTheChannelMatchesGoldens) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  auto gpu_model = cpu::CpuModel::Create(*t->ckpt, nullptr);
  ASSERT_OK(gpu_model);
  gpu::ModelHost host;
  host.model = gpu_model->get();
  const ModelConfig& cfg = t->ckpt->config();
  shm::Geometry geo{.hidden = static_cast<uint32_t>(cfg.hidden_size),
                    .top_k = static_cast<uint32_t>(cfg.num_experts_per_tok),
                    .max_rows = 48,
                    .max_seqs = 4,
                    .vocab = static_cast<uint32_t>(cfg.vocab_size),
                    .logits_rows = 4};
  auto gpu_end = shm::Channel::CreateAnonymous(geo);
  ASSERT_OK(gpu_end);
  auto worker_end = (*gpu_end)->PeerEndpoint();
  ASSERT_OK(worker_end);
  gpu::WorkerSession session(&host, gpu::SessionInfo{.lease = 1, .worker_id = "test"}, std::move(*gpu_end));
  session.Start(nullptr);

  RemoteExecutor remote(worker_end->get(), t->experts.get());
  EXPECT_EQ(remote.limits().max_step_tokens, 48);
  Recorder rec(&remote);
  Engine engine(&rec, EngineOptions{.max_seqs = 8, .max_step_tokens = 1000, .prefill_chunk = 32});
  EXPECT_EQ(engine.options().max_seqs, 4);  // clamped to the channel
  EXPECT_EQ(engine.options().max_step_tokens, 48);
  std::vector<std::unique_ptr<RequestStream>> streams;
  for (const auto& g : t->goldens) {
    auto s = RequestStream::Open(&engine, GreedyRequest(g));
    ASSERT_OK(s);
    streams.push_back(std::move(*s));
  }
  RunToEnd(engine);
  for (size_t i = 0; i < streams.size(); ++i) {
    auto r = streams[i]->Wait();
    ASSERT_OK(r);
    EXPECT_EQ(r->tokens, t->goldens[i].greedy) << t->goldens[i].name;
  }
  EXPECT_GT(rec.mixed_steps, 0);
  EXPECT_LE(rec.largest_step, 48);
  EXPECT_GT(remote.moe_requests(), 0);
  EXPECT_EQ(session.sequences(), 0);  // closes were flushed when the engine went idle
  EXPECT_GT(host.hops.count(), 0u);

  // Logits travel too, and equal the local executor's.
  auto seq = remote.Open(SamplingParams{});
  ASSERT_OK(seq);
  const auto& p = t->goldens[2].input_ids;
  StepItem item{.seq = *seq, .tokens = std::span<const int32_t>(p), .sample = true, .logits = true};
  StepOutput out;
  ASSERT_OK(remote.Step(std::span<const StepItem>(&item, 1), &out));
  ASSERT_EQ(out.logits.size(), 1u);
  ASSERT_EQ(out.logits[0].size(), static_cast<size_t>(cfg.vocab_size));
  EXPECT_EQ(out.tokens[0], t->goldens[2].greedy[0]);
  EXPECT_EQ(Argmax(out.logits[0].data(), cfg.vocab_size), t->goldens[2].greedy[0]);

  // A bad step is an error naming the field, and the channel stays usable.
  auto seq2 = remote.Open(SamplingParams{});
  ASSERT_OK(seq2);
  const int32_t bad_token = 5000;
  StepItem bad{.seq = *seq2, .tokens = std::span<const int32_t>(&bad_token, 1), .sample = true};
  Status st = remote.Step(std::span<const StepItem>(&bad, 1), &out);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("out of range"), std::string::npos) << st;
  EXPECT_TRUE(remote.healthy());
  ASSERT_OK(remote.Close(*seq));
  ASSERT_OK(remote.Close(*seq2));
  ASSERT_OK(remote.Flush());
  EXPECT_EQ(session.sequences(), 0);

  // The gpu side goes away: the worker's next step fails with UNAVAILABLE and the executor is broken.
  session.Stop();
  auto seq3 = remote.Open(SamplingParams{});
  ASSERT_OK(seq3);
  StepItem last{.seq = *seq3, .tokens = std::span<const int32_t>(p), .sample = true};
  st = remote.Step(std::span<const StepItem>(&last, 1), &out);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_FALSE(remote.healthy());
}

}  // namespace
}  // namespace numoe::engine
