// Encoding, decoding and lookups (loading lives in tokenizer_load.cc).
#include "common/tokenizer/tokenizer.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/tokenizer/tokenizer_impl.h"
#include "common/tokenizer/utf8.h"

namespace numoe::tokenizer {

// ---- AddedTokenTrie ----------------------------------------------------------------------------------

void AddedTokenTrie::Add(std::string_view content, int32_t token_index) {
  int32_t node = 0;
  for (const char ch : content) {
    const auto b = static_cast<uint8_t>(ch);
    auto& next = nodes_[node].next;
    auto it = std::lower_bound(next.begin(), next.end(), b,
                               [](const std::pair<uint8_t, int32_t>& e, uint8_t v) { return e.first < v; });
    if (it != next.end() && it->first == b) {
      node = it->second;
      continue;
    }
    const auto child = static_cast<int32_t>(nodes_.size());
    next.insert(it, {b, child});  // before push_back: push_back may move `next`
    nodes_.emplace_back();
    node = child;
  }
  nodes_[node].token = token_index;
  first_[static_cast<uint8_t>(content[0])] = true;
}

int32_t AddedTokenTrie::LongestAt(std::string_view text, size_t pos, size_t* len) const {
  int32_t node = 0;
  int32_t best = -1;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto b = static_cast<uint8_t>(text[i]);
    const auto& next = nodes_[node].next;
    auto it = std::lower_bound(next.begin(), next.end(), b,
                               [](const std::pair<uint8_t, int32_t>& e, uint8_t v) { return e.first < v; });
    if (it == next.end() || it->first != b) break;
    node = it->second;
    if (nodes_[node].token >= 0) {
      best = nodes_[node].token;
      *len = i + 1 - pos;
    }
  }
  return best;
}

// ---- ScratchPool -------------------------------------------------------------------------------------

ScratchPool::Lease ScratchPool::Acquire() {
  std::unique_ptr<EncodeScratch> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!idle_.empty()) {
      s = std::move(idle_.back());
      idle_.pop_back();
    }
  }
  if (s == nullptr) s = std::make_unique<EncodeScratch>();
  return Lease(this, std::move(s));
}

void ScratchPool::Return(std::unique_ptr<EncodeScratch> s) {
  std::lock_guard<std::mutex> lock(mu_);
  if (idle_.size() < kMaxIdle) idle_.push_back(std::move(s));
}

// ---- Encoding ----------------------------------------------------------------------------------------

namespace {

size_t PrevCharStart(std::string_view text, size_t pos) {
  do {
    --pos;
  } while (pos > 0 && (static_cast<uint8_t>(text[pos]) & 0xC0) == 0x80);
  return pos;
}

bool IsWordCharAt(const Tokenizer::Impl& im, std::string_view text, size_t pos, EncodeScratch& s) {
  const size_t n = std::max<size_t>(1, Utf8SequenceLength(text, pos));
  return im.word_char->MatchesAtStart(text.substr(pos, n), &s.match);
}

// HF AddedVocabulary::find_matches over text[seg): leftmost-longest matches, each filtered and widened by
// its token's flags. Calls on_text(range) for the gaps and on_token(id) for the tokens, in order.
template <typename OnText, typename OnToken>
Status SplitOnAddedTokens(const Tokenizer::Impl& im, const AddedTokenTrie& trie, std::string_view text, Range seg,
                          bool allow_special, EncodeScratch& s, OnText&& on_text, OnToken&& on_token) {
  if (trie.empty()) return on_text(seg);
  const std::string_view bounded = text.substr(0, seg.second);
  size_t start_offset = seg.first;  // end of the last emitted split
  size_t pos = seg.first;
  while (pos < seg.second) {
    if (!trie.MayStart(static_cast<uint8_t>(text[pos]))) {
      ++pos;
      continue;
    }
    size_t len = 0;
    const int32_t index = trie.LongestAt(bounded, pos, &len);
    if (index < 0) {
      ++pos;
      continue;
    }
    const AddedToken& tok = im.added[index];
    size_t start = pos;
    size_t stop = pos + len;
    pos = stop;  // the matcher moves past a match even when it is then discarded, as Aho-Corasick does
    if (tok.special && !allow_special) continue;
    if (tok.single_word) {
      const bool word_before = start > seg.first && IsWordCharAt(im, text, PrevCharStart(text, start), s);
      const bool word_after = stop < seg.second && IsWordCharAt(im, text, stop, s);
      if (word_before || word_after) continue;
    }
    if (tok.lstrip) {
      size_t new_start = start;
      while (new_start > seg.first) {
        const size_t prev = PrevCharStart(text, new_start);
        size_t clen = 1;
        if (!IsUnicodeWhiteSpace(DecodeCodePoint(text, prev, &clen))) break;
        new_start = prev;
      }
      start = std::max(new_start, start_offset);  // spaces already taken by an rstrip stay there
    }
    if (tok.rstrip) {
      while (stop < seg.second) {
        size_t clen = 1;
        if (!IsUnicodeWhiteSpace(DecodeCodePoint(text, stop, &clen))) break;
        stop += clen;
      }
      pos = stop;
    }
    if (start_offset < start) RETURN_IF_ERROR(on_text(Range{start_offset, start}));
    on_token(tok.id);
    start_offset = stop;
  }
  if (start_offset < seg.second) RETURN_IF_ERROR(on_text(Range{start_offset, seg.second}));
  return absl::OkStatus();
}

// One HF Split over the piece text[p): appends the resulting pieces (absolute offsets) to *out.
Status ApplySplit(const SplitStep& step, std::string_view text, Range p, EncodeScratch& s, std::vector<Range>* out) {
  const std::string_view sub = text.substr(p.first, p.second - p.first);
  s.matches.clear();
  RETURN_IF_ERROR(step.regex->FindAll(sub, &s.match, &s.matches));
  if (s.matches.empty() && !step.invert) {  // common fast path: one unmatched piece, kept by every behavior
    out->push_back(p);
    return absl::OkStatus();
  }
  auto& marked = s.marked;
  marked.clear();
  size_t prev = 0;
  for (const Range& m : s.matches) {
    if (prev != m.first) marked.push_back({{prev, m.first}, false});
    marked.push_back({m, true});
    prev = m.second;
  }
  if (prev != sub.size()) marked.push_back({{prev, sub.size()}, false});
  if (step.invert) {
    for (auto& m : marked) m.second = !m.second;
  }
  const size_t first_out = out->size();
  const auto push = [&](Range r) { out->push_back({p.first + r.first, p.first + r.second}); };
  bool previous_match = false;
  switch (step.behavior) {
    case SplitBehavior::kIsolated:
      for (const auto& m : marked) push(m.first);
      break;
    case SplitBehavior::kRemoved:
      for (const auto& m : marked) {
        if (!m.second) push(m.first);
      }
      break;
    case SplitBehavior::kContiguous:
      for (const auto& m : marked) {
        if (m.second == previous_match && out->size() > first_out) {
          out->back().second = p.first + m.first.second;
        } else {
          push(m.first);
        }
        previous_match = m.second;
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const auto& m : marked) {
        if (m.second && !previous_match && out->size() > first_out) {
          out->back().second = p.first + m.first.second;
        } else {
          push(m.first);
        }
        previous_match = m.second;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = marked.rbegin(); it != marked.rend(); ++it) {
        if (it->second && !previous_match && out->size() > first_out) {
          out->back().first = p.first + it->first.first;
        } else {
          push(it->first);
        }
        previous_match = it->second;
      }
      std::reverse(out->begin() + static_cast<ptrdiff_t>(first_out), out->end());
      break;
  }
  return absl::OkStatus();
}

// Pre-tokenizes text[r) with every split step, leaving the pieces in s.pieces.
Status SplitPlainText(const Tokenizer::Impl& im, std::string_view text, Range r, EncodeScratch& s) {
  s.pieces.clear();
  s.pieces.push_back(r);
  for (const SplitStep& step : im.splits) {
    s.next_pieces.clear();
    for (const Range& p : s.pieces) RETURN_IF_ERROR(ApplySplit(step, text, p, s, &s.next_pieces));
    std::swap(s.pieces, s.next_pieces);
  }
  return absl::OkStatus();
}

// Applies the invalid-UTF-8 rule; returns the text to encode (`text` itself or *storage).
StatusOr<std::string_view> CheckUtf8(std::string_view text, InvalidUtf8 rule, std::string* storage) {
  const size_t bad = FindInvalidUtf8(text);
  if (bad == std::string_view::npos) return text;
  if (rule == InvalidUtf8::kError) {
    return absl::InvalidArgumentError(absl::StrCat("invalid UTF-8 at byte offset ", bad, " (byte 0x",
                                                   absl::Hex(static_cast<uint8_t>(text[bad]), absl::kZeroPad2),
                                                   ")"));
  }
  AppendUtf8Lossy(text, /*final=*/true, storage);
  return std::string_view(*storage);
}

// Runs added-token extraction (raw pass, then the "normalized" pass over the gaps; with no normalizer the
// normalized text is the raw text) and calls on_piece(range) for every pre-tokenized piece of plain text
// and on_token(id) for every added token, in order.
template <typename OnPiece, typename OnToken>
Status Segment(const Tokenizer::Impl& im, std::string_view text, bool allow_special, EncodeScratch& s,
               OnPiece&& on_piece, OnToken&& on_token) {
  const auto on_plain = [&](Range r) -> Status {
    RETURN_IF_ERROR(SplitPlainText(im, text, r, s));
    for (const Range& p : s.pieces) {
      if (p.second > p.first) on_piece(p);
    }
    return absl::OkStatus();
  };
  const auto on_gap = [&](Range r) {
    return SplitOnAddedTokens(im, im.normalized_trie, text, r, allow_special, s, on_plain, on_token);
  };
  return SplitOnAddedTokens(im, im.raw_trie, text, Range{0, text.size()}, allow_special, s, on_gap, on_token);
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

StatusOr<std::vector<int32_t>> Tokenizer::Encode(std::string_view text, const EncodeOptions& options) const {
  const Impl& im = *impl_;
  std::string storage;
  ASSIGN_OR_RETURN(text, CheckUtf8(text, options.invalid_utf8, &storage));
  const ScratchPool::Lease lease = im.pool.Acquire();
  EncodeScratch& s = *lease.get();
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 8);
  if (options.add_special_tokens) ids.insert(ids.end(), im.prefix_ids.begin(), im.prefix_ids.end());
  RETURN_IF_ERROR(Segment(
      im, text, options.allow_special, s,
      [&](Range p) { im.bpe.Encode(text.substr(p.first, p.second - p.first), &s.bpe, &ids); },
      [&](int32_t id) { ids.push_back(id); }));
  if (options.add_special_tokens) ids.insert(ids.end(), im.suffix_ids.begin(), im.suffix_ids.end());
  return ids;
}

StatusOr<std::vector<std::string>> Tokenizer::PreTokenize(std::string_view text, const EncodeOptions& options) const {
  const Impl& im = *impl_;
  std::string storage;
  ASSIGN_OR_RETURN(text, CheckUtf8(text, options.invalid_utf8, &storage));
  const ScratchPool::Lease lease = im.pool.Acquire();
  std::vector<std::string> pieces;
  RETURN_IF_ERROR(Segment(
      im, text, options.allow_special, *lease.get(),
      [&](Range p) { pieces.emplace_back(text.substr(p.first, p.second - p.first)); },
      [&](int32_t id) { pieces.push_back(im.id_bytes[id]); }));
  return pieces;
}

// ---- Decoding and lookups ----------------------------------------------------------------------------

std::string Tokenizer::Decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& im = *impl_;
  std::string out;
  std::string chunk;  // bytes of ordinary tokens since the last added token
  for (const int32_t id : ids) {
    if (!im.has(id)) continue;
    const uint8_t flags = im.id_flags[id];
    if ((flags & Impl::kAdded) != 0) {
      if (skip_special_tokens && (flags & Impl::kSpecial) != 0) continue;
      AppendUtf8Lossy(chunk, /*final=*/true, &out);
      chunk.clear();
      out += im.id_bytes[id];
    } else {
      chunk += im.id_bytes[id];
    }
  }
  AppendUtf8Lossy(chunk, /*final=*/true, &out);
  return out;
}

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  const auto it = impl_->token_to_id.find(absl::string_view(token.data(), token.size()));
  if (it == impl_->token_to_id.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> Tokenizer::IdToToken(int32_t id) const {
  if (!impl_->has(id)) return std::nullopt;
  return impl_->id_to_token[id];
}

std::string_view Tokenizer::IdToBytes(int32_t id) const {
  if (!impl_->has(id)) return {};
  return impl_->id_bytes[id];
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_flags.size()); }

bool Tokenizer::IsAddedToken(int32_t id) const { return impl_->has(id) && (impl_->id_flags[id] & Impl::kAdded); }

bool Tokenizer::IsSpecialToken(int32_t id) const {
  return impl_->has(id) && (impl_->id_flags[id] & Impl::kSpecial);
}

const SpecialTokenIds& Tokenizer::special_ids() const { return impl_->special; }

std::optional<int32_t> Tokenizer::SpecialTokenId(std::string_view name) const {
  const SpecialTokenIds& s = impl_->special;
  int32_t id = -2;
  if (name == "bos") id = s.bos;
  if (name == "eos") id = s.eos;
  if (name == "user" || name == "User") id = s.user;
  if (name == "assistant" || name == "Assistant") id = s.assistant;
  if (name == "think") id = s.think;
  if (name == "end_think" || name == "</think>") id = s.end_think;
  if (id == -2) {
    const auto it = impl_->token_to_id.find(absl::string_view(name.data(), name.size()));
    if (it == impl_->token_to_id.end() || !IsAddedToken(it->second)) return std::nullopt;
    id = it->second;
  }
  if (id < 0) return std::nullopt;
  return id;
}

// ---- StreamDecoder -----------------------------------------------------------------------------------

StreamDecoder::StreamDecoder(const Tokenizer& tok, bool skip_special_tokens)
    : tok_(&tok), skip_special_(skip_special_tokens) {}

std::string StreamDecoder::Add(int32_t id) {
  std::string out;
  const std::string_view bytes = tok_->IdToBytes(id);
  if (bytes.empty()) return out;  // unknown id: skipped, as Decode does
  if (tok_->IsAddedToken(id)) {
    if (skip_special_ && tok_->IsSpecialToken(id)) return out;
    AppendUtf8Lossy(pending_, /*final=*/true, &out);  // an added token ends any partial character
    pending_.clear();
    out += bytes;
    return out;
  }
  pending_ += bytes;
  const size_t held = AppendUtf8Lossy(pending_, /*final=*/false, &out);
  pending_.erase(0, pending_.size() - held);
  return out;
}

std::string StreamDecoder::Finish() {
  std::string out;
  AppendUtf8Lossy(pending_, /*final=*/true, &out);
  pending_.clear();
  return out;
}

}  // namespace numoe::tokenizer
