// Checkpoint::Open / LoadF32 / ExpectedTensors / ComputeFootprint on the fixtures and synthetic family members.
#include "common/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>

#include "common/synthetic/synthetic.h"
#include "tests/support/files.h"
#include "tests/support/status_matchers.h"

namespace numoe {
namespace {

using test::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

const std::string kData = NUMOE_TEST_DATA;

TEST(CheckpointFixture, TinyOpensAndLoads) {
  auto ck = Checkpoint::Open(kData + "/tiny-v4");
  ASSERT_OK(ck);
  const Checkpoint& c = **ck;
  EXPECT_EQ(c.mtp_stages(), 3);
  EXPECT_EQ(c.config().num_hidden_layers, 5);
  EXPECT_EQ(c.store().num_tensors(), 662u);

  auto wq = c.LoadF32("layers.0.attn.wq_a.weight");
  ASSERT_OK(wq);
  EXPECT_EQ(wq->shape, (std::vector<int64_t>{64, 128}));
  ASSERT_EQ(wq->data.size(), 64u * 128u);

  // MXFP4 expert: stored I8 [64, 64], logical [64, 128].
  auto raw = c.Raw("layers.0.ffn.experts.0.w1.weight");
  ASSERT_OK(raw);
  EXPECT_EQ((*raw)->dtype, DType::kI8);
  EXPECT_EQ((*raw)->shape, (std::vector<int64_t>{64, 64}));
  auto w1 = c.LoadF32("layers.0.ffn.experts.0.w1.weight");
  ASSERT_OK(w1);
  EXPECT_EQ(w1->shape, (std::vector<int64_t>{64, 128}));
  // Value check against the format definition: element (0,0) is the low nibble of byte 0 times its scale.
  auto scale = c.Raw("layers.0.ffn.experts.0.w1.scale");
  ASSERT_OK(scale);
  const uint8_t b0 = (*raw)->data[0];
  EXPECT_EQ(w1->data[0], Fp4E2M1ToFloat(b0 & 0xF) * E8M0ToFloat((*scale)->data[0]));
  EXPECT_EQ(w1->data[1], Fp4E2M1ToFloat(b0 >> 4) * E8M0ToFloat((*scale)->data[0]));

  auto w2 = c.LoadF32("layers.0.ffn.experts.7.w2.weight");
  ASSERT_OK(w2);
  EXPECT_EQ(w2->shape, (std::vector<int64_t>{128, 64}));

  auto embed = c.LoadF32("embed.weight");
  ASSERT_OK(embed);
  EXPECT_EQ(embed->shape, (std::vector<int64_t>{1024, 128}));
  for (float v : embed->data) ASSERT_TRUE(std::isfinite(v));

  auto main_proj = c.LoadF32("mtp.0.main_proj.weight");
  ASSERT_OK(main_proj);
  EXPECT_EQ(main_proj->shape, (std::vector<int64_t>{128, 384}));

  auto missing = c.LoadF32("layers.9.attn.wq_a.weight");
  EXPECT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("layers.9.attn.wq_a.weight"));
}

TEST(CheckpointFixture, DemoOpens) {
  auto ck = Checkpoint::Open(kData + "/demo-v4");
  ASSERT_OK(ck);
  EXPECT_EQ((*ck)->mtp_stages(), 0);
  auto w = (*ck)->LoadF32("layers.3.ffn.experts.15.w3.weight");
  ASSERT_OK(w);
  EXPECT_EQ(w->shape, (std::vector<int64_t>{256, 256}));
  auto tid = (*ck)->LoadF32("layers.0.ffn.gate.tid2eid");
  ASSERT_OK(tid);
  EXPECT_EQ(tid->shape, (std::vector<int64_t>{1024, 2}));
  std::vector<int64_t> shape;
  auto ids = (*ck)->LoadIndex("layers.0.ffn.gate.tid2eid", &shape);
  ASSERT_OK(ids);
  EXPECT_EQ(shape, (std::vector<int64_t>{1024, 2}));
  ASSERT_EQ(ids->size(), 2048u);
  for (size_t i = 0; i < ids->size(); ++i) EXPECT_EQ(static_cast<float>((*ids)[i]), tid->data[i]);
  EXPECT_THAT(std::string((*ck)->LoadIndex("embed.weight").status().message()), HasSubstr("embed.weight"));
}

TEST(Footprint, FlashConfig) {
  auto c = LoadModelConfig(kData + "/v4-flash-0731.config.json");
  ASSERT_OK(c);
  EXPECT_EQ(c->DefaultMtpStages(), 3);
  const ModelFootprint fp = ComputeFootprint(*c, c->DefaultMtpStages());
  // 43 x 256 x 3 x 4096 x 2048 params at 4.25 bits.
  const double routed = 43.0 * 256 * 3 * 4096 * 2048 * 4.25 / 8;
  EXPECT_EQ(static_cast<double>(fp.routed_expert_bytes), routed);
  EXPECT_NEAR(fp.routed_expert_bytes / 1e9, 147.2, 0.05);
  EXPECT_NEAR(fp.routed_bytes_per_token / 1e9, 3.45, 0.005);
  EXPECT_EQ(static_cast<double>(fp.routed_bytes_per_token), 43.0 * 6 * 3 * 4096 * 2048 * 4.25 / 8);
  EXPECT_GT(fp.mtp_routed_expert_bytes, 0);
  EXPECT_GT(fp.other_bytes, 0);
}


// ---- mutations of a real checkpoint ----------------------------------------

struct Owned {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
using Tensors = std::vector<Owned>;

Tensors LoadAll(const std::string& dir) {
  Tensors out;
  auto store = TensorStore::Open(dir);
  EXPECT_OK(store);
  if (!store.ok()) return out;
  for (const auto& name : (*store)->Names()) {
    const TensorView* t = (*store)->Find(name);
    out.push_back({name, t->dtype, t->shape, std::vector<uint8_t>(t->data, t->data + t->nbytes)});
  }
  return out;
}

// Writes `ts` as two shards + index into `dir` next to `config_from`'s config.json.
void WriteAll(const std::string& config_from, const std::string& dir, const Tensors& ts) {
  std::filesystem::copy_file(config_from + "/config.json", dir + "/config.json",
                             std::filesystem::copy_options::overwrite_existing);
  std::vector<TensorToWrite> a, b;
  std::string map;
  for (size_t i = 0; i < ts.size(); ++i) {
    (i % 2 ? b : a).push_back({ts[i].name, ts[i].dtype, ts[i].shape, ts[i].bytes.data()});
    map += (map.empty() ? "" : ", ") + ("\"" + ts[i].name + "\": \"") + (i % 2 ? "b" : "a") + ".safetensors\"";
  }
  ASSERT_OK(WriteSafetensors(dir + "/a.safetensors", a));
  ASSERT_OK(WriteSafetensors(dir + "/b.safetensors", b));
  test::WriteFile(dir + "/model.safetensors.index.json", "{\"weight_map\": {" + map + "}}");
}

// Copies `fixture`'s tensors, applies `edit`, and returns what Checkpoint::Open says.
Status OpenEdited(const std::string& fixture, const std::function<void(Tensors&)>& edit) {
  TempDir d;
  Tensors ts = LoadAll(fixture);
  edit(ts);
  WriteAll(fixture, d.str(), ts);
  return Checkpoint::Open(d.str()).status();
}

void Erase(Tensors& ts, const std::string& prefix) {
  std::erase_if(ts, [&](const Owned& t) { return t.name.rfind(prefix, 0) == 0; });
}
Owned* FindT(Tensors& ts, const std::string& name) {
  for (auto& t : ts)
    if (t.name == name) return &t;
  ADD_FAILURE() << "no tensor " << name;
  static Owned dummy;
  return &dummy;
}

const std::string kTiny = kData + "/tiny-v4";

TEST(CheckpointValidation, UnchangedCopyOpens) {
  EXPECT_OK(OpenEdited(kTiny, [](Tensors&) {}));
}

TEST(CheckpointValidation, MissingTensorNamed) {
  Status s = OpenEdited(kTiny, [](Tensors& ts) { Erase(ts, "layers.2.attn.wq_b."); });
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("1 missing tensor(s): layers.2.attn.wq_b.weight"), Not(HasSubstr("unexpected"))));
  // Only the scale gone: the weight is reported with what is missing.
  s = OpenEdited(kTiny, [](Tensors& ts) { Erase(ts, "layers.2.attn.wq_b.scale"); });
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("layers.2.attn.wq_b.weight"), HasSubstr("'layers.2.attn.wq_b.scale' is missing")));
}

TEST(CheckpointValidation, ExtraTensorNamed) {
  Status s = OpenEdited(kTiny, [](Tensors& ts) {
    ts.push_back({"layers.0.attn.bogus.weight", DType::kF32, {2}, std::vector<uint8_t>(8)});
    // A scored-MoE bias on a hash layer is unexpected too.
    ts.push_back({"layers.0.ffn.gate.bias", DType::kF32, {8}, std::vector<uint8_t>(32)});
  });
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr("2 unexpected tensor(s)"), HasSubstr("layers.0.attn.bogus.weight"),
                                              HasSubstr("layers.0.ffn.gate.bias")));
}

TEST(CheckpointValidation, MisShapedAndMisTypedNamed) {
  Status s = OpenEdited(kTiny, [](Tensors& ts) {
    Owned* w = FindT(ts, "layers.1.attn.wkv.weight");
    w->shape = {64, 64};
    w->bytes.resize(64 * 64);
    Owned* n = FindT(ts, "layers.3.attn_norm.weight");  // BF16 [128] -> I32 [64]
    n->dtype = DType::kI32;
    n->shape = {64};
    Owned* e = FindT(ts, "layers.4.ffn.experts.3.w2.scale");  // [128, 2] -> [128, 1]
    e->shape = {128, 1};
    e->bytes.resize(128);
  });
  const std::string m(s.message());
  EXPECT_THAT(m, AllOf(HasSubstr("3 mis-shaped or mis-typed"), HasSubstr("layers.1.attn.wkv.weight: expected [64, 128]"),
                       HasSubstr("got F8_E4M3 [64, 64]"), HasSubstr("layers.3.attn_norm.weight"), HasSubstr("I32 [64]"),
                       HasSubstr("layers.4.ffn.experts.3.w2.scale"), HasSubstr("[128, 2]")));
  EXPECT_THAT(m, HasSubstr(".safetensors"));  // says which file holds it
}

TEST(CheckpointValidation, Tid2eidValues) {
  Status s = OpenEdited(kTiny, [](Tensors& ts) {
    Owned* t = FindT(ts, "layers.1.ffn.gate.tid2eid");
    const int64_t bad = 8;  // 8 experts: ids are 0..7
    std::memcpy(t->bytes.data() + 8 * 5, &bad, 8);
  });
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("layers.1.ffn.gate.tid2eid"), HasSubstr("value 8 at [2, 1]"), HasSubstr("[0, 8)")));
  s = OpenEdited(kTiny, [](Tensors& ts) {
    Owned* t = FindT(ts, "layers.0.ffn.gate.tid2eid");
    t->dtype = DType::kF32;
    t->shape = {1024, 4};
  });
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr("layers.0.ffn.gate.tid2eid"), HasSubstr("I32/I64")));
}

TEST(CheckpointValidation, ManyProblemsAreCapped) {
  Status s = OpenEdited(kTiny, [](Tensors& ts) { Erase(ts, "layers.4.ffn.experts."); });
  const std::string m(s.message());
  // 8 experts x 3 weights missing (their scales simply go with them): 20 named, then "and 4 more".
  EXPECT_THAT(m, AllOf(HasSubstr("24 missing tensor(s)"), HasSubstr("layers.4.ffn.experts.0.w1.weight"),
                       HasSubstr("and 4 more")));
}

TEST(CheckpointValidation, MissingMtpStageNamed) {
  Status s = OpenEdited(kTiny, [](Tensors& ts) { Erase(ts, "mtp.1."); });
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr("3 MTP stages"), HasSubstr("mtp.1.attn_norm.weight")));
}

TEST(CheckpointValidation, DenseMayBeBf16OrF32) {
  TempDir d;
  Tensors ts = LoadAll(kTiny);
  auto orig = Checkpoint::Open(kTiny);
  ASSERT_OK(orig);
  auto wq = (*orig)->LoadF32("layers.2.attn.wq_a.weight");
  ASSERT_OK(wq);
  Erase(ts, "layers.2.attn.wq_a.");
  Owned w{"layers.2.attn.wq_a.weight", DType::kF32, {64, 128}, std::vector<uint8_t>(64 * 128 * 4)};
  std::memcpy(w.bytes.data(), wq->data.data(), w.bytes.size());
  ts.push_back(std::move(w));
  // A norm stored F32 instead of BF16.
  Owned* n = FindT(ts, "norm.weight");
  std::vector<uint8_t> f32(128 * 4);
  for (int i = 0; i < 128; ++i) {
    uint16_t b;
    std::memcpy(&b, n->bytes.data() + 2 * i, 2);
    const float v = Bf16ToFloat(b);
    std::memcpy(f32.data() + 4 * i, &v, 4);
  }
  n->dtype = DType::kF32;
  n->bytes = f32;
  WriteAll(kTiny, d.str(), ts);
  auto ck = Checkpoint::Open(d.str());
  ASSERT_OK(ck);
  auto back = (*ck)->LoadF32("layers.2.attn.wq_a.weight");
  ASSERT_OK(back);
  EXPECT_EQ(back->data, wq->data);
  auto norm = (*ck)->LoadF32("norm.weight");
  auto norm0 = (*orig)->LoadF32("norm.weight");
  ASSERT_OK(norm);
  ASSERT_OK(norm0);
  EXPECT_EQ(norm->data, norm0->data);
}

TEST(CheckpointValidation, BadConfigIsReported) {
  TempDir d;
  test::CopyFiles(kTiny, d.str());
  test::WriteFile(d / "config.json", "{\"hidden_size\": 128}");
  EXPECT_THAT(std::string(Checkpoint::Open(d.str()).status().message()),
              AllOf(HasSubstr("config.json"), HasSubstr("missing required key")));
}

// ---- ExpectedTensors -------------------------------------------------------

TEST(ExpectedTensors, TinyMatchesFixtureExactly) {
  auto ck = Checkpoint::Open(kTiny);
  ASSERT_OK(ck);
  const auto expected = ExpectedTensors((*ck)->config(), 3);
  size_t stored = 0;
  int64_t bytes = 0;
  for (const auto& e : expected) {
    const TensorView* t = (*ck)->store().Find(e.name);
    ASSERT_NE(t, nullptr) << e.name;
    // The official layout: dtype and stored shape as ExpectedTensors predicts (tid2eid: I64 here).
    if (e.dtype != DType::kI32) {
      EXPECT_EQ(t->dtype, e.dtype) << e.name;
    }
    EXPECT_EQ(t->shape, e.stored_shape) << e.name;
    ++stored;
    bytes += static_cast<int64_t>(t->nbytes);
    if (e.format != WeightFormat::kPlain) {
      const TensorView* s = (*ck)->store().Find(ScaleNameOf(e.name));
      ASSERT_NE(s, nullptr) << e.name;
      EXPECT_EQ(s->dtype, e.scale_dtype) << e.name;
      EXPECT_EQ(s->shape, e.scale_shape) << e.name;
      ++stored;
      bytes += static_cast<int64_t>(s->nbytes);
    }
  }
  EXPECT_EQ(stored, (*ck)->store().num_tensors());
  EXPECT_EQ(bytes, 3297047);  // the index's total_size
}

TEST(ExpectedTensors, ShapesOfOneCsaLayer) {
  auto c = LoadModelConfig(kData + "/v4-flash-0731.config.json");
  ASSERT_OK(c);
  std::map<std::string, ExpectedTensor> by;
  for (auto& e : ExpectedTensors(*c, 3)) by[e.name] = e;
  // docs/dsv4-architecture.md §5 (V4-Flash).
  EXPECT_EQ(by["layers.2.attn.wq_b.weight"].scale_shape, (std::vector<int64_t>{256, 8}));
  EXPECT_EQ(by["layers.2.attn.wo_a.weight"].shape, (std::vector<int64_t>{8192, 4096}));
  EXPECT_EQ(by["layers.2.attn.wo_b.weight"].scale_shape, (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(by["layers.2.attn.compressor.wkv.weight"].shape, (std::vector<int64_t>{1024, 4096}));
  EXPECT_EQ(by["layers.3.attn.compressor.ape"].shape, (std::vector<int64_t>{128, 512}));
  EXPECT_EQ(by["layers.2.attn.indexer.wq_b.weight"].scale_shape, (std::vector<int64_t>{64, 8}));
  EXPECT_EQ(by["layers.2.attn.indexer.compressor.ape"].shape, (std::vector<int64_t>{4, 256}));
  EXPECT_EQ(by["layers.0.ffn.gate.tid2eid"].shape, (std::vector<int64_t>{129280, 6}));
  EXPECT_EQ(by.count("layers.3.ffn.gate.tid2eid"), 0u);
  EXPECT_EQ(by["layers.3.ffn.gate.bias"].shape, (std::vector<int64_t>{256}));
  EXPECT_EQ(by["layers.5.ffn.experts.255.w1.weight"].stored_shape, (std::vector<int64_t>{2048, 2048}));
  EXPECT_EQ(by["layers.5.ffn.experts.255.w1.weight"].scale_shape, (std::vector<int64_t>{2048, 128}));
  EXPECT_EQ(by["layers.5.ffn.experts.0.w2.weight"].stored_shape, (std::vector<int64_t>{4096, 1024}));
  EXPECT_EQ(by["layers.5.ffn.experts.0.w2.weight"].scale_shape, (std::vector<int64_t>{4096, 64}));
  EXPECT_EQ(by["layers.5.ffn.shared_experts.w2.weight"].scale_shape, (std::vector<int64_t>{32, 16}));
  EXPECT_EQ(by["mtp.0.main_proj.weight"].shape, (std::vector<int64_t>{4096, 3 * 4096}));
  EXPECT_EQ(by["mtp.2.markov_head.markov_w1.weight"].shape, (std::vector<int64_t>{129280, 256}));
  EXPECT_EQ(by["mtp.2.confidence_head.proj.weight"].shape, (std::vector<int64_t>{1, 4096 + 256}));
  EXPECT_EQ(by.count("mtp.1.norm.weight"), 0u);
  EXPECT_EQ(by.count("mtp.1.attn.compressor.ape"), 0u);
  EXPECT_EQ(by["hc_head_fn"].shape, (std::vector<int64_t>{4, 16384}));
  EXPECT_EQ(by["layers.0.hc_attn_fn"].shape, (std::vector<int64_t>{24, 16384}));
}

TEST(ExpectedTensors, FlashTensorCountsMatchTheReleases) {
  // docs/dsv4-architecture.md §0: V4-Flash-0731 ships 72,317 tensors (3 DSpark stages), the preview
  // Flash 69,187 (1 MTP stage with e_proj/h_proj). Scales count as tensors.
  auto c = LoadModelConfig(kData + "/v4-flash-0731.config.json");
  ASSERT_OK(c);
  auto count = [](const ModelConfig& cfg, int64_t stages) {
    int64_t n = 0;
    for (const auto& e : ExpectedTensors(cfg, stages)) n += e.format == WeightFormat::kPlain ? 1 : 2;
    return n;
  };
  EXPECT_EQ(count(*c, 3), 72317);
  ModelConfig preview = *c;
  preview.dspark_block_size = 0;
  EXPECT_EQ(count(preview, 1), 69187);
}

// ---- synthetic family members ------------------------------------------------

void ExpectOpens(const ModelConfig& cfg, const synthetic::SyntheticOptions& opt, int64_t stages) {
  TempDir d;
  Status made = synthetic::MakeSyntheticCheckpoint(cfg, d.str(), opt);
  ASSERT_OK(made);
  auto ck = Checkpoint::Open(d.str());
  ASSERT_OK(ck);
  EXPECT_EQ((*ck)->mtp_stages(), stages);
  EXPECT_EQ((*ck)->config().layer_types, cfg.layer_types);
  EXPECT_EQ((*ck)->config().mlp_layer_types, cfg.mlp_layer_types);
  EXPECT_EQ((*ck)->config().n_routed_experts, cfg.n_routed_experts);
  EXPECT_EQ((*ck)->store().files().size(), static_cast<size_t>(std::min<int64_t>(opt.num_shards, 1000)));
  for (const auto& e : ExpectedTensors((*ck)->config(), stages)) {
    if (e.routed_expert && e.name.find("experts.0.") == std::string::npos) continue;  // keep it quick
    auto t = (*ck)->LoadF32(e.name);
    ASSERT_OK(t);
    ASSERT_EQ(t->shape, e.shape) << e.name;
    for (float v : t->data) ASSERT_TRUE(std::isfinite(v)) << e.name;
  }
}

TEST(Synthetic, TinyDefault) { ExpectOpens(synthetic::TinyConfig(), {}, 3); }

TEST(Synthetic, OtherScheduleExpertsShardsAndI32) {
  ModelConfig c = synthetic::TinyConfig();
  synthetic::SetSchedule(&c,
                         {AttnType::kCSA, AttnType::kCSA, AttnType::kHCA, AttnType::kSliding, AttnType::kHCA,
                          AttnType::kCSA, AttnType::kSliding},
                         1);
  c.n_routed_experts = 16;
  c.num_experts_per_tok = 4;
  c.hca_rate = 8;
  synthetic::SyntheticOptions o;
  o.num_shards = 3;
  o.tid2eid_dtype = DType::kI32;
  o.seed = 99;
  ExpectOpens(c, o, 3);
  TempDir d;
  ASSERT_OK(synthetic::MakeSyntheticCheckpoint(c, d.str(), o));
  auto ck = Checkpoint::Open(d.str());
  ASSERT_OK(ck);
  auto raw = (*ck)->Raw("layers.0.ffn.gate.tid2eid");
  ASSERT_OK(raw);
  EXPECT_EQ((*raw)->dtype, DType::kI32);
  EXPECT_EQ((*raw)->shape, (std::vector<int64_t>{1024, 4}));
  auto ids = (*ck)->LoadIndex("layers.0.ffn.gate.tid2eid");
  ASSERT_OK(ids);
  std::vector<int> hits(16, 0);
  for (int64_t id : *ids) {
    ASSERT_GE(id, 0);
    ASSERT_LT(id, 16);
    ++hits[id];
  }
  for (int h : hits) EXPECT_GT(h, 0);  // uniform ids reach every expert
}

TEST(Synthetic, SingleFileNoMtpUnquantized) {
  ModelConfig c = synthetic::TinyConfig();
  c.dspark_block_size = 0;
  c.extra_compress_ratios.clear();
  c.num_nextn_predict_layers = 0;
  c.fp8_dense = false;
  c.expert_dtype = "bf16";
  synthetic::SyntheticOptions o;
  o.num_shards = 1;
  o.write_index = false;
  ExpectOpens(c, o, 0);
}

TEST(Synthetic, Fp8ExpertsWiderModelPreviewMtp) {
  ModelConfig c = synthetic::TinyConfig();
  c.hidden_size = 256;
  c.moe_intermediate_size = 160;  // not a multiple of 128: ceil scale grids
  c.expert_dtype = "fp8";
  c.fp8_scale_fmt = "fp32";
  c.dspark_block_size = 0;
  c.extra_compress_ratios = {0};
  c.num_nextn_predict_layers = 1;  // preview-Flash MTP: e_proj/h_proj/enorm/hnorm
  c.tie_word_embeddings = true;
  synthetic::SyntheticOptions o;
  o.num_shards = 4;
  ExpectOpens(c, o, 1);
}

TEST(Synthetic, DeterministicAcrossShardCounts) {
  TempDir a, b, c;
  synthetic::SyntheticOptions o;
  ASSERT_OK(synthetic::MakeSyntheticCheckpoint(synthetic::TinyConfig(), a.str(), o));
  o.num_shards = 3;
  ASSERT_OK(synthetic::MakeSyntheticCheckpoint(synthetic::TinyConfig(), b.str(), o));
  o.seed = 2;
  ASSERT_OK(synthetic::MakeSyntheticCheckpoint(synthetic::TinyConfig(), c.str(), o));
  auto ca = Checkpoint::Open(a.str());
  auto cb = Checkpoint::Open(b.str());
  auto cc = Checkpoint::Open(c.str());
  ASSERT_OK(ca);
  ASSERT_OK(cb);
  ASSERT_OK(cc);
  for (const char* n : {"layers.3.attn.wq_b.weight", "layers.1.ffn.experts.5.w2.weight", "mtp.2.hc_head_fn"}) {
    auto x = (*ca)->LoadF32(n), y = (*cb)->LoadF32(n), z = (*cc)->LoadF32(n);
    ASSERT_OK(x);
    ASSERT_OK(y);
    ASSERT_OK(z);
    EXPECT_EQ(x->data, y->data) << n;
    EXPECT_NE(x->data, z->data) << n;
  }
}

TEST(Synthetic, ValueScales) {
  TempDir d;
  ASSERT_OK(synthetic::MakeSyntheticCheckpoint(synthetic::TinyConfig(), d.str()));
  auto ck = Checkpoint::Open(d.str());
  ASSERT_OK(ck);
  auto stats = [&](const std::string& name, double* mean, double* std) {
    auto t = (*ck)->LoadF32(name);
    ASSERT_OK(t);
    double s = 0, s2 = 0;
    for (float v : t->data) {
      s += v;
      s2 += double{v} * v;
    }
    const double n = static_cast<double>(t->data.size());
    *mean = s / n;
    *std = std::sqrt(s2 / n - *mean * *mean);
  };
  double m, s;
  stats("layers.0.attn.wq_a.weight", &m, &s);  // 0.05 through FP8
  EXPECT_NEAR(s, 0.05, 0.01);
  stats("layers.2.ffn.experts.1.w1.weight", &m, &s);  // 0.05 through MXFP4 (coarse)
  EXPECT_NEAR(s, 0.05, 0.015);
  stats("layers.1.attn_norm.weight", &m, &s);
  EXPECT_NEAR(m, 1.0, 0.03);
  stats("embed.weight", &m, &s);
  EXPECT_NEAR(s, 1.0, 0.05);
  stats("layers.1.hc_ffn_scale", &m, &s);
  EXPECT_GT(m, 0.3);
}

TEST(Synthetic, RejectsBadOptionsAndConfigs) {
  TempDir d;
  synthetic::SyntheticOptions o;
  o.num_shards = 0;
  EXPECT_FALSE(synthetic::MakeSyntheticCheckpoint(synthetic::TinyConfig(), d.str(), o).ok());
  ModelConfig c = synthetic::TinyConfig();
  c.num_experts_per_tok = 100;
  Status s = synthetic::MakeSyntheticCheckpoint(c, d.str());
  EXPECT_THAT(std::string(s.message()), HasSubstr("num_experts_per_tok"));
}

}  // namespace
}  // namespace numoe
