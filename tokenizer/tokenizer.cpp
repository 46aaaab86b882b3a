#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "tokenizer/added_vocabulary.h"
#include "tokenizer/bpe_model.h"
#include "tokenizer/decoder.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/post_processor.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/utf8.h"

namespace moe {

using nlohmann::json;

struct Tokenizer::Impl {
  std::unique_ptr<tok::Normalizer> normalizer;
  std::unique_ptr<tok::PreTokenizer> pre_tokenizer;
  std::unique_ptr<tok::BpeModel> model;
  std::unique_ptr<tok::PostProcessor> post_processor;
  std::unique_ptr<tok::Decoder> decoder;

  std::vector<tok::AddedToken> added;
  std::unordered_map<int32_t, size_t> added_by_id;  // id -> index in added
  tok::TokenMap added_by_content;
  std::unique_ptr<tok::AddedMatcher> raw_matcher;  // normalized=false tokens, on raw text
  std::unique_ptr<tok::AddedMatcher>
      normalized_matcher;  // normalized=true tokens, on normalised text
  // The same without the special tokens: encode_part() of text in which a
  // special token's text is only text.
  std::unique_ptr<tok::AddedMatcher> raw_text_matcher, normalized_text_matcher;
  int32_t max_id = -1;

  // The text cut at its raw-matched added tokens (the special ones too
  // where `specials`), each plain run encoded; `at_text_start`: the text
  // begins the input.
  std::vector<int32_t> encode_all(std::string_view text, bool specials, bool at_text_start) const {
    std::string repaired;
    if (!tok::utf8_valid(text)) {
      repaired = tok::sanitize_utf8(text);
      text = repaired;
    }
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3 + 4);
    std::vector<tok::Segment> segs;
    if (const tok::AddedMatcher* m = specials ? raw_matcher.get() : raw_text_matcher.get())
      m->split(text, segs);
    else
      segs.push_back({text, -1});
    for (const auto& s : segs) {
      if (s.id >= 0)
        ids.push_back(s.id);
      else if (!s.text.empty())
        encode_plain(s.text, at_text_start && s.text.data() == text.data(), ids, specials);
    }
    return ids;
  }

  // Plain text between raw-matched added tokens: normalise, cut out the
  // normalised added tokens (the special ones too where `specials`),
  // pre-tokenise, run BPE on each word.
  void encode_plain(std::string_view text, bool at_text_start, std::vector<int32_t>& ids, bool specials) const {
    const std::string normalized = normalizer ? normalizer->normalize(text) : std::string(text);
    std::vector<tok::Segment> segs;
    const tok::AddedMatcher* matcher = specials ? normalized_matcher.get() : normalized_text_matcher.get();
    if (matcher)
      matcher->split(normalized, segs);
    else
      segs.push_back({normalized, -1});
    std::vector<std::string> pieces;
    for (size_t k = 0; k < segs.size(); ++k) {
      if (segs[k].id >= 0) {
        ids.push_back(segs[k].id);
        continue;
      }
      if (segs[k].text.empty()) continue;
      pieces.assign(1, std::string(segs[k].text));
      if (pre_tokenizer) pre_tokenizer->pre_tokenize(pieces, at_text_start && k == 0);
      for (const auto& p : pieces) model->encode_word(p, ids);
    }
  }
};

Tokenizer::Tokenizer() : impl_(std::make_unique<Impl>()) {}
Tokenizer::~Tokenizer() = default;

namespace {

// bos_token / eos_token in tokenizer_config.json: a string or {"content": ...}.
std::string config_token(const json& cfg, const char* key) {
  if (!cfg.contains(key)) return {};
  const auto& v = cfg[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  return {};
}

tok::AddedToken parse_added(const json& a) {
  tok::AddedToken t;
  t.content = a.value("content", "");
  // An id past any vocabulary reads as kMaxTokenId + 1, which the caller refuses.
  const json id = a.value("id", json(-1));
  t.id = !id.is_number_integer() ? -1
         : id.get<int64_t>() > tok::kMaxTokenId ? tok::kMaxTokenId + 1
                                                : int32_t(std::max<int64_t>(id.get<int64_t>(), -1));
  t.special = a.value("special", false);
  t.single_word = a.value("single_word", false);
  t.lstrip = a.value("lstrip", false);
  t.rstrip = a.value("rstrip", false);
  // Defaults as the reference: special tokens are matched on raw text.
  t.normalized = a.value("normalized", !t.special);
  return t;
}

Result<std::string> read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return make_error("cannot open " + p.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

namespace {

// The replacements of transformers' clean_up_tokenization, in its order.
constexpr std::pair<std::string_view, std::string_view> kCleanUpRules[] = {
    {" .", "."},   {" ?", "?"},   {" !", "!"},   {" ,", ","},   {" ' ", "'"},
    {" n't", "n't"}, {" 'm", "'m"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"},
};

}  // namespace

bool clean_up_may_change_tail(std::string_view text) {
  for (const auto& [from, to] : kCleanUpRules)
    for (size_t k = 1; k < from.size(); ++k)
      if (text.ends_with(from.substr(0, k))) return true;
  return false;
}

std::string clean_up_tokenization_spaces(std::string_view text) {
  std::string s(text);
  for (const auto& [from, to] : kCleanUpRules) {
    std::string out;
    out.reserve(s.size());
    size_t at = 0;
    for (size_t hit; (hit = s.find(from, at)) != std::string::npos; at = hit + from.size())
      out.append(s, at, hit - at).append(to);
    out.append(s, at, std::string::npos);
    s = std::move(out);
  }
  return s;
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::from_json(std::string_view tokenizer_json,
                                                        std::string_view tokenizer_config_json) {
  try {
    const json tj = json::parse(tokenizer_json);
    const json cfg =
        tokenizer_config_json.empty() ? json::object() : json::parse(tokenizer_config_json);
    if (!tj.is_object()) return make_error("tokenizer.json: not an object");
    auto t = std::unique_ptr<Tokenizer>(new Tokenizer());
    Impl& im = *t->impl_;

    auto model = tok::BpeModel::from_json(tj.value("model", json()));
    if (!model) return make_error("tokenizer.json: " + model.error());
    im.model = std::move(model.value());
    im.max_id = im.model->max_id();
    auto norm = tok::make_normalizer(tj.value("normalizer", json()));
    if (!norm) return make_error("tokenizer.json: " + norm.error());
    im.normalizer = std::move(norm.value());
    auto pre = tok::make_pre_tokenizer(tj.value("pre_tokenizer", json()));
    if (!pre) return make_error("tokenizer.json: " + pre.error());
    im.pre_tokenizer = std::move(pre.value());
    auto post = tok::make_post_processor(tj.value("post_processor", json()));
    if (!post) return make_error("tokenizer.json: " + post.error());
    im.post_processor = std::move(post.value());
    auto dec = tok::make_decoder(tj.value("decoder", json()));
    if (!dec) return make_error("tokenizer.json: " + dec.error());
    im.decoder = std::move(dec.value());

    std::string bad_id;
    auto add_token = [&](tok::AddedToken a) {
      if (a.id > tok::kMaxTokenId && bad_id.empty()) bad_id = a.content.substr(0, 64);
      if (a.id < 0 || a.id > tok::kMaxTokenId || a.content.empty() || im.added_by_id.count(a.id)) return;
      im.added_by_id.emplace(a.id, im.added.size());
      im.added_by_content.emplace(a.content, a.id);
      im.max_id = std::max(im.max_id, a.id);
      im.added.push_back(std::move(a));
    };
    for (const auto& a : tj.value("added_tokens", json::array())) add_token(parse_added(a));
    if (!bad_id.empty())
      return make_error("tokenizer.json: the added token '" + bad_id + "' has an id past " +
                        std::to_string(tok::kMaxTokenId));
    // Tokens that only tokenizer_config.json declares (id -> flags).
    if (cfg.contains("added_tokens_decoder") && cfg["added_tokens_decoder"].is_object()) {
      for (const auto& [id, a] : cfg["added_tokens_decoder"].items()) {
        json with_id = a;
        char* end = nullptr;
        const long long n = std::strtoll(id.c_str(), &end, 10);
        if (id.empty() || *end != '\0' || n < 0 || n > tok::kMaxTokenId)
          return make_error("tokenizer_config.json: added_tokens_decoder has the id '" + id.substr(0, 32) +
                            "', not an integer from 0 to " + std::to_string(tok::kMaxTokenId));
        with_id["id"] = int(n);
        add_token(parse_added(with_id));
      }
    }
    std::vector<tok::AddedToken> raw, normalized, raw_text, normalized_text;
    for (const auto& a : im.added) {
      if (!a.normalized) {
        raw.push_back(a);
        if (!a.special) raw_text.push_back(a);
      } else {
        tok::AddedToken n = a;
        if (im.normalizer) n.content = im.normalizer->normalize(a.content);
        if (!a.special) normalized_text.push_back(n);
        normalized.push_back(std::move(n));
      }
    }
    if (!raw.empty()) im.raw_matcher = std::make_unique<tok::AddedMatcher>(std::move(raw));
    if (!normalized.empty())
      im.normalized_matcher = std::make_unique<tok::AddedMatcher>(std::move(normalized));
    if (!raw_text.empty()) im.raw_text_matcher = std::make_unique<tok::AddedMatcher>(std::move(raw_text));
    if (!normalized_text.empty())
      im.normalized_text_matcher = std::make_unique<tok::AddedMatcher>(std::move(normalized_text));

    // transformers' clean_up_tokenization: decode() drops the space before
    // . ? ! , and English contractions (off unless the config says true).
    if (cfg.contains("clean_up_tokenization_spaces") && cfg["clean_up_tokenization_spaces"].is_boolean())
      t->clean_up_spaces_ = cfg["clean_up_tokenization_spaces"].get<bool>();

    t->bos_token_ = config_token(cfg, "bos_token");
    t->eos_token_ = config_token(cfg, "eos_token");
    if (!t->bos_token_.empty()) t->bos_id_ = t->token_to_id(t->bos_token_);
    if (!t->eos_token_.empty()) t->eos_id_ = t->token_to_id(t->eos_token_);

    // Explicit add_bos_token / add_eos_token replace the post-processor with
    // bos + A + eos, the way the reference's slow-tokenizer settings do.
    const bool has_add_bos = cfg.contains("add_bos_token") && cfg["add_bos_token"].is_boolean();
    const bool has_add_eos = cfg.contains("add_eos_token") && cfg["add_eos_token"].is_boolean();
    if (has_add_bos || has_add_eos) {
      std::vector<int32_t> prefix, suffix;
      if (has_add_bos && cfg["add_bos_token"].get<bool>() && t->bos_id_ >= 0)
        prefix.push_back(t->bos_id_);
      if (has_add_eos && cfg["add_eos_token"].get<bool>() && t->eos_id_ >= 0)
        suffix.push_back(t->eos_id_);
      im.post_processor = tok::make_wrap_processor(std::move(prefix), std::move(suffix));
    }
    return t;
  } catch (const json::exception& e) {
    return make_error(std::string("tokenizer json: ") + e.what());
  }
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::load_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return make_error(dir + ": not a directory");
  auto tj = read_file(fs::path(dir) / "tokenizer.json");
  if (!tj) return make_error(tj.error());
  std::string cfg;
  if (fs::exists(fs::path(dir) / "tokenizer_config.json", ec)) {
    auto c = read_file(fs::path(dir) / "tokenizer_config.json");
    if (!c) return make_error(c.error());
    cfg = std::move(c.value());
  }
  auto t = from_json(tj.value(), cfg);
  if (!t) return make_error(dir + ": " + t.error());
  return t;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  std::vector<int32_t> ids = impl_->encode_all(text, /*specials=*/true, /*at_text_start=*/true);
  if (add_special_tokens && impl_->post_processor) impl_->post_processor->process(ids);
  return ids;
}

std::vector<int32_t> Tokenizer::encode_part(std::string_view text, bool specials, bool at_text_start) const {
  return impl_->encode_all(text, specials, at_text_start);
}

bool Tokenizer::has_special_text(std::string_view text) const {
  const Impl& im = *impl_;
  std::vector<tok::Segment> segs;
  auto any_special = [&] {
    for (const auto& s : segs)
      if (s.id >= 0 && im.added[im.added_by_id.at(s.id)].special) return true;
    return false;
  };
  if (im.raw_matcher) {
    im.raw_matcher->split(text, segs);
    if (any_special()) return true;
  }
  if (im.normalized_matcher) {  // tokens matched in the normalised text
    segs.clear();
    const std::string normalized = im.normalizer ? im.normalizer->normalize(text) : std::string(text);
    im.normalized_matcher->split(normalized, segs);
    if (any_special()) return true;
  }
  return false;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& im = *impl_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    auto it = im.added_by_id.find(id);
    if (it != im.added_by_id.end()) {
      const auto& a = im.added[it->second];
      if (!(skip_special_tokens && a.special)) tokens.push_back(a.content);
      continue;
    }
    if (const std::string* t = im.model->id_to_token(id)) tokens.push_back(*t);
  }
  if (im.decoder) im.decoder->decode_chain(tokens);
  std::string out;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (i && !im.decoder) out.push_back(' ');
    out += tokens[i];
  }
  return clean_up_spaces_ ? clean_up_tokenization_spaces(out) : out;
}

std::string Tokenizer::token_bytes(int32_t id) const {
  const Impl& im = *impl_;
  if (auto it = im.added_by_id.find(id); it != im.added_by_id.end()) return im.added[it->second].content;
  const std::string* t = im.model->id_to_token(id);
  if (!t) return {};
  std::vector<std::string> tokens{*t};
  if (im.decoder) im.decoder->decode_chain_raw(tokens);
  std::string out;
  for (const std::string& s : tokens) out += s;
  return out;
}

int32_t Tokenizer::token_to_id(std::string_view token) const {
  auto it = impl_->added_by_content.find(token);
  if (it != impl_->added_by_content.end()) return it->second;
  return impl_->model->token_to_id(token);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  auto it = impl_->added_by_id.find(id);
  if (it != impl_->added_by_id.end()) return impl_->added[it->second].content;
  const std::string* t = impl_->model->id_to_token(id);
  return t ? *t : std::string();
}

int Tokenizer::vocab_size() const { return impl_->max_id + 1; }

bool Tokenizer::is_special(int32_t id) const {
  auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && impl_->added[it->second].special;
}

}  // namespace moe
