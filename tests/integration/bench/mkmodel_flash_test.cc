// A full-width V4-Flash checkpoint from `numoe mkmodel` (3 layers: sliding, CSA, HCA; 6 experts so that it
// stays ~2.5 GB) is written with little memory, described by `numoe inspect`, and runs in `numoe generate`:
// 4 greedy tokens with finite, non-constant logits. Label integration: it takes a minute or two and ~10 GB of
// RAM (generate dequantizes the embedding and head to fp32), so it skips on smaller machines.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/statvfs.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/safetensors.h"
#include "nlohmann/json.hpp"
#include "tests/support/files.h"
#include "tests/support/process.h"
#include "tests/support/status_matchers.h"

namespace numoe::test {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

int64_t MemAvailableBytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

int64_t FreeDiskBytes(const fs::path& p) {
  struct statvfs st;
  if (::statvfs(p.c_str(), &st) != 0) return 0;
  return static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
}

std::vector<float> F32(const TensorView& t) {
  std::vector<float> v(t.nbytes / 4);
  std::memcpy(v.data(), t.data, v.size() * 4);
  return v;
}

TEST(MkmodelFlashTest, FullWidthCheckpointLoadsInInspectAndGenerate) {
  TempDir dir("mk-flash");
  if (MemAvailableBytes() < (int64_t{14} << 30)) GTEST_SKIP() << "needs 14 GiB of available memory";
  if (FreeDiskBytes(dir.path()) < (int64_t{6} << 30)) GTEST_SKIP() << "needs 6 GiB of free disk";
  const std::string model = (dir.path() / "model").string();

  RunResult mk = RunCommand({BinPath("numoe"), "mkmodel", "--preset", "v4-flash", "--layers", "3", "--experts", "6",
                             "--threads", "2", "--out", model}, {.merge_stderr = true});
  ASSERT_EQ(mk.rc, 0) << mk.out;
  EXPECT_THAT(mk.out, HasSubstr("3 layers [sliding+hash, csa+hash, hca+hash]"));
  EXPECT_THAT(mk.out, HasSubstr("it loads as a checkpoint"));
  int64_t bytes = 0;
  for (const auto& e : fs::directory_iterator(model)) bytes += static_cast<int64_t>(fs::file_size(e.path()));
  EXPECT_GT(bytes, int64_t{2'400'000'000});  // embedding + head alone are 2 x 129280 x 4096 BF16 = 2.12 GB
  // Streaming: the writer's peak memory is a small fraction of what it wrote (the encoder ring + scratch).
  EXPECT_LT(mk.peak_rss_kb, 400 * 1024) << "mkmodel peak RSS " << mk.peak_rss_kb << " KB for " << bytes << " bytes";
  std::printf("mkmodel wrote %.2f GB with a peak RSS of %.0f MB\n", bytes / 1e9, mk.peak_rss_kb / 1024.0);

  RunResult inspect = RunCommand({BinPath("numoe"), "inspect", "--model", model, "--json"}, {.merge_stderr = true});
  ASSERT_EQ(inspect.rc, 0) << inspect.out;
  const auto j = nlohmann::json::parse(inspect.out.substr(inspect.out.find('{')));
  const auto& a = j["architecture"];
  EXPECT_EQ(a["hidden_size"], 4096);
  EXPECT_EQ(a["vocab_size"], 129280);
  EXPECT_EQ(a["num_attention_heads"], 64);
  EXPECT_EQ(a["head_dim"], 512);
  EXPECT_EQ(a["index_n_heads"], 64);
  EXPECT_EQ(a["index_head_dim"], 128);
  EXPECT_EQ(a["moe_intermediate_size"], 2048);
  EXPECT_EQ(a["num_experts_per_tok"], 6);
  EXPECT_EQ(a["n_routed_experts"], 6);
  EXPECT_EQ(a["layer_types"], nlohmann::json({"sliding", "csa", "hca"}));
  // top-6 MXFP4 experts of 2048x4096 in 3 layers: 3 x 6 x 3 x (4 MiB + 256 KiB).
  EXPECT_EQ(j["memory"]["routed_bytes_per_token"], int64_t{3} * 6 * 3 * (2048 * 4096 / 2 + 2048 * 128));

  const std::string logits = (dir.path() / "logits.safetensors").string();
  RunResult gen = RunCommand({BinPath("numoe"), "generate", "--model", model, "--prompt-ids",
                              "0,17,4242,99,128803,1000,31337,7", "--max-new-tokens", "4", "--ignore-eos",
                              "--logits-out", logits}, {.merge_stderr = true});
  ASSERT_EQ(gen.rc, 0) << gen.out;
  std::printf("generate: peak RSS %.2f GB; %s", gen.peak_rss_kb / 1048576.0, gen.out.c_str());
  auto file = SafetensorsFile::Open(logits);
  ASSERT_OK(file);
  const TensorView* tokens = (*file)->Find("tokens");
  const TensorView* prefill = (*file)->Find("prefill_logits");
  const TensorView* steps = (*file)->Find("step_logits");
  ASSERT_TRUE(tokens && prefill && steps);
  EXPECT_EQ(tokens->shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(prefill->shape, (std::vector<int64_t>{8, 129280}));
  EXPECT_EQ(steps->shape, (std::vector<int64_t>{4, 129280}));
  for (int64_t i = 0; i < 4; ++i) {
    int64_t id;
    std::memcpy(&id, tokens->data + 8 * i, 8);
    EXPECT_GE(id, 0);
    EXPECT_LT(id, 129280);
  }
  for (const TensorView* t : {prefill, steps}) {
    const std::vector<float> v = F32(*t);
    double sum = 0, sq = 0;
    int64_t bad = 0;
    for (float x : v) {
      bad += !std::isfinite(x);
      sum += x;
      sq += static_cast<double>(x) * x;
    }
    EXPECT_EQ(bad, 0) << t->name << ": non-finite logits";
    const double mean = sum / v.size(), var = sq / v.size() - mean * mean;
    EXPECT_GT(var, 1e-6) << t->name << ": constant logits";
    EXPECT_LT(std::fabs(mean) + std::sqrt(var), 1e4) << t->name << ": activations blew up";
  }
}

}  // namespace
}  // namespace numoe::test
