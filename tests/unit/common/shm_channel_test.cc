// The shared-memory channel: geometry validation, attach checks, the ping-pong conversation between
// two threads and between two processes (fork), and a dead or silent peer turning into an error.
#include "common/shm_channel.h"
#include "tests/support/status_matchers.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fcntl.h>
#include <string>
#include <thread>
#include <vector>

namespace numoe::shm {
namespace {

Geometry SmallGeometry() {
  Geometry g;
  g.hidden = 64;
  g.top_k = 2;
  g.max_rows = 16;
  g.max_seqs = 4;
  g.vocab = 100;
  g.logits_rows = 2;
  return g;
}

std::string UniqueName(const char* tag) {
  static int counter = 0;
  return absl::StrCat("/numoe-test-", tag, "-", getpid(), "-", counter++);
}

int64_t ElapsedMs(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
}

TEST(ShmGeometry, ValidatesEveryField) {
  EXPECT_OK(ValidateGeometry(SmallGeometry()));
  Geometry g = SmallGeometry();
  g.hidden = 0;
  EXPECT_NE(ValidateGeometry(g).message().find("hidden"), std::string::npos);
  g = SmallGeometry();
  g.top_k = 65;
  EXPECT_NE(ValidateGeometry(g).message().find("top_k"), std::string::npos);
  g = SmallGeometry();
  g.logits_rows = 5;  // > max_seqs
  EXPECT_NE(ValidateGeometry(g).message().find("logits_rows"), std::string::npos);
  g = SmallGeometry();
  g.hidden = 65536;
  g.max_rows = 65536;  // 2 x 16 GiB of rows
  EXPECT_NE(ValidateGeometry(g).message().find("16 GiB"), std::string::npos);
  // Speculative decoding: a known drafter; model drafts only with one; a drafter needs verification.
  g = SmallGeometry();
  g.drafter = SpecMethod::kNgram;  // ngram is no model drafter
  EXPECT_NE(ValidateGeometry(g).message().find("drafter"), std::string::npos);
  g = SmallGeometry();
  g.max_model_drafts = 5;  // without a drafter
  EXPECT_NE(ValidateGeometry(g).message().find("max_model_drafts"), std::string::npos);
  g.drafter = SpecMethod::kDspark;
  EXPECT_NE(ValidateGeometry(g).message().find("verify"), std::string::npos);
  g.verify = 1;
  EXPECT_OK(ValidateGeometry(g));
  g.max_model_drafts = 4097;
  EXPECT_NE(ValidateGeometry(g).message().find("max_model_drafts"), std::string::npos);
  g = SmallGeometry();
  g.verify = 2;
  EXPECT_NE(ValidateGeometry(g).message().find("verify"), std::string::npos);
  g.verify = 1;  // an n-gram-only gpu: verifies, no model drafter
  EXPECT_OK(ValidateGeometry(g));
}

TEST(ShmGeometry, LayoutIsAlignedAndDisjoint) {
  const Layout l = ComputeLayout(SmallGeometry());
  const std::vector<size_t> offs = {l.header,  l.to_gpu, l.to_worker,   l.up_msg,  l.entries, l.tokens,
                                    l.releases, l.moe_out, l.up_error, l.down_msg, l.moe_x,   l.moe_ids,
                                    l.moe_weights, l.sampled, l.counts, l.drafted, l.accepted, l.cached, l.emitted,
                                    l.logits, l.down_error, l.total};
  for (size_t i = 0; i < offs.size(); ++i) {
    EXPECT_EQ(offs[i] % 64, 0u) << i;
    if (i > 0) {
      EXPECT_GT(offs[i], offs[i - 1]) << i;
    }
  }
  EXPECT_GE(l.moe_ids - l.moe_x, 16u * 64 * sizeof(float));
  EXPECT_GE(l.down_error - l.logits, 2u * 100 * sizeof(float));
  EXPECT_GE(l.counts - l.sampled, 4u * sizeof(int32_t));
  EXPECT_GE(l.logits - l.emitted, 16u * sizeof(int32_t));  // max_rows emitted tokens
}

TEST(ShmChannel, CreateRejectsBadNames) {
  EXPECT_FALSE(Channel::Create("no-slash", SmallGeometry()).ok());
  EXPECT_FALSE(Channel::Create("/a/b", SmallGeometry()).ok());
}

TEST(ShmChannel, AttachValidatesTheHeader) {
  const std::string name = UniqueName("attach");
  auto gpu = Channel::Create(name, SmallGeometry());
  ASSERT_OK(gpu);
  {
    auto w = Channel::Attach(name);
    ASSERT_OK(w);
    EXPECT_EQ((*w)->geometry().hidden, 64u);
    EXPECT_EQ((*w)->bytes(), (*gpu)->bytes());
    EXPECT_TRUE((*gpu)->peer_attached());
  }
  EXPECT_NE(Channel::Attach("/numoe-test-does-not-exist").status().code(), absl::StatusCode::kOk);

  // A foreign object of the right size: bad magic.
  const std::string junk = UniqueName("junk");
  int fd = shm_open(junk.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
  auto bad = Channel::Attach(junk);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(bad.status().message().find("magic"), std::string::npos) << bad.status();
  // A channel of another protocol version (a numoe-gpu of an older build): the magic, then the version.
  fd = shm_open(junk.c_str(), O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  const uint32_t old_version = kVersion - 1;
  ASSERT_EQ(pwrite(fd, &kMagic, sizeof(kMagic), 0), static_cast<ssize_t>(sizeof(kMagic)));
  ASSERT_EQ(pwrite(fd, &old_version, sizeof(old_version), sizeof(kMagic)), static_cast<ssize_t>(sizeof(old_version)));
  close(fd);
  auto old = Channel::Attach(junk);
  EXPECT_EQ(old.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string want = absl::StrCat("protocol version ", old_version, ", this build speaks ", kVersion);
  EXPECT_NE(old.status().message().find(want), std::string::npos) << old.status();
  // Too small for a header.
  fd = shm_open(junk.c_str(), O_RDWR, 0600);
  ASSERT_EQ(ftruncate(fd, 8), 0);
  close(fd);
  EXPECT_NE(Channel::Attach(junk).status().message().find("smaller than its header"), std::string::npos);
  shm_unlink(junk.c_str());

  // Unlink removes the name; the mapping stays usable.
  ASSERT_OK((*gpu)->Unlink());
  EXPECT_FALSE(Channel::Attach(name).ok());
  (*gpu)->moe_x()[0] = 1.0f;
}

// The whole step conversation between two threads: one StepRequest, three layers, a StepResult.
TEST(ShmChannel, StepConversationBetweenThreads) {
  auto gpu_or = Channel::CreateAnonymous(SmallGeometry());
  ASSERT_OK(gpu_or);
  std::unique_ptr<Channel> gpu = std::move(*gpu_or);
  auto worker_or = gpu->PeerEndpoint();
  ASSERT_OK(worker_or);
  std::unique_ptr<Channel> worker = std::move(*worker_or);
  constexpr int kLayers = 3;
  const int D = 64;

  std::thread gpu_thread([&] {
    auto t = gpu->Receive(5000);
    ASSERT_OK(t);
    ASSERT_EQ(*t, MsgType::kStepRequest);
    const MsgHeader& req = gpu->incoming();
    ASSERT_EQ(req.num_entries, 2);
    ASSERT_EQ(req.num_tokens, 3);
    EXPECT_EQ(gpu->entries()[1].seq, 42);
    EXPECT_EQ(gpu->entries()[1].sampling.seed, 7u);
    EXPECT_EQ(gpu->tokens()[2], 9);
    EXPECT_EQ(gpu->entries()[0].drafts, 1);
    EXPECT_EQ(gpu->entries()[1].model_drafts, 3);
    for (int layer = 0; layer < kLayers; ++layer) {
      MsgHeader& m = gpu->outgoing();
      m.layer = layer;
      m.rows = 3;
      m.top_k = 2;
      for (int i = 0; i < 3 * D; ++i) gpu->moe_x()[i] = static_cast<float>(layer * 1000 + i);
      ASSERT_OK(gpu->Send(MsgType::kMoeRequest));
      auto r = gpu->Receive(5000);
      ASSERT_OK(r);
      ASSERT_EQ(*r, MsgType::kMoeResponse);
      EXPECT_EQ(gpu->incoming().layer, layer);
      for (int i = 0; i < 3 * D; ++i) ASSERT_EQ(gpu->moe_out()[i], 2.0f * (layer * 1000 + i));
    }
    // Entry 0 verified its one draft (kept), entry 1 had 3 model drafts and kept none.
    gpu->sampled()[0] = 11;
    gpu->sampled()[1] = 12;
    const int32_t counts[2] = {2, 1}, drafted[2] = {1, 3}, accepted[2] = {1, 0}, emitted[3] = {11, 13, 12};
    std::memcpy(gpu->counts(), counts, sizeof(counts));
    std::memcpy(gpu->drafted(), drafted, sizeof(drafted));
    std::memcpy(gpu->accepted(), accepted, sizeof(accepted));
    std::memcpy(gpu->emitted(), emitted, sizeof(emitted));
    gpu->outgoing().num_entries = 2;
    gpu->outgoing().num_emitted = 3;
    ASSERT_OK(gpu->Send(MsgType::kStepResult));
  });

  StepEntry* e = worker->entries();
  e[0] = StepEntry{.seq = 41, .num_tokens = 2, .flags = kEntryOpen | kEntrySample, .drafts = 1};
  e[1] = StepEntry{
      .seq = 42, .num_tokens = 1, .flags = kEntryOpen | kEntrySample, .sampling = {.seed = 7}, .model_drafts = 3};
  worker->tokens()[0] = 5;
  worker->tokens()[1] = 6;
  worker->tokens()[2] = 9;
  worker->outgoing().num_entries = 2;
  worker->outgoing().num_tokens = 3;
  ASSERT_OK(worker->Send(MsgType::kStepRequest));
  int layers_seen = 0;
  for (;;) {
    auto t = worker->Receive(5000);
    ASSERT_OK(t);
    if (*t == MsgType::kStepResult) break;
    ASSERT_EQ(*t, MsgType::kMoeRequest);
    const MsgHeader& m = worker->incoming();
    EXPECT_EQ(m.layer, layers_seen);
    for (int i = 0; i < m.rows * D; ++i) worker->moe_out()[i] = 2.0f * worker->moe_x()[i];
    worker->outgoing().layer = m.layer;
    worker->outgoing().rows = m.rows;
    ASSERT_OK(worker->Send(MsgType::kMoeResponse));
    ++layers_seen;
  }
  gpu_thread.join();
  EXPECT_EQ(layers_seen, kLayers);
  EXPECT_EQ(worker->incoming().num_entries, 2);
  EXPECT_EQ(worker->sampled()[0], 11);
  EXPECT_EQ(worker->sampled()[1], 12);
  EXPECT_EQ(worker->incoming().num_emitted, 3);
  EXPECT_EQ(std::vector<int32_t>(worker->counts(), worker->counts() + 2), (std::vector<int32_t>{2, 1}));
  EXPECT_EQ(std::vector<int32_t>(worker->drafted(), worker->drafted() + 2), (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(std::vector<int32_t>(worker->accepted(), worker->accepted() + 2), (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(std::vector<int32_t>(worker->emitted(), worker->emitted() + 3), (std::vector<int32_t>{11, 13, 12}));
}

TEST(ShmChannel, SendBeforeThePeerReceivedIsRefused) {
  auto gpu = Channel::CreateAnonymous(SmallGeometry());
  ASSERT_OK(gpu);
  auto worker = (*gpu)->PeerEndpoint();
  ASSERT_OK(worker);
  ASSERT_OK((*worker)->Send(MsgType::kStepRequest));
  EXPECT_EQ((*worker)->Send(MsgType::kStepRequest).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_OK((*gpu)->Receive(1000));
  EXPECT_OK((*worker)->Send(MsgType::kStepRequest));
}

TEST(ShmChannel, ErrorsTravelWithCodeAndText) {
  auto gpu = Channel::CreateAnonymous(SmallGeometry());
  ASSERT_OK(gpu);
  auto worker = (*gpu)->PeerEndpoint();
  ASSERT_OK(worker);
  ASSERT_OK((*worker)->Send(MsgType::kStepRequest));
  ASSERT_OK((*gpu)->Receive(1000));
  ASSERT_OK((*gpu)->SendError(absl::InvalidArgumentError("entries[1].tokens[0]: token id 5000 >= vocab")));
  auto t = (*worker)->Receive(1000);
  ASSERT_OK(t);
  ASSERT_EQ(*t, MsgType::kError);
  Status st = (*worker)->IncomingError();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "entries[1].tokens[0]: token id 5000 >= vocab");
}

// Found by fuzz_gpu_step (UBSan): an empty message was copied from a null pointer.
TEST(ShmChannel, AnErrorWithoutTextTravels) {
  auto gpu = Channel::CreateAnonymous(SmallGeometry());
  ASSERT_OK(gpu);
  auto worker = (*gpu)->PeerEndpoint();
  ASSERT_OK(worker);
  ASSERT_OK((*worker)->SendError(Status(absl::StatusCode::kInternal, "")));
  auto t = (*gpu)->Receive(1000);
  ASSERT_OK(t);
  ASSERT_EQ(*t, MsgType::kError);
  Status st = (*gpu)->IncomingError();
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(st.message(), "");
}

TEST(ShmChannel, TimeoutInterruptAndClose) {
  auto gpu = Channel::CreateAnonymous(SmallGeometry(), {.spin_us = 10, .poll_ms = 5});
  ASSERT_OK(gpu);
  auto worker = (*gpu)->PeerEndpoint();
  ASSERT_OK(worker);
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ((*gpu)->Receive(30).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(ElapsedMs(t0), 29);
  EXPECT_LT(ElapsedMs(t0), 2000);

  std::thread interrupter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    (*gpu)->Interrupt();
  });
  EXPECT_EQ((*gpu)->Receive(-1).status().code(), absl::StatusCode::kCancelled);
  interrupter.join();
  (*gpu)->ClearInterrupt();

  EXPECT_OK((*gpu)->PeerStatus());
  std::thread closer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    (*worker)->Close();
  });
  auto closed = (*gpu)->Receive(-1);
  closer.join();
  EXPECT_EQ(closed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(closed.status().message().find("closed"), std::string::npos);
  EXPECT_EQ((*gpu)->PeerStatus().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*worker)->Send(MsgType::kStepRequest).code(), absl::StatusCode::kUnavailable);
}

// Two processes over a named channel: the child attaches by name and answers 200 MoE requests.
TEST(ShmChannel, PingPongAcrossProcesses) {
  const std::string name = UniqueName("fork");
  auto gpu_or = Channel::Create(name, SmallGeometry());
  ASSERT_OK(gpu_or);
  std::unique_ptr<Channel> gpu = std::move(*gpu_or);
  constexpr int kRounds = 200;
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto w = Channel::Attach(name);
    if (!w.ok()) _exit(10);
    for (int i = 0; i < kRounds; ++i) {
      auto t = (*w)->Receive(10000);
      if (!t.ok() || *t != MsgType::kMoeRequest) _exit(11);
      const int64_t rows = (*w)->incoming().rows;
      for (int64_t j = 0; j < rows * 64; ++j) (*w)->moe_out()[j] = (*w)->moe_x()[j] + 1.0f;
      (*w)->outgoing().rows = rows;
      if (!(*w)->Send(MsgType::kMoeResponse).ok()) _exit(12);
    }
    _exit(0);
  }
  for (int i = 0; i < kRounds; ++i) {
    const int rows = 1 + i % 16;
    for (int j = 0; j < rows * 64; ++j) gpu->moe_x()[j] = static_cast<float>(i + j);
    gpu->outgoing().rows = rows;
    ASSERT_OK(gpu->Send(MsgType::kMoeRequest));
    auto t = gpu->Receive(10000);
    ASSERT_OK(t);
    ASSERT_EQ(*t, MsgType::kMoeResponse);
    ASSERT_EQ(gpu->incoming().rows, rows);
    for (int j = 0; j < rows * 64; ++j) ASSERT_EQ(gpu->moe_out()[j], static_cast<float>(i + j) + 1.0f);
  }
  int wstatus = 0;
  ASSERT_EQ(waitpid(pid, &wstatus, 0), pid);
  EXPECT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) << wstatus;
}

// A worker process that dies mid-conversation: the gpu side's Receive returns UNAVAILABLE promptly (the
// child is not reaped yet, so this also covers a zombie peer), never hangs.
TEST(ShmChannel, DeadPeerProcessIsAnErrorNotAHang) {
  const std::string name = UniqueName("dead");
  auto gpu_or = Channel::Create(name, SmallGeometry(), {.spin_us = 10, .poll_ms = 10});
  ASSERT_OK(gpu_or);
  std::unique_ptr<Channel> gpu = std::move(*gpu_or);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto w = Channel::Attach(name);
    if (!w.ok()) _exit(10);
    auto t = (*w)->Receive(10000);  // takes the MoeRequest, then dies without answering
    (void)t;
    raise(SIGKILL);
    _exit(13);
  }
  gpu->outgoing().rows = 1;
  ASSERT_OK(gpu->Send(MsgType::kMoeRequest));
  auto t0 = std::chrono::steady_clock::now();
  auto r = gpu->Receive(-1);  // no deadline: only liveness can end this
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_NE(r.status().message().find("exited"), std::string::npos) << r.status();
  EXPECT_LT(ElapsedMs(t0), 5000);
  EXPECT_EQ(gpu->PeerStatus().code(), absl::StatusCode::kUnavailable);  // the watchdog's view agrees
  int wstatus = 0;
  ASSERT_EQ(waitpid(pid, &wstatus, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(wstatus));
}

// The worker side notices a dead gpu service the same way.
TEST(ShmChannel, DeadGpuProcessIsSeenByTheWorker) {
  auto ch_or = Channel::CreateAnonymous(SmallGeometry(), {.spin_us = 10, .poll_ms = 10});
  ASSERT_OK(ch_or);
  std::unique_ptr<Channel> ch = std::move(*ch_or);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ch->BindAfterFork(Side::kGpu);  // the child plays the gpu service: receives the step, then dies
    auto t = ch->Receive(10000);
    (void)t;
    raise(SIGKILL);
    _exit(13);
  }
  ch->BindAfterFork(Side::kWorker);
  ASSERT_OK(ch->Send(MsgType::kStepRequest));
  auto r = ch->Receive(20000);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  int wstatus = 0;
  ASSERT_EQ(waitpid(pid, &wstatus, 0), pid);
}

}  // namespace
}  // namespace numoe::shm
