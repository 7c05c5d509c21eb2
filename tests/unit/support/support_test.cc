// tests/support itself: the status matchers fail with the status, RunCommand and Child start, capture, wait and
// stop processes, TempDir cleans up, and the goldens load from the fixture.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <filesystem>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/config.h"
#include "tests/support/files.h"
#include "tests/support/fixtures.h"
#include "tests/support/process.h"
#include "tests/support/status_matchers.h"

namespace numoe::test {
namespace {

using namespace std::chrono_literals;

absl::StatusOr<int> Seven() { return 7; }
absl::StatusOr<int> Broken() { return absl::DataLossError("torn page"); }

TEST(StatusMatchers, PassOnOk) {
  ASSERT_OK(absl::OkStatus());
  EXPECT_OK(Seven());
  ASSERT_OK_AND_ASSIGN(int v, Seven());
  EXPECT_EQ(v, 7);
}

TEST(StatusMatchers, FailuresPrintTheExpressionAndStatus) {
  EXPECT_NONFATAL_FAILURE(EXPECT_OK(absl::InternalError("boom")), "absl::InternalError(\"boom\") is not OK: INTERNAL: boom");
  EXPECT_FATAL_FAILURE(ASSERT_OK(Broken()), "Broken() is not OK: DATA_LOSS: torn page");
  EXPECT_FATAL_FAILURE(
      {
        ASSERT_OK_AND_ASSIGN(int v, Broken());
        (void)v;
      },
      "Broken() is not OK: DATA_LOSS: torn page");
}

TEST(StatusMatchers, AssignReturnsBeforeTheValueIsUsed) {
  static bool reached = false;
  EXPECT_FATAL_FAILURE(
      {
        ASSERT_OK_AND_ASSIGN(int v, Broken());
        reached = v >= 0;
      },
      "torn page");
  EXPECT_FALSE(reached);
}

TEST(RunCommand, SeparatesStdoutStderrAndTheExitCode) {
  const RunResult r = RunCommand({"/bin/sh", "-c", "echo out; echo err >&2; exit 3"});
  EXPECT_EQ(r.rc, 3);
  EXPECT_EQ(r.out, "out\n");
  EXPECT_EQ(r.err, "err\n");
  EXPECT_GT(r.peak_rss_kb, 0);
  const RunResult merged = RunCommand({"/bin/sh", "-c", "echo a; echo b >&2; echo c"}, {.merge_stderr = true});
  EXPECT_EQ(merged.rc, 0);
  EXPECT_EQ(merged.out, "a\nb\nc\n");
  EXPECT_EQ(merged.err, "");
}

TEST(RunCommand, DrainsBothPipesPastTheirBuffers) {
  // 1 MiB on each stream: a runner that reads one pipe to the end first would deadlock here.
  const RunResult r = RunCommand({"/bin/sh", "-c", "head -c 1048576 /dev/zero; head -c 1048576 /dev/zero >&2; exit 0"});
  EXPECT_EQ(r.rc, 0);
  EXPECT_EQ(r.out.size(), 1048576u);
  EXPECT_EQ(r.err.size(), 1048576u);
}

TEST(RunCommand, AKilledOrMissingCommandIsNotASuccess) {
  EXPECT_EQ(RunCommand({"/bin/sh", "-c", "kill -9 $$"}).rc, -1);
  const RunResult missing = RunCommand({"/nonexistent/numoe"});
  EXPECT_EQ(missing.rc, 127);
  EXPECT_NE(missing.err.find("/nonexistent/numoe"), std::string::npos) << missing.err;
}

TEST(RunCommand, CommandLineSplitsLikeAShell) {
  EXPECT_EQ(CommandLine("/bin/numoe", "inspect  --model '/tmp/a b' --json"),
            (std::vector<std::string>{"/bin/numoe", "inspect", "--model", "/tmp/a b", "--json"}));
  EXPECT_EQ(CommandLine("/bin/numoe", ""), std::vector<std::string>{"/bin/numoe"});
  EXPECT_EQ(CommandLine("/bin/numoe", "--x ''"), (std::vector<std::string>{"/bin/numoe", "--x", ""}));
}

TEST(Child, WaitsForTheReadyLineOnTheNotifyPipe) {
  TempDir dir("support-child");
  Child c = Child::Start({"/bin/sh", "-c", "echo starting; echo \"READY 127.0.0.1:4242\" >&$NUMOE_NOTIFY_FD; sleep 30"},
                         {.log = dir / "log", .notify = true});
  ASSERT_GT(c.pid(), 0);
  EXPECT_EQ(c.WaitReady(10s), "127.0.0.1:4242");
  EXPECT_TRUE(c.running());
  const int status = c.Terminate(10s);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << status;
  EXPECT_FALSE(c.running());
  EXPECT_EQ(c.Log(), "starting\n");
}

TEST(Child, ReadyIsEmptyWhenTheChildDiesFirst) {
  Child c = Child::Start({"/bin/sh", "-c", "exit 4"}, {.notify = true});
  EXPECT_EQ(c.WaitReady(10s), "");
  const int status = c.Wait(10s);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 4) << status;
}

TEST(Child, FirstStdoutLineAndProcessGroup) {
  TempDir dir("support-line");
  Child c = Child::Start({"/bin/sh", "-c", "echo ready at 1; echo more; sleep 30 & wait"},
                         {.log = dir / "log", .stdout_file = dir / "out", .new_group = true});
  EXPECT_EQ(c.WaitForLine(10s), "ready at 1");
  bool saw_sleep = false;
  for (int i = 0; i < 100 && !saw_sleep; ++i) {
    for (const auto& [pid, comm] : ProcessGroupMembers(c.pid())) saw_sleep |= comm == "sleep";
    if (!saw_sleep) std::this_thread::sleep_for(20ms);
  }
  EXPECT_TRUE(saw_sleep);
  const pid_t pgid = c.pid();
  kill(-pgid, SIGKILL);
  EXPECT_NE(c.Wait(10s), -1);
  for (int i = 0; i < 100 && !ProcessGroupMembers(pgid).empty(); ++i) std::this_thread::sleep_for(20ms);
  EXPECT_TRUE(ProcessGroupMembers(pgid).empty());
}

TEST(Child, TerminateEscalatesToSigkill) {
  TempDir dir("support-term");
  Child c = Child::Start({"/bin/sh", "-c", "trap '' TERM; echo trapped; while :; do sleep 0.05; done"},
                         {.stdout_file = dir / "out"});
  ASSERT_EQ(c.WaitForLine(10s), "trapped");
  const int status = c.Terminate(200ms);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
  EXPECT_EQ(c.Wait(1s), status);  // reaped: the status stays
}

TEST(Files, TempDirIsFreshAndRemoved) {
  std::filesystem::path kept;
  {
    TempDir a("support-files"), b("support-files");
    EXPECT_NE(a.path(), b.path());
    EXPECT_TRUE(std::filesystem::is_empty(a.path()));
    const std::string bytes("one\0two", 7);
    ASSERT_TRUE(WriteFile(a / "f", bytes));
    EXPECT_EQ(ReadFile(a / "f"), bytes);
    CopyFiles(a.path(), b.path());
    EXPECT_EQ(ReadFile(b / "f"), bytes);
    kept = a.path();
  }
  EXPECT_FALSE(std::filesystem::exists(kept));
  EXPECT_EQ(ReadFile(kept / "f"), "");
  EXPECT_FALSE(WriteFile(kept / "f", "x"));
}

TEST(Goldens, LoadTheFixtureInOrder) {
  ASSERT_OK_AND_ASSIGN(const ModelConfig cfg, LoadModelConfig(TinyDir() + "/config.json"));
  ASSERT_OK_AND_ASSIGN(const Goldens g, Goldens::Load(TinyDir()));
  ASSERT_EQ(g.size(), 4u);
  for (size_t k = 0; k < g.size(); ++k) {
    const GoldenPrompt& p = g[k];
    EXPECT_EQ(p.name, "p" + std::to_string(k));
    EXPECT_FALSE(p.input_ids.empty());
    EXPECT_FALSE(p.greedy.empty());
    EXPECT_EQ(p.prefill_logits.size(), p.input_ids.size() * cfg.vocab_size) << p.name;
    EXPECT_EQ(p.step_logits.size(), p.greedy.size() * cfg.vocab_size) << p.name;
    for (int32_t t : p.greedy) EXPECT_LT(t, cfg.vocab_size);
  }
  ASSERT_OK_AND_ASSIGN(const GoldenPrompt* p2, g.Find("p2"));
  EXPECT_EQ(p2, &g[2]);
  EXPECT_FALSE(g.Find("p9").ok());
  ASSERT_OK_AND_ASSIGN(const std::vector<float> hidden, g.Floats("p0.hidden.0"));
  EXPECT_EQ(hidden.size() % (g[0].input_ids.size() * cfg.hidden_size), 0u);
}

TEST(Goldens, AMissingFileNamesThePath) {
  TempDir dir("support-goldens");
  const auto g = Goldens::Load(dir.str());
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().ToString().find(dir / "golden.safetensors"), std::string::npos) << g.status();
}

}  // namespace
}  // namespace numoe::test
