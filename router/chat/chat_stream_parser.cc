// StreamingOutputParser: §4.3 state machine with the §4.4 robustness rules (see chat_encoding.h).
#include <random>

#include "common/log.h"
#include "router/chat/chat_encoding.h"

namespace numoe::chat {
namespace {

constexpr std::string_view kCallsOpen = "<｜DSML｜tool_calls>";
constexpr std::string_view kCallsClose = "</｜DSML｜tool_calls>";
constexpr std::string_view kInvokeOpen = "<｜DSML｜invoke";
constexpr std::string_view kInvokeClose = "</｜DSML｜invoke>";
constexpr std::string_view kParamOpen = "<｜DSML｜parameter";
constexpr std::string_view kParamClose = "</｜DSML｜parameter>";
constexpr std::string_view kAnyOpenTag = "<｜DSML｜";
constexpr std::string_view kAnyCloseTag = "</｜DSML｜";
constexpr std::string_view kStringTrue = "\" string=\"true\">";
constexpr std::string_view kStringFalse = "\" string=\"false\">";

bool StartsWith(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

// Length of the longest suffix of `s` that is a proper prefix of one of `markers` (text that may turn out
// to be a marker once more arrives).
size_t PartialMarkerSuffix(std::string_view s, std::initializer_list<std::string_view> markers) {
  size_t best = 0;
  for (std::string_view m : markers) {
    for (size_t k = std::min(s.size(), m.size() - 1); k > best; --k) {
      if (s.substr(s.size() - k) == m.substr(0, k)) {
        best = k;
        break;
      }
    }
  }
  return best;
}

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

size_t TrimTrailingSpace(std::string_view s, size_t end) {
  while (end > 0 && IsSpace(s[end - 1])) --end;
  return end;
}

size_t SkipSpace(std::string_view s, size_t p) {
  while (p < s.size() && IsSpace(s[p])) ++p;
  return p;
}

struct Found {
  size_t pos = std::string_view::npos;
  std::string_view marker;
};

Found FindFirst(std::string_view s, std::initializer_list<std::string_view> markers) {
  Found f;
  for (std::string_view m : markers) {
    const size_t p = s.find(m);
    if (p < f.pos) f = {p, m};
  }
  return f;
}

std::string RandomCallId() {
  static constexpr char kAlnum[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  thread_local std::mt19937_64 rng{std::random_device{}()};
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id.push_back(kAlnum[rng() % (sizeof(kAlnum) - 1)]);
  return id;
}

void AddToolDelta(OutputDelta* d, int index, const std::string& id, const std::string& name,
                  std::string_view args) {
  if (!d->tool_calls.empty() && d->tool_calls.back().index == index) {
    ToolCallDelta& last = d->tool_calls.back();
    if (!id.empty()) last.id = id;
    if (!name.empty()) last.name = name;
    last.arguments.append(args);
    return;
  }
  d->tool_calls.push_back({index, id, name, std::string(args)});
}

}  // namespace

StreamingOutputParser::StreamingOutputParser(ParserStart start, Options options)
    : state_(start == ParserStart::kReasoning ? State::kReasoning : State::kContent), options_(std::move(options)) {
  if (!options_.make_call_id) options_.make_call_id = [](int) { return RandomCallId(); };
}

OutputDelta StreamingOutputParser::Feed(std::string_view text) {
  OutputDelta d;
  if (state_ == State::kDone) return d;
  buf_.append(text);
  while (Step(/*final=*/false, &d)) {
  }
  return d;
}

OutputDelta StreamingOutputParser::Finish() {
  OutputDelta d;
  while (state_ != State::kDone && Step(/*final=*/true, &d)) {
  }
  if (in_call_) DropCall();
  state_ = State::kDone;
  buf_.clear();
  return d;
}

std::string StreamingOutputParser::FinishReason(bool hit_length) const {
  if (!msg_.tool_calls.empty()) return "tool_calls";
  return hit_length ? "length" : "stop";
}

void StreamingOutputParser::EmitText(bool reasoning, std::string_view text, OutputDelta* d) {
  if (text.empty()) return;
  (reasoning ? d->reasoning_content : d->content).append(text);
  (reasoning ? msg_.reasoning_content : msg_.content).append(text);
}

void StreamingOutputParser::EmitArgs(std::string_view fragment, OutputDelta* d) {
  call_.arguments.append(fragment);
  AddToolDelta(d, static_cast<int>(msg_.tool_calls.size()), "", "", fragment);
}

void StreamingOutputParser::DropCall() {
  NLOG(WARNING) << "model output ended inside tool call '" << call_.name << "'; the call is dropped";
  in_call_ = false;
  call_ = ToolCall();
}

bool StreamingOutputParser::Step(bool final, OutputDelta* d) {
  switch (state_) {
    case State::kReasoning: return StepText(/*reasoning=*/true, final, d);
    case State::kContent: return StepText(/*reasoning=*/false, final, d);
    case State::kToolsBlock:
    case State::kInvokeBody:
    case State::kAfterTools: return StepBetweenTags(final, d);
    case State::kInvokeHeader: return StepInvokeHeader(final, d);
    case State::kParamHeader: return StepParamHeader(final, d);
    case State::kParamValue: return StepParamValue(final, d);
    case State::kDone: buf_.clear(); return false;
  }
  return false;
}

// Reasoning or content text: emit everything that cannot be (the start of) a marker.
bool StreamingOutputParser::StepText(bool reasoning, bool final, OutputDelta* d) {
  const bool tool_markers = !reasoning || options_.tools_enabled;
  const Found f = tool_markers ? FindFirst(buf_, {kEndThink, kEos, kBos, kCallsOpen, kInvokeOpen})
                               : FindFirst(buf_, {kEndThink, kEos, kBos});
  if (f.pos == std::string_view::npos) {
    const size_t keep = tool_markers ? PartialMarkerSuffix(buf_, {kEndThink, kEos, kBos, kCallsOpen, kInvokeOpen})
                                     : PartialMarkerSuffix(buf_, {kEndThink, kEos, kBos});
    // Whitespace right before a tool block is not part of the text (§4.3 / §4.4.2), so hold it too.
    size_t emit = tool_markers ? TrimTrailingSpace(buf_, buf_.size() - keep) : buf_.size() - keep;
    if (final) {
      // What looks like a cut-off DSML tag is dropped (never leak DSML); other held text is real text.
      const std::string_view tail = std::string_view(buf_).substr(buf_.size() - keep);
      const bool partial_dsml = tool_markers && keep >= 2 && (StartsWith(kCallsOpen, tail) || StartsWith(kInvokeOpen, tail));
      emit = partial_dsml ? TrimTrailingSpace(buf_, buf_.size() - keep) : buf_.size();
      EmitText(reasoning, std::string_view(buf_).substr(0, emit), d);
      buf_.clear();
      state_ = State::kDone;
      return false;
    }
    EmitText(reasoning, std::string_view(buf_).substr(0, emit), d);
    buf_.erase(0, emit);
    return false;
  }
  if (f.marker == kCallsOpen || f.marker == kInvokeOpen) {
    EmitText(reasoning, std::string_view(buf_).substr(0, TrimTrailingSpace(buf_, f.pos)), d);
    buf_.erase(0, f.pos + f.marker.size());
    wrapped_ = f.marker == kCallsOpen;
    state_ = wrapped_ ? State::kToolsBlock : State::kInvokeHeader;
    return true;
  }
  EmitText(reasoning, std::string_view(buf_).substr(0, f.pos), d);
  buf_.erase(0, f.pos + f.marker.size());
  if (f.marker == kEos) {  // generation is over; in reasoning everything so far stays reasoning (§4.4.7)
    state_ = State::kDone;
    buf_.clear();
    return false;
  }
  if (f.marker == kEndThink && reasoning) state_ = State::kContent;
  // A stray BOS, or </think> inside content, is dropped (§4.4.8).
  return true;
}

// Between tags: inside the block, inside an invoke, or after the block.
bool StreamingOutputParser::StepBetweenTags(bool final, OutputDelta* d) {
  const size_t p = SkipSpace(buf_, 0);
  const std::string_view rest = std::string_view(buf_).substr(p);
  if (state_ == State::kAfterTools) {
    if (StartsWith(rest, kEos) || (final && rest.empty())) {
      state_ = State::kDone;
      buf_.clear();
      return false;
    }
    if (rest.empty() || (StartsWith(kEos, rest) && !final)) {
      buf_.erase(0, p);
      return false;
    }
    buf_.erase(0, p);  // text after the block goes back to content (§4.4.5); the whitespace is dropped
    state_ = State::kContent;
    return true;
  }
  const bool body = state_ == State::kInvokeBody;
  const std::string_view open = body ? kParamOpen : kInvokeOpen;
  const std::string_view close = body ? kInvokeClose : kCallsClose;
  if (StartsWith(rest, open)) {
    buf_.erase(0, p + open.size());
    state_ = body ? State::kParamHeader : State::kInvokeHeader;
    return true;
  }
  if (StartsWith(rest, close)) {
    buf_.erase(0, p + close.size());
    if (body) {
      EmitArgs(call_has_params_ ? "}" : "{}", d);
      msg_.tool_calls.push_back(std::move(call_));
      call_ = ToolCall();
      in_call_ = false;
      state_ = wrapped_ ? State::kToolsBlock : State::kAfterTools;
    } else {
      state_ = State::kAfterTools;
    }
    return true;
  }
  if (StartsWith(rest, kEos)) {  // ended inside the block: a complete call stays, a partial one is dropped
    state_ = State::kDone;
    buf_.clear();
    return false;
  }
  if (rest.empty() || StartsWith(open, rest) || StartsWith(close, rest) || StartsWith(kEos, rest)) {
    if (final) {
      state_ = State::kDone;
      buf_.clear();
      return false;
    }
    buf_.erase(0, p);
    return false;
  }
  // Anything else is malformed: skip to the next DSML tag (or EOS) without letting it reach the client.
  const Found next = FindFirst(rest.substr(1), {kAnyOpenTag, kAnyCloseTag, kEos});
  NLOG(DEBUG) << "skipping unexpected text inside a tool-call block";
  if (next.pos == std::string_view::npos) {
    const size_t keep = PartialMarkerSuffix(buf_, {kAnyOpenTag, kAnyCloseTag, kEos});
    buf_.erase(0, buf_.size() - keep);
    if (final) {
      state_ = State::kDone;
      buf_.clear();
    }
    return false;
  }
  buf_.erase(0, p + 1 + next.pos);
  return true;
}

// After "<｜DSML｜invoke": ` name="NAME">`.
bool StreamingOutputParser::StepInvokeHeader(bool final, OutputDelta* d) {
  const size_t q = buf_.find("\">");
  if (q == std::string::npos) {
    if (final) {
      state_ = State::kDone;
      buf_.clear();
    }
    return false;
  }
  const std::string_view header = std::string_view(buf_).substr(0, q);
  const size_t p = SkipSpace(header, 0);
  std::string name;
  if (StartsWith(header.substr(p), "name=\"")) {
    name = std::string(header.substr(p + 6));
  } else {
    NLOG(WARNING) << "malformed tool-call header; using an empty tool name";
  }
  buf_.erase(0, q + 2);
  in_call_ = true;
  call_ = ToolCall();
  const int index = static_cast<int>(msg_.tool_calls.size());
  call_.id = options_.make_call_id(index);
  call_.name = name;
  call_has_params_ = false;
  AddToolDelta(d, index, call_.id, call_.name, "");
  state_ = State::kInvokeBody;
  return true;
}

// After "<｜DSML｜parameter": ` name="KEY" string="true|false">`.
bool StreamingOutputParser::StepParamHeader(bool final, OutputDelta* d) {
  const size_t t = buf_.find(kStringTrue);
  const size_t f = buf_.find(kStringFalse);
  if (t == std::string::npos && f == std::string::npos) {
    if (final) {
      state_ = State::kDone;
      buf_.clear();
    }
    return false;
  }
  param_is_string_ = t < f;
  const size_t at = param_is_string_ ? t : f;
  const std::string_view header = std::string_view(buf_).substr(0, at);
  const size_t p = SkipSpace(header, 0);
  std::string key;
  if (StartsWith(header.substr(p), "name=\"")) key = std::string(header.substr(p + 6));
  std::string fragment = call_has_params_ ? ", " : "{";
  fragment += PythonJsonDumps(Json(key));
  fragment += ": ";
  if (param_is_string_) fragment += "\"";
  EmitArgs(fragment, d);
  call_has_params_ = true;
  param_value_.clear();
  buf_.erase(0, at + (param_is_string_ ? kStringTrue.size() : kStringFalse.size()));
  state_ = State::kParamValue;
  return true;
}

// A parameter value, up to "</｜DSML｜parameter>". String values stream; others are buffered.
bool StreamingOutputParser::StepParamValue(bool final, OutputDelta* d) {
  const size_t close = buf_.find(kParamClose);
  const size_t end = close != std::string::npos ? close : final ? 0 : buf_.size() - PartialMarkerSuffix(buf_, {kParamClose});
  if (close == std::string::npos && final) {
    state_ = State::kDone;
    buf_.clear();
    return false;
  }
  const std::string_view value = std::string_view(buf_).substr(0, end);
  if (param_is_string_) {
    std::string escaped;
    AppendPythonJsonEscaped(value, &escaped);
    if (close != std::string::npos) escaped += "\"";
    if (!escaped.empty()) EmitArgs(escaped, d);
  } else {
    param_value_.append(value);
    if (close != std::string::npos) {
      if (Json::accept(param_value_)) {
        EmitArgs(param_value_, d);  // pasted as written, like the official decoder
      } else {
        NLOG(WARNING) << "tool '" << call_.name << "': a string=\"false\" value is not JSON; sent as a string";
        EmitArgs(PythonJsonDumps(Json(param_value_)), d);
      }
    }
  }
  if (close == std::string::npos) {
    buf_.erase(0, end);
    return false;
  }
  buf_.erase(0, close + kParamClose.size());
  state_ = State::kInvokeBody;
  return true;
}

}  // namespace numoe::chat
