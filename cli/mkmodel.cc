// numoe mkmodel: writes a random-weight checkpoint in the official DeepSeek-V4 layout (common/synthetic/presets.h
// for the shapes, synthetic.h for the storage and the values, synthetic_tokenizer.h for the tokenizer).
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cli/commands.h"
#include "common/args.h"
#include "common/checkpoint.h"
#include "common/synthetic/presets.h"
#include "common/synthetic/synthetic.h"
#include "common/synthetic/synthetic_tokenizer.h"

namespace numoe::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr int64_t kShardTargetBytes = int64_t{4} << 30;  // official shards are ~3.4 GB
constexpr int64_t kTokenizerSlackBytes = int64_t{16} << 20;

int Fail(const Status& s) {
  std::fprintf(stderr, "numoe mkmodel: %s\n", std::string(s.message()).c_str());
  return 1;
}

// Bytes in decimal units (GB = 1e9 bytes), as inspect prints them.
std::string Gb(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1e9) return absl::StrFormat("%.2f GB", b / 1e9);
  if (b >= 1e6) return absl::StrFormat("%.2f MB", b / 1e6);
  return absl::StrFormat("%.1f KB", b / 1e3);
}

// Files of a checkpoint directory that mkmodel writes (or wrote with other flags): what --force replaces.
bool IsCheckpointFile(const std::string& name) {
  if (name == "config.json" || name == "generation_config.json" || name == "tokenizer.json" ||
      name == "tokenizer_config.json" || name == "model.safetensors.index.json" ||
      name == "model.safetensors.index.json.tmp")
    return true;
  auto ends = [&](std::string_view s) { return name.size() >= s.size() && name.rfind(s) == name.size() - s.size(); };
  return name.rfind("model", 0) == 0 && (ends(".safetensors") || ends(".safetensors.tmp"));
}

// Checks --out: absent or empty, or (with --force) holding only files that mkmodel writes. `replace` gets
// those files and `reclaim` the bytes their removal frees (removed later, once the space check passed).
Status CheckOut(const std::string& out, bool force, std::vector<fs::path>* replace, int64_t* reclaim) {
  *reclaim = 0;
  std::error_code ec;
  if (!fs::exists(out, ec)) return absl::OkStatus();
  if (!fs::is_directory(out, ec)) return absl::InvalidArgumentError(absl::StrCat("--out ", out, " is not a directory"));
  std::vector<fs::path> others;
  for (const auto& entry : fs::directory_iterator(out, ec)) {
    const bool ours = IsCheckpointFile(entry.path().filename().string()) && entry.is_regular_file();
    (ours ? *replace : others).push_back(entry.path());
  }
  if (ec) return absl::PermissionDeniedError(absl::StrCat("--out ", out, ": cannot list: ", ec.message()));
  if (replace->empty() && others.empty()) return absl::OkStatus();
  if (!force) {
    return absl::AlreadyExistsError(absl::StrCat("--out ", out, " is not empty (", replace->size() + others.size(),
                                                 " entries); pass --force to replace a checkpoint there"));
  }
  if (!others.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--out ", out, " holds files that are not part of a checkpoint (e.g. ",
                     others.front().filename().string(), "); --force only replaces checkpoint files"));
  }
  for (const fs::path& f : *replace) *reclaim += static_cast<int64_t>(fs::file_size(f, ec));
  return absl::OkStatus();
}

// Free bytes for an unprivileged writer on the filesystem that holds `path` (or its nearest existing parent).
StatusOr<int64_t> FreeBytes(const std::string& path) {
  fs::path p = fs::absolute(path);
  std::error_code ec;
  while (!p.empty() && !fs::exists(p, ec)) p = p.parent_path();
  struct statvfs st;
  if (p.empty() || ::statvfs(p.c_str(), &st) != 0)
    return absl::NotFoundError(absl::StrCat("--out ", path, ": cannot find its filesystem"));
  return static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
}

// A progress bar on stderr: redrawn in place on a terminal (5 times a second), otherwise a line every 10 s and
// one at the end (logs stay short).
class Progress {
 public:
  explicit Progress(bool quiet) : quiet_(quiet), tty_(::isatty(2) == 1), start_(Clock::now()), last_(start_) {}
  void Update(int64_t done, int64_t total) {
    if (quiet_) return;
    const auto now = Clock::now();
    const bool finished = done >= total;
    if (!finished && now - last_ < (tty_ ? std::chrono::milliseconds(200) : std::chrono::milliseconds(10000))) return;
    if (finished && done_printed_) return;
    done_printed_ = finished;
    last_ = now;
    const double s = std::chrono::duration<double>(now - start_).count();
    const double rate = s > 0 ? static_cast<double>(done) / s : 0.0;
    const double eta = rate > 0 ? static_cast<double>(total - done) / rate : 0.0;
    const double frac = total > 0 ? static_cast<double>(done) / static_cast<double>(total) : 1.0;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(frac * kWidth);
    std::string bar(static_cast<size_t>(filled), '=');
    if (filled < kWidth) bar += '>';
    bar.resize(kWidth, ' ');
    std::fprintf(stderr, "%s[%s] %s / %s  %.2f GB/s  ETA %d:%02d%s", tty_ ? "\r" : "", bar.c_str(), Gb(done).c_str(),
                 Gb(total).c_str(), rate / 1e9, static_cast<int>(eta) / 60, static_cast<int>(eta) % 60,
                 tty_ ? (finished ? "\n" : "   ") : "\n");
    std::fflush(stderr);
  }
  double seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }

 private:
  bool quiet_, tty_;
  Clock::time_point start_, last_;
  bool done_printed_ = false;
};

std::string ScheduleText(const ModelConfig& c) {
  std::string s;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    absl::StrAppend(&s, i ? ", " : "", AttnTypeName(c.layer_types[i]),
                    c.mlp_layer_types[i] == MoeType::kHash ? "+hash" : "");
  }
  return s;
}

std::string DrafterText(const synthetic::Preset& p) {
  if (p.drafter == "dspark") return absl::StrCat("dspark (", p.mtp_stages, " stages)");
  if (p.drafter == "mtp") return "mtp (1 block)";
  return "none";
}

}  // namespace

int RunMkmodel(int argc, char** argv) {
  std::string preset_name, out, drafter;
  int64_t layers = 0, experts = 0, seed = 1, shards = 0, dspark_stages = -1, threads = 0;
  bool force = false, quiet = false, no_verify = false, dry_run = false;
  ArgParser p(argv[0],
              "Write a random-weight DeepSeek-V4 checkpoint in the official format: config.json, sharded\n"
              "safetensors + index (FP8 E4M3 dense weights with E8M0 128x128 block scales, MXFP4 routed experts\n"
              "with E8M0 per-32 scales, BF16/F32 where the official files use them), tokenizer files. Streams to\n"
              "disk (memory stays small at any size); the same flags and seed give the same bytes.");
  p.AddString("preset", "NAME",
              "tiny (tests/data/tiny-v4's shapes, its tokenizer) or v4-flash (DeepSeek-V4-Flash-0731's full widths "
              "with fewer layers, a generated 129280-token tokenizer)",
              &preset_name, true);
  p.AddString("out", "DIR", "output directory (created; must be empty unless --force)", &out, true);
  p.AddInt("layers", "N", "main layers (default: tiny 5, v4-flash 2 = 9.3 GB, which a 24 GB machine can serve)", &layers,
           1, 1024);
  p.AddInt("experts", "E", "routed experts per layer (default: the preset's, tiny 8, v4-flash 256)", &experts, 1, 4096);
  p.AddInt("seed", "S", "weight seed", &seed, 0, INT64_MAX);
  p.AddInt("shards", "K", "safetensors shards (default: tiny 2, v4-flash one per ~4 GiB)", &shards, 1, 1000);
  p.AddString("drafter", "none|mtp|dspark",
              "the checkpoint's drafter: none, mtp (preview-Flash layout: one mtp.0 block with e_proj/h_proj, "
              "no dspark_* config) or dspark (0731 layout, --dspark-stages stages, default 3) (default: the "
              "preset's, tiny dspark, v4-flash none)",
              &drafter);
  p.AddInt("dspark-stages", "N", "DSpark drafter stages (default: tiny 3, v4-flash 0 to save disk)", &dspark_stages,
           0, 16);
  p.AddInt("threads", "N", "encoding threads (default: all cores; the bytes do not depend on it)", &threads, 1, 4096);
  p.AddFlag("force", "replace a checkpoint already in --out (other files there are an error)", &force);
  p.AddFlag("no-verify", "skip opening the result with the checkpoint loader at the end", &no_verify);
  p.AddFlag("quiet", "no progress bar or summary", &quiet);
  p.AddFlag("dry-run", "print what would be written (shapes, bytes, shards) and stop", &dry_run);
  p.AddEpilog(
      "\nThe v4-flash layer schedule is Flash's, truncated: 2 sliding layers, then CSA/HCA alternating (with 3+\n"
      "layers at least one CSA and one HCA: 3 = sliding, CSA, HCA); the first min(3, layers) are hash-routed.\n"
      "Sizes: v4-flash is 3.42 GB of routed experts (256 experts) + 0.14-0.19 GB of dense weights per layer,\n"
      "plus 2.12 GB of BF16 embedding and head.\n"
      "\nExamples:\n"
      "  numoe mkmodel --preset tiny --out /tmp/tiny --seed 7\n"
      "  numoe mkmodel --preset tiny --drafter mtp --out /tmp/tiny-mtp\n"
      "  numoe mkmodel --preset v4-flash --layers 2 --out /data/v4-flash-2l\n"
      "  numoe mkmodel --preset v4-flash --layers 4 --experts 32 --out /tmp/v4-narrow\n");
  int rc = 0;
  if (!p.ParseOrExit(argc, argv, &rc)) return rc;

  auto preset = synthetic::MakePreset(
      {.preset = preset_name,
       .layers = layers,
       .experts = experts,
       .dspark_stages = p.given("dspark-stages") ? dspark_stages : -1,
       .drafter = drafter});
  if (!preset.ok()) return Fail(preset.status());
  const ModelConfig& cfg = preset->config;

  synthetic::SyntheticOptions opt;
  opt.seed = static_cast<uint64_t>(seed);
  opt.mtp_stages = preset->mtp_stages;
  opt.threads = threads > 0 ? static_cast<int>(threads) : std::max(1u, std::thread::hardware_concurrency());
  if (shards > 0) {
    opt.num_shards = static_cast<int>(shards);
  } else if (preset_name == "tiny") {
    opt.num_shards = 2;
  } else {
    opt.num_shards = 1;
    auto one = synthetic::SyntheticCheckpointBytes(cfg, opt);
    if (!one.ok()) return Fail(one.status());
    opt.num_shards = static_cast<int>(std::max<int64_t>(1, (*one + kShardTargetBytes - 1) / kShardTargetBytes));
  }
  auto total = synthetic::SyntheticCheckpointBytes(cfg, opt);
  if (!total.ok()) return Fail(total.status());

  if (dry_run) {
    const ModelFootprint dfp = ComputeFootprint(cfg, preset->mtp_stages);
    std::printf("%s preset: %lld layers [%s], %lld experts top-%lld, drafter %s; %s in %d shard(s) "
                "(routed experts %s, %s read per token)\n",
                preset_name.c_str(), static_cast<long long>(cfg.num_hidden_layers), ScheduleText(cfg).c_str(),
                static_cast<long long>(cfg.n_routed_experts), static_cast<long long>(cfg.num_experts_per_tok),
                DrafterText(*preset).c_str(), Gb(*total).c_str(), opt.num_shards,
                Gb(dfp.routed_expert_bytes).c_str(), Gb(dfp.routed_bytes_per_token).c_str());
    return 0;
  }
  std::vector<fs::path> replace;
  int64_t reclaim = 0;
  if (Status s = CheckOut(out, force, &replace, &reclaim); !s.ok()) return Fail(s);
  auto free_bytes = FreeBytes(out);
  if (!free_bytes.ok()) return Fail(free_bytes.status());
  const int64_t need = *total + kTokenizerSlackBytes;
  if (*free_bytes + reclaim < need) {
    return Fail(absl::ResourceExhaustedError(absl::StrCat("the checkpoint needs ", Gb(need), " but the filesystem of ",
                                                          out, " has ", Gb(*free_bytes + reclaim), " free",
                                                          reclaim > 0 ? " (counting the files --force replaces)" : "")));
  }
  for (const fs::path& f : replace) {
    std::error_code ec;
    if (!fs::remove(f, ec) || ec) {
      return Fail(absl::PermissionDeniedError(absl::StrCat(f.string(), ": cannot remove: ", ec.message())));
    }
  }

  const ModelFootprint fp = ComputeFootprint(cfg, preset->mtp_stages);
  if (!quiet) {
    std::fprintf(stderr,
                 "numoe mkmodel: %s preset, %lld layers [%s], %lld experts top-%lld of %lldx%lld, vocab %lld, drafter %s, "
                 "seed %lld\n  %s in %d shard(s) (routed experts %s, %s read per token), %s free; %d thread(s)\n",
                 preset_name.c_str(), static_cast<long long>(cfg.num_hidden_layers), ScheduleText(cfg).c_str(),
                 static_cast<long long>(cfg.n_routed_experts), static_cast<long long>(cfg.num_experts_per_tok),
                 static_cast<long long>(cfg.moe_intermediate_size), static_cast<long long>(cfg.hidden_size),
                 static_cast<long long>(cfg.vocab_size), DrafterText(*preset).c_str(),
                 static_cast<long long>(seed), Gb(*total).c_str(), opt.num_shards, Gb(fp.routed_expert_bytes).c_str(),
                 Gb(fp.routed_bytes_per_token).c_str(), Gb(*free_bytes + reclaim).c_str(), opt.threads);
  }
  Progress progress(quiet);
  opt.progress = [&](int64_t done, int64_t all) { progress.Update(done, all); };
  if (Status s = synthetic::MakeSyntheticCheckpoint(cfg, out, opt); !s.ok()) return Fail(s);
  const Status tok = preset_name == "tiny" ? synthetic::WriteTinyTokenizer(out)
                                           : synthetic::WriteSyntheticTokenizer(out, cfg.vocab_size);
  if (!tok.ok()) return Fail(tok);
  const double secs = progress.seconds();

  if (!no_verify) {
    auto ck = Checkpoint::Open(out);
    if (!ck.ok()) return Fail(absl::InternalError(absl::StrCat("the written checkpoint does not load: ", ck.status().message())));
  }
  if (!quiet) {
    std::fprintf(stderr, "numoe mkmodel: wrote %s (%s) in %.1f s, %.2f GB/s%s\n", out.c_str(), Gb(*total).c_str(), secs,
                 secs > 0 ? *total / secs / 1e9 : 0.0, no_verify ? "" : "; it loads as a checkpoint");
  }
  return 0;
}

}  // namespace numoe::cli
