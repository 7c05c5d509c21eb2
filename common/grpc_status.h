// absl <-> gRPC status conversion at the edge of every daemon (absl and gRPC share the canonical codes).
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

#include "common/status.h"

namespace numoe {

grpc::Status ToGrpcStatus(const Status& status);
// `what` prefixes the message (the call that failed); empty = the message as it came.
Status FromGrpcStatus(const grpc::Status& status, const std::string& what = "");

}  // namespace numoe
