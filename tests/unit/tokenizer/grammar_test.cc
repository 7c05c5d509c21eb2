// The constrained-output grammar (common/tokenizer/grammar.h): the schema compiler, the automaton, and the
// token mask against a vocabulary.
#include "common/tokenizer/grammar.h"

#include <gtest/gtest.h>

#include <random>

#include "common/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tests/support/status_matchers.h"

namespace numoe::tokenizer {
namespace {

using json = nlohmann::ordered_json;

const std::string kDemo = std::string(NUMOE_TEST_DATA) + "/demo-v4";

std::string Spec(const json& schema, int32_t end = -1) {
  json s = {{"type", "json_schema"}, {"schema", schema}};
  if (end >= 0) s["end"] = {end};
  return s.dump();
}

// A single-byte vocabulary (every byte is a token), so Accepts(text) is the automaton on bytes.
std::shared_ptr<const GrammarVocab> ByteVocab() {
  std::vector<std::string> t;
  for (int b = 0; b < 256; ++b) t.push_back(std::string(1, static_cast<char>(b)));
  return GrammarVocab::FromBytes(t);
}

bool Accepts(const Grammar& g, std::string_view text) {
  GrammarStates s = g.Start();
  for (char ch : text) {
    s = g.Feed(s, static_cast<uint8_t>(ch));
    if (s.empty()) return false;
  }
  return g.CanEnd(s);
}

const json kPerson = json::parse(R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer"},
    "score": {"type": "number"},
    "ok": {"type": "boolean"},
    "kind": {"enum": ["cat", "dog", 3]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 2},
    "note": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
    "home": {"$ref": "#/$defs/place"},
    "v": {"const": "x"}
  },
  "required": ["name", "age", "kind", "home"],
  "$defs": {"place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                      "required": ["city"], "additionalProperties": false}}
})");

TEST(GrammarTest, AcceptsValidAndRejectsInvalidJson) {
  ASSERT_OK_AND_ASSIGN(auto g, Grammar::Compile(Spec(kPerson), ByteVocab()));
  EXPECT_TRUE(Accepts(*g, R"({"name":"bo","age":-12,"kind":"cat","home":{"city":"Oslo"}})"));
  EXPECT_TRUE(Accepts(*g, R"({ "name" : "bo", "age":0,"score":1.5e+3,"ok":true,"kind":3,"tags":["a","bb"],)"
                          R"("note":null,"home":{"city":"\u00e9x"},"v":"x"})"));
  EXPECT_TRUE(Accepts(*g, "{\"name\":\"\xc3\xa9\",\"age\":1,\"kind\":\"dog\",\"note\":\"n\",\"home\":{\"city\":\"\"}}"));
  // Missing a required property, out of order, a wrong type, too long, an unknown enum value, a leading
  // zero, a fraction in an integer, too many items, an extra property, unbounded whitespace, bad UTF-8.
  EXPECT_FALSE(Accepts(*g, R"({"name":"bo","age":1,"kind":"cat"})"));
  EXPECT_FALSE(Accepts(*g, R"({"age":1,"name":"bo","kind":"cat","home":{"city":"a"}})"));
  EXPECT_FALSE(Accepts(*g, R"({"name":1,"age":1,"kind":"cat","home":{"city":"a"}})"));
  EXPECT_FALSE(Accepts(*g, R"({"name":"123456789","age":1,"kind":"cat","home":{"city":"a"}})"));
  EXPECT_FALSE(Accepts(*g, R"({"name":"a","age":1,"kind":"cow","home":{"city":"a"}})"));
  EXPECT_FALSE(Accepts(*g, R"({"name":"a","age":01,"kind":"cat","home":{"city":"a"}})"));
  EXPECT_FALSE(Accepts(*g, R"({"name":"a","age":1.5,"kind":"cat","home":{"city":"a"}})"));
  EXPECT_FALSE(Accepts(*g, R"({"name":"a","age":1,"kind":"cat","tags":["a","b","c"],"home":{"city":"a"}})"));
  EXPECT_FALSE(Accepts(*g, R"({"name":"a","age":1,"kind":"cat","tags":[],"home":{"city":"a"}})"));
  EXPECT_FALSE(Accepts(*g, R"({"name":"a","age":1,"kind":"cat","home":{"city":"a","x":1}})"));
  EXPECT_FALSE(Accepts(*g, R"({"name":"a",      "age":1,"kind":"cat","home":{"city":"a"}})"));
  EXPECT_FALSE(Accepts(*g, "{\"name\":\"\xc0\xaf\",\"age\":1,\"kind\":\"cat\",\"home\":{\"city\":\"a\"}}"));
  EXPECT_FALSE(Accepts(*g, R"({"name":"a","age":1,"kind":"cat","home":{"city":"a"}} )"));
}

TEST(GrammarTest, JsonObjectAndRecursion) {
  ASSERT_OK_AND_ASSIGN(auto any, Grammar::Compile(R"({"type":"json_object"})", ByteVocab()));
  EXPECT_TRUE(Accepts(*any, R"({"a":[1,{"b":null}],"c":"d","e":{}})"));
  EXPECT_TRUE(Accepts(*any, "{}"));
  EXPECT_FALSE(Accepts(*any, "[1]"));
  EXPECT_FALSE(Accepts(*any, R"({"a":1,})"));
  const json tree = json::parse(R"({"type":"object","properties":{"v":{"type":"integer"},
      "kids":{"type":"array","items":{"$ref":"#"}}},"required":["v","kids"]})");
  ASSERT_OK_AND_ASSIGN(auto g, Grammar::Compile(Spec(tree), ByteVocab()));
  EXPECT_TRUE(Accepts(*g, R"({"v":1,"kids":[{"v":2,"kids":[]},{"v":3,"kids":[{"v":4,"kids":[]}]}]})"));
  EXPECT_FALSE(Accepts(*g, R"({"v":1,"kids":[{"v":2}]})"));
}

TEST(GrammarTest, RefusesUnsupportedKeywordsByName) {
  const auto check = [](const char* schema, const char* words) {
    const Status st = Grammar::CheckSchema(schema, "response_format.json_schema");
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << schema;
    EXPECT_NE(std::string(st.message()).find(words), std::string::npos) << st.message();
  };
  check(R"({"type":"string","pattern":"a+"})", "unsupported keyword 'pattern' at /");
  check(R"({"type":"object","properties":{"x":{"type":"integer","minimum":3}}})", "'minimum' at /properties/x");
  check(R"({"oneOf":[{"type":"string"}]})", "'oneOf'");
  check(R"({"type":"object","properties":{"x":{}},"additionalProperties":true})", "additionalProperties");
  check(R"({"$ref":"#/$defs/missing"})", "names no definition");
  check(R"({"type":"object","properties":{},"required":["x"]})", "not in properties");
  check(R"({"type":"strin"})", "unknown type 'strin'");
  EXPECT_OK(Grammar::CheckSchema(kPerson.dump(), "f"));
}

// The mask over a real vocabulary: every allowed token keeps the automaton alive, every refused one kills
// it, the end token only once the value is complete; random walks over the mask produce valid values.
TEST(GrammarTest, MaskOverDemoVocabularyGivesValidValues) {
  ASSERT_OK_AND_ASSIGN(auto tok, Tokenizer::Load(kDemo));
  const int32_t eos = tok->special_ids().eos;
  ASSERT_GE(eos, 0);
  auto vocab = GrammarVocab::FromTokenizer(*tok, tok->vocab_size());
  ASSERT_OK_AND_ASSIGN(auto g, Grammar::Compile(Spec(kPerson, eos), vocab));
  std::mt19937 rng(7);
  for (int walk = 0; walk < 20; ++walk) {
    GrammarState st(g);
    std::vector<int32_t> ids;
    for (int step = 0; step < 3000 && !st.finished(); ++step) {
      auto mask = st.Mask();
      std::vector<int32_t> allowed;
      for (int32_t id = 0; id < vocab->size(); ++id) {
        if (MaskAllows(*mask, id)) allowed.push_back(id);
      }
      ASSERT_FALSE(allowed.empty());
      if (walk == 0 && step < 5) {  // each allowed token is viable, each refused one is not
        for (int32_t id = 0; id < vocab->size(); ++id) {
          if (id == eos) continue;
          GrammarStates probe = st.states();
          for (int32_t sym : vocab->symbols(id)) probe = g->Feed(probe, sym);
          EXPECT_EQ(MaskAllows(*mask, id), !probe.empty()) << "token " << id;
        }
      }
      const int32_t id = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
      st.Accept(id);
      if (id != eos) ids.push_back(id);
    }
    ASSERT_TRUE(st.finished()) << "walk " << walk << " did not close: " << tok->Decode(ids);
    const std::string text = tok->Decode(ids);
    const json v = json::parse(text, nullptr, false);
    ASSERT_FALSE(v.is_discarded()) << text;
    ASSERT_TRUE(v.is_object()) << text;
    EXPECT_TRUE(v["name"].is_string() && v["name"].get<std::string>().size() <= 16) << text;
    EXPECT_TRUE(v["age"].is_number_integer()) << text;
    EXPECT_TRUE(v["kind"] == "cat" || v["kind"] == "dog" || v["kind"] == 3) << text;
    EXPECT_TRUE(v["home"].is_object() && v["home"]["city"].is_string()) << text;
    if (v.contains("tags")) {
      EXPECT_TRUE(v["tags"].is_array() && v["tags"].size() >= 1 && v["tags"].size() <= 2);
    }
    if (v.contains("note")) {
      EXPECT_TRUE(v["note"].is_null() || v["note"].is_string());
    }
    if (v.contains("v")) {
      EXPECT_EQ(v["v"], "x");
    }
  }
  const Grammar::MaskStats stats = Grammar::GlobalMaskStats();
  EXPECT_GT(stats.cached, 0u);  // repeated states hit the cache
}

TEST(GrammarTest, ForcedDsmlToolCall) {
  // Bytes plus one added token (id 3) standing for ｜DSML｜.
  std::vector<std::string> t;
  for (int b = 0; b < 256; ++b) t.push_back(std::string(1, static_cast<char>(b)));
  const int32_t dsml = 256, eos = 257;
  t.push_back("|DSML|");
  t.push_back("</s>");
  const std::vector<int32_t> added = {dsml, eos};
  auto vocab = GrammarVocab::FromBytes(t, added);
  const json spec = {{"type", "dsml_tool_call"}, {"dsml", dsml}, {"end", {eos}},
                     {"tools", json::parse(R"([{"name":"get_weather","parameters":{"type":"object",
                        "properties":{"city":{"type":"string"},"days":{"type":"integer"}},"required":["city"]}}])")}};
  ASSERT_OK_AND_ASSIGN(auto g, Grammar::Compile(spec.dump(), vocab));
  auto run = [&](std::vector<std::string> parts) {
    GrammarStates s = g->Start();
    for (const std::string& p : parts) {
      if (p == "D") {
        s = g->Feed(s, Grammar::kSymbolToken + dsml);
      } else {
        for (char ch : p) s = g->Feed(s, static_cast<uint8_t>(ch));
      }
      if (s.empty()) return false;
    }
    return g->CanEnd(s);
  };
  EXPECT_TRUE(run({"<", "D", "tool_calls>\n<", "D", "invoke name=\"get_weather\">\n<", "D",
                   "parameter name=\"city\" string=\"true\">Paris (b)\n</", "D", "parameter>\n<", "D",
                   "parameter name=\"days\" string=\"false\">3</", "D", "parameter>\n</", "D", "invoke>\n</", "D",
                   "tool_calls>"}));
  EXPECT_FALSE(run({"<", "D", "tool_calls>\n<", "D", "invoke name=\"get_weather\">\n</", "D", "invoke>\n</", "D",
                    "tool_calls>"}));  // city is required
  EXPECT_FALSE(run({"<|DSML|tool_calls>"}));  // the marker must be the added token
}

}  // namespace
}  // namespace numoe::tokenizer
