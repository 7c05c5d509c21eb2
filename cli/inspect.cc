// numoe inspect: describe a checkpoint (--model DIR: config + every tensor, validated) or a config alone
// (--config FILE: shape-only arithmetic). Prints the architecture, tensor counts and bytes by dtype, and
// the memory split that deployment cares about: routed experts (each CPU worker's copy) vs everything else
// (the GPU service's share), and the routed-expert bytes read per decoded token. GB = 1e9 bytes.
#include <cstdio>
#include <iostream>
#include <map>
#include <sstream>
#include <string>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cli/commands.h"
#include "common/args.h"
#include "common/checkpoint.h"
#include "common/config.h"
#include "nlohmann/json.hpp"

namespace numoe::cli {
namespace {

using json = nlohmann::json;

std::string Bytes(int64_t b) {
  const double x = static_cast<double>(b);
  if (x >= 1e11) return absl::StrFormat("%.1f GB", x / 1e9);
  if (x >= 1e9) return absl::StrFormat("%.2f GB", x / 1e9);
  if (x >= 1e6) return absl::StrFormat("%.2f MB", x / 1e6);
  if (x >= 1e3) return absl::StrFormat("%.1f KB", x / 1e3);
  return absl::StrFormat("%d B", b);
}

std::string Params(int64_t p) {
  const double x = static_cast<double>(p);
  if (x >= 1e9) return absl::StrFormat("%.2fB", x / 1e9);
  if (x >= 1e6) return absl::StrFormat("%.2fM", x / 1e6);
  if (x >= 1e3) return absl::StrFormat("%.1fK", x / 1e3);
  return absl::StrFormat("%d", p);
}

const char* ScoringName(ScoringFunc f) {
  switch (f) {
    case ScoringFunc::kSqrtSoftplus:
      return "sqrtsoftplus";
    case ScoringFunc::kSoftmax:
      return "softmax";
    case ScoringFunc::kSigmoid:
      return "sigmoid";
  }
  return "?";
}

std::string RopeText(const RopeConfig& r) {
  if (!r.yarn) return absl::StrFormat("theta %g", r.theta);
  return absl::StrFormat("theta %g, YaRN x%g (original %d, beta %g/%g)", r.theta, r.factor,
                         r.original_max_position_embeddings, r.beta_fast, r.beta_slow);
}

json RopeJson(const RopeConfig& r) {
  json j = {{"theta", r.theta}, {"yarn", r.yarn}};
  if (r.yarn) {
    j["factor"] = r.factor;
    j["original_max_position_embeddings"] = r.original_max_position_embeddings;
    j["beta_fast"] = r.beta_fast;
    j["beta_slow"] = r.beta_slow;
  }
  return j;
}

std::string StagesKind(const ModelConfig& c) { return c.dspark_block_size > 0 ? "DSpark" : "MTP"; }

json ArchitectureJson(const ModelConfig& c, int64_t stages) {
  std::vector<std::string> attn, moe;
  for (AttnType t : c.layer_types) attn.push_back(AttnTypeName(t));
  for (MoeType t : c.mlp_layer_types) moe.push_back(MoeTypeName(t));
  json j = {
      {"num_hidden_layers", c.num_hidden_layers},
      {"layers_by_attention",
       {{"sliding", c.NumLayersOf(AttnType::kSliding)}, {"csa", c.NumLayersOf(AttnType::kCSA)},
        {"hca", c.NumLayersOf(AttnType::kHCA)}}},
      {"layers_by_moe", {{"hash", c.NumLayersOf(MoeType::kHash)}, {"scored", c.NumLayersOf(MoeType::kScored)}}},
      {"layer_types", attn},
      {"mlp_layer_types", moe},
      {"csa_rate", c.csa_rate},
      {"hca_rate", c.hca_rate},
      {"hidden_size", c.hidden_size},
      {"vocab_size", c.vocab_size},
      {"num_attention_heads", c.num_attention_heads},
      {"head_dim", c.head_dim},
      {"rope_dim", c.rope_dim},
      {"q_lora_rank", c.q_lora_rank},
      {"o_groups", c.o_groups},
      {"o_lora_rank", c.o_lora_rank},
      {"sliding_window", c.sliding_window},
      {"index_n_heads", c.index_n_heads},
      {"index_head_dim", c.index_head_dim},
      {"index_topk", c.index_topk},
      {"n_routed_experts", c.n_routed_experts},
      {"num_experts_per_tok", c.num_experts_per_tok},
      {"n_shared_experts", c.n_shared_experts},
      {"moe_intermediate_size", c.moe_intermediate_size},
      {"scoring_func", ScoringName(c.scoring_func)},
      {"hc_mult", c.hc_mult},
      {"rope_main", RopeJson(c.rope_main)},
      {"rope_compress", RopeJson(c.rope_compress)},
      {"fp8_dense", c.fp8_dense},
      {"expert_dtype", c.expert_dtype},
      {"mtp_stages", stages},
      {"mtp_kind", stages > 0 ? StagesKind(c) : "none"},
  };
  if (c.dspark_block_size > 0) {
    j["dspark"] = {{"block_size", c.dspark_block_size},
                   {"noise_token_id", c.dspark_noise_token_id},
                   {"markov_rank", c.dspark_markov_rank},
                   {"target_layer_ids", c.dspark_target_layer_ids}};
  }
  return j;
}

void PrintArchitecture(std::ostream& out, const ModelConfig& c, int64_t stages) {
  std::string schedule;
  for (AttnType t : c.layer_types) schedule += t == AttnType::kSliding ? 'S' : t == AttnType::kCSA ? 'C' : 'H';
  std::string moe;
  for (MoeType t : c.mlp_layer_types) moe += t == MoeType::kHash ? 'h' : 'm';
  out << "architecture: DeepSeek-V4\n";
  out << absl::StrFormat("  layers: %d (sliding %d, CSA %d at rate %d, HCA %d at rate %d)\n", c.num_hidden_layers,
                         c.NumLayersOf(AttnType::kSliding), c.NumLayersOf(AttnType::kCSA), c.csa_rate,
                         c.NumLayersOf(AttnType::kHCA), c.hca_rate);
  out << "  attention schedule: " << schedule << "  (S sliding, C CSA, H HCA)\n";
  out << absl::StrFormat("  MoE: %d hash-routed + %d scored layers (%s); %d routed experts, top-%d, + %d shared; "
                         "expert width %d; scoring %s\n",
                         c.NumLayersOf(MoeType::kHash), c.NumLayersOf(MoeType::kScored), moe, c.n_routed_experts,
                         c.num_experts_per_tok, c.n_shared_experts, c.moe_intermediate_size,
                         ScoringName(c.scoring_func));
  out << absl::StrFormat("  hidden %d, vocab %d, %d heads x %d (rope %d), q_lora %d, %d output groups x rank %d, "
                         "sliding window %d, mHC x%d\n",
                         c.hidden_size, c.vocab_size, c.num_attention_heads, c.head_dim, c.rope_dim, c.q_lora_rank,
                         c.o_groups, c.o_lora_rank, c.sliding_window, c.hc_mult);
  out << absl::StrFormat("  indexer: %d heads x %d, top-%d\n", c.index_n_heads, c.index_head_dim, c.index_topk);
  out << "  rope: main " << RopeText(c.rope_main) << "; compress " << RopeText(c.rope_compress) << "\n";
  out << "  weights: "
      << (c.fp8_dense ? absl::StrFormat("FP8 E4M3 dense (%dx%d blocks, %s scales)", c.fp8_block_out, c.fp8_block_in,
                                        c.fp8_scale_fmt)
                      : std::string("BF16 dense"))
      << ", " << (c.expert_dtype == "fp4" ? "MXFP4" : c.expert_dtype == "fp8" ? "FP8" : "BF16") << " routed experts\n";
  if (stages == 0) {
    out << "  MTP/DSpark stages: none\n";
  } else if (c.dspark_block_size > 0) {
    out << absl::StrFormat("  DSpark stages: %d (block %d, noise token %d, Markov rank %d, target layers [%s])\n",
                           stages, c.dspark_block_size, c.dspark_noise_token_id, c.dspark_markov_rank,
                           absl::StrJoin(c.dspark_target_layer_ids, ", "));
  } else {
    out << absl::StrFormat("  MTP stages: %d\n", stages);
  }
}

json MemoryJson(const ModelFootprint& fp) {
  return {{"routed_expert_bytes", fp.routed_expert_bytes},
          {"mtp_routed_expert_bytes", fp.mtp_routed_expert_bytes},
          {"other_bytes", fp.other_bytes},
          {"routed_bytes_per_token", fp.routed_bytes_per_token},
          {"total_params", fp.total_params},
          {"active_params_per_token", fp.active_params_per_token}};
}

void PrintMemory(std::ostream& out, const ModelConfig& c, const ModelFootprint& fp, int64_t stages) {
  out << "memory (GB = 1e9 bytes):\n";
  out << "  routed experts: " << Bytes(fp.routed_expert_bytes) << "  (" << fp.routed_expert_bytes
      << " bytes; main layers; what each CPU worker holds)\n";
  if (stages > 0)
    out << "  " << StagesKind(c) << " routed experts: " << Bytes(fp.mtp_routed_expert_bytes) << "  ("
        << fp.mtp_routed_expert_bytes << " bytes)\n";
  out << "  everything else: " << Bytes(fp.other_bytes) << "  (" << fp.other_bytes
      << " bytes; what the GPU service holds)\n";
  out << "  routed expert bytes per token: " << Bytes(fp.routed_bytes_per_token) << "  (" << fp.routed_bytes_per_token
      << " bytes; top-" << c.num_experts_per_tok << " of " << c.n_routed_experts << " in each of "
      << c.num_hidden_layers << " layers)\n";
  out << "  parameters: " << Params(fp.total_params) << " total, " << Params(fp.active_params_per_token)
      << " active per token\n";
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

struct DTypeCount {
  int64_t count = 0, bytes = 0;
};

int Fail(const Status& s) {
  std::cerr << "numoe inspect: " << s.message() << "\n";
  return 1;
}

}  // namespace

int RunInspect(int argc, char** argv) {
  ArgParser parser(argv[0],
                   "Describe a DeepSeek-V4 checkpoint (--model DIR: config + tensors, validated) or a config alone "
                   "(--config FILE: shape-only arithmetic).");
  std::string model, config_path;
  bool as_json = false;
  parser.AddString("model", "DIR", "checkpoint directory (config.json + safetensors shards)", &model);
  parser.AddString("config", "FILE", "a config.json (or a directory holding one); no weights needed", &config_path);
  parser.AddFlag("json", "print JSON instead of text", &as_json);
  parser.AddEpilog(
      "\nExamples:\n  numoe inspect --model tests/data/tiny-v4\n"
      "  numoe inspect --config tests/data/v4-flash-0731.config.json --json\n"
      "Exit code 1 on any loading/validation error (the message goes to stderr).\n");
  int rc = 0;
  if (!parser.ParseOrExit(argc, argv, &rc)) return rc;
  if (model.empty() == config_path.empty()) {
    std::cerr << argv[0] << ": give exactly one of --model DIR or --config FILE (see --help)\n";
    return 2;
  }

  ModelConfig config;
  int64_t stages = 0;
  ModelFootprint fp;
  std::unique_ptr<Checkpoint> ck;
  if (!model.empty()) {
    auto opened = Checkpoint::Open(model);
    if (!opened.ok()) return Fail(opened.status());
    ck = *std::move(opened);
    config = ck->config();
    stages = ck->mtp_stages();
    fp = StoredFootprint(*ck);
  } else {
    auto loaded = LoadModelConfig(config_path);
    if (!loaded.ok()) return Fail(loaded.status());
    config = *std::move(loaded);
    stages = config.DefaultMtpStages();
    fp = ComputeFootprint(config, stages);
  }

  std::map<std::string, DTypeCount> by_dtype;
  int64_t total_tensors = 0, total_bytes = 0;
  int64_t expected_tensors = 0;
  if (ck) {
    for (const auto& name : ck->store().Names()) {
      const TensorView* t = ck->store().Find(name);
      auto& d = by_dtype[std::string(DTypeName(t->dtype))];
      ++d.count;
      d.bytes += static_cast<int64_t>(t->nbytes);
      ++total_tensors;
      total_bytes += static_cast<int64_t>(t->nbytes);
    }
  } else {
    // What the official layout would store for this config (weights and their scales).
    for (const ExpectedTensor& e : ExpectedTensors(config, stages)) {
      const int64_t scale_bytes =
          e.format == WeightFormat::kPlain ? 0 : Numel(e.scale_shape) * static_cast<int64_t>(DTypeSize(e.scale_dtype));
      auto& d = by_dtype[std::string(DTypeName(e.dtype))];
      ++d.count;
      d.bytes += e.stored_bytes - scale_bytes;
      ++expected_tensors;
      if (e.format != WeightFormat::kPlain) {
        auto& s = by_dtype[std::string(DTypeName(e.scale_dtype))];
        ++s.count;
        s.bytes += scale_bytes;
        ++expected_tensors;
      }
    }
  }

  if (as_json) {
    json j = {{"source", model.empty() ? config_path : model},
              {"kind", model.empty() ? "config" : "model"},
              {"architecture", ArchitectureJson(config, stages)},
              {"memory", MemoryJson(fp)}};
    json d = json::object();
    for (const auto& [name, c] : by_dtype) d[name] = {{"count", c.count}, {"bytes", c.bytes}};
    if (ck) {
      j["tensors"] = {{"count", total_tensors}, {"bytes", total_bytes}, {"by_dtype", d},
                      {"files", ck->store().files().size()}};
    } else {
      j["expected_tensors"] = {{"count", expected_tensors}, {"by_dtype", d}};
    }
    std::cout << j.dump(2) << "\n";
    return 0;
  }

  std::ostringstream out;
  if (ck) {
    out << "model: " << model << "  (" << ck->store().files().size() << " safetensors file(s), validated against "
        << "config.json)\n";
  } else {
    out << "config: " << config_path << "  (shape-only; " << StagesKind(config) << " stages from the config: "
        << stages << ")\n";
  }
  PrintArchitecture(out, config, stages);
  if (ck) {
    out << "tensors: " << total_tensors << ", " << Bytes(total_bytes) << "\n";
  } else {
    out << "tensors (expected in the official layout): " << expected_tensors << ", "
        << Bytes(fp.routed_expert_bytes + fp.mtp_routed_expert_bytes + fp.other_bytes) << "\n";
  }
  for (const auto& [name, c] : by_dtype)
    out << absl::StrFormat("  %-8s %7d tensors  %s\n", name, c.count, Bytes(c.bytes));
  PrintMemory(out, config, fp, stages);
  std::cout << out.str();
  return 0;
}

}  // namespace numoe::cli
