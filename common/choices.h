// Enumerated options shared by the daemons, `numoe serve`, `numoe plan` and the planner: each enum has one
// name table (ChoiceTable<T>), so its flag vocabulary, its parser and its error message are written once.
//
//   ParseChoice<Backend>("cuda", "--backend")   -> Backend::kCuda
//   ParseChoice<Backend>("gpu", "--backend")    -> InvalidArgument "--backend must be auto, cpu or cuda (got 'gpu')"
//   ChoiceName(Backend::kCpu)                   -> "cpu"
//   ChoiceMetavar<Backend>()                    -> "auto|cpu|cuda" (for --help)
//
// ArgParser::AddEnum<T> (common/args.h) parses a flag through the same table.
#pragma once

#include <span>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace numoe {

template <typename T>
struct Choice {
  T value;
  const char* name;
};

// Specialised once per enum below: `static constexpr Choice<T> kChoices[]`, in the order --help lists them.
template <typename T>
struct ChoiceTable;

// numoe-gpu's model backend. kAuto: kCuda when a CUDA device is present, else kCpu (ResolveBackend).
enum class Backend { kAuto, kCpu, kCuda };
template <>
struct ChoiceTable<Backend> {
  static constexpr Choice<Backend> kChoices[] = {
      {Backend::kAuto, "auto"}, {Backend::kCpu, "cpu"}, {Backend::kCuda, "cuda"}};
};

// Where the model drafter's (DSpark/MTP stages') routed experts run: in every numoe-worker, like the main
// model's, or on numoe-gpu's device (CUDA backend only). One vocabulary for serve, plan, numoe-gpu,
// numoe-worker and the planner.
enum class DrafterExperts { kWorker, kGpu };
template <>
struct ChoiceTable<DrafterExperts> {
  static constexpr Choice<DrafterExperts> kChoices[] = {{DrafterExperts::kWorker, "worker"},
                                                        {DrafterExperts::kGpu, "gpu"}};
};

// numoe-gpu --merge-lanes (gpu_service/merged_step.h): whether decode steps of several workers that wait for
// the model at the same time run as one merged pass. kAuto: where that was measured to pay (gpu::MergeEnabled:
// nowhere yet).
enum class MergeLanes { kAuto, kOff, kOn };
template <>
struct ChoiceTable<MergeLanes> {
  static constexpr Choice<MergeLanes> kChoices[] = {
      {MergeLanes::kAuto, "auto"}, {MergeLanes::kOff, "off"}, {MergeLanes::kOn, "on"}};
};

// --spec: which drafter speculative decoding uses. kAuto: the checkpoint's model drafter when the backend
// runs it, else none (model/spec_policy.h decides). The others name a SpecMethod (common/config.h).
enum class SpecChoice { kAuto, kNone, kDspark, kMtp, kNgram };
template <>
struct ChoiceTable<SpecChoice> {
  static constexpr Choice<SpecChoice> kChoices[] = {{SpecChoice::kAuto, "auto"},
                                                    {SpecChoice::kNone, "none"},
                                                    {SpecChoice::kDspark, "dspark"},
                                                    {SpecChoice::kMtp, "mtp"},
                                                    {SpecChoice::kNgram, "ngram"}};
};

template <typename T>
constexpr std::span<const Choice<T>> Choices() {
  return ChoiceTable<T>::kChoices;
}

template <typename T>
const char* ChoiceName(T value) {
  for (const Choice<T>& c : Choices<T>()) {
    if (c.value == value) return c.name;
  }
  return "?";
}

// "a|b|c".
template <typename T>
std::string ChoiceMetavar() {
  std::string out;
  for (const Choice<T>& c : Choices<T>()) absl::StrAppend(&out, out.empty() ? "" : "|", c.name);
  return out;
}

// "a, b or c".
template <typename T>
std::string ChoiceList() {
  const auto all = Choices<T>();
  std::string out;
  for (size_t i = 0; i < all.size(); ++i) {
    absl::StrAppend(&out, i == 0 ? "" : (i + 1 == all.size() ? " or " : ", "), all[i].name);
  }
  return out;
}

// `what` names the flag or field in the error: "<what> must be a, b or c (got 'x')".
template <typename T>
StatusOr<T> ParseChoice(const std::string& text, const std::string& what) {
  for (const Choice<T>& c : Choices<T>()) {
    if (text == c.name) return c.value;
  }
  return absl::InvalidArgumentError(absl::StrCat(what, " must be ", ChoiceList<T>(), " (got '", text, "')"));
}

// Backend::kAuto -> kCuda when `cuda_devices` > 0, else kCpu; the others unchanged. Callers pass
// CudaDeviceCount() (backends/cuda/cuda_model.h), which is 0 in a build without CUDA.
inline Backend ResolveBackend(Backend requested, int cuda_devices) {
  if (requested != Backend::kAuto) return requested;
  return cuda_devices > 0 ? Backend::kCuda : Backend::kCpu;
}

}  // namespace numoe
