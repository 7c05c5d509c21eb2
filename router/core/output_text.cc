#include "router/core/output_text.h"

#include <algorithm>

namespace numoe::router {

OutputText::OutputText(const tokenizer::Tokenizer& tok, OutputTextOptions options)
    : options_(std::move(options)), decoder_(tok, options_.skip_special_tokens) {
  options_.stop.erase(std::remove(options_.stop.begin(), options_.stop.end(), std::string()), options_.stop.end());
}

OutputText::Step OutputText::Add(std::span<const int32_t> ids) {
  Step step;
  if (stopped_) return step;
  for (int32_t id : ids) {
    if (id == options_.eos_id) continue;
    held_ += decoder_.Add(id);
  }
  if (options_.stop.empty()) {
    step.text = std::move(held_);
    held_.clear();
    return step;
  }
  // Earliest match wins; among matches at the same position, the longest stop string.
  size_t best = std::string::npos;
  const std::string* best_stop = nullptr;
  for (const std::string& s : options_.stop) {
    size_t p = held_.find(s);
    if (p == std::string::npos) continue;
    if (p < best || (p == best && s.size() > best_stop->size())) {
      best = p;
      best_stop = &s;
    }
  }
  if (best_stop != nullptr) {
    stopped_ = true;
    matched_ = *best_stop;
    step.stopped = true;
    step.text = held_.substr(0, options_.include_stop_in_output ? best + best_stop->size() : best);
    held_.clear();
    decoder_.Reset();
    return step;
  }
  // Hold back the longest suffix that is a proper prefix of some stop string. Every occurrence of a stop
  // string therefore starts inside held_, which is why searching held_ alone above is enough.
  size_t keep = 0;
  for (const std::string& s : options_.stop) {
    size_t max_len = std::min(s.size() - 1, held_.size());
    for (size_t len = max_len; len > keep; --len) {
      if (held_.compare(held_.size() - len, len, s, 0, len) == 0) {
        keep = len;
        break;
      }
    }
  }
  step.text = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return step;
}

std::string OutputText::Finish() {
  if (stopped_) return {};
  std::string out = std::move(held_);
  held_.clear();
  out += decoder_.Finish();
  // A stop string may complete only with the flushed bytes (e.g. a U+FFFD from an incomplete character).
  if (!options_.stop.empty()) {
    size_t best = std::string::npos;
    const std::string* best_stop = nullptr;
    for (const std::string& s : options_.stop) {
      size_t p = out.find(s);
      if (p != std::string::npos && (p < best || (p == best && s.size() > best_stop->size()))) {
        best = p;
        best_stop = &s;
      }
    }
    if (best_stop != nullptr) {
      stopped_ = true;
      matched_ = *best_stop;
      out.resize(options_.include_stop_in_output ? best + best_stop->size() : best);
    }
  }
  return out;
}

}  // namespace numoe::router
