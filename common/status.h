// Status plumbing used across every module boundary (absl::Status / absl::StatusOr).
// Convert to gRPC / HTTP status only at the edge (router, daemons' mains).
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace numoe {
using absl::Status;
using absl::StatusOr;
}  // namespace numoe

#define NUMOE_CONCAT_INNER_(a, b) a##b
#define NUMOE_CONCAT_(a, b) NUMOE_CONCAT_INNER_(a, b)

// RETURN_IF_ERROR(expr): evaluate a Status expression and return it from the caller when not ok.
#define RETURN_IF_ERROR(expr)                                     \
  do {                                                            \
    ::absl::Status numoe_status_ = (expr);                        \
    if (!numoe_status_.ok()) return numoe_status_;                \
  } while (0)

// ASSIGN_OR_RETURN(lhs, expr): lhs = value of a StatusOr expression, or return its error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  NUMOE_ASSIGN_OR_RETURN_IMPL_(NUMOE_CONCAT_(numoe_statusor_, __LINE__), lhs, expr)
#define NUMOE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()
