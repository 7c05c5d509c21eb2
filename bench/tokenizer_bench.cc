// numoe-bench tokenizer: single-thread Encode throughput on a deterministic ~1 MB mixed text (English-like
// prose, code, numbers, CJK/kana/Hangul, a few emoji), generated in code so runs are comparable anywhere.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "bench/commands.h"
#include "common/args.h"
#include "common/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"

namespace numoe::bench {
namespace {

constexpr const char* kWords[] = {
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
    "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you", "were",
    "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when", "will", "would",
    "who", "so", "no", "model", "expert", "memory", "bandwidth", "token", "server", "request", "latency",
    "throughput", "attention", "window", "compressed", "routing", "quantization", "performance", "question",
    "fortune", "tomorrow", "understanding", "nevertheless", "extraordinary", "philosophy", "mountain", "river",
    "computer", "language", "beautiful", "government", "international", "development", "experience"};
constexpr const char* kPunct[] = {",", ",", ".", ".", ".", ";", ":", "!", "?", " -", "'s", "n't"};
constexpr const char* kCode[] = {
    "for (int i = 0; i < n; ++i) {\n  sum += a[i] * b[i];\n}\n",
    "def softmax(x):\n    e = np.exp(x - x.max())\n    return e / e.sum()\n",
    "if (status.ok() && ptr != nullptr) return absl::OkStatus();\n",
    "    let mut cache: HashMap<String, Vec<u32>> = HashMap::new();\n",
    "SELECT id, name FROM users WHERE created_at > '2024-01-01' ORDER BY id;\n",
    "<div class=\"row\"><span id=\"x42\">{{ value }}</span></div>\n",
    "#include <vector>\nstd::vector<float> w(4096 * 2048, 0.0f);\n",
    "    }\n\n    return out;\n}\n\n",
};
// Common CJK ideographs, kana and Hangul, as UTF-8 strings of several characters each.
constexpr const char* kCjk[] = {"中文分词测试", "你好世界", "模型推理服务器", "专家路由", "内存带宽", "日本語のテキスト",
                                "カタカナ", "ひらがな", "東京都", "안녕하세요", "세계", "토큰화", "。", "、", "，",
                                "：", "「引用」", "（括号）"};
constexpr const char* kEmoji[] = {"😀", "🚀", "👍🏽", "👨‍👩‍👧", "✨", "🎉"};

template <size_t N>
const char* Pick(const char* const (&table)[N], std::mt19937& rng) {
  return table[std::uniform_int_distribution<size_t>(0, N - 1)(rng)];
}

std::string MakeText(size_t bytes) {
  std::mt19937 rng(20260731);  // fixed: every run and machine encodes the same text
  std::uniform_int_distribution<int> pct(0, 99);
  std::string text;
  text.reserve(bytes + 256);
  while (text.size() < bytes) {
    const int kind = pct(rng);
    if (kind < 60) {  // a sentence of prose
      const int words = 6 + pct(rng) % 18;
      for (int w = 0; w < words; ++w) {
        std::string word = Pick(kWords, rng);
        if (w == 0) word[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(word[0])));
        text += word;
        if (pct(rng) < 12) text += Pick(kPunct, rng);
        text += ' ';
      }
      text.back() = '.';
      text += pct(rng) < 20 ? "\n\n" : " ";
    } else if (kind < 78) {
      text += Pick(kCode, rng);
    } else if (kind < 86) {  // numbers, dates, decimals
      text += std::to_string(std::uniform_int_distribution<int>(0, 2000000)(rng));
      text += pct(rng) < 50 ? "." + std::to_string(pct(rng)) : "";
      text += pct(rng) < 50 ? " ms, " : " GB/s; ";
    } else if (kind < 98) {
      const int n = 1 + pct(rng) % 6;
      for (int i = 0; i < n; ++i) text += Pick(kCjk, rng);
      text += pct(rng) < 30 ? "\n" : "";
    } else {
      text += Pick(kEmoji, rng);
      text += ' ';
    }
  }
  return text;
}

// tests/data/tiny-v4 from the working directory (the repo root), else relative to build/bin/.
std::string DefaultTokenizerPath(const char* argv0) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path rel = "tests/data/tiny-v4/tokenizer.json";
  if (fs::exists(rel, ec)) return rel.string();
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) exe = fs::path(argv0);
  const fs::path repo = exe.parent_path().parent_path().parent_path();
  if (fs::exists(repo / rel, ec)) return (repo / rel).string();
  return rel.string();
}

}  // namespace

int RunTokenizerBench(int argc, char** argv) {
  ArgParser parser(argv[0], "Single-thread tokenizer Encode throughput (MB/s) on a deterministic mixed text.");
  std::string model_dir, tokenizer_file;
  double mb = 1.0;
  int64_t runs = 5;
  bool json_only = false;
  parser.AddString("model", "DIR", "model directory holding tokenizer.json (default tests/data/tiny-v4)", &model_dir);
  parser.AddString("tokenizer", "FILE", "tokenizer.json path (instead of --model)", &tokenizer_file);
  parser.AddDouble("mb", "MB", "size of the text in MB (10^6 bytes)", &mb, 0.001, 1024);
  parser.AddInt("runs", "N", "timed encodes; the median is reported", &runs, 1, 1000);
  parser.AddFlag("json", "print only the JSON result line", &json_only);
  int rc = 0;
  if (!parser.ParseOrExit(argc, argv, &rc)) return rc;
  if (!model_dir.empty() && !tokenizer_file.empty()) {
    std::fprintf(stderr, "%s: give --model or --tokenizer, not both\n", argv[0]);
    return 2;
  }
  const std::string path =
      !tokenizer_file.empty() ? tokenizer_file : !model_dir.empty() ? model_dir : DefaultTokenizerPath(argv[0]);

  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  auto tok = tokenizer::Tokenizer::Load(path);
  const double load_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  if (!tok.ok()) {
    std::fprintf(stderr, "%s: %s\n", argv[0], tok.status().ToString().c_str());
    return 1;
  }
  const std::string text = MakeText(static_cast<size_t>(mb * 1e6));

  std::vector<double> mb_s;
  size_t tokens = 0;
  std::vector<int32_t> ids;
  for (int64_t r = 0; r < runs; ++r) {
    const auto start = Clock::now();
    auto encoded = (*tok)->Encode(text);
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (!encoded.ok()) {
      std::fprintf(stderr, "%s: encode failed: %s\n", argv[0], encoded.status().ToString().c_str());
      return 1;
    }
    tokens = encoded->size();
    ids = std::move(encoded).value();
    mb_s.push_back(static_cast<double>(text.size()) / 1e6 / seconds);
    if (!json_only) std::printf("run %lld: %.2f MB/s (%zu tokens)\n", static_cast<long long>(r + 1), mb_s.back(), tokens);
  }
  // A benchmark that silently mis-tokenizes would be worthless: check the round trip once.
  if ((*tok)->Decode(ids) != text) {
    std::fprintf(stderr, "%s: decode(encode(text)) != text\n", argv[0]);
    return 1;
  }
  const double cold = mb_s.front();
  std::vector<double> sorted = mb_s;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted.size() % 2 == 1
                            ? sorted[sorted.size() / 2]
                            : 0.5 * (sorted[sorted.size() / 2 - 1] + sorted[sorted.size() / 2]);
  if (!json_only) {
    std::printf("tokenizer %s (vocab %d), loaded in %.1f ms\n", path.c_str(), (*tok)->vocab_size(), load_ms);
    std::printf("text %.3f MB, %zu tokens (%.2f bytes/token); first run (cold word cache) %.2f MB/s\n",
                text.size() / 1e6, tokens, static_cast<double>(text.size()) / std::max<size_t>(tokens, 1), cold);
    std::printf("median %.2f MB/s over %lld runs (min %.2f, max %.2f), one thread\n", median,
                static_cast<long long>(runs), sorted.front(), sorted.back());
  }
  const auto r3 = [](double v) { return std::round(v * 1000) / 1000; };
  nlohmann::ordered_json out;
  out["bench"] = "tokenizer";
  out["tokenizer"] = path;
  out["mb"] = mb;
  out["bytes"] = text.size();
  out["runs"] = runs;
  out["median_mb_s"] = r3(median);
  out["min_mb_s"] = r3(sorted.front());
  out["max_mb_s"] = r3(sorted.back());
  out["cold_mb_s"] = r3(cold);
  out["tokens"] = tokens;
  out["load_ms"] = r3(load_ms);
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace numoe::bench
