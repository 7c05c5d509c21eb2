// What numoe mkmodel is built from: the presets (shapes, schedules, DSpark), the generated 129280-token
// tokenizer, and the streaming synthetic writer (same bytes for any thread count and shard count, an exact
// byte plan, progress, write errors).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checkpoint.h"
#include "common/config.h"
#include "common/safetensors.h"
#include "common/synthetic/presets.h"
#include "common/synthetic/synthetic.h"
#include "common/synthetic/synthetic_tokenizer.h"
#include "common/tokenizer/tokenizer.h"
#include "tests/support/files.h"
#include "tests/support/status_matchers.h"

namespace numoe::test {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using synthetic::MakePreset;
using synthetic::PresetOptions;

const std::string kData = NUMOE_TEST_DATA;

std::string Schedule(const ModelConfig& c) {
  std::string s;
  for (AttnType t : c.layer_types) s += t == AttnType::kSliding ? 'S' : t == AttnType::kCSA ? 'C' : 'H';
  s += '/';
  for (MoeType m : c.mlp_layer_types) s += m == MoeType::kHash ? 'h' : 'm';
  return s;
}

// ---- presets ----------------------------------------------------------------------------------------------

TEST(PresetTest, EmbeddedFlashConfigIsTheFixture) {
  auto fixture = LoadModelConfig(kData + "/v4-flash-0731.config.json");
  ASSERT_OK(fixture);
  EXPECT_EQ(ModelConfigToJson(synthetic::V4FlashConfig()), ModelConfigToJson(*fixture));
  // The released schedule: 2 sliding, then CSA on even and HCA on odd layers; 3 hash layers.
  EXPECT_EQ(synthetic::PresetSchedule(43, 2), fixture->layer_types);
}

TEST(PresetTest, FlashDefaultsAreFullWidthTwoLayers) {
  auto p = MakePreset({.preset = "v4-flash"});
  ASSERT_OK(p);
  const ModelConfig& c = p->config;
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.n_routed_experts, 256);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.num_experts_per_tok, 6);
  EXPECT_EQ(c.num_attention_heads, 64);
  EXPECT_EQ(c.head_dim, 512);
  EXPECT_EQ(c.index_n_heads, 64);
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.vocab_size, 129280);
  EXPECT_EQ(c.expert_dtype, "fp4");
  EXPECT_TRUE(c.fp8_dense);
  EXPECT_EQ(c.fp8_scale_fmt, "ue8m0");
  EXPECT_EQ(Schedule(c), "SS/hh");
  EXPECT_EQ(p->mtp_stages, 0);
  EXPECT_EQ(c.DefaultMtpStages(), 0);
  EXPECT_EQ(c.dspark_block_size, 0);

  // Bytes from the shapes: an MXFP4 expert matrix of 2048x4096 is 4 MiB of codes + 2048*128 scale bytes.
  const int64_t matrix = 2048 * 4096 / 2 + 2048 * (4096 / 32);
  const ModelFootprint fp = ComputeFootprint(c, 0);
  EXPECT_EQ(fp.routed_expert_bytes, 2 * 256 * 3 * matrix);      // 6.85 GB
  EXPECT_EQ(fp.routed_bytes_per_token, 2 * 6 * 3 * matrix);     // 160 MB
}

TEST(PresetTest, FlashScheduleHasCsaAndHcaFromThreeLayers) {
  const std::map<int64_t, std::string> want = {
      {1, "S/h"},     {2, "SS/hh"},     {3, "SCH/hhh"},         {4, "SSCH/hhhm"},
      {5, "SSCHC/hhhmm"}, {6, "SSCHCH/hhhmmm"},
  };
  for (const auto& [layers, schedule] : want) {
    auto p = MakePreset({.preset = "v4-flash", .layers = layers});
    ASSERT_OK(p);
    EXPECT_EQ(Schedule(p->config), schedule) << layers << " layers";
  }
  auto full = MakePreset({.preset = "v4-flash", .layers = 43, .dspark_stages = 3});
  ASSERT_OK(full);
  const ModelConfig flash = synthetic::V4FlashConfig();
  EXPECT_EQ(full->config.layer_types, flash.layer_types);
  EXPECT_EQ(full->config.mlp_layer_types, flash.mlp_layer_types);
  EXPECT_EQ(full->config.dspark_target_layer_ids, flash.dspark_target_layer_ids);
  EXPECT_EQ(full->config.DefaultMtpStages(), 3);
  EXPECT_EQ(ModelConfigToJson(full->config), ModelConfigToJson(flash));
}

TEST(PresetTest, TinyDefaultIsTheFixtureConfig) {
  auto p = MakePreset({.preset = "tiny"});
  ASSERT_OK(p);
  auto fixture = LoadModelConfig(kData + "/tiny-v4");
  ASSERT_OK(fixture);
  EXPECT_EQ(ModelConfigToJson(p->config), ModelConfigToJson(*fixture));
  EXPECT_EQ(p->mtp_stages, 3);
  EXPECT_EQ(Schedule(p->config), "SCHCH/hhmmm");
}

TEST(PresetTest, OverridesAndDspark) {
  auto p = MakePreset({.preset = "v4-flash", .layers = 4, .experts = 16, .dspark_stages = 2});
  ASSERT_OK(p);
  EXPECT_EQ(p->config.n_routed_experts, 16);
  EXPECT_EQ(p->mtp_stages, 2);
  EXPECT_EQ(p->config.DefaultMtpStages(), 2);
  EXPECT_EQ(p->config.dspark_target_layer_ids, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(p->config.dspark_noise_token_id, 128799);

  auto two = MakePreset({.preset = "tiny", .layers = 2, .dspark_stages = 1});
  ASSERT_OK(two);
  EXPECT_EQ(Schedule(two->config), "SC/hh");
  EXPECT_EQ(two->config.dspark_target_layer_ids, (std::vector<int64_t>{0, 1}));
}

TEST(PresetTest, BadOptionsNameTheFlag) {
  auto few = MakePreset({.preset = "v4-flash", .experts = 5});
  ASSERT_FALSE(few.ok());
  EXPECT_THAT(std::string(few.status().message()), HasSubstr("--experts must be in [6, "));
  auto unknown = MakePreset({.preset = "v4-pro"});
  ASSERT_FALSE(unknown.ok());
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("--preset must be tiny or v4-flash"));
  EXPECT_FALSE(MakePreset({.preset = "tiny", .layers = 5000}).ok());
  EXPECT_FALSE(MakePreset({.preset = "tiny", .dspark_stages = 17}).ok());
}

// ---- generated tokenizer ----------------------------------------------------------------------------------

TEST(SyntheticTokenizerTest, FlashSizedVocabularyLoadsWithDeepSeekIds) {
  auto json = synthetic::SyntheticTokenizerJson(129280);
  ASSERT_OK(json);
  auto again = synthetic::SyntheticTokenizerJson(129280);
  ASSERT_OK(again);
  EXPECT_EQ(*json, *again);  // deterministic

  auto tok = tokenizer::Tokenizer::FromJson(*json, "synthetic tokenizer.json");
  ASSERT_OK(tok);
  EXPECT_EQ((*tok)->vocab_size(), 129280);
  for (int32_t id = 0; id < 129280; ++id) ASSERT_TRUE((*tok)->IdToToken(id).has_value()) << "id " << id;
  const auto& sp = (*tok)->special_ids();
  EXPECT_EQ(sp.bos, 0);
  EXPECT_EQ(sp.eos, 1);
  EXPECT_EQ(sp.user, 128803);
  EXPECT_EQ(sp.assistant, 128804);
  EXPECT_EQ(sp.think, 128821);
  EXPECT_EQ(sp.end_think, 128822);
  EXPECT_EQ((*tok)->TokenToId("<｜dspark▁noise｜>"), 128799);
  EXPECT_EQ((*tok)->TokenToId("｜DSML｜"), 128825);
  EXPECT_EQ((*tok)->TokenToId("<｜latest_reminder｜>"), 128828);
  EXPECT_TRUE((*tok)->IsSpecialToken(128000));

  // Merges apply: English text takes fewer tokens than bytes; a number of 3 ascending digits is one token
  // (2 digits + 1).
  const std::string english = " the quick brown fox jumps over the lazy dog and then some more";
  auto words = (*tok)->Encode(english);
  ASSERT_OK(words);
  EXPECT_LT(words->size(), english.size() / 2);
  auto num = (*tok)->Encode("123");
  ASSERT_OK(num);
  EXPECT_EQ(num->size(), 1u);

  for (const std::string text : {"Hello, world! The answer is 42.\n\n  def f(x):\n    return x",
                                 "混合 text — with emoji 🙂 and ÄÖÜ", "<｜User｜>hi<｜Assistant｜><think>ok</think>", ""}) {
    auto ids = (*tok)->Encode(text);
    ASSERT_OK(ids) << text;
    EXPECT_EQ((*tok)->Decode(*ids), text);
    for (int32_t id : *ids) EXPECT_LT(id, 129280);
  }
}

TEST(SyntheticTokenizerTest, PreTokenizerIsDeepSeeks) {
  auto tiny = tokenizer::Tokenizer::Load(kData + "/tiny-v4");
  ASSERT_OK(tiny);
  auto json = synthetic::SyntheticTokenizerJson(1024);
  ASSERT_OK(json);
  auto small = tokenizer::Tokenizer::FromJson(*json, "synthetic tokenizer.json");
  ASSERT_OK(small);
  EXPECT_EQ((*small)->vocab_size(), 1024);
  EXPECT_EQ((*small)->special_ids().user, 992);
  for (const std::string text : {"It's 2024: 12345 apples, ¿qué?  \r\n\tend", "日本語のテキストと中文", "a.b,c!!d"}) {
    auto a = (*tiny)->PreTokenize(text), b = (*small)->PreTokenize(text);
    ASSERT_OK(a);
    ASSERT_OK(b);
    EXPECT_EQ(*a, *b) << text;
  }
  EXPECT_FALSE(synthetic::SyntheticTokenizerJson(1000).ok());
}

// ---- streaming writer -------------------------------------------------------------------------------------

// A config whose expert, dense and embedding matrices are split into several pieces.
ModelConfig WideConfig() {
  ModelConfig c = synthetic::TinyConfig();
  synthetic::SetSchedule(&c, {AttnType::kSliding, AttnType::kCSA}, 1);
  c.hidden_size = 2048;
  c.moe_intermediate_size = 1024;
  c.n_routed_experts = 2;
  c.vocab_size = 1100;  // embed and head: 2.25M elements each
  c.dspark_target_layer_ids = {1};
  return c;
}

std::map<std::string, std::string> TensorBytes(const std::string& dir) {
  std::map<std::string, std::string> out;
  auto store = TensorStore::Open(dir);
  EXPECT_OK(store);
  if (!store.ok()) return out;
  for (const std::string& name : (*store)->Names()) {
    const TensorView* t = (*store)->Find(name);
    out[name] = absl::StrCat(std::string(DTypeName(t->dtype)), t->ShapeString(), ":",
                             std::string(reinterpret_cast<const char*>(t->data), t->nbytes));
  }
  return out;
}

TEST(SyntheticStreamingTest, BytesDoNotDependOnThreadsOrShards) {
  const ModelConfig c = WideConfig();
  TempDir a("mk-stream-a"), b("mk-stream-b");
  synthetic::SyntheticOptions oa;
  oa.seed = 3;
  oa.num_shards = 1;
  oa.threads = 1;
  oa.mtp_stages = 0;
  std::vector<std::pair<int64_t, int64_t>> calls;
  oa.progress = [&](int64_t done, int64_t total) { calls.push_back({done, total}); };
  ASSERT_OK(synthetic::MakeSyntheticCheckpoint(c, a.str(), oa));
  synthetic::SyntheticOptions ob = oa;
  ob.num_shards = 3;
  ob.threads = 3;
  ob.progress = nullptr;
  ASSERT_OK(synthetic::MakeSyntheticCheckpoint(c, b.str(), ob));

  // The plan is exact: every byte written was counted up front.
  auto planned = synthetic::SyntheticCheckpointBytes(c, oa);
  ASSERT_OK(planned);
  int64_t on_disk = 0;
  for (const auto& e : fs::directory_iterator(a.path())) on_disk += static_cast<int64_t>(fs::file_size(e.path()));
  EXPECT_EQ(on_disk, *planned);
  EXPECT_GT(on_disk, 13'000'000);  // 2 layers x 2 experts x 3 x 2M params in MXFP4 alone is 13.4 MB

  // Progress: monotone, one total, ending at it, many calls (pieces of ~1M elements).
  ASSERT_GT(calls.size(), 30u);
  for (size_t i = 1; i < calls.size(); ++i) {
    EXPECT_GE(calls[i].first, calls[i - 1].first);
    EXPECT_EQ(calls[i].second, *planned);
  }
  EXPECT_EQ(calls.back().first, *planned);

  const auto ta = TensorBytes(a.str()), tb = TensorBytes(b.str());
  EXPECT_EQ(ta.size(), tb.size());
  for (const auto& [name, bytes] : ta) EXPECT_TRUE(tb.count(name) && tb.at(name) == bytes) << name;
  for (const auto& e : fs::directory_iterator(a.path())) EXPECT_EQ(e.path().extension() == ".tmp", false);
  EXPECT_OK(Checkpoint::Open(b.str()));
}

TEST(SyntheticStreamingTest, WriteErrorNamesTheFileAndLeavesNoTemp) {
  TempDir dir("mk-stream-err");
  // A directory where the shard file should go makes its rename fail.
  fs::create_directories(dir.path() / "model-00001-of-00001.safetensors");
  synthetic::SyntheticOptions o;
  o.num_shards = 1;
  const Status s = synthetic::MakeSyntheticCheckpoint(synthetic::TinyConfig(), dir.str(), o);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("model-00001-of-00001.safetensors"));
  EXPECT_FALSE(fs::exists(dir.path() / "model-00001-of-00001.safetensors.tmp"));
}

}  // namespace
}  // namespace numoe::test
