#include "model/gguf_tokenizer.h"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <type_traits>
#include <unordered_map>

namespace moe {

namespace {

using nlohmann::json;

// GGUF token types.
enum : int64_t { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

// The splitting rules behind each tokenizer.ggml.pre name, as the
// tokenizer.json of a model of that family writes them (a sequence of
// isolating splits before the byte-level mapping).
struct PreTokenizer {
  std::vector<std::string> names;
  std::vector<std::string> regexes;
};

const std::vector<PreTokenizer>& pre_tokenizers() {
  static const std::vector<PreTokenizer> kAll = {
      {{"qwen2", "stablelm2", "hunyuan"},
       {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}},
      {{"qwen35"},
       {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}},
      {{"llama3", "llama-bpe", "llama-v3", "smaug-bpe", "dbrx"},
       {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}},
      {{"gpt-2", "gpt2", "olmo", "mpt", "jais"},
       {R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)"}},
      {{"deepseek-v3"},
       {R"(\p{N}{1,3})", "[一-龥぀-ゟ゠-ヿ]+",
        R"([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}},
  };
  return kAll;
}

// The string array `key` into *out; false when absent or not all strings.
bool tokens_at(const GgufFile& g, const char* key, std::vector<std::string>* out) {
  const GgufValue* v = g.find_value(key);
  if (!v || !v->as_array()) return false;
  out->clear();
  out->reserve(v->as_array()->size());
  for (const GgufValue& x : *v->as_array()) {
    const std::string* s = x.as_string();
    if (!s) return false;
    out->push_back(*s);
  }
  return true;
}

// The numeric array `key` of n entries (`fill` where the key is absent):
// int64 through as_int, double through as_double.
template <typename T>
Result<std::vector<T>> numbers_at(const GgufFile& g, const char* key, size_t n, T fill) {
  std::vector<T> out(n, fill);
  const GgufValue* v = g.find_value(key);
  if (!v) return out;
  const auto* a = v->as_array();
  if (!a || a->size() != n)
    return make_error(g.path() + ": '" + key + "' is not an array of " + std::to_string(n) + " entries");
  for (size_t i = 0; i < n; ++i) {
    bool ok;
    if constexpr (std::is_integral_v<T>)
      ok = (*a)[i].as_int(&out[i]);
    else
      ok = (*a)[i].as_double(&out[i]);
    if (!ok) return make_error(g.path() + ": '" + key + "' holds a non-number");
  }
  return out;
}

// Number of bytes of the UTF-8 character starting with byte c.
size_t utf8_len(unsigned char c) { return c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1; }

// SentencePiece BPE as llama.cpp runs it: repeatedly merge the adjacent pair
// whose joined text is a piece of the highest score, the leftmost among
// equal scores. As BPE merges: every split of every piece into two pieces,
// ranked by the joined piece's score (equal scores, equal ranks; our BPE
// breaks rank ties leftmost).
// Longer pieces (none in the vocabularies we know, whose longest are < 64
// bytes) are not made by merges.
constexpr size_t kMaxMergedPieceBytes = 512;

void spm_merges(const std::vector<std::string>& tokens, const std::vector<int64_t>& types,
                const std::vector<double>& scores, json* merges, json* ranks) {
  std::unordered_map<std::string, int32_t> id;
  for (size_t i = 0; i < tokens.size(); ++i)
    if (types[i] == kNormal || types[i] == kUserDefined || types[i] == kUnused) id.emplace(tokens[i], int32_t(i));
  std::vector<double> distinct;
  for (const auto& [t, i] : id) distinct.push_back(scores[size_t(i)]);
  std::sort(distinct.begin(), distinct.end(), std::greater<>());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  struct M {
    int32_t rank, piece;
    size_t split;
  };
  std::vector<M> all;
  for (const auto& [t, i] : id) {
    if (t.size() > kMaxMergedPieceBytes) continue;  // every split of a piece is tried: bound the work
    const int32_t rank =
        int32_t(std::lower_bound(distinct.begin(), distinct.end(), scores[size_t(i)], std::greater<>()) - distinct.begin());
    for (size_t k = utf8_len(static_cast<unsigned char>(t[0])); k < t.size(); k += utf8_len(static_cast<unsigned char>(t[k])))
      if (id.count(t.substr(0, k)) && id.count(t.substr(k))) all.push_back({rank, i, k});
  }
  std::sort(all.begin(), all.end(), [](const M& a, const M& b) {
    return a.rank != b.rank ? a.rank < b.rank : a.piece != b.piece ? a.piece < b.piece : a.split < b.split;
  });
  for (const M& m : all) {
    const std::string& t = tokens[size_t(m.piece)];
    merges->push_back(json::array({t.substr(0, m.split), t.substr(m.split)}));
    ranks->push_back(m.rank);
  }
}

}  // namespace

const std::vector<std::string>& gguf_known_pre_tokenizers() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const PreTokenizer& p : pre_tokenizers()) out.insert(out.end(), p.names.begin(), p.names.end());
    return out;
  }();
  return names;
}

Result<GgufTokenizerFiles> gguf_tokenizer_files(const GgufFile& g) {
  std::string model;
  if (auto got = g.get_string("tokenizer.ggml.model", &model); !got || !*got)
    return make_error(got ? g.path() + ": no tokenizer in the file (tokenizer.ggml.model missing)" : got.error());
  std::vector<std::string> tokens;
  if (!tokens_at(g, "tokenizer.ggml.tokens", &tokens))
    return make_error(g.path() + ": tokenizer.ggml.tokens missing or not a list of strings");
  const size_t n = tokens.size();
  auto types = numbers_at<int64_t>(g, "tokenizer.ggml.token_type", n, kNormal);
  if (!types) return make_error(types.error());

  json tj;
  tj["version"] = "1.0";
  json added = json::array();
  for (size_t i = 0; i < n; ++i) {
    const int64_t t = (*types)[i];
    if (t != kControl && t != kUserDefined) continue;
    if (tokens[i].empty()) continue;
    added.push_back({{"id", i},
                     {"content", tokens[i]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", t == kControl}});
  }
  tj["added_tokens"] = added;
  json vocab = json::object();
  for (size_t i = 0; i < n; ++i) vocab[tokens[i]] = i;

  auto special_id = [&](const char* key, int64_t* out) -> Status {
    *out = -1;
    auto got = g.get_int(key, out);
    if (!got) return make_error(got.error());
    if (*got && (*out < 0 || size_t(*out) >= n)) return make_error(g.path() + ": " + key + " is out of the vocabulary");
    return Status::ok_status();
  };
  int64_t bos = -1, eos = -1, eot = -1, eom = -1, unk = -1;
  MOE_TRY(special_id("tokenizer.ggml.bos_token_id", &bos));
  MOE_TRY(special_id("tokenizer.ggml.eos_token_id", &eos));
  MOE_TRY(special_id("tokenizer.ggml.eot_token_id", &eot));
  MOE_TRY(special_id("tokenizer.ggml.eom_token_id", &eom));
  MOE_TRY(special_id("tokenizer.ggml.unknown_token_id", &unk));

  bool add_bos = false, add_eos = false;
  bool clean_spaces = false;  // llama.cpp's clean_spaces: false for SentencePiece
  if (model == "gpt2") {
    std::string pre;
    if (auto got = g.get_string("tokenizer.ggml.pre", &pre); !got) return make_error(got.error());
    const PreTokenizer* rules = nullptr;
    for (const PreTokenizer& p : pre_tokenizers())
      if (std::find(p.names.begin(), p.names.end(), pre) != p.names.end()) rules = &p;
    if (!rules) {
      std::string known;
      for (const std::string& k : gguf_known_pre_tokenizers()) known += (known.empty() ? "" : ", ") + k;
      return make_error(g.path() + ": pre-tokenizer '" + pre + "' is not known (known: " + known + ")");
    }
    // llama.cpp cleans up spaces on detokenising a BPE vocabulary unless its
    // pre-tokenizer says not to (of the names read here: these).
    static const char* const kNoCleanUp[] = {"qwen2", "qwen35", "deepseek-v3", "hunyuan"};
    clean_spaces = std::find(std::begin(kNoCleanUp), std::end(kNoCleanUp), pre) == std::end(kNoCleanUp);
    json seq = json::array();
    for (const std::string& r : rules->regexes)
      seq.push_back({{"type", "Split"}, {"pattern", {{"Regex", r}}}, {"behavior", "Isolated"}, {"invert", false}});
    seq.push_back({{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}});
    tj["normalizer"] = nullptr;
    tj["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", seq}};
    tj["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
    std::vector<std::string> merges;
    if (!tokens_at(g, "tokenizer.ggml.merges", &merges))
      return make_error(g.path() + ": a gpt2 tokenizer without tokenizer.ggml.merges");
    tj["model"] = {{"type", "BPE"},          {"dropout", nullptr},          {"unk_token", nullptr},
                   {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
                   {"fuse_unk", false},      {"byte_fallback", false},      {"ignore_merges", false},
                   {"vocab", vocab},         {"merges", merges}};
  } else if (model == "llama") {
    auto scores = numbers_at<double>(g, "tokenizer.ggml.scores", n, 0.0);
    if (!scores) return make_error(scores.error());
    bool space_prefix = true;
    if (auto got = g.get_bool("tokenizer.ggml.add_space_prefix", &space_prefix); !got) return make_error(got.error());
    add_bos = true;  // llama.cpp's default for SentencePiece vocabularies
    json normalizers = json::array();
    if (space_prefix) normalizers.push_back({{"type", "Prepend"}, {"prepend", "\u2581"}});
    normalizers.push_back({{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}});
    tj["normalizer"] = {{"type", "Sequence"}, {"normalizers", normalizers}};
    tj["pre_tokenizer"] = nullptr;
    json decoders = json::array({json{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
                                 json{{"type", "ByteFallback"}}, json{{"type", "Fuse"}}});
    if (space_prefix) decoders.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
    tj["decoder"] = {{"type", "Sequence"}, {"decoders", decoders}};
    json merges = json::array(), ranks = json::array();
    spm_merges(tokens, *types, *scores, &merges, &ranks);
    tj["model"] = {{"type", "BPE"},
                   {"dropout", nullptr},
                   {"unk_token", unk >= 0 ? json(tokens[size_t(unk)]) : json(nullptr)},
                   {"continuing_subword_prefix", nullptr},
                   {"end_of_word_suffix", nullptr},
                   {"fuse_unk", true},
                   {"byte_fallback", true},
                   {"ignore_merges", false},
                   {"vocab", vocab},
                   {"merges", merges},
                   {"merge_ranks", ranks}};
  } else {
    return make_error(g.path() + ": tokenizer model '" + model + "' is not read (gpt2 and llama are)");
  }
  tj["post_processor"] = nullptr;
  if (auto got = g.get_bool("tokenizer.ggml.add_bos_token", &add_bos); !got) return make_error(got.error());
  if (auto got = g.get_bool("tokenizer.ggml.add_eos_token", &add_eos); !got) return make_error(got.error());

  json cfg;
  if (bos >= 0) cfg["bos_token"] = tokens[size_t(bos)];
  if (eos >= 0) cfg["eos_token"] = tokens[size_t(eos)];
  if (unk >= 0) cfg["unk_token"] = tokens[size_t(unk)];
  cfg["add_bos_token"] = add_bos && bos >= 0;
  cfg["add_eos_token"] = add_eos && eos >= 0;
  cfg["clean_up_tokenization_spaces"] = clean_spaces;
  std::string chat;
  if (auto got = g.get_string("tokenizer.chat_template", &chat); !got) return make_error(got.error());
  else if (*got) cfg["chat_template"] = chat;

  GgufTokenizerFiles out;
  // A string that is not UTF-8 (GGUF requires it) comes out with U+FFFD in its place.
  out.tokenizer_json = tj.dump(-1, ' ', false, json::error_handler_t::replace);
  out.tokenizer_config_json = cfg.dump(2, ' ', false, json::error_handler_t::replace);
  for (int64_t id : {eos, eot, eom})
    if (id >= 0 && std::find(out.eos_ids.begin(), out.eos_ids.end(), int32_t(id)) == out.eos_ids.end())
      out.eos_ids.push_back(int32_t(id));
  out.bos_id = int32_t(bos);
  return out;
}

}  // namespace moe
