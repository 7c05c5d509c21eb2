// config.json parsing: official and transformers spellings, defaults, every validation error, rope tables.
#include "common/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "nlohmann/json.hpp"
#include "tests/support/files.h"
#include "tests/support/status_matchers.h"

namespace numoe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using json = nlohmann::json;

const std::string kData = NUMOE_TEST_DATA;

json TinyJson() { return json::parse(test::ReadFile(kData + "/tiny-v4/config.json")); }

// The tiny config in transformers' spelling (docs/dsv4-architecture.md §6 style).
json TransformersJson() {
  return json::parse(R"({
    "model_type": "deepseek_v4", "vocab_size": 1024, "hidden_size": 128, "num_hidden_layers": 5,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "partial_rotary_factor": 0.25,
    "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32, "sliding_window": 8,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention", "heavily_compressed_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe"],
    "index_n_heads": 8, "index_head_dim": 32, "index_topk": 3,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 64,
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 1.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1024,
    "rope_parameters": {
      "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
      "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 4,
                   "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
                   "partial_rotary_factor": 0.25, "attention_factor": 1.0}},
    "tie_word_embeddings": false})");
}

StatusOr<ModelConfig> Parse(const json& j) { return ParseModelConfig(j.dump(), "cfg.json"); }

// Parsing must fail with a message that names the source and contains every fragment.
void ExpectError(const json& j, std::vector<std::string> fragments) {
  auto c = Parse(j);
  ASSERT_FALSE(c.ok()) << j.dump();
  const std::string msg(c.status().message());
  EXPECT_THAT(msg, HasSubstr("cfg.json")) << msg;
  for (const auto& f : fragments) EXPECT_THAT(msg, HasSubstr(f));
}

TEST(Config, TinyOfficial) {
  auto c = LoadModelConfig(kData + "/tiny-v4");
  ASSERT_OK(c);
  EXPECT_EQ(c->num_hidden_layers, 5);
  EXPECT_EQ(c->layer_types, (std::vector<AttnType>{AttnType::kSliding, AttnType::kCSA, AttnType::kHCA, AttnType::kCSA,
                                                   AttnType::kHCA}));
  EXPECT_EQ(c->mlp_layer_types,
            (std::vector<MoeType>{MoeType::kHash, MoeType::kHash, MoeType::kScored, MoeType::kScored, MoeType::kScored}));
  EXPECT_EQ(c->extra_compress_ratios, (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(c->CompressRate(0), 0);
  EXPECT_EQ(c->CompressRate(1), 4);
  EXPECT_EQ(c->CompressRate(2), 128);
  EXPECT_EQ(c->rope_dim, 16);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_DOUBLE_EQ(c->rope_main.theta, 10000.0);
  EXPECT_FALSE(c->rope_main.yarn);
  EXPECT_DOUBLE_EQ(c->rope_compress.theta, 160000.0);
  EXPECT_TRUE(c->rope_compress.yarn);
  EXPECT_DOUBLE_EQ(c->rope_compress.factor, 4.0);
  EXPECT_EQ(c->rope_compress.original_max_position_embeddings, 256);
  EXPECT_DOUBLE_EQ(c->rope_compress.attention_factor, 1.0);
  EXPECT_TRUE(c->fp8_dense);
  EXPECT_EQ(c->fp8_block_out, 128);
  EXPECT_EQ(c->fp8_block_in, 128);
  EXPECT_EQ(c->fp8_scale_fmt, "ue8m0");
  EXPECT_EQ(c->expert_dtype, "fp4");
  EXPECT_EQ(c->dspark_block_size, 5);
  EXPECT_EQ(c->dspark_noise_token_id, 6);
  EXPECT_EQ(c->dspark_markov_rank, 16);
  EXPECT_EQ(c->dspark_target_layer_ids, (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(c->num_nextn_predict_layers, 1);
  EXPECT_EQ(c->DefaultMtpStages(), 3);
  EXPECT_DOUBLE_EQ(c->swiglu_limit, 1.0);
  EXPECT_DOUBLE_EQ(c->routed_scaling_factor, 1.5);
  EXPECT_EQ(c->scoring_func, ScoringFunc::kSqrtSoftplus);
  EXPECT_EQ(c->index_topk, 3);
  EXPECT_EQ(c->n_routed_experts, 8);
  EXPECT_EQ(c->num_experts_per_tok, 2);
}

TEST(Config, FlashOfficial) {
  auto c = LoadModelConfig(kData + "/v4-flash-0731.config.json");
  ASSERT_OK(c);
  EXPECT_EQ(c->num_hidden_layers, 43);
  EXPECT_EQ(c->layer_types[0], AttnType::kSliding);
  EXPECT_EQ(c->layer_types[1], AttnType::kSliding);
  EXPECT_EQ(c->layer_types[2], AttnType::kCSA);
  EXPECT_EQ(c->layer_types[3], AttnType::kHCA);
  EXPECT_EQ(c->layer_types[42], AttnType::kCSA);
  EXPECT_EQ(c->NumLayersOf(AttnType::kCSA), 21);
  EXPECT_EQ(c->NumLayersOf(AttnType::kHCA), 20);
  EXPECT_EQ(c->NumLayersOf(MoeType::kHash), 3);
  EXPECT_EQ(c->extra_compress_ratios.size(), 3u);
  EXPECT_EQ(c->DefaultMtpStages(), 3);
  EXPECT_EQ(c->rope_dim, 64);
  EXPECT_EQ(c->rope_compress.original_max_position_embeddings, 65536);
}

TEST(Config, TransformersSpellingMatchesOfficial) {
  auto a = Parse(TinyJson());
  auto b = Parse(TransformersJson());
  ASSERT_OK(a);
  ASSERT_OK(b);
  EXPECT_EQ(a->layer_types, b->layer_types);
  EXPECT_EQ(a->mlp_layer_types, b->mlp_layer_types);
  EXPECT_EQ(a->rope_dim, b->rope_dim);
  EXPECT_EQ(a->csa_rate, b->csa_rate);
  EXPECT_EQ(a->hca_rate, b->hca_rate);
  EXPECT_EQ(RopeInvFreq(a->rope_main, a->rope_dim), RopeInvFreq(b->rope_main, b->rope_dim));
  EXPECT_EQ(RopeInvFreq(a->rope_compress, a->rope_dim), RopeInvFreq(b->rope_compress, b->rope_dim));
  // No quantization_config: unquantized weights.
  EXPECT_FALSE(b->fp8_dense);
  EXPECT_EQ(b->expert_dtype, "bf16");
}

TEST(Config, OtherCompressRates) {
  json j = TransformersJson();
  j["compress_rates"] = {{"compressed_sparse_attention", 4}, {"heavily_compressed_attention", 8}};
  auto c = Parse(j);
  ASSERT_OK(c);
  EXPECT_EQ(c->hca_rate, 8);
  EXPECT_EQ(c->CompressRate(2), 8);
  // Official compress_ratios with the same custom rate (given alongside compress_rates).
  json k = TinyJson();
  k["compress_ratios"] = {0, 4, 8, 4, 8};
  k["compress_rates"] = {{"heavily_compressed_attention", 8}};
  auto d = Parse(k);
  ASSERT_OK(d);
  EXPECT_EQ(d->layer_types[2], AttnType::kHCA);
  EXPECT_TRUE(d->extra_compress_ratios.empty());
  // Legacy scalar key.
  json l = TinyJson();
  l["compress_rate_hca"] = 16;
  l["compress_ratios"] = {0, 4, 16, 4, 16};
  auto e = Parse(l);
  ASSERT_OK(e);
  EXPECT_EQ(e->hca_rate, 16);
}

TEST(Config, TransformersDefaults) {
  // Only the required keys: everything else as transformers' DeepseekV4Config defaults it.
  json j = {{"vocab_size", 1000}, {"hidden_size", 256},   {"num_hidden_layers", 6},   {"num_attention_heads", 8},
            {"head_dim", 64},     {"q_lora_rank", 64},    {"o_groups", 2},           {"o_lora_rank", 32},
            {"n_routed_experts", 4}, {"num_experts_per_tok", 2}, {"moe_intermediate_size", 32},
            {"index_n_heads", 2}, {"index_head_dim", 16}, {"index_topk", 4}};
  auto c = Parse(j);
  ASSERT_OK(c);
  // V4-Pro schedule: 2 x HCA, then HCA/CSA alternating.
  EXPECT_EQ(c->layer_types, (std::vector<AttnType>{AttnType::kHCA, AttnType::kHCA, AttnType::kHCA, AttnType::kCSA,
                                                   AttnType::kHCA, AttnType::kCSA}));
  EXPECT_EQ(c->NumLayersOf(MoeType::kHash), 3);
  EXPECT_EQ(c->mlp_layer_types[2], MoeType::kHash);
  EXPECT_EQ(c->mlp_layer_types[3], MoeType::kScored);
  EXPECT_EQ(c->rope_dim, 8);  // head_dim / 8
  EXPECT_EQ(c->sliding_window, 128);
  EXPECT_EQ(c->csa_rate, 4);
  EXPECT_EQ(c->hca_rate, 128);
  EXPECT_EQ(c->hc_mult, 4);
  EXPECT_EQ(c->hc_sinkhorn_iters, 20);
  EXPECT_DOUBLE_EQ(c->swiglu_limit, 10.0);
  EXPECT_DOUBLE_EQ(c->routed_scaling_factor, 1.5);
  EXPECT_DOUBLE_EQ(c->rope_main.theta, 10000.0);
  EXPECT_DOUBLE_EQ(c->rope_compress.theta, 160000.0);
  EXPECT_FALSE(c->rope_compress.yarn);
  EXPECT_EQ(c->max_position_embeddings, 1048576);
  EXPECT_EQ(c->DefaultMtpStages(), 0);
  EXPECT_EQ(c->expert_dtype, "bf16");
  // Aliases from transformers' attribute_map.
  json k = j;
  k.erase("n_routed_experts");
  k.erase("moe_intermediate_size");
  k["num_local_experts"] = 4;
  k["intermediate_size"] = 32;
  auto d = Parse(k);
  ASSERT_OK(d);
  EXPECT_EQ(d->n_routed_experts, 4);
  EXPECT_EQ(d->moe_intermediate_size, 32);
}

TEST(Config, RopeInvFreqMatchesOracle) {
  const json report = json::parse(test::ReadFile(kData + "/tiny-v4.report.json"));
  auto c = LoadModelConfig(kData + "/tiny-v4");
  ASSERT_OK(c);
  for (const auto& [table, rope] : {std::pair{"main", c->rope_main}, std::pair{"compress", c->rope_compress}}) {
    const auto want = report["tiny-v4"]["inv_freq"][table].get<std::vector<double>>();
    const std::vector<float> got = RopeInvFreq(rope, c->rope_dim);
    ASSERT_EQ(got.size(), want.size()) << table;
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_NEAR(got[i], want[i], 1e-6 * std::fabs(want[i])) << table << " i=" << i;
  }
}

TEST(Config, RopeYarnFlashRamp) {
  // Doc §2.5: dim 64, L0 65536, base 160000 -> low 15, high 25; below low the frequency is kept, above high
  // it is divided by the factor (16).
  auto c = LoadModelConfig(kData + "/v4-flash-0731.config.json");
  ASSERT_OK(c);
  const std::vector<float> inv = RopeInvFreq(c->rope_compress, 64);
  ASSERT_EQ(inv.size(), 32u);
  for (int i : {0, 5, 15}) EXPECT_NEAR(inv[i], std::pow(160000.0, -2.0 * i / 64), 1e-6 * inv[i]) << i;
  for (int i : {25, 31}) EXPECT_NEAR(inv[i], std::pow(160000.0, -2.0 * i / 64) / 16, 1e-6 * inv[i]) << i;
  const double f20 = std::pow(160000.0, -40.0 / 64), ramp = 0.5;
  EXPECT_NEAR(inv[20], f20 / 16 * ramp + f20 * (1 - ramp), 1e-6 * inv[20]);
}

TEST(Config, Validation) {
  json j;
  j = TinyJson(); j.erase("hidden_size");
  ExpectError(j, {"missing required key 'hidden_size'"});
  j = TinyJson(); j["hidden_size"] = "128";
  ExpectError(j, {"hidden_size", "must be an integer"});
  j = TinyJson(); j["hidden_size"] = 12.5;
  ExpectError(j, {"hidden_size", "must be an integer"});
  j = TinyJson(); j["vocab_size"] = 0;
  ExpectError(j, {"vocab_size", "got 0"});
  j = TinyJson(); j["num_key_value_heads"] = 2;
  ExpectError(j, {"num_key_value_heads must be 1 (got 2)"});
  j = TinyJson(); j["n_shared_experts"] = 2;
  ExpectError(j, {"n_shared_experts must be 1 (got 2)"});
  j = TinyJson(); j["qk_rope_head_dim"] = 128;
  ExpectError(j, {"qk_rope_head_dim", "must not exceed head_dim"});
  j = TinyJson(); j["qk_rope_head_dim"] = 15;
  ExpectError(j, {"qk_rope_head_dim", "15", "even"});
  j = TransformersJson(); j["partial_rotary_factor"] = 0.3;
  ExpectError(j, {"partial_rotary_factor", "whole number"});
  j = TinyJson(); j["index_head_dim"] = 8;
  ExpectError(j, {"index_head_dim", "rope dim"});
  j = TinyJson(); j["o_groups"] = 3;
  ExpectError(j, {"o_groups", "must divide num_attention_heads"});
  j = TinyJson(); j["num_experts_per_tok"] = 9;
  ExpectError(j, {"num_experts_per_tok", "must not exceed n_routed_experts"});
  j = TransformersJson(); j["layer_types"].erase(0);
  ExpectError(j, {"layer_types has 4 entries but num_hidden_layers is 5"});
  j = TransformersJson(); j["layer_types"][1] = "full_attention";
  ExpectError(j, {"layer_types", "'full_attention'"});
  j = TransformersJson(); j["mlp_layer_types"].push_back("moe");
  ExpectError(j, {"mlp_layer_types has 6 entries"});
  j = TransformersJson(); j["mlp_layer_types"][0] = "dense";
  ExpectError(j, {"mlp_layer_types", "'dense'"});
  j = TinyJson(); j["compress_ratios"][2] = 64;
  ExpectError(j, {"compress_ratios", "entry 2 is 64", "0, 4 (CSA) and 128 (HCA)"});
  j = TinyJson(); j["compress_ratios"] = {0, 4};
  ExpectError(j, {"compress_ratios", "fewer than num_hidden_layers"});
  j = TinyJson(); j["compress_ratios"] = "0,4";
  ExpectError(j, {"compress_ratios", "list of integers"});
  j = TransformersJson(); j["compress_rates"] = {{"sliding_attention", 4}};
  ExpectError(j, {"compress_rates.sliding_attention"});
  j = TransformersJson(); j["compress_rates"] = {{"compressed_sparse_attention", 128}};
  ExpectError(j, {"compress_rates", "must differ"});
  j = TinyJson(); j["scoring_func"] = "relu";
  ExpectError(j, {"scoring_func", "'relu'"});
  j = TinyJson(); j["rope_scaling"]["type"] = "longrope";
  ExpectError(j, {"rope_scaling.rope_type", "'longrope'"});
  j = TinyJson(); j["rope_scaling"].erase("factor");
  ExpectError(j, {"rope_scaling.factor"});
  j = TransformersJson(); j["rope_parameters"].erase("main");
  ExpectError(j, {"rope_parameters", "'main' and 'compress'"});
  j = TransformersJson(); j["rope_parameters"]["compress"]["rope_theta"] = "big";
  ExpectError(j, {"rope_parameters.compress.rope_theta", "must be a number"});
  j = TinyJson(); j["quantization_config"]["quant_method"] = "awq";
  ExpectError(j, {"quantization_config.quant_method", "'awq'"});
  j = TinyJson(); j["quantization_config"]["weight_block_size"] = {128};
  ExpectError(j, {"quantization_config.weight_block_size"});
  j = TinyJson(); j["expert_dtype"] = "int4";
  ExpectError(j, {"expert_dtype", "'int4'"});
  j = TinyJson(); j["dspark_target_layer_ids"] = {2, 3, 5};
  ExpectError(j, {"dspark_target_layer_ids", "entry 5"});
  // Found by fuzz_config: without the noise token a DSpark config parsed, and ModelConfigToJson then wrote
  // dspark_noise_token_id -1, which does not parse.
  j = TinyJson(); j.erase("dspark_noise_token_id");
  ExpectError(j, {"dspark_noise_token_id", "dspark_block_size"});
  j = TinyJson(); j["model_type"] = "llama";
  ExpectError(j, {"model_type", "llama"});
  j = TinyJson(); j["eos_token_id"] = 5000;
  ExpectError(j, {"eos_token_id"});
  j = TinyJson(); j["tie_word_embeddings"] = "no";
  ExpectError(j, {"tie_word_embeddings", "true or false"});
  j = TinyJson(); j["hc_mult"] = 0;
  ExpectError(j, {"hc_mult"});
  j = TinyJson(); j["expert_dtype"] = "fp4"; j["moe_intermediate_size"] = 63;
  ExpectError(j, {"expert_dtype", "even"});
  EXPECT_THAT(std::string(ParseModelConfig("{oops", "cfg.json").status().message()),
              AllOf(HasSubstr("cfg.json"), HasSubstr("not valid JSON")));
  EXPECT_THAT(std::string(ParseModelConfig("[1]", "cfg.json").status().message()), HasSubstr("not a JSON object"));
  EXPECT_THAT(std::string(LoadModelConfig("/nonexistent/dir").status().message()), HasSubstr("/nonexistent/dir"));
}

TEST(Config, EosList) {
  json j = TinyJson();
  j["eos_token_id"] = {1, 7};
  auto c = Parse(j);
  ASSERT_OK(c);
  EXPECT_EQ(c->eos_token_id, 1);
}

TEST(Config, JsonRoundTrip) {
  for (const std::string& file : {kData + "/tiny-v4/config.json", kData + "/v4-flash-0731.config.json"}) {
    auto a = LoadModelConfig(file);
    ASSERT_OK(a);
    auto b = ParseModelConfig(ModelConfigToJson(*a), "roundtrip");
    ASSERT_OK(b);
    EXPECT_EQ(a->layer_types, b->layer_types);
    EXPECT_EQ(a->mlp_layer_types, b->mlp_layer_types);
    EXPECT_EQ(a->extra_compress_ratios, b->extra_compress_ratios);
    EXPECT_EQ(a->rope_dim, b->rope_dim);
    EXPECT_EQ(a->dspark_target_layer_ids, b->dspark_target_layer_ids);
    EXPECT_EQ(a->expert_dtype, b->expert_dtype);
    EXPECT_EQ(a->fp8_dense, b->fp8_dense);
    EXPECT_EQ(RopeInvFreq(a->rope_compress, a->rope_dim), RopeInvFreq(b->rope_compress, b->rope_dim));
  }
  // Hash layers that are not a prefix are written as mlp_layer_types.
  auto c = Parse(TransformersJson());
  ASSERT_OK(c);
  c->mlp_layer_types = {MoeType::kScored, MoeType::kHash, MoeType::kScored, MoeType::kHash, MoeType::kScored};
  c->hca_rate = 8;
  auto d = ParseModelConfig(ModelConfigToJson(*c), "roundtrip");
  ASSERT_OK(d);
  EXPECT_EQ(d->mlp_layer_types, c->mlp_layer_types);
  EXPECT_EQ(d->hca_rate, 8);
  EXPECT_EQ(d->layer_types, c->layer_types);
}

}  // namespace
}  // namespace numoe
