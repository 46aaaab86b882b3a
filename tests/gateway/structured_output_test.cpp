// Structured output's grammar without a model: the schema compiler's
// refusals, the recogniser on valid and invalid JSON, token masks against a
// token-by-token brute force, and random walks through the masks whose
// text always parses and validates (by a validator written here, not the
// recogniser).
#include <catch2/catch.hpp>

#include <random>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gateway/structured/grammar_vocabulary.h"
#include "gateway/structured/json_grammar.h"
#include "gateway/structured/json_schema.h"
#include "gateway/structured/token_grammar.h"
#include "gateway/sched/scheduler.h"
#include "gateway/sched/token_controls.h"

using namespace moe::gw;
using namespace moe::gw::structured;
using json = nlohmann::json;

namespace {

// Every byte, pieces that JSON text is made of, and two special tokens.
class PieceCodec final : public TextCodec {
 public:
  PieceCodec() {
    for (int b = 0; b < 256; ++b) pieces_.push_back(std::string(1, char(b)));
    for (const char* p : {"{\"", "\":", "\": ", "\",", ", \"", "\"}", "}}", "]}", "true", "false", "null", "12", "0.",
                          "-3", "e5", "  ", "\n  ", "name", "\"name\"", "\"age", "red\"", "\"green\"", "[\"", "\"]",
                          "[1", ",2", "]", "{}", "[]", "\\n", "\\u00", "ab", "\"a", "tags", "\"tags\": [", "<|x|>",
                          "<|end|>"})
      pieces_.push_back(p);
  }
  std::vector<int32_t> encode(std::string_view) const override { return {}; }
  moe::Result<std::vector<int32_t>> encode_chat(const json&) const override { return std::vector<int32_t>{}; }
  std::unique_ptr<TokenTextStream> stream_decoder() const override { return nullptr; }
  // As the model codecs do: a lone byte that is not a character reads as
  // U+FFFD; its raw bytes are the byte itself.
  std::string token_bytes(int32_t id) const override {
    const std::string& p = pieces_[size_t(id)];
    return p.size() == 1 && (unsigned char)p[0] >= 0x80 ? std::string("\xEF\xBF\xBD") : p;
  }
  std::string token_raw_bytes(int32_t id) const override { return pieces_[size_t(id)]; }
  bool is_special(int32_t id) const override { return pieces_[size_t(id)] == "<|x|>"; }
  int vocab_size() const override { return int(pieces_.size()); }
  std::vector<int32_t> stop_token_ids() const override { return {vocab_size() - 1}; }  // "<|end|>"

 private:
  std::vector<std::string> pieces_;
};

std::shared_ptr<const Schema> compile(const json& s) {
  auto r = compile_json_schema(s);
  INFO((r.ok() ? std::string() : r.error()));
  REQUIRE(r.ok());
  return *r;
}

bool accepts(const Schema& sc, std::string_view text) {
  GrammarState g = GrammarState::start(sc);
  return g.feed(sc, text) && g.finishable(sc);
}

// The subset's meaning, spelled out independently of the recogniser.
bool valid(const json& v, const json& s, const json& root) {
  if (s.is_boolean()) return s.get<bool>();
  if (s.contains("$ref")) {
    const std::string r = s["$ref"];
    const std::string name = r.substr(r.rfind('/') + 1);
    return valid(v, root.contains("$defs") ? root["$defs"][name] : root["definitions"][name], root);
  }
  if (s.contains("enum")) {
    for (const json& e : s["enum"])
      if (e == v) return true;
    return false;
  }
  if (s.contains("const")) return s["const"] == v;
  if (s.contains("anyOf") || s.contains("oneOf")) {
    for (const json& o : s.contains("anyOf") ? s["anyOf"] : s["oneOf"])
      if (valid(v, o, root)) return true;
    return false;
  }
  if (s.value("nullable", false) && v.is_null()) return true;
  if (s.contains("type")) {
    std::vector<std::string> types;
    if (s["type"].is_string()) types.push_back(s["type"]);
    else for (const json& t : s["type"]) types.push_back(t);
    bool any = false;
    for (const std::string& t : types) {
      if (t == "object" && v.is_object()) any = true;
      if (t == "array" && v.is_array()) any = true;
      if (t == "string" && v.is_string()) any = true;
      if (t == "number" && v.is_number()) any = true;
      if (t == "integer" && v.is_number_integer()) any = true;
      if (t == "boolean" && v.is_boolean()) any = true;
      if (t == "null" && v.is_null()) any = true;
    }
    if (!any) return false;
  }
  if (v.is_object()) {
    const json props = s.value("properties", json::object());
    for (const json& r : s.value("required", json::array()))
      if (!v.contains(r.get<std::string>())) return false;
    for (const auto& [k, x] : v.items()) {
      if (props.contains(k)) {
        if (!valid(x, props[k], root)) return false;
      } else {
        const json add = s.value("additionalProperties", json(props.empty()));
        if (add.is_boolean() ? !add.get<bool>() : !valid(x, add, root)) return false;
      }
    }
  }
  if (v.is_array()) {
    if (int(v.size()) < s.value("minItems", 0) || int(v.size()) > s.value("maxItems", 1 << 30)) return false;
    if (s.contains("items"))
      for (const json& x : v)
        if (!valid(x, s["items"], root)) return false;
  }
  return true;
}

const json kPerson = json::parse(R"({
  "type": "object",
  "properties": {
    "name": {"type": "string"},
    "age": {"type": "integer"},
    "height": {"type": "number"},
    "colour": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
    "address": {"type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": ["string", "null"]}},
                "required": ["city"], "additionalProperties": false},
    "alive": {"type": "boolean"}
  },
  "required": ["name", "age", "colour"],
  "additionalProperties": false
})");

}  // namespace

TEST_CASE("structured: a schema keyword that would not be enforced is refused, naming it and its place",
          "[gateway][structured]") {
  struct Case {
    json schema;
    const char* says;
  };
  for (const Case& c : {Case{{{"type", "string"}, {"pattern", "^a"}}, "'pattern' at #"},
                        Case{{{"type", "object"}, {"properties", {{"d", {{"type", "string"}, {"format", "date"}}}}}},
                             "'format' at #/properties/d"},
                        Case{{{"type", "integer"}, {"minimum", 0}}, "'minimum'"},
                        Case{{{"$ref", "#/$defs/missing"}}, "not a definition"},
                        Case{{{"type", "object"}, {"required", {"x"}}}, "not among 'properties'"},
                        Case{{{"type", "blob"}}, "unknown type 'blob'"},
                        Case{{{"type", "array"}, {"items", json::array({{{"type", "string"}}})}}, "tuples"},
                        Case{{{"type", "object"}, {"properties", {{"a\"b", {{"type", "string"}}}}}}, "escapes"}}) {
    INFO(c.schema.dump());
    auto r = compile_json_schema(c.schema);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find(c.says) != std::string::npos);
  }
  // Alternatives that only refer to each other, and nestings past 8 options.
  const json loop = json::parse(R"({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}]},
                                              "b": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"})");
  auto l = compile_json_schema(loop);
  REQUIRE_FALSE(l.ok());
  CHECK(l.error().find("match nothing") != std::string::npos);
  json wide = {{"type", "integer"}};
  for (int i = 0; i < 5; ++i) wide = {{"anyOf", {wide, {{"const", i}}}}};
  CHECK(compile_json_schema(wide).ok());  // 6 options once merged
  for (int i = 5; i < 9; ++i) wide = {{"anyOf", {wide, {{"const", i}}}}};
  auto w = compile_json_schema(wide);
  REQUIRE_FALSE(w.ok());
  CHECK(w.error().find("more than 8") != std::string::npos);
  // Annotations pass.
  CHECK(compile_json_schema({{"type", "string"}, {"description", "x"}, {"title", "t"}, {"default", "a"}}).ok());
}

TEST_CASE("structured: what the recogniser could not follow is refused when the schema compiles", "[gateway][structured]") {
  auto refused = [](const json& schema, const char* says) {
    auto r = compile_json_schema(schema);
    INFO(schema.dump().substr(0, 200));
    REQUIRE_FALSE(r.ok());
    INFO(r.error());
    CHECK(r.error().find(says) != std::string::npos);
  };
  // A literal or a name longer than the 16-bit count of bytes matched
  // would wrap (the literal asked for again from its start).
  std::string long_text(kMaxLiteralBytes, 'a');
  CHECK(compile_json_schema({{"const", long_text.substr(2)}}).ok());
  refused({{"const", long_text}}, "more than 16384");
  refused({{"enum", {"a", long_text}}}, "more than 16384");
  refused({{"type", "object"}, {"properties", {{long_text + "b", {{"type", "integer"}}}}}}, "longer than 16384");
  // More nodes than a frame can name.
  json leaf = {{"type", "object"}, {"properties", json::object()}};
  for (int i = 0; i < 5; ++i) leaf["properties"]["p" + std::to_string(i)] = {{"type", "string"}};
  json mid = {{"type", "object"}, {"properties", json::object()}};
  for (int i = 0; i < 64; ++i) mid["properties"]["m" + std::to_string(i)] = leaf;
  json top = {{"type", "object"}, {"properties", json::object()}};
  for (int i = 0; i < 64; ++i) top["properties"]["t" + std::to_string(i)] = mid;
  refused(top, "more than 16384");
  // Nesting the recogniser's 16 frames cannot hold, when the schema
  // requires it; optional nesting compiles (the masks stop it in time).
  json deep = {{"type", "integer"}}, optional = deep;
  for (int i = 0; i < 20; ++i) {
    deep = {{"type", "array"}, {"items", deep}, {"minItems", 1}};
    optional = {{"type", "array"}, {"items", optional}};
  }
  refused(deep, "nested deeper than 15");
  CHECK(compile_json_schema(optional).ok());
  refused(json::parse(R"({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                           "required": ["next"]}}, "$ref": "#/$defs/n"})"),
          "never ends");
  // Keywords beside $ref, and beside enum or const, other than a type.
  const json defs = json::parse(R"({"o": {"type": "object", "properties": {"a": {"type": "integer"}}}})");
  refused({{"$defs", defs}, {"$ref", "#/$defs/o"}, {"required", {"a"}}}, "'required' beside '$ref'");
  refused({{"enum", {1, 2}}, {"maxItems", 1}}, "'maxItems' beside 'enum'");
  refused({{"type", "string"}, {"const", 5}}, "not of its 'type'");
  refused({{"type", "integer"}, {"enum", {"x", "y"}}}, "no value of 'enum'");
  auto ints = compile({{"type", "integer"}, {"enum", {"x", 1, 2.0, 2.5}}});
  CHECK(accepts(*ints, "1"));
  CHECK(accepts(*ints, "2.0"));
  CHECK_FALSE(accepts(*ints, "\"x\""));
  CHECK_FALSE(accepts(*ints, "2.5"));
  // References that only point at each other have no schema: not "any value".
  refused(json::parse(R"({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})"),
          "refers back to itself");
  refused(json::parse(R"({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})"), "refers back to itself");
}

TEST_CASE("structured: a property name that leaves a listed one mid-character stays well-formed UTF-8",
          "[gateway][structured]") {
  // "é" is C3 A9; "è" (C3 A8) shares its lead byte and is another name.
  auto sc = compile(json::parse(R"({"type": "object", "properties": {"é": {"type": "integer"}},
                                    "additionalProperties": {"type": "integer"}})"));
  CHECK(accepts(*sc, "{\"\xC3\xA9\": 1}"));
  CHECK(accepts(*sc, "{\"\xC3\xA8\": 1}"));
  CHECK(accepts(*sc, "{\"x\": 1, \"\xC3\xA9\": 2}"));
  CHECK_FALSE(accepts(*sc, "{\"\xC3\xC3\xA9\": 1}"));  // a lead byte where its continuation must come
  CHECK_FALSE(accepts(*sc, "{\"\xC3\": 1}"));          // the name ends inside the character
  CHECK_FALSE(accepts(*sc, "{\"\xC3\xA9\xC3\": 1}"));
}

TEST_CASE("structured: the recogniser takes valid instances and refuses invalid ones", "[gateway][structured]") {
  auto sc = compile(kPerson);
  for (const char* ok : {R"({"name": "Ada", "age": 36, "colour": "red"})",
                         R"({"colour":"blue","age":-7,"name":"x\n\"y\u00e9"})",
                         R"( {
  "name": "B", "age": 0, "height": -1.5e3, "colour": "green",
  "tags": ["a", "b"], "address": {"city": "Oslo", "zip": null}, "alive": false
})",
                         R"({"name":"","age":12,"colour":"red","address":{"zip":"0150","city":"x"}})"}) {
    INFO(ok);
    CHECK(accepts(*sc, ok));
    CHECK(valid(json::parse(ok), kPerson, kPerson));
  }
  for (const char* bad : {R"({"name": "Ada", "age": 36})",                                   // colour required
                          R"({"name": "Ada", "age": 36, "colour": "pink"})",                 // not in the enum
                          R"({"name": "Ada", "age": 3.5, "colour": "red"})",                 // not an integer
                          R"({"name": "Ada", "age": 36, "colour": "red", "x": 1})",          // no other properties
                          R"({"name": "Ada", "name": "B", "age": 1, "colour": "red"})",      // twice
                          R"({"name": "Ada", "age": 036, "colour": "red"})",                 // leading zero
                          R"({"name": "Ada", "age": 36, "colour": "red",})",                 // trailing comma
                          R"({"name": "A
", "age": 1, "colour": "red"})",                                                             // raw newline
                          R"({"name": "A", "age": 1, "colour": "red", "tags": []})",         // minItems 1
                          R"({"name": "A", "age": 1, "colour": "red", "tags": ["1","2","3","4"]})",  // maxItems 3
                          R"({"name": "A", "age": 1, "colour": "red", "address": {"zip": "1"}})",    // city required
                          R"({"name": "A", "age": 1, "colour": "red"} x)",                   // after the value
                          R"({"name": "A", "age": 1, "colour": "red", "alive": nul})"}) {
    INFO(bad);
    CHECK_FALSE(accepts(*sc, bad));
  }
  // Not finished yet is not refused: a prefix lives, and is not finishable.
  GrammarState g = GrammarState::start(*sc);
  REQUIRE(g.feed(*sc, R"({"name": "Ad)"));
  CHECK_FALSE(g.finishable(*sc));
  CHECK_FALSE(g.closed());
  REQUIRE(g.feed(*sc, R"(a", "age": 1, "colour": "red"})"));
  CHECK(g.closed());
}

TEST_CASE("structured: a self-referring anyOf is one level of options, each byte a bounded step", "[gateway][structured]") {
  // A list that may hold itself or a number: recursion through values, not through alternatives.
  const json s = json::parse(R"({"$defs": {"v": {"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/v"},
      {"type": "array", "items": {"$ref": "#/$defs/v"}}]}}, "$ref": "#/$defs/v"})");
  auto sc = compile(s);
  CHECK(accepts(*sc, "[1, [2, [3]], []]"));
  CHECK(accepts(*sc, "7"));
  CHECK_FALSE(accepts(*sc, "[1, \"x\"]"));
  // Deeper than the recogniser's 16 frames: refused, not a crash.
  std::string deep(40, '[');
  CHECK_FALSE(accepts(*sc, deep));
}

TEST_CASE("structured: an array's count is kept only as far as its bounds need it", "[gateway][structured]") {
  auto sc = compile({{"type", "array"}, {"items", {{"type", "integer"}}}, {"minItems", 2}});
  CHECK_FALSE(accepts(*sc, "[1]"));
  CHECK(accepts(*sc, "[1, 2]"));
  CHECK(accepts(*sc, "[1, 2, 3, 4, 5, 6]"));
  // Past minItems (no maxItems) the items share states: the third and the fifth.
  GrammarState a = GrammarState::start(*sc), b = a;
  REQUIRE(a.feed(*sc, "[1, 2, 3"));
  REQUIRE(b.feed(*sc, "[1, 2, 3, 4, 5"));
  CHECK(a.key() == b.key());
  auto bounded = compile({{"type", "array"}, {"maxItems", 3}});
  GrammarState c = GrammarState::start(*bounded), d = c;
  REQUIRE(c.feed(*bounded, "[1, 2"));
  REQUIRE(d.feed(*bounded, "[1, 2, 3"));
  CHECK(c.key() != d.key());
  CHECK_FALSE(accepts(*bounded, "[1, 2, 3, 4]"));
}

TEST_CASE("structured: recursion through $defs, anyOf, and json_object's any object", "[gateway][structured]") {
  const json tree = json::parse(R"({
    "$defs": {"node": {"type": "object", "properties": {"v": {"type": "number"},
              "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"]}},
    "$ref": "#/$defs/node"})");
  auto sc = compile(tree);
  CHECK(accepts(*sc, R"({"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": [{"v": 4, "kids": []}]}]})"));
  CHECK_FALSE(accepts(*sc, R"({"v": 1, "kids": [{"w": 2}]})"));
  const json alt = {{"anyOf", {{{"type", "object"}, {"properties", {{"a", {{"type", "integer"}}}}}, {"required", {"a"}}},
                               {{"type", "object"}, {"properties", {{"b", {{"type", "string"}}}}}, {"required", {"b"}}},
                               {{"type", "array"}}}}};
  auto sa = compile(alt);
  CHECK(accepts(*sa, R"({"a": 5})"));
  CHECK(accepts(*sa, R"({"b": "x"})"));
  CHECK(accepts(*sa, R"([1, "two", {"three": [null, true]}])"));
  CHECK_FALSE(accepts(*sa, R"({"a": "x"})"));
  auto any = any_object_schema();
  CHECK(accepts(*any, R"({"k": [1, 2.5e-3, "s", {"x": null}], "t": true, "f": false})"));
  CHECK(accepts(*any, "{}"));
  CHECK_FALSE(accepts(*any, "[1]"));  // json_object: an object
  CHECK_FALSE(accepts(*any, R"({"k": tru})"));
}

TEST_CASE("structured: a token mask equals feeding every token's bytes, and leaves out special tokens",
          "[gateway][structured]") {
  PieceCodec codec;
  auto vocab = GrammarVocabulary::build(codec);
  auto sc = compile(kPerson);
  const std::string text = R"({"name": "Ada", "tags": ["x"], "age": 12, "colour": "green", "address": {"city": "a"}})";
  GrammarState g = GrammarState::start(*sc);
  size_t allowed_somewhere = 0;
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    INFO("after " << text.substr(0, cut));
    const TokenMask mask = compute_mask(*sc, *vocab, g);
    for (int32_t id = 0; id < codec.vocab_size(); ++id) {
      const std::string b = codec.token_raw_bytes(id);
      bool want = !codec.is_special(id) && id != codec.vocab_size() - 1;
      if (want) {
        GrammarState c = g;
        want = c.feed(*sc, b);
      }
      const bool got = mask[size_t(id) / 32] >> (id % 32) & 1;
      if (got != want) FAIL_CHECK("token " << id << " " << json(b).dump() << ": mask " << got << ", bytes " << want);
      allowed_somewhere += got;
    }
    if (cut < text.size()) REQUIRE(g.feed(*sc, text.substr(cut, 1)));
  }
  CHECK(allowed_somewhere > text.size());
}

TEST_CASE("structured: a request's stop ids that the grammar takes as text are allowed only once the value is complete",
          "[gateway][structured]") {
  // A newline is whitespace inside the value and a brace may close it: as
  // stop ids they would end the choice with the value open (the stop id is
  // not shown), so until the value is complete they are not allowed; then
  // they are, with the model's own end.
  PieceCodec codec;
  GrammarRegistry registry(&codec);
  SequenceRequest req;
  req.grammar = registry.grammar(compile({{"type", "object"}}));
  const int32_t newline = '\n', brace = '}', end = codec.vocab_size() - 1;  // byte b is token b
  req.stop_ids = {end, newline, brace};
  auto has = [](const std::vector<uint32_t>& w, int32_t id) { return (w[size_t(id) / 32] >> (id % 32) & 1u) != 0; };
  const std::vector<uint32_t> open = TokenControls(req, std::vector<int32_t>{'{'}).allowed(req);
  REQUIRE(!open.empty());
  CHECK(has(open, ' '));  // whitespace, as the newline would be
  CHECK(has(open, '"'));
  CHECK_FALSE(has(open, newline));
  CHECK_FALSE(has(open, brace));
  CHECK_FALSE(has(open, end));
  const std::vector<uint32_t> done = TokenControls(req, std::vector<int32_t>{'{', '}'}).allowed(req);
  REQUIRE(!done.empty());
  CHECK(has(done, newline));
  CHECK(has(done, brace));
  CHECK(has(done, end));
}

TEST_CASE("structured: characters the vocabulary has no token for are spelled in bytes, and only whole",
          "[gateway][structured]") {
  // "é" (C3 A9) and "😀" (F0 9F 98 80) have no piece of their own: only
  // byte tokens spell them (read alone, each is U+FFFD), in a const and a
  // property name; a byte that cannot continue the character is refused.
  PieceCodec codec;
  auto vocab = GrammarVocabulary::build(codec);
  for (const json& schema : {json{{"const", "\xC3\xA9\xF0\x9F\x98\x80"}},
                             json{{"type", "object"}, {"properties", {{"\xC3\xA9", {{"const", 1}}}}},
                                  {"required", {"\xC3\xA9"}}, {"additionalProperties", false}}}) {
    INFO(schema.dump());
    auto sc = compile(schema);
    const std::string text = schema.contains("const") ? "\"\xC3\xA9\xF0\x9F\x98\x80\"" : "{\"\xC3\xA9\":1}";
    GrammarState g = GrammarState::start(*sc);
    for (size_t i = 0; i < text.size(); ++i) {
      INFO("before byte " << i);
      const TokenMask mask = compute_mask(*sc, *vocab, g);
      const int32_t id = int32_t((unsigned char)text[i]);  // the byte's own token
      CHECK((mask[size_t(id) / 32] >> (id % 32) & 1));
      if ((unsigned char)text[i] == 0xC3) {
        CHECK_FALSE((mask[0x41 / 32] >> (0x41 % 32) & 1));  // not "A" where "é" must come
      }
      if (i > 0 && (unsigned char)text[i - 1] == 0xC3) {
        CHECK_FALSE((mask[0xC3 / 32] >> (0xC3 % 32) & 1));  // a lead byte cannot continue one
      }
      REQUIRE(g.feed(*sc, text.substr(i, 1)));
    }
    CHECK(g.finishable(*sc));
  }
}

TEST_CASE("structured: random walks through the masks always end in valid JSON", "[gateway][structured]") {
  PieceCodec codec;
  GrammarRegistry registry(&codec);
  std::mt19937 rng(3);
  const json kTree = json::parse(R"({"type": "object", "properties": {"items": {"type": "array", "maxItems": 4,
      "items": {"type": "object", "properties": {"id": {"type": "integer"}, "kind": {"enum": ["a", "b", 3, null]},
      "score": {"type": "number"}}, "required": ["id", "kind"], "additionalProperties": false}},
      "note": {"type": ["string", "null"]}}, "required": ["items"], "additionalProperties": false})");
  for (const json& schema : {kPerson, kTree, json{{"type", "object"}}}) {
    auto g = registry.grammar(compile(schema));
    int closed = 0;
    for (int walk = 0; walk < 60; ++walk) {
      GrammarState st = g->start();
      std::string text;
      for (int step = 0; step < 400 && !st.closed(); ++step) {
        auto mask = g->mask(st);
        std::vector<int32_t> allowed;
        for (int32_t id = 0; id < codec.vocab_size(); ++id)
          if ((*mask)[size_t(id) / 32] >> (id % 32) & 1) allowed.push_back(id);
        REQUIRE_FALSE(allowed.empty());  // a live state always has a way on
        // Prefer structure over endless strings: closing bytes weigh more.
        std::vector<double> w;
        for (int32_t id : allowed) {
          const std::string b = codec.token_raw_bytes(id);
          w.push_back(b.find_first_of("\"}],:") != std::string::npos ? 8.0 : 1.0);
        }
        const int32_t pick = allowed[std::discrete_distribution<size_t>(w.begin(), w.end())(rng)];
        REQUIRE(st.feed(g->schema(), codec.token_raw_bytes(pick)));
        text += codec.token_raw_bytes(pick);
      }
      if (!st.closed()) continue;
      ++closed;
      INFO(text);
      json v = json::parse(text, nullptr, false);
      REQUIRE_FALSE(v.is_discarded());
      CHECK(valid(v, schema, schema));
    }
    INFO(schema.dump());
    CHECK(closed >= 20);
  }
  CHECK(registry.stats().mask_hits > 0);
}

TEST_CASE("structured: a tool call's markup takes no whitespace before it, and its masks never run dry",
          "[gateway][structured][tools]") {
  // A space before "<tool_call>" was taken as a value's leading whitespace,
  // after which the raw text refused every byte: a live state with an empty
  // mask, which the worker refuses (and with it every sequence of the step).
  PieceCodec codec;
  GrammarRegistry registry(&codec);
  std::mt19937 rng(5);
  const auto call = compile(json::parse(R"({"type": "object", "properties": {"name": {"const": "f"},
      "arguments": {"type": "object"}}, "required": ["name", "arguments"], "additionalProperties": false})"));
  const std::vector<std::shared_ptr<const Schema>> sequences = {
      tool_call_sequence(*call, "<tool_call>\n", "\n</tool_call>", ""),
      tool_call_sequence(*call, "<tool_call>\n", "\n</tool_call>", "\n"),
      tool_call_sequence(*call, "[TOOL_CALLS]", "", "")};
  for (const auto& sc : sequences) {
    for (const char* lead : {" ", "\n", "  <tool_call>"}) {
      GrammarState st = GrammarState::start(*sc);
      CHECK_FALSE(st.feed(*sc, lead));
    }
    auto g = registry.grammar(sc);
    int ended = 0;
    for (int walk = 0; walk < 40; ++walk) {
      GrammarState st = g->start();
      bool finished = false;
      for (int step = 0; step < 600 && !st.closed(); ++step) {
        auto mask = g->mask(st);
        std::vector<int32_t> allowed;
        for (int32_t id = 0; id < codec.vocab_size(); ++id)
          if ((*mask)[size_t(id) / 32] >> (id % 32) & 1) allowed.push_back(id);
        if (allowed.empty()) {
          REQUIRE(st.finishable(*sc));  // only a finished value may have no way on
          break;
        }
        // Closing bytes weigh most (walks end), whitespace next: it is what
        // found the dead end.
        std::vector<double> w;
        for (int32_t id : allowed) {
          const std::string b = codec.token_bytes(id);
          w.push_back(b.find_first_of("\"}]:<>") != std::string::npos ? 8.0
                      : b.find_first_of(" \n") != std::string::npos   ? 3.0
                                                                        : 1.0);
        }
        const int32_t pick = allowed[std::discrete_distribution<size_t>(w.begin(), w.end())(rng)];
        REQUIRE(st.feed(*sc, codec.token_bytes(pick)));
        finished = finished || st.finishable(*sc);  // a whole call (more may follow a separator)
      }
      ended += finished ? 1 : 0;
    }
    INFO("walks that made a whole call: " << ended << ", sequence " << (&sc - &sequences[0]));
    CHECK(ended >= 10);
  }
}

