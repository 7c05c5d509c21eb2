// Turns one choice's generated token ids into text as they arrive: incremental UTF-8-safe detokenizing plus
// stop strings, which are matched on the detokenized text (never on token ids: a stop string may start or
// end inside a token).
//
// Stop rule (OpenAI / vLLM): generation ends at the first occurrence of any stop string; the text before it
// is returned and the stop string is not (unless include_stop_in_output). Text that might be the start of a
// stop string is held back until the next tokens decide, so a client never sees text that is later cut.
//
// The end-of-sequence token is not turned into text (it ends the sequence, it is not content).
//
// Not thread-safe: one per choice, fed from one thread at a time.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/tokenizer/tokenizer.h"

namespace numoe::router {

struct OutputTextOptions {
  std::vector<std::string> stop;      // empty strings are ignored
  bool include_stop_in_output = false;
  bool skip_special_tokens = false;   // drop special tokens (BOS, <think>, ...) from the text
  int32_t eos_id = -1;                // never decoded; -1 = none
};

class OutputText {
 public:
  OutputText(const tokenizer::Tokenizer& tok, OutputTextOptions options);

  struct Step {
    std::string text;      // text now safe to send (may be empty)
    bool stopped = false;  // a stop string matched: the choice is finished (finish_reason "stop")
  };
  // Feeds newly generated ids. After a step that stopped, further calls return nothing.
  Step Add(std::span<const int32_t> ids);
  // End of generation without a stop-string match: everything held back.
  std::string Finish();

  bool stopped() const { return stopped_; }
  // The stop string that matched ("" if none).
  const std::string& matched_stop() const { return matched_; }

 private:
  OutputTextOptions options_;
  tokenizer::StreamDecoder decoder_;
  std::string held_;  // decoded, not yet sent (a possible stop-string prefix)
  bool stopped_ = false;
  std::string matched_;
};

}  // namespace numoe::router
