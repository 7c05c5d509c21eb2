#include "worker/service/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"

namespace numoe::worker {

ProgressBar::ProgressBar(std::string label, int64_t total_bytes, FILE* out)
    : label_(std::move(label)), total_(total_bytes), out_(out), tty_(isatty(fileno(out)) != 0) {
  start_ = last_ = std::chrono::steady_clock::now();
}

std::string ProgressBar::Format(const std::string& label, int64_t done, int64_t total, double seconds, int width) {
  // GB for real models; MB when the whole load is under 1 GB (test fixtures).
  const bool mb = total > 0 && total < 1'000'000'000;
  const double unit = mb ? 1e6 : 1e9;
  const char* name = mb ? "MB" : "GB";
  const double amount = static_cast<double>(done) / unit;
  const double rate = seconds > 0 ? amount / seconds : 0.0;
  std::string s = absl::StrFormat("%s %7.2f", label, amount);
  if (total > 0) {
    const double frac = std::clamp(static_cast<double>(done) / static_cast<double>(total), 0.0, 1.0);
    const int fill = static_cast<int>(std::lround(frac * width));
    s += absl::StrFormat(" / %.2f %s [%s%s] %3d%%", static_cast<double>(total) / unit, name, std::string(fill, '#'),
                         std::string(width - fill, '.'), static_cast<int>(std::lround(frac * 100)));
  } else {
    s += absl::StrFormat(" %s", name);
  }
  s += absl::StrFormat("  %.2f %s/s", rate, name);
  if (total > 0 && done < total) {
    if (rate > 0) {
      s += absl::StrFormat("  ETA %.0f s", (static_cast<double>(total - done) / unit) / rate);
    } else {
      s += "  ETA --";
    }
  } else {
    s += absl::StrFormat("  in %.1f s", seconds);
  }
  return s;
}

void ProgressBar::Print(int64_t done, bool final) {
  const auto now = std::chrono::steady_clock::now();
  const double secs = std::chrono::duration<double>(now - start_).count();
  const std::string line = Format(label_, done, total_, secs, 30);
  if (tty_) {
    std::fprintf(out_, "\r%s\033[K%s", line.c_str(), final ? "\n" : "");
  } else {
    std::fprintf(out_, "%s\n", line.c_str());
  }
  std::fflush(out_);
  last_ = now;
  printed_ = true;
}

void ProgressBar::Update(int64_t done_bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  const auto now = std::chrono::steady_clock::now();
  const auto every = tty_ ? std::chrono::milliseconds(100) : std::chrono::milliseconds(1000);
  if (now - last_ < every) return;
  Print(done_bytes, false);
}

void ProgressBar::Done(int64_t done_bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  Print(done_bytes, true);
}

}  // namespace numoe::worker
