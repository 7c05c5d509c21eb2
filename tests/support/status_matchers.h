// Status checks for tests: ASSERT_OK / EXPECT_OK on an absl::Status, an absl::StatusOr<T> or a
// grpc::Status, and ASSERT_OK_AND_ASSIGN(lhs, expr) for a StatusOr. On failure they print the expression
// and the status (code and message), so a failing test says why without a hand-written `<< x.status()`.
// Extra context streams in as with any gtest assertion: ASSERT_OK(s) << "while loading " << dir.
#pragma once

#include <gtest/gtest.h>

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace numoe::test::internal {

// gtest predicate-formatter: success when `value.ok()`, else the expression and the status it holds.
// Works for anything with ok(): absl::Status, absl::StatusOr<T> (prints status()), grpc::Status (prints
// the code and error_message(); no gRPC header is needed here).
template <typename T>
::testing::AssertionResult IsOk(const char* expr, const T& value) {
  if (value.ok()) return ::testing::AssertionSuccess();
  ::testing::AssertionResult failure = ::testing::AssertionFailure();
  failure << expr << " is not OK: ";
  if constexpr (requires { value.status(); }) {
    failure << value.status();
  } else if constexpr (requires { value.error_message(); }) {
    failure << "gRPC status " << static_cast<int>(value.error_code()) << ": " << value.error_message();
  } else {
    failure << value;
  }
  return failure;
}

}  // namespace numoe::test::internal

#define ASSERT_OK(expr) ASSERT_PRED_FORMAT1(::numoe::test::internal::IsOk, expr)
#define EXPECT_OK(expr) EXPECT_PRED_FORMAT1(::numoe::test::internal::IsOk, expr)

// ASSERT_OK_AND_ASSIGN(lhs, expr): evaluates the StatusOr `expr` once; on error fails the test (printing the
// expression and status) and returns from the function; else moves the value into `lhs`, which may be a
// declaration (`auto ckpt`, `const Foo& x` is not allowed: the temporary dies at the end of the macro).
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  NUMOE_TEST_ASSERT_OK_AND_ASSIGN_(NUMOE_TEST_CONCAT_(numoe_test_statusor_, __LINE__), lhs, expr)

#define NUMOE_TEST_CONCAT_INNER_(a, b) a##b
#define NUMOE_TEST_CONCAT_(a, b) NUMOE_TEST_CONCAT_INNER_(a, b)
#define NUMOE_TEST_ASSERT_OK_AND_ASSIGN_(tmp, lhs, expr) \
  auto tmp = (expr);                                     \
  GTEST_ASSERT_(::numoe::test::internal::IsOk(#expr, tmp), GTEST_FATAL_FAILURE_); \
  lhs = std::move(tmp).value()
