// Real numoe-gpu + numoe-worker processes on loopback, tiny-v4: greedy token ids through the Worker gRPC
// API equal the transformers goldens with several concurrent streams over four workers whose steps
// interleave in numoe-gpu (speculation on for two of them, off for the others); a client that cancels frees
// its sequence in numoe-gpu; a full queue answers RESOURCE_EXHAUSTED; bad input names the field; a worker
// killed with SIGKILL mid-step has its sequences and channel freed in numoe-gpu while the other workers keep
// emitting their goldens; a worker with a different model is refused.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "numoe/v1/gpu.grpc.pb.h"
#include "numoe/v1/worker.grpc.pb.h"
#include "tests/support/files.h"
#include "tests/support/fixtures.h"
#include "tests/support/process.h"
#include "tests/support/status_matchers.h"

namespace numoe::test {
namespace {

using Clock = std::chrono::steady_clock;

struct StreamResult {
  grpc::Status status;
  std::vector<int32_t> tokens;
  std::string finish_reason;
  int messages = 0;
  uint64_t cached_tokens = 0;
};

StreamResult Generate(v1::Worker::Stub& stub, const v1::WorkerGenerateRequest& req, int timeout_s = 120) {
  StreamResult r;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(timeout_s));
  auto reader = stub.Generate(&ctx, req);
  v1::WorkerGenerateResponse resp;
  while (reader->Read(&resp)) {
    ++r.messages;
    r.tokens.insert(r.tokens.end(), resp.token_ids().begin(), resp.token_ids().end());
    if (!resp.finish_reason().empty()) r.finish_reason = resp.finish_reason();
    r.cached_tokens += resp.cached_tokens();
  }
  r.status = reader->Finish();
  return r;
}

v1::WorkerGenerateRequest GreedyRequest(const GoldenPrompt& g, int max_new = 0) {
  v1::WorkerGenerateRequest req;
  for (int32_t t : g.input_ids) req.add_prompt_ids(t);
  req.set_max_new_tokens(max_new > 0 ? max_new : static_cast<uint32_t>(g.greedy.size()));
  req.set_ignore_eos(true);
  req.set_request_id(g.name);
  return req;
}

v1::GpuStats GpuStats(v1::GpuService::Stub& gpu) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::GpuStats s;
  EXPECT_OK(gpu.Stats(&ctx, v1::GpuStatsRequest(), &s));
  return s;
}

v1::WorkerStats WorkerStats(v1::Worker::Stub& w) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::WorkerStats s;
  EXPECT_OK(w.Stats(&ctx, v1::WorkerStatsRequest(), &s));
  return s;
}

// Polls `pred` for up to `ms`.
template <typename F>
bool Eventually(F pred, int ms = 20000) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(ms);
  while (Clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

class Runtime : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(goldens_, Goldens::Load(TinyDir()));
    ASSERT_EQ(goldens_.size(), 4u);
    // Heartbeats every 100 ms, but a lease of 3 s: on a loaded 2-core CI box a healthy worker's heartbeat can
    // be late by more than the default 4 x 100 ms.
    std::vector<std::string> args = {BinPath("numoe-gpu"), "--model", TinyDir(), "--port", "0",
                                     "--heartbeat-ms", "100", "--lease-ms", "3000", "--merge-lanes", merge_lanes_};
    gpu_ = std::make_unique<Child>(Child::Start(args, {.log = tmp_ / "gpu.log", .notify = true}));
    gpu_addr_ = gpu_->WaitReady();
    ASSERT_FALSE(gpu_addr_.empty()) << gpu_->Log();
    gpu_stub_ = v1::GpuService::NewStub(grpc::CreateChannel(gpu_addr_, grpc::InsecureChannelCredentials()));
  }

  // Starts a worker; returns its index in workers_.
  size_t StartWorker(std::vector<std::string> extra = {}, const std::string& model = "") {
    std::vector<std::string> args = {BinPath("numoe-worker"), "--model", model.empty() ? TinyDir() : model,
                                     "--gpu", gpu_addr_, "--port", "0", "--no-numa-bind", "--threads", "1",
                                     "--max-step-tokens", "64", "--prefill-chunk", "32"};
    args.insert(args.end(), extra.begin(), extra.end());
    const size_t i = workers_.size();
    workers_.push_back(std::make_unique<Child>(
        Child::Start(args, {.log = tmp_ / ("worker" + std::to_string(i) + ".log"), .notify = true})));
    const std::string addr = workers_.back()->WaitReady();
    addrs_.push_back(addr);
    stubs_.push_back(addr.empty() ? nullptr
                                  : v1::Worker::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials())));
    return i;
  }

  // The killed-worker scenario (KilledWorkerIsFreedInGpuWhileTheOthersKeepTheirGoldens), for both step paths.
  void KillOneWorkerMidStep();

  std::string merge_lanes_ = "off";  // numoe-gpu --merge-lanes (RuntimeMerged: on)
  Goldens goldens_;
  TempDir tmp_{"numoe-runtime-it"};  // the logs; declared first, so the children stop before it goes
  std::unique_ptr<Child> gpu_;
  std::string gpu_addr_;
  std::unique_ptr<v1::GpuService::Stub> gpu_stub_;
  std::vector<std::unique_ptr<Child>> workers_;
  std::vector<std::string> addrs_;
  std::vector<std::unique_ptr<v1::Worker::Stub>> stubs_;
};

// Four workers at once, two drafting with the model's DSpark stages (--spec auto) and two without
// (--spec none), one of each split into two micro-batches (--micro-batches 2: two sessions in numoe-gpu):
// numoe-gpu's CPU backend interleaves their steps at the expert calls (GpuStats overlapped_steps), and every
// stream still emits exactly the transformers goldens (the CPU backend is batch invariant, so interleaving,
// batching and splitting change no bit).
TEST_F(Runtime, ConcurrentGreedyStreamsOverFourWorkersInterleaveAndMatchGoldens) {
  // Sessions in numoe-gpu: 2 + 2 + 1 + 1 micro-batches, and every worker's prefill lane (on by default).
  constexpr int kWorkers = 4, kSessions = 6 + kWorkers;
  for (int i = 0; i < kWorkers; ++i) {
    // Workers 0 and 2 prefill every golden prompt in their prefill lane (4+ tokens) beside their decode steps.
    StartWorker({"--spec", i % 2 == 0 ? "auto" : "none", "--micro-batches", i < 2 ? "2" : "1", "--prefill-lane-tokens",
                 i % 2 == 0 ? "4" : "2048"});
    ASSERT_FALSE(addrs_[i].empty()) << workers_[i]->Log();
  }
  EXPECT_TRUE(Eventually([&] { return GpuStats(*gpu_stub_).workers() == kSessions; }));

  // 16 streams at once: every prompt 4 times, each copy on another worker.
  constexpr int kCopies = 4;
  std::vector<StreamResult> results(goldens_.size() * kCopies);
  std::vector<std::thread> threads;
  for (size_t k = 0; k < results.size(); ++k) {
    threads.emplace_back([&, k] {
      const GoldenPrompt& g = goldens_[k % goldens_.size()];
      results[k] = Generate(*stubs_[(k / goldens_.size() + k) % kWorkers], GreedyRequest(g));
    });
  }
  for (auto& t : threads) t.join();
  for (size_t k = 0; k < results.size(); ++k) {
    const GoldenPrompt& g = goldens_[k % goldens_.size()];
    const size_t w = (k / goldens_.size() + k) % kWorkers;
    ASSERT_OK(results[k].status) << g.name << ": " << results[k].status.error_message();
    EXPECT_EQ(results[k].tokens, g.greedy) << g.name << " on worker " << w;
    EXPECT_EQ(results[k].finish_reason, "length");
    EXPECT_GE(results[k].messages, 2);  // streamed, not one reply at the end
  }

  const v1::GpuStats gs = GpuStats(*gpu_stub_);
  EXPECT_EQ(gs.workers(), static_cast<uint32_t>(kSessions));
  int micro_batch_sessions = 0, lanes_stepped = 0;
  for (const v1::GpuWorkerStats& w : gs.worker_stats()) {
    if (w.worker_id().ends_with(":mb1")) {
      ++micro_batch_sessions;
      EXPECT_GT(w.steps(), 0u) << w.worker_id() << ": its second micro-batch never stepped";
    }
    if (w.worker_id().ends_with(":lane")) {
      EXPECT_EQ(w.sequences(), 0u) << w.worker_id() << ": the table is counted by the worker's first session";
      if (w.steps() > 0) ++lanes_stepped;
    }
  }
  EXPECT_EQ(micro_batch_sessions, 2);
  EXPECT_EQ(lanes_stepped, 2) << "workers 0 and 2 prefill in their lanes, 1 and 3 (short prompts) do not";
  EXPECT_GT(gs.overlapped_steps(), 0u) << "no step ran while another was between its layers";
  EXPECT_TRUE(Eventually([&] { return GpuStats(*gpu_stub_).sequences() == 0; })) << GpuStats(*gpu_stub_).DebugString();
  EXPECT_GT(gs.layer_hops(), 0u);
  EXPECT_GT(gs.layer_hop_p50_us(), 0.0);
  EXPECT_EQ(gs.backend(), "cpu");
  uint64_t tokens = 0;
  for (int i = 0; i < kWorkers; ++i) {
    // A stream's last message can reach the client before the worker's engine has retired the sequence.
    EXPECT_TRUE(Eventually([&] { return WorkerStats(*stubs_[i]).active_sequences() == 0; }));
    const v1::WorkerStats ws = WorkerStats(*stubs_[i]);
    EXPECT_EQ(ws.active_sequences(), 0u);
    EXPECT_EQ(ws.outstanding_tokens(), 0u);
    EXPECT_EQ(ws.max_step_tokens(), 64u);
    EXPECT_EQ(ws.spec_method(), i % 2 == 0 ? "dspark" : "none");
    EXPECT_GT(ws.expert_seconds(), 0.0);  // the time inside its MoE calls
    tokens += ws.tokens_generated();
  }
  EXPECT_EQ(tokens, results.size() * 32);
}

// The prefix cache lives in numoe-gpu, shared by its workers: a prompt worker 0 ran serves worker 1 (all
// but its last token restored), and the next turn of the conversation (the prompt, the answer, more) on
// worker 1 restores the whole first turn. The tokens equal the goldens, and for the next turn those of a
// numoe-gpu started with --no-prefix-cache.
TEST_F(Runtime, PrefixCachedByOneWorkerServesAnother) {
  StartWorker({"--spec", "none"});
  StartWorker({"--spec", "ngram"});
  ASSERT_FALSE(addrs_[0].empty() || addrs_[1].empty());
  const GoldenPrompt& g = goldens_[3];
  const StreamResult first = Generate(*stubs_[0], GreedyRequest(g));
  ASSERT_OK(first.status) << first.status.error_message();
  EXPECT_EQ(first.tokens, g.greedy);
  const StreamResult again = Generate(*stubs_[1], GreedyRequest(g));
  ASSERT_OK(again.status) << again.status.error_message();
  EXPECT_EQ(again.tokens, g.greedy);
  EXPECT_EQ(again.cached_tokens, g.input_ids.size() - 1);

  v1::WorkerGenerateRequest turn2 = GreedyRequest(g, 12);
  for (size_t i = 0; i + 1 < g.greedy.size(); ++i) turn2.add_prompt_ids(g.greedy[i]);
  for (int32_t t : goldens_[0].input_ids) turn2.add_prompt_ids(t);
  const StreamResult warm = Generate(*stubs_[1], turn2);
  ASSERT_OK(warm.status) << warm.status.error_message();
  EXPECT_EQ(warm.cached_tokens, g.input_ids.size() + g.greedy.size() - 1);

  Child cold_gpu = Child::Start({BinPath("numoe-gpu"), "--model", TinyDir(), "--port", "0", "--no-prefix-cache"},
                                {.log = tmp_ / "gpu-cold.log", .notify = true});
  const std::string cold_addr = cold_gpu.WaitReady();
  ASSERT_FALSE(cold_addr.empty()) << cold_gpu.Log();
  Child cold_worker = Child::Start({BinPath("numoe-worker"), "--model", TinyDir(), "--gpu", cold_addr, "--port", "0",
                                    "--no-numa-bind", "--threads", "1", "--max-step-tokens", "64", "--prefill-chunk", "32"},
                                   {.log = tmp_ / "worker-cold.log", .notify = true});
  const std::string cold_worker_addr = cold_worker.WaitReady();
  ASSERT_FALSE(cold_worker_addr.empty()) << cold_worker.Log();
  auto cold_stub = v1::Worker::NewStub(grpc::CreateChannel(cold_worker_addr, grpc::InsecureChannelCredentials()));
  const StreamResult cold = Generate(*cold_stub, turn2);
  ASSERT_OK(cold.status) << cold.status.error_message();
  EXPECT_EQ(cold.cached_tokens, 0u);
  EXPECT_EQ(warm.tokens, cold.tokens);

  const v1::GpuStats gs = GpuStats(*gpu_stub_);
  EXPECT_TRUE(gs.prefix_cache());
  EXPECT_EQ(gs.prefix_hit_tokens(), again.cached_tokens + warm.cached_tokens);
  EXPECT_GT(gs.prefix_checkpoints(), 0u);
  EXPECT_GT(gs.prefix_bytes(), 0u);
  EXPECT_LE(gs.prefix_bytes(), gs.prefix_budget_bytes());
  EXPECT_TRUE(Eventually([&] { return WorkerStats(*stubs_[1]).prefix_hit_tokens() == gs.prefix_hit_tokens(); }));
  EXPECT_EQ(WorkerStats(*stubs_[0]).prefix_hit_tokens(), 0u);
  EXPECT_GT(WorkerStats(*stubs_[1]).prefix_cache_bytes(), 0);
  EXPECT_EQ(WorkerStats(*cold_stub).prefix_cache_bytes(), -1);
}

TEST_F(Runtime, CancelQueueFullAndBadInput) {
  StartWorker({"--max-seqs", "1", "--max-queue", "1"});
  ASSERT_FALSE(addrs_[0].empty()) << workers_[0]->Log();
  v1::Worker::Stub& w = *stubs_[0];

  // Bad input names the field.
  v1::WorkerGenerateRequest bad = GreedyRequest(goldens_[0]);
  bad.set_prompt_ids(2, 4096);
  StreamResult r = Generate(w, bad);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(r.status.error_message().find("prompt_ids[2]"), std::string::npos) << r.status.error_message();
  bad = GreedyRequest(goldens_[0]);
  bad.mutable_sampling()->set_temperature(-1);
  r = Generate(w, bad);
  EXPECT_NE(r.status.error_message().find("sampling.temperature"), std::string::npos) << r.status.error_message();

  // One long stream runs, one waits, the third is refused; then the client cancels the running one.
  v1::WorkerGenerateRequest longreq = GreedyRequest(goldens_[0], 100000);
  grpc::ClientContext running_ctx;
  auto running = w.Generate(&running_ctx, longreq);
  v1::WorkerGenerateResponse first;
  ASSERT_TRUE(running->Read(&first));
  EXPECT_EQ(first.token_ids(0), goldens_[0].greedy[0]);
  grpc::ClientContext waiting_ctx;
  auto waiting = w.Generate(&waiting_ctx, GreedyRequest(goldens_[2], 4));
  ASSERT_TRUE(Eventually([&] { return WorkerStats(w).queued_sequences() == 1; }));
  r = Generate(w, GreedyRequest(goldens_[2], 4));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << r.status.error_message();
  EXPECT_EQ(GpuStats(*gpu_stub_).sequences(), 1u);

  running_ctx.TryCancel();
  v1::WorkerGenerateResponse rest;
  while (running->Read(&rest)) {
  }
  EXPECT_EQ(running->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The waiting request now runs to completion, then nothing is left anywhere.
  std::vector<int32_t> got;
  while (waiting->Read(&rest)) got.insert(got.end(), rest.token_ids().begin(), rest.token_ids().end());
  EXPECT_OK(waiting->Finish());
  EXPECT_EQ(got, std::vector<int32_t>(goldens_[2].greedy.begin(), goldens_[2].greedy.begin() + 4));
  EXPECT_TRUE(Eventually([&] { return GpuStats(*gpu_stub_).sequences() == 0; }));
  EXPECT_TRUE(Eventually([&] { return WorkerStats(w).active_sequences() == 0; }));
}

// A worker killed with SIGKILL in the middle of its steps: numoe-gpu frees its sequences and channels (it
// runs two micro-batches: two sessions), and the other workers, whose steps interleave with its steps, keep
// emitting exactly their goldens throughout.
TEST_F(Runtime, KilledWorkerIsFreedInGpuWhileTheOthersKeepTheirGoldens) { KillOneWorkerMidStep(); }

void Runtime::KillOneWorkerMidStep() {
  for (int i = 0; i < 3; ++i) {
    StartWorker(i == 0 ? std::vector<std::string>{"--micro-batches", "2"} : std::vector<std::string>{});
    ASSERT_FALSE(addrs_[i].empty()) << workers_[i]->Log();
  }
  // Three long streams on worker 0 (it is always mid-step), one on worker 1.
  std::vector<std::unique_ptr<grpc::ClientContext>> ctxs;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::WorkerGenerateResponse>>> readers;
  for (int i = 0; i < 4; ++i) {
    ctxs.push_back(std::make_unique<grpc::ClientContext>());
    readers.push_back(stubs_[i < 3 ? 0 : 1]->Generate(ctxs.back().get(), GreedyRequest(goldens_[i % 4], 100000)));
    v1::WorkerGenerateResponse resp;
    ASSERT_TRUE(readers.back()->Read(&resp));
  }
  v1::GpuStats before = GpuStats(*gpu_stub_);
  EXPECT_EQ(before.workers(), 7u);  // worker 0's three sessions (two micro-batches, its prefill lane), 2 + 2
  EXPECT_EQ(before.sequences(), 4u);

  // Workers 1 and 2 run every golden prompt, round after round, until two rounds after the kill.
  std::atomic<bool> killed{false};
  std::vector<std::vector<StreamResult>> rounds[2];
  std::vector<std::thread> loops;
  for (int w = 1; w <= 2; ++w) {
    loops.emplace_back([&, w] {
      int after_kill = 0;
      while (after_kill < 2) {
        const bool was_killed = killed.load();
        std::vector<StreamResult> round(goldens_.size());
        std::vector<std::thread> streams;
        for (size_t p = 0; p < goldens_.size(); ++p) {
          streams.emplace_back([&, p] { round[p] = Generate(*stubs_[w], GreedyRequest(goldens_[p])); });
        }
        for (auto& t : streams) t.join();
        rounds[w - 1].push_back(std::move(round));
        if (was_killed) ++after_kill;
      }
    });
  }
  // Kill while worker 0 is mid-step and the others' golden streams are running.
  ASSERT_TRUE(Eventually([&] { return GpuStats(*gpu_stub_).sequences() > 4; }));
  const uint32_t killed_pid = static_cast<uint32_t>(workers_[0]->pid());
  workers_[0]->Kill();
  killed = true;
  // numoe-gpu notices the dead process and frees its sequences and channel; the others are untouched.
  EXPECT_TRUE(Eventually([&] {
    v1::GpuStats s = GpuStats(*gpu_stub_);
    if (s.workers() != 4) return false;  // the other two workers' sessions (each with its prefill lane)
    for (const v1::GpuWorkerStats& w : s.worker_stats()) {
      if (w.pid() == killed_pid) return false;
    }
    return true;
  })) << GpuStats(*gpu_stub_).DebugString();
  v1::WorkerGenerateResponse resp;
  while (readers[0]->Read(&resp)) {  // what was in flight, then the broken connection
  }
  EXPECT_EQ(readers[0]->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(readers[3]->Read(&resp));  // worker 1's long stream still streams
  for (auto& t : loops) t.join();
  for (int w = 0; w < 2; ++w) {
    EXPECT_GE(rounds[w].size(), 2u);
    for (size_t r = 0; r < rounds[w].size(); ++r) {
      for (size_t p = 0; p < goldens_.size(); ++p) {
        const StreamResult& got = rounds[w][r][p];
        ASSERT_OK(got.status) << "worker " << w + 1 << " round " << r << " " << goldens_[p].name << ": "
                              << got.status.error_message();
        EXPECT_EQ(got.tokens, goldens_[p].greedy) << "worker " << w + 1 << " round " << r << " " << goldens_[p].name;
      }
    }
  }
  ctxs[3]->TryCancel();
  while (readers[3]->Read(&resp)) {
  }
  (void)readers[3]->Finish();
  EXPECT_TRUE(Eventually([&] { return GpuStats(*gpu_stub_).sequences() == 0; }));
  // No channel left behind by the dead worker.
  const std::string prefix = "numoe-gpu-" + std::to_string(gpu_->pid()) + "-";
  int left = 0;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    if (e.path().filename().string().rfind(prefix, 0) == 0) ++left;
  }
  EXPECT_EQ(left, 0);

  // A new worker registers and serves.
  const size_t k = StartWorker();
  ASSERT_FALSE(addrs_[k].empty()) << workers_[k]->Log();
  StreamResult r = Generate(*stubs_[k], GreedyRequest(goldens_[2]));
  ASSERT_OK(r.status) << r.status.error_message();
  EXPECT_EQ(r.tokens, goldens_[2].greedy);
}

// numoe-gpu --merge-lanes on: decode steps of workers that wait for the model together run as one merged
// pass (gpu_service/merged_step.h), each worker computing its own rows' experts. The CPU backend is batch
// invariant, so every stream still emits exactly its goldens.
class RuntimeMerged : public Runtime {
 protected:
  RuntimeMerged() { merge_lanes_ = "on"; }
};

// Four workers at once, two drafting with the DSpark stages and two without: streams on every worker, their
// steps merged (GpuStats merged_passes > 0), every stream its goldens bit for bit.
TEST_F(RuntimeMerged, FourWorkersAtOnceMatchGoldensWithSpeculationOnAndOff) {
  constexpr int kWorkers = 4;
  for (int i = 0; i < kWorkers; ++i) {
    StartWorker({"--spec", i % 2 == 0 ? "auto" : "none"});
    ASSERT_FALSE(addrs_[i].empty()) << workers_[i]->Log();
  }
  for (int round = 0; round < 2; ++round) {
    std::vector<StreamResult> results(goldens_.size() * kWorkers);
    std::vector<std::thread> threads;
    for (size_t k = 0; k < results.size(); ++k) {
      threads.emplace_back([&, k] { results[k] = Generate(*stubs_[k % kWorkers], GreedyRequest(goldens_[k / kWorkers])); });
    }
    for (auto& t : threads) t.join();
    for (size_t k = 0; k < results.size(); ++k) {
      const GoldenPrompt& g = goldens_[k / kWorkers];
      ASSERT_OK(results[k].status) << g.name << ": " << results[k].status.error_message();
      EXPECT_EQ(results[k].tokens, g.greedy) << g.name << " on worker " << k % kWorkers << " round " << round;
    }
  }
  const v1::GpuStats gs = GpuStats(*gpu_stub_);
  EXPECT_TRUE(gs.merge_lanes());
  EXPECT_GT(gs.merged_passes(), 0u) << "no two workers' steps ran as one pass";
  EXPECT_GE(gs.merged_steps(), 2 * gs.merged_passes());
  EXPECT_TRUE(Eventually([&] { return GpuStats(*gpu_stub_).sequences() == 0; })) << GpuStats(*gpu_stub_).DebugString();
}

// One worker killed with SIGKILL mid-step while its steps merge with the others': it is dropped from the
// pass alone, the others keep their goldens (the scenario of Runtime.KilledWorker...).
TEST_F(RuntimeMerged, KilledWorkerIsDroppedFromThePassWhileTheOthersKeepTheirGoldens) {
  KillOneWorkerMidStep();
  EXPECT_GT(GpuStats(*gpu_stub_).merged_passes(), 0u);
}

// A worker that hangs (SIGSTOP: alive, but silent) loses its lease: numoe-gpu frees its sequences, even
// from the middle of a step, and keeps serving the others; woken up, the worker finds its lease gone and
// exits (a launcher restarts it).
TEST_F(Runtime, SilentWorkerLosesItsLease) {
  StartWorker();
  StartWorker();
  ASSERT_FALSE(addrs_[0].empty()) << workers_[0]->Log();
  ASSERT_FALSE(addrs_[1].empty()) << workers_[1]->Log();
  grpc::ClientContext ctx;
  auto reader = stubs_[0]->Generate(&ctx, GreedyRequest(goldens_[1], 100000));
  v1::WorkerGenerateResponse resp;
  ASSERT_TRUE(reader->Read(&resp));
  ASSERT_EQ(GpuStats(*gpu_stub_).sequences(), 1u);
  kill(workers_[0]->pid(), SIGSTOP);
  EXPECT_TRUE(Eventually([&] {
    v1::GpuStats s = GpuStats(*gpu_stub_);
    return s.workers() == 2 && s.sequences() == 0;  // the other worker's two sessions (with its prefill lane)
  })) << GpuStats(*gpu_stub_).DebugString();
  StreamResult r = Generate(*stubs_[1], GreedyRequest(goldens_[0]));
  ASSERT_OK(r.status) << r.status.error_message();
  EXPECT_EQ(r.tokens, goldens_[0].greedy);
  kill(workers_[0]->pid(), SIGCONT);
  const int status = workers_[0]->Wait(std::chrono::seconds(30));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status << "\n" << workers_[0]->Log();
  ctx.TryCancel();
  while (reader->Read(&resp)) {
  }
  (void)reader->Finish();
}

TEST_F(Runtime, WorkerWithAnotherModelIsRefused) {
  StartWorker({}, std::string(NUMOE_TEST_DATA) + "/demo-v4");
  EXPECT_TRUE(addrs_[0].empty());
  const int status = workers_[0]->Wait(std::chrono::seconds(60));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
  EXPECT_NE(workers_[0]->Log().find("model_fingerprint"), std::string::npos) << workers_[0]->Log();
  EXPECT_EQ(GpuStats(*gpu_stub_).workers(), 0u);
}

TEST_F(Runtime, GpuGoneMakesTheWorkerExit) {
  StartWorker();
  ASSERT_FALSE(addrs_[0].empty()) << workers_[0]->Log();
  const pid_t gpu_pid = gpu_->pid();
  gpu_->Kill();
  const int status = workers_[0]->Wait(std::chrono::seconds(30));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status << "\n" << workers_[0]->Log();
  EXPECT_NE(workers_[0]->Log().find("lost numoe-gpu"), std::string::npos) << workers_[0]->Log();
  // The worker removed the channel's name once attached: a killed numoe-gpu leaves nothing in /dev/shm.
  const std::string prefix = "numoe-gpu-" + std::to_string(gpu_pid) + "-";
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    EXPECT_NE(e.path().filename().string().rfind(prefix, 0), 0u) << e.path();
  }
}

// A daemon started on a port that another one serves fails to listen and exits 1, saying so; it must not
// start and share the port (gRPC's default SO_REUSEPORT would let it take half the connections).
TEST_F(Runtime, DaemonsOnATakenPortExitInsteadOfSharingIt) {
  const std::string port = gpu_addr_.substr(gpu_addr_.rfind(':') + 1);
  Child second = Child::Start({BinPath("numoe-gpu"), "--model", TinyDir(), "--port", port},
                              {.log = tmp_ / "gpu2.log", .notify = true});
  EXPECT_TRUE(second.WaitReady().empty()) << second.Log();
  int status = second.Wait(std::chrono::seconds(60));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status << "\n" << second.Log();
  EXPECT_NE(second.Log().find("cannot listen on"), std::string::npos) << second.Log();

  StartWorker();
  ASSERT_FALSE(addrs_[0].empty()) << workers_[0]->Log();
  const uint32_t sessions = GpuStats(*gpu_stub_).workers();  // the first worker's (its prefill lane is one more)
  StartWorker({"--port", addrs_[0].substr(addrs_[0].rfind(':') + 1)});
  EXPECT_TRUE(addrs_[1].empty()) << workers_[1]->Log();
  status = workers_[1]->Wait(std::chrono::seconds(60));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status << "\n" << workers_[1]->Log();
  EXPECT_NE(workers_[1]->Log().find("cannot listen on"), std::string::npos) << workers_[1]->Log();
  EXPECT_EQ(GpuStats(*gpu_stub_).workers(), sessions);  // the refused worker released its sessions on the way out
}

}  // namespace
}  // namespace numoe::test
