// Request errors that name the offending request field. The field travels as a Status payload, so the
// error stays an absl::Status inside the router and becomes OpenAI's {"error": {..., "param"}} (REST) or
// the gRPC message text only at the edge.
#pragma once

#include <string>
#include "absl/strings/string_view.h"

#include "common/status.h"

namespace numoe::router {

// InvalidArgument naming `param` (e.g. "max_tokens", "messages[2].content").
Status InvalidParam(absl::string_view param, absl::string_view message);
// Any status with a param attached.
Status WithParam(Status status, absl::string_view param);
// The attached param, "" when none.
std::string ParamOf(const Status& status);

}  // namespace numoe::router
