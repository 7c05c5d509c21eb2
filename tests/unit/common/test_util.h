// Helpers shared by the common/ unit tests: scratch directories and raw file bytes.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace numoe::test {

// A fresh directory under the test temp dir, removed with everything in it on destruction.
class ScratchDir {
 public:
  ScratchDir() {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::path(::testing::TempDir()) /
            ("numoe_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  std::string path() const { return path_.string(); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

inline void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// 8-byte little-endian length + header + data: a safetensors file, or a corrupt one.
inline std::string SafetensorsBytes(const std::string& header, const std::string& data, uint64_t header_len) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header_len >> (8 * i)) & 0xFF);
  return out + header + data;
}
inline std::string SafetensorsBytes(const std::string& header, const std::string& data) {
  return SafetensorsBytes(header, data, header.size());
}

// Copies a directory's regular files (a fixture) into `to`, writable.
inline void CopyFiles(const std::string& from, const std::string& to) {
  for (const auto& e : std::filesystem::directory_iterator(from)) {
    if (!e.is_regular_file()) continue;
    const auto dst = std::filesystem::path(to) / e.path().filename();
    std::filesystem::copy_file(e.path(), dst, std::filesystem::copy_options::overwrite_existing);
    std::filesystem::permissions(dst, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  }
}

}  // namespace numoe::test
