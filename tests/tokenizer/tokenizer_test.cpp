// The tokenizer against what the reference library computed on the same
// tokenizer.json files (tests/data/fixtures, models/demo-moe).

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

using nlohmann::json;

namespace {

const std::string kData = MOE_TEST_DATA;
const std::string kFixtures = kData + "/fixtures";
const std::string kDemo = kData + "/../../models/demo-moe";

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::unique_ptr<moe::Tokenizer> load(const std::string& dir) {
  auto t = moe::Tokenizer::load_dir(dir);
  INFO(dir << ": " << (t ? "" : t.error()));
  REQUIRE(t.ok());
  return std::move(t.value());
}

std::vector<int32_t> ids_of(const json& j) { return j.get<std::vector<int32_t>>(); }

// An integer tensor (I32 or I64) of a .safetensors file, as int32 ids.
std::vector<int32_t> safetensors_ids(const std::string& path, const std::string& name) {
  const std::string bytes = slurp(path);
  REQUIRE(bytes.size() >= 8);
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  const json header = json::parse(bytes.substr(8, header_len));
  REQUIRE(header.contains(name));
  const auto& t = header[name];
  const size_t begin = 8 + header_len + t["data_offsets"][0].get<size_t>();
  const size_t end = 8 + header_len + t["data_offsets"][1].get<size_t>();
  std::vector<int32_t> out;
  if (t["dtype"] == "I64") {
    for (size_t p = begin; p < end; p += 8) {
      int64_t v;
      std::memcpy(&v, bytes.data() + p, 8);
      out.push_back(static_cast<int32_t>(v));
    }
  } else {
    REQUIRE(t["dtype"] == "I32");
    for (size_t p = begin; p < end; p += 4) {
      int32_t v;
      std::memcpy(&v, bytes.data() + p, 4);
      out.push_back(v);
    }
  }
  return out;
}

// Streams ids one at a time; every piece must be valid UTF-8.
std::string stream_all(const moe::Tokenizer& tok, const std::vector<int32_t>& ids,
                       bool skip_special) {
  moe::StreamDecoder sd(tok, skip_special);
  std::string all;
  for (int32_t id : ids) {
    const std::string piece = sd.push(id);
    INFO("piece after id " << id);
    CHECK(moe::tok::utf8_valid(piece));
    all += piece;
  }
  const std::string rest = sd.flush();
  CHECK(moe::tok::utf8_valid(rest));
  return all + rest;
}

const char* const kReferenceTokenizers[] = {"bytelevel_qwen", "bytelevel_gpt2", "spm_bpe"};

}  // namespace

TEST_CASE("reference strings encode and decode exactly as the reference library", "[tokenizer]") {
  const json ref = json::parse(slurp(kFixtures + "/tokenizers/reference.json"));
  for (const char* name : kReferenceTokenizers) {
    auto tok = load(kFixtures + "/tokenizers/" + name);
    const auto& strings = ref[name]["strings"];
    REQUIRE(strings.size() >= 10);
    for (const auto& s : strings) {
      const std::string text = s["text"];
      INFO(name << ": " << text);
      CHECK(tok->encode(text, true) == ids_of(s["ids"]));
      CHECK(tok->encode(text, false) == ids_of(s["ids_no_special"]));
      CHECK(tok->decode(ids_of(s["ids"]), false) == s["decoded"].get<std::string>());
    }
  }
}

TEST_CASE("rendered chats encode to the reference ids without adding special tokens",
          "[tokenizer]") {
  const json ref = json::parse(slurp(kFixtures + "/tokenizers/reference.json"));
  for (const char* name : kReferenceTokenizers) {
    auto tok = load(kFixtures + "/tokenizers/" + name);
    const auto& chats = ref[name]["chats"];
    REQUIRE(!chats.empty());
    for (const auto& c : chats) {
      const std::string text = c["text"];
      INFO(name << ": " << text);
      CHECK(tok->encode(text, false) == ids_of(c["ids"]));
      // SentencePiece decoding keeps the space of a "▁" after a special token.
      if (std::string(name) != "spm_bpe") CHECK(tok->decode(ids_of(c["ids"]), false) == text);
    }
  }
}

TEST_CASE("streaming decode, token by token, gives the same text as decode",
          "[tokenizer][stream]") {
  const json ref = json::parse(slurp(kFixtures + "/tokenizers/reference.json"));
  for (const char* name : kReferenceTokenizers) {
    auto tok = load(kFixtures + "/tokenizers/" + name);
    for (const auto& s : ref[name]["strings"]) {
      const auto ids = ids_of(s["ids"]);
      INFO(name << ": " << s["text"].get<std::string>());
      CHECK(stream_all(*tok, ids, false) == s["decoded"].get<std::string>());
      CHECK(stream_all(*tok, ids, true) == tok->decode(ids, true));
    }
    for (const auto& c : ref[name]["chats"]) {
      const auto ids = ids_of(c["ids"]);
      CHECK(stream_all(*tok, ids, false) == tok->decode(ids, false));
    }
  }
}

TEST_CASE("stream decoder holds back a character split over byte tokens", "[tokenizer][stream]") {
  auto tok = load(kFixtures + "/tokenizers/spm_bpe");
  // "🙂" has no token of its own: four <0xNN> byte tokens.
  const auto ids = tok->encode("\xF0\x9F\x99\x82!", false);
  REQUIRE(ids.size() == 6);  // ▁ + 4 bytes + !
  moe::StreamDecoder sd(*tok);
  std::string out = sd.push(ids[0]);
  for (int k = 1; k <= 3; ++k) CHECK(sd.push(ids[static_cast<size_t>(k)]).empty());
  out += sd.push(ids[4]);
  CHECK(out == "\xF0\x9F\x99\x82");
  CHECK(sd.push(ids[5]) == "!");
  // A character left incomplete comes out as U+FFFD at flush.
  moe::StreamDecoder cut(*tok);
  CHECK(cut.push(ids[1]).empty());
  CHECK(cut.push(ids[2]).empty());
  CHECK(cut.flush().find("\xEF\xBF\xBD") != std::string::npos);
}

TEST_CASE("stream decoder holds back at most kMaxHeld ids, whatever comes", "[tokenizer][stream]") {
  auto tok = load(kFixtures + "/tokenizers/spm_bpe");
  const auto ids = tok->encode("\xF0\x9F\x99\x82!", false);
  REQUIRE(ids.size() == 6);
  // 3,000 lone lead bytes (no character ever completes), then "!": the text
  // comes out as the whole decodes (U+FFFD for each), never held back past
  // kMaxHeld ids (a window that only grew cost quadratic time).
  std::vector<int32_t> run(3000, ids[1]);
  run.push_back(ids[5]);
  moe::StreamDecoder sd(*tok);
  std::string out;
  size_t empty = 0, longest_empty = 0;
  for (int32_t id : run) {
    const std::string piece = sd.push(id);
    CHECK(moe::tok::utf8_valid(piece));
    empty = piece.empty() ? empty + 1 : 0;
    longest_empty = std::max(longest_empty, empty);
    out += piece;
  }
  out += sd.flush();
  CHECK(longest_empty <= moe::StreamDecoder::kMaxHeld + 1);
  CHECK(out == tok->decode(run, true));
  // A character split over byte tokens after such a run: as the whole decodes.
  std::vector<int32_t> then(40, ids[1]);
  then.insert(then.end(), ids.begin() + 1, ids.end());
  moe::StreamDecoder again(*tok);
  std::string whole;
  for (int32_t id : then) whole += again.push(id);
  whole += again.flush();
  CHECK(whole == tok->decode(then, true));
  // Skipped special tokens add no text and hold nothing up.
  auto qwen = load(kFixtures + "/tokenizers/bytelevel_qwen");
  const auto special = qwen->encode("<|endoftext|>", false);
  REQUIRE(special.size() == 1);
  std::vector<int32_t> specials(2000, special[0]);
  const auto tail = qwen->encode(" done", false);
  specials.insert(specials.end(), tail.begin(), tail.end());
  CHECK(stream_all(*qwen, specials, true) == " done");
}

TEST_CASE("token_bytes gives each token's own bytes, a part of a character included", "[tokenizer]") {
  // Byte tokens (SentencePiece's <0xNN>): one byte each, joined the character.
  auto spm = load(kFixtures + "/tokenizers/spm_bpe");
  const auto ids = spm->encode("\xF0\x9F\x99\x82!", false);
  REQUIRE(ids.size() == 6);
  std::string joined;
  for (int k = 1; k <= 4; ++k) {
    const std::string b = spm->token_bytes(ids[size_t(k)]);
    CHECK(b.size() == 1);
    joined += b;
  }
  CHECK(joined == "\xF0\x9F\x99\x82");
  CHECK(spm->decode(std::vector<int32_t>{ids[1]}, false) == "\xEF\xBF\xBD");  // decode repairs it
  // Byte-level vocabularies: every reference string's tokens join to its text.
  const json ref = json::parse(slurp(kFixtures + "/tokenizers/reference.json"));
  for (const char* name : {"bytelevel_qwen", "bytelevel_gpt2"}) {
    auto tok = load(kFixtures + "/tokenizers/" + name);
    int partial = 0;
    for (const auto& s : ref[name]["strings"]) {
      const auto sids = ids_of(s["ids_no_special"]);
      std::string all;
      for (int32_t id : sids) {
        const std::string b = tok->token_bytes(id);
        partial += moe::tok::utf8_valid(b) ? 0 : 1;
        all += b;
      }
      INFO(name << ": " << s["text"].get<std::string>());
      CHECK(all == tok->decode(sids, false));
    }
    INFO(name);
    CHECK(partial > 0);  // some token of the references is part of a character
  }
}

TEST_CASE("bos, eos and special ids come from the tokenizer files", "[tokenizer]") {
  auto spm = load(kFixtures + "/tokenizers/spm_bpe");
  CHECK(spm->bos_token() == "<s>");
  CHECK(spm->bos_id() == 1);
  CHECK(spm->eos_token() == "</s>");
  CHECK(spm->eos_id() == 2);
  CHECK(spm->is_special(1));
  CHECK_FALSE(spm->is_special(377));
  CHECK(spm->vocab_size() == 1118);
  CHECK(spm->token_to_id("<0x09>") == 12);
  CHECK(spm->id_to_token(12) == "<0x09>");
  CHECK(spm->token_to_id("no such token") == -1);
  CHECK(spm->id_to_token(1 << 20).empty());

  auto qwen = load(kFixtures + "/tokenizers/bytelevel_qwen");
  CHECK(qwen->bos_token().empty());
  CHECK(qwen->bos_id() == -1);
  CHECK(qwen->eos_token() == "<|im_end|>");
  CHECK(qwen->eos_id() == qwen->token_to_id("<|im_end|>"));
  CHECK(qwen->eos_id() >= 0);
  CHECK(qwen->is_special(qwen->eos_id()));
  // Special tokens are skipped on request only.
  const auto ids = qwen->encode("hi<|im_end|>", false);
  CHECK(qwen->decode(ids, true) == "hi");
  CHECK(qwen->decode(ids, false) == "hi<|im_end|>");
}

TEST_CASE("every model fixture's tokenizer reproduces its prompts' input ids", "[tokenizer]") {
  const json index = json::parse(slurp(kFixtures + "/index.json"));
  int checked_models = 0;
  for (const char* model :
       {"qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "qwen2_dense", "deepseek_v2"}) {
    const std::string dir = kFixtures + "/" + model;
    auto tok = load(dir);
    const json ref = json::parse(slurp(dir + "/reference.json"));
    for (const auto& p : ref["prompts"]) {
      const int i = p["index"];
      const std::string text = p["text"];
      const bool chat = p["chat"];
      INFO(model << " prompt " << i << ": " << text);
      const auto expected =
          safetensors_ids(dir + "/reference.safetensors", "p" + std::to_string(i) + ".input_ids");
      CHECK(tok->encode(text, !chat) == expected);
      CHECK(stream_all(*tok, expected, false) == tok->decode(expected, false));
    }
    ++checked_models;
  }
  CHECK(checked_models == 6);
  (void)index;
}

TEST_CASE("demo model: prompts, greedy samples and held-out text", "[tokenizer]") {
  auto tok = load(kDemo);
  const json ref = json::parse(slurp(kDemo + "/reference.json"));
  for (const auto& s : ref["samples"]) {
    INFO(s["prompt"].get<std::string>());
    CHECK(tok->encode(s["prompt"].get<std::string>(), false) == ids_of(s["prompt_ids"]));
    const auto greedy = ids_of(s["greedy_ids"]);
    CHECK(tok->decode(greedy, true) == s["greedy_text"].get<std::string>());
    CHECK(stream_all(*tok, greedy, true) == s["greedy_text"].get<std::string>());
  }
  // Held-out text: round trip of the first 50 KB (cut at a line end).
  const std::string eval_text = slurp(kDemo + "/eval.txt");
  std::string text = eval_text.substr(0, eval_text.rfind('\n', 50 * 1024) + 1);
  const auto ids = tok->encode(text, false);
  CHECK(ids.size() > 5000);
  CHECK(tok->decode(ids, false) == text);
  // The reference's ids of the same text: files joined by <|endoftext|>,
  // each encoded on its own. Every whole file must encode to its ids, and
  // the files' text must be the start of eval.txt.
  const auto eval_ids = safetensors_ids(kDemo + "/reference.safetensors", "eval.ids");
  const int32_t sep = tok->token_to_id("<|endoftext|>");
  REQUIRE(sep >= 0);
  std::string joined;
  int files = 0;
  for (size_t b = 0, e; (e = static_cast<size_t>(std::find(eval_ids.begin() + static_cast<long>(b),
                                                           eval_ids.end(), sep) -
                                                 eval_ids.begin())) < eval_ids.size();
       b = e + 1) {
    const std::vector<int32_t> file(eval_ids.begin() + static_cast<long>(b),
                                    eval_ids.begin() + static_cast<long>(e));
    const std::string file_text = tok->decode(file, false);
    CHECK(tok->encode(file_text, false) == file);
    joined += file_text;
    ++files;
  }
  CHECK(files >= 3);
  CHECK(eval_text.compare(0, joined.size(), joined) == 0);
}

TEST_CASE("invalid UTF-8 and NUL bytes are encoded, never rejected", "[tokenizer]") {
  for (const char* name : kReferenceTokenizers) {
    auto tok = load(kFixtures + "/tokenizers/" + name);
    INFO(name);
    // Each maximal invalid subsequence counts as one U+FFFD.
    CHECK(tok->encode("a\xFF"
                      "b",
                      false) == tok->encode("a\xEF\xBF\xBD"
                                            "b",
                                            false));
    CHECK(tok->encode("a\xE2\x82"
                      "b",
                      false) == tok->encode("a\xEF\xBF\xBD"
                                            "b",
                                            false));
    CHECK(tok->encode("x\xF0\x9F\x99", false) == tok->encode("x\xEF\xBF\xBD", false));
    CHECK(tok->encode("\xC0\x80", false) == tok->encode("\xEF\xBF\xBD\xEF\xBF\xBD", false));
    // NUL is a character like any other and survives the round trip.
    const std::string with_nul("a\0b", 3);
    const auto ids = tok->encode(with_nul, false);
    CHECK(ids.size() >= 3);
    std::string decoded = tok->decode(ids, false);
    if (std::string(name) == "spm_bpe") decoded.erase(0, decoded.find('a'));
    CHECK(decoded == with_nul);
    // Ids outside the vocabulary are skipped.
    const std::vector<int32_t> bad = {-5, 1 << 24};
    CHECK(tok->decode(bad, false).empty());
  }
}

TEST_CASE("loading reports bad input as errors", "[tokenizer]") {
  CHECK_FALSE(moe::Tokenizer::from_json("{", "").ok());
  CHECK_FALSE(moe::Tokenizer::from_json("{}", "").ok());
  CHECK_FALSE(moe::Tokenizer::from_json(R"({"model":{"type":"Unigram","vocab":[]}})", "").ok());
  CHECK_FALSE(moe::Tokenizer::load_dir(kFixtures + "/no-such-dir").ok());
  const auto r = moe::Tokenizer::from_json(
      R"({"model":{"type":"BPE","vocab":{"a":0},"merges":[]},"pre_tokenizer":{"type":"Split","pattern":{"Regex":"(("},"behavior":"Isolated"}})",
      "");
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().find("regex") != std::string::npos);
  // An id far past any vocabulary sized a table by it (a billion entries:
  // std::bad_alloc, an abort) before anything else was checked.
  for (const char* id : {"1000000000", "2147483647", "16777216", "99999999999", "-1", "1.5"}) {
    INFO(id);
    const auto big = moe::Tokenizer::from_json(
        std::string(R"({"model":{"type":"BPE","vocab":{"a":0,"zzz":)") + id + R"(},"merges":[]}})", "");
    REQUIRE_FALSE(big.ok());
    CHECK(big.error().find("zzz") != std::string::npos);
  }
  CHECK(moe::Tokenizer::from_json(R"({"model":{"type":"BPE","vocab":{"a":0,"zzz":16777215},"merges":[]}})", "").ok());
  const auto added = moe::Tokenizer::from_json(
      R"({"model":{"type":"BPE","vocab":{"a":0},"merges":[]},"added_tokens":[{"id":1000000000,"content":"<big>"}]})", "");
  REQUIRE_FALSE(added.ok());
  CHECK(added.error().find("<big>") != std::string::npos);
}

TEST_CASE("random text: never crashes, round-trips, streams as decode does", "[tokenizer]") {
  // Characters that are their own NFC form, so decode(encode(s)) == s.
  const char* const alphabet[] = {"a",
                                  "Z",
                                  " ",
                                  "  ",
                                  "\n",
                                  "\t",
                                  "'s",
                                  "'LL",
                                  "0",
                                  "42",
                                  "_",
                                  "(",
                                  "!",
                                  "\xC3\xA9",
                                  "\xE6\x95\xB0",
                                  "\xF0\x9F\x99\x82",
                                  "<|im_end|>",
                                  "<s>",
                                  "\xE2\x96\x81",
                                  "\r\n"};
  uint64_t state = 0x9E3779B97F4A7C15ull;
  auto next = [&state] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  for (const char* name : kReferenceTokenizers) {
    auto tok = load(kFixtures + "/tokenizers/" + name);
    INFO(name);
    for (int round = 0; round < 200; ++round) {
      std::string text, bytes;
      const int n = static_cast<int>(next() % 40);
      for (int k = 0; k < n; ++k)
        text += alphabet[next() % (sizeof(alphabet) / sizeof(alphabet[0]))];
      for (int k = 0; k < n; ++k) bytes.push_back(static_cast<char>(next() & 0xFF));
      INFO("text: " << text);
      const auto ids = tok->encode(text, false);
      std::string back = tok->decode(ids, false);
      if (std::string(name) != "spm_bpe") {
        CHECK(back == text);
      } else if (text.find("<s>") == std::string::npos &&
                 text.find("\xE2\x96\x81") == std::string::npos) {
        // SentencePiece: "▁" is a space once decoded, and a special token
        // starts a new "▁"-prefixed piece.
        CHECK(back == text);
      }
      CHECK(stream_all(*tok, ids, false) == tok->decode(ids, false));
      // Arbitrary bytes: valid ids, valid UTF-8 out.
      const auto byte_ids = tok->encode(bytes, true);
      for (int32_t id : byte_ids) CHECK((id >= 0 && id < tok->vocab_size()));
      CHECK(moe::tok::utf8_valid(tok->decode(byte_ids, false)));
      CHECK(stream_all(*tok, byte_ids, true) == tok->decode(byte_ids, true));
    }
  }
}

TEST_CASE("one tokenizer encodes from many threads at once", "[tokenizer]") {
  auto tok = load(kDemo);
  const std::string eval_text = slurp(kDemo + "/eval.txt");
  std::vector<std::string> texts;
  for (size_t off = 0; off + 4000 < 200000; off += 4000)
    texts.push_back(eval_text.substr(off, 4000));
  std::vector<std::vector<int32_t>> expected;
  {
    auto fresh = load(kDemo);
    for (const auto& t : texts) expected.push_back(fresh->encode(t, false));
  }
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w)
    threads.emplace_back([&, w] {
      for (size_t i = static_cast<size_t>(w); i < texts.size() * 4; i += 4)
        if (tok->encode(texts[i % texts.size()], false) != expected[i % texts.size()])
          ++mismatches[static_cast<size_t>(w)];
    });
  for (auto& t : threads) t.join();
  for (int m : mismatches) CHECK(m == 0);
}

TEST_CASE("merges written as \"a b\" strings give the same ids as [a, b] pairs", "[tokenizer]") {
  const json ref = json::parse(slurp(kFixtures + "/tokenizers/reference.json"));
  for (const char* name : {"bytelevel_qwen", "bytelevel_gpt2"}) {
    json tj = json::parse(slurp(kFixtures + "/tokenizers/" + name + "/tokenizer.json"));
    json merges = json::array();
    for (const auto& m : tj["model"]["merges"])
      merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
    tj["model"]["merges"] = merges;
    auto tok = moe::Tokenizer::from_json(
        tj.dump(), slurp(kFixtures + "/tokenizers/" + name + "/tokenizer_config.json"));
    REQUIRE(tok.ok());
    for (const auto& s : ref[name]["strings"]) {
      INFO(name << ": " << s["text"].get<std::string>());
      CHECK(tok.value()->encode(s["text"].get<std::string>(), true) == ids_of(s["ids"]));
    }
  }
}

TEST_CASE("a Metaspace pre-tokenizer and decoder match the Prepend+Replace normaliser",
          "[tokenizer]") {
  // The SentencePiece fixture spells "spaces become ▁, one ▁ in front" as
  // normalisers; Metaspace says the same, so it must give the same ids.
  const json ref = json::parse(slurp(kFixtures + "/tokenizers/reference.json"));
  for (bool split : {false, true}) {
    json tj = json::parse(slurp(kFixtures + "/tokenizers/spm_bpe/tokenizer.json"));
    tj["normalizer"] = nullptr;
    tj["pre_tokenizer"] = {{"type", "Metaspace"},
                           {"replacement", "\xE2\x96\x81"},
                           {"prepend_scheme", "always"},
                           {"split", split}};
    tj["decoder"] = {{"type", "Sequence"},
                     {"decoders", json::array({{{"type", "ByteFallback"}},
                                               {{"type", "Metaspace"},
                                                {"replacement", "\xE2\x96\x81"},
                                                {"prepend_scheme", "always"},
                                                {"split", split}}})}};
    auto tok = moe::Tokenizer::from_json(
        tj.dump(), slurp(kFixtures + "/tokenizers/spm_bpe/tokenizer_config.json"));
    REQUIRE(tok.ok());
    for (const auto& s : ref["spm_bpe"]["strings"]) {
      const std::string text = s["text"];
      // Metaspace prepends "▁" only where the text does not start with one.
      if (text.starts_with(" ")) continue;
      INFO("split " << split << ": " << text);
      CHECK(tok.value()->encode(text, true) == ids_of(s["ids"]));
      CHECK(tok.value()->encode(text, false) == ids_of(s["ids_no_special"]));
      CHECK(tok.value()->decode(ids_of(s["ids"]), false) == s["decoded"].get<std::string>());
      CHECK(stream_all(*tok.value(), ids_of(s["ids"]), false) == s["decoded"].get<std::string>());
    }
  }
}

TEST_CASE("clean_up_tokenization_spaces: decode drops the space before punctuation, streaming agrees",
          "[tokenizer][stream]") {
  // transformers' rules, in its order.
  CHECK(moe::clean_up_tokenization_spaces("Hi , there . Why ? Yes ! it 's I 'm we 've they 're do n't") ==
        "Hi, there. Why? Yes! it's I'm we've they're don't");
  CHECK(moe::clean_up_tokenization_spaces("a ' b") == "a'b");
  CHECK(moe::clean_up_tokenization_spaces("no change here") == "no change here");

  const std::string dir = kFixtures + "/tokenizers/bytelevel_gpt2";
  const std::string tj = slurp(dir + "/tokenizer.json");
  auto plain = moe::Tokenizer::from_json(tj, R"({"clean_up_tokenization_spaces": false})");
  auto clean = moe::Tokenizer::from_json(tj, R"({"clean_up_tokenization_spaces": true})");
  REQUIRE(plain.ok());
  REQUIRE(clean.ok());
  CHECK_FALSE(plain.value()->cleans_up_spaces());
  CHECK(clean.value()->cleans_up_spaces());
  const std::string text = "price: $3.14 , 99.9% off !!! ??? it 's here . Done";
  const auto ids = clean.value()->encode(text, false);
  CHECK(plain.value()->decode(ids, false) == text);
  const std::string cleaned = clean.value()->decode(ids, false);
  CHECK(cleaned == "price: $3.14, 99.9% off!!!??? it's here. Done");
  // The stream holds a trailing space back until the next piece shows whether it goes.
  CHECK(stream_all(*clean.value(), ids, false) == cleaned);
}
