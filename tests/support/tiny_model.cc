#include <filesystem>
#include <map>
#include <mutex>

#include "backends/cpu/cpu_model.h"
#include "common/checkpoint.h"
#include "common/status.h"
#include "common/synthetic/presets.h"
#include "common/synthetic/synthetic.h"
#include "tests/support/files.h"
#include "tests/support/fixtures.h"
#include "worker/experts/reference_experts.h"

namespace numoe::test {
namespace {

Status WriteTinyMtp(const std::string& dir) {
  ASSIGN_OR_RETURN(synthetic::Preset preset, synthetic::MakePreset({.preset = "tiny", .drafter = "mtp"}));
  synthetic::SyntheticOptions opt;
  opt.seed = 11;
  opt.mtp_stages = preset.mtp_stages;
  return synthetic::MakeSyntheticCheckpoint(preset.config, dir, opt);
}

}  // namespace

TinyModel::TinyModel() = default;
TinyModel::~TinyModel() = default;
TinyModel::TinyModel(TinyModel&&) noexcept = default;
TinyModel& TinyModel::operator=(TinyModel&&) noexcept = default;

StatusOr<TinyModel*> TinyModel::Get(const TinyModelOptions& options) {
  static std::mutex mu;
  static std::map<std::pair<std::string, bool>, std::unique_ptr<TinyModel>> loaded;
  const bool mtp = options.model == kTinyMtp;
  std::string dir = options.model.starts_with('/') || mtp ? options.model : TestDataDir() + "/" + options.model;
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<TinyModel>& slot = loaded[{dir, options.drafter}];
  if (slot) return slot.get();
  auto m = std::make_unique<TinyModel>();
  TempDir scratch("numoe-tiny-mtp");  // kTinyMtp's files, removed once loaded
  if (mtp) {
    dir = scratch / "model";
    RETURN_IF_ERROR(WriteTinyMtp(dir));
  }
  ASSIGN_OR_RETURN(m->ckpt, Checkpoint::Open(dir));
  ASSIGN_OR_RETURN(m->model, cpu::CpuModel::Create(*m->ckpt, nullptr, {.drafter = options.drafter}));
  ASSIGN_OR_RETURN(m->experts, cpu::ReferenceExperts::Load(*m->ckpt, options.drafter));
  if (std::filesystem::exists(dir + "/golden.safetensors")) {
    ASSIGN_OR_RETURN(m->goldens, Goldens::Load(dir));
  }
  slot = std::move(m);
  return slot.get();
}

}  // namespace numoe::test
