// Hugging Face `tokenizer.json` byte-level BPE tokenizer (DeepSeek V3/V4 flavour), with an incremental
// UTF-8-safe detokenizer.
//
//   ASSIGN_OR_RETURN(auto tok, tokenizer::Tokenizer::Load("tests/data/tiny-v4"));   // dir or file
//   ASSIGN_OR_RETURN(std::vector<int32_t> ids, tok->Encode("Hello, world!"));          // [47, 477, 86, 19, 707, 8]
//   std::string text = tok->Decode(ids);                                               // "Hello, world!"
//   tokenizer::StreamDecoder dec(*tok);
//   for (int32_t id : generated) send(dec.Add(id));   send(dec.Finish());
//
// What is supported (anything else in tokenizer.json is an error naming the field, never silently ignored):
//   normalizer     null, or a Sequence with no entries.
//   pre_tokenizer  null, Split (pattern {"Regex"|"String"}, behavior Removed|Isolated|MergedWithPrevious|
//                  MergedWithNext|Contiguous, invert), ByteLevel (add_prefix_space=false; use_regex either
//                  way), and Sequences of these.
//   model          BPE: vocab, merges ("a b" strings or ["a","b"] pairs), ignore_merges, unk_token/fuse_unk;
//                  no byte_fallback, continuing_subword_prefix or end_of_word_suffix; dropout is ignored
//                  (inference never drops merges).
//   post_processor null, ByteLevel, TemplateProcessing (its "single" template), or a Sequence of these.
//   decoder        ByteLevel (or a Sequence holding only ByteLevel).
//   added_tokens   matched before any splitting, leftmost-longest, honouring single_word / lstrip / rstrip /
//                  normalized / special exactly as the HF library does.
// Regexes run on PCRE2 (UTF + UCP, JIT) with `\s` meaning Unicode White_Space, as in Oniguruma.
//
// Invalid UTF-8 input (the documented rule): by default every ill-formed subsequence (maximal subpart, see
// utf8.h) is replaced by U+FFFD before encoding, so Encode never fails on bytes; with
// EncodeOptions::invalid_utf8 = kError it instead returns InvalidArgument naming the byte offset.
//
// Decoding: ids are mapped to their bytes (ByteLevel), concatenated and turned into text with invalid
// UTF-8 replaced by U+FFFD (as HF does). Added tokens decode to their content; with skip_special_tokens the
// *special* ones are dropped. Ids outside the vocabulary are skipped (HF does the same).
//
// Thread-safety: a loaded Tokenizer is immutable; Encode/Decode and the lookups may be called from any
// number of threads at once (each Encode borrows a private scratch, including its word cache, from a small
// pool). A StreamDecoder is single-threaded state and must not outlive its Tokenizer.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace numoe::tokenizer {

enum class InvalidUtf8 {
  kReplace,  // each ill-formed subsequence becomes U+FFFD, then the text is encoded (default)
  kError,    // InvalidArgument("invalid UTF-8 at byte offset N")
};

struct EncodeOptions {
  // Apply the post_processor (e.g. a TemplateProcessing that prepends BOS). DeepSeek V4's tokenizer.json has
  // none, so this changes nothing there. Default true, like HF `encode`.
  bool add_special_tokens = true;
  // Recognise added tokens flagged "special" (BOS, <｜User｜>, <think>, ...) inside the text. Set false for
  // untrusted user text so that "<｜end▁of▁sentence｜>" typed by a user is encoded as plain characters
  // (HF's encode_special_tokens=True). Non-special added tokens are always recognised.
  bool allow_special = true;
  InvalidUtf8 invalid_utf8 = InvalidUtf8::kReplace;
};

// Ids of the tokens the chat template and the server need; -1 when the vocabulary lacks one.
// bos/eos come from tokenizer_config.json (bos_token / eos_token) when it sits next to tokenizer.json,
// else DeepSeek's strings; the others are DeepSeek's fixed strings.
struct SpecialTokenIds {
  int32_t bos = -1;        // <｜begin▁of▁sentence｜>
  int32_t eos = -1;        // <｜end▁of▁sentence｜>
  int32_t user = -1;       // <｜User｜>
  int32_t assistant = -1;  // <｜Assistant｜>
  int32_t think = -1;      // <think>
  int32_t end_think = -1;  // </think>
};

class Tokenizer {
 public:
  // `path` is a tokenizer.json file or a model directory holding one. A tokenizer_config.json next to it is
  // read for bos_token/eos_token when present. Errors (NotFound, InvalidArgument, Unimplemented) name the
  // file and the offending field, e.g. "tokenizer.json: model.merges[17]: token 'ab' is not in the vocab".
  static StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& path);
  // Same from in-memory text; `source` names it in errors. `config_json` is tokenizer_config.json's text
  // (may be empty).
  static StatusOr<std::unique_ptr<Tokenizer>> FromJson(std::string_view json, const std::string& source,
                                                       std::string_view config_json = {});

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Text -> token ids. Fails only with kError on invalid UTF-8, or if PCRE2 runs out of its match limits
  // (ResourceExhausted; not seen with the DeepSeek patterns even on multi-megabyte inputs).
  StatusOr<std::vector<int32_t>> Encode(std::string_view text, const EncodeOptions& options = {}) const;

  // The pieces BPE would see for `text` (added tokens extracted and kept whole, then every split applied),
  // as HF's pre_tokenize_str; for debugging and tests. Options as for Encode (add_special_tokens unused).
  StatusOr<std::vector<std::string>> PreTokenize(std::string_view text, const EncodeOptions& options = {}) const;

  // Token ids -> text (see the header comment for the rules).
  std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // Token string as written in tokenizer.json (byte-level form, e.g. "Ġthe"; added tokens as their content)
  // <-> id. nullopt when absent.
  std::optional<int32_t> TokenToId(std::string_view token) const;
  std::optional<std::string> IdToToken(int32_t id) const;
  // The raw bytes id decodes to (may be part of a UTF-8 character); empty for unknown ids.
  std::string_view IdToBytes(int32_t id) const;

  // Number of id slots: 1 + the largest id of the vocab and added tokens.
  int32_t vocab_size() const;
  bool IsAddedToken(int32_t id) const;
  bool IsSpecialToken(int32_t id) const;

  const SpecialTokenIds& special_ids() const;
  // Id by role name: "bos", "eos", "user", "assistant", "think", "end_think" (also accepted: "User",
  // "Assistant", "</think>"), or any added token's exact content. nullopt when unknown.
  std::optional<int32_t> SpecialTokenId(std::string_view name) const;

  struct Impl;  // tokenizer_impl.h
  explicit Tokenizer(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

// Incremental detokenizer: feed generated ids one by one and get text as soon as it is complete UTF-8.
// Bytes that end in the middle of a character are held until the character completes; a sequence that can
// no longer become valid is emitted as U+FFFD. The concatenation of every Add() result and Finish() equals
// tok.Decode(all ids, skip_special_tokens).
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool skip_special_tokens = false);

  // Text made complete by `id` (often empty while a multi-byte character is still arriving).
  std::string Add(int32_t id);
  // Flushes held bytes (an incomplete character becomes U+FFFD) and resets for a new stream.
  std::string Finish();
  // Drops held bytes without emitting them.
  void Reset() { pending_.clear(); }
  // Number of bytes held back waiting for the rest of a character.
  size_t pending_bytes() const { return pending_.size(); }

 private:
  const Tokenizer* tok_;
  bool skip_special_;
  std::string pending_;
};

}  // namespace numoe::tokenizer
