#include "common/grpc_status.h"

namespace numoe {

grpc::Status ToGrpcStatus(const Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

Status FromGrpcStatus(const grpc::Status& status, const std::string& what) {
  if (status.ok()) return absl::OkStatus();
  const std::string message =
      what.empty() ? status.error_message() : absl::StrCat(what, ": ", status.error_message());
  return Status(static_cast<absl::StatusCode>(status.error_code()), message);
}

}  // namespace numoe
