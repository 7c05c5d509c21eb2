// Files for tests: a scratch directory removed on destruction, whole-file reads and writes.
#pragma once

#include <chrono>
#include <filesystem>
#include <string>

namespace numoe::test {

// A fresh empty directory under the test temp dir (gtest's TempDir(): $TEST_TMPDIR, $TMPDIR or /tmp),
// named `<prefix>-<pid>-<n>` so tests in one process and parallel ctest processes never share one;
// removed with everything in it on destruction, except when the current test has failed or
// NUMOE_KEEP_TEST_LOGS is set: then the logs in it stay for the post-mortem. Move-only.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "numoe");
  TempDir(TempDir&& o) noexcept;
  TempDir& operator=(TempDir&& o) noexcept;
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir();

  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }
  // The path of `name` inside the directory.
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// The whole file as bytes ("" when it cannot be read).
std::string ReadFile(const std::filesystem::path& path);
// Replaces the file's contents with `bytes`; false when it cannot be written.
bool WriteFile(const std::filesystem::path& path, const std::string& bytes);
// Copies a directory's regular files (a fixture) into `to`, owner-writable (fixtures in the source tree
// may be read-only).
void CopyFiles(const std::filesystem::path& from, const std::filesystem::path& to);
// Waits until `path` exists and is non-empty, up to `timeout`; its contents, or "" on timeout.
std::string WaitForFile(const std::filesystem::path& path, std::chrono::milliseconds timeout);

}  // namespace numoe::test
