// Tokenizer files for synthetic checkpoints (`numoe mkmodel`), so that `generate` and `serve` run on them.
//
//   RETURN_IF_ERROR(WriteTinyTokenizer(dir));                   // tiny-v4's own files (1024 tokens)
//   RETURN_IF_ERROR(WriteSyntheticTokenizer(dir, 129280));      // a generated V4-Flash-sized vocabulary
//
// Both write tokenizer.json, tokenizer_config.json (bos/eos/pad strings, as the official file) and
// generation_config.json (bos 0, eos 1).
//
// The generated tokenizer (SyntheticTokenizerJson) is a valid Hugging Face byte-level BPE with DeepSeek
// V3/V4's normalizer-free pipeline (the three Split regexes, then ByteLevel without its own regex, ByteLevel
// decoder) and vocab_size ids [0, vocab_size), every id used. It is NOT DeepSeek's vocabulary (that is not
// public in this repository): text encodes to different ids than the real model would produce, which is fine
// for random weights. Layout, deterministic (no seed):
//   0, 1, 2                 <｜begin▁of▁sentence｜>, <｜end▁of▁sentence｜>, <｜▁pad▁｜>   (special)
//   3 .. 258                the 256 byte tokens, in GPT-2's bytes_to_unicode order ('!' first)
//   259 .. first_added-1    merges: "ĠĠ", "ĠĠĠĠ", "ĊĊ"; all 2-digit numbers, then 3-digit ones ("12"+"3");
//                           then words grown one lowercase letter at a time from the 53 starts
//                           {Ġ, A-Z, a-z}: 2-letter, 3-letter, 4-letter, ... until the range is full
//   first_added .. V-1      added tokens (special): where V >= 128900, DeepSeek's known ids
//                           <｜dspark▁noise｜>=128799, <｜fim▁hole｜>=128800, <｜fim▁begin｜>=128801,
//                           <｜fim▁end｜>=128802, <｜User｜>=128803, <｜Assistant｜>=128804, <think>=128821,
//                           </think>=128822, ｜DSML｜=128825, <｜latest_reminder｜>=128828; every other id
//                           of the range is <｜place▁holder▁no▁N｜> (N = id - first_added).
//                           first_added = 128000 for V >= 129000 (as DeepSeek's 128000 BPE ids), else
//                           V - 32 with the named tokens (User, Assistant, think, /think, noise, fim) first.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace numoe::synthetic {

// tokenizer.json text of the generated tokenizer; vocab_size in [1024, 1 << 24).
StatusOr<std::string> SyntheticTokenizerJson(int64_t vocab_size);

// Writes the generated tokenizer files into `dir` (which must exist).
Status WriteSyntheticTokenizer(const std::string& dir, int64_t vocab_size);

// Writes tests/data/tiny-v4's tokenizer.json and tokenizer_config.json (embedded at build time, byte for
// byte) and a generation_config.json into `dir` (which must exist).
Status WriteTinyTokenizer(const std::string& dir);

}  // namespace numoe::synthetic
