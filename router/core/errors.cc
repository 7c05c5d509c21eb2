#include "router/core/errors.h"

#include "absl/strings/cord.h"

namespace numoe::router {
namespace {
constexpr char kParamUrl[] = "numoe.dev/param";
}  // namespace

Status WithParam(Status status, absl::string_view param) {
  status.SetPayload(kParamUrl, absl::Cord(param));
  return status;
}

Status InvalidParam(absl::string_view param, absl::string_view message) {
  return WithParam(absl::InvalidArgumentError(message), param);
}

std::string ParamOf(const Status& status) {
  auto p = status.GetPayload(kParamUrl);
  return p ? std::string(*p) : std::string();
}

}  // namespace numoe::router
