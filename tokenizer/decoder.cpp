#include "tokenizer/decoder.h"

#include <utility>

#include "tokenizer/byte_level.h"
#include "tokenizer/replace_pattern.h"
#include "tokenizer/utf8.h"

namespace moe::tok {

namespace {

// Byte-alphabet characters back to bytes; a token with a character outside
// the alphabet (an added token such as "<|im_end|>" may have one) is taken
// as its own UTF-8. The bytes of all tokens are joined, then repaired.
class ByteLevel final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    tokens.assign(1, sanitize_utf8(joined(tokens)));
  }
  void decode_chain_raw(std::vector<std::string>& tokens) const override { tokens.assign(1, joined(tokens)); }

 private:
  static std::string joined(const std::vector<std::string>& tokens) {
    const ByteAlphabet& alphabet = byte_alphabet();
    std::string bytes;
    for (const auto& t : tokens)
      if (!alphabet.decode(t, bytes)) bytes += t;
    return bytes;
  }
};

class Replace final : public Decoder {
 public:
  explicit Replace(ReplacePattern p) : p_(std::move(p)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (auto& t : tokens) t = p_.apply(t);
  }

 private:
  ReplacePattern p_;
};

// Runs of "<0xNN>" tokens become their bytes when those form valid UTF-8;
// otherwise each byte of the run becomes one U+FFFD.
class ByteFallback final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override { decode(tokens, true); }
  void decode_chain_raw(std::vector<std::string>& tokens) const override { decode(tokens, false); }

 private:
  static void decode(std::vector<std::string>& tokens, bool repair) {
    std::vector<std::string> out;
    out.reserve(tokens.size());
    std::string run;
    size_t run_len = 0;
    auto flush = [&] {
      if (run_len == 0) return;
      if (!repair || utf8_valid(run)) {
        out.push_back(run);
      } else {
        for (size_t k = 0; k < run_len; ++k) out.emplace_back(kReplacementChar);
      }
      run.clear();
      run_len = 0;
    };
    for (auto& t : tokens) {
      int byte = -1;
      if (t.size() == 6 && t.starts_with("<0x") && t.back() == '>') byte = parse_hex2(t[3], t[4]);
      if (byte >= 0) {
        run.push_back(static_cast<char>(byte));
        ++run_len;
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens = std::move(out);
  }

  static int hex(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  }
  static int parse_hex2(char a, char b) {
    const int h = hex(a), l = hex(b);
    return h < 0 || l < 0 ? -1 : h * 16 + l;
  }
};

class Fuse final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const auto& t : tokens) all += t;
    tokens.assign(1, std::move(all));
  }
};

// Removes up to `start` leading and `stop` trailing copies of one character
// from every token.
class Strip final : public Decoder {
 public:
  Strip(std::string content, size_t start, size_t stop)
      : content_(std::move(content)), start_(start), stop_(stop) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    if (content_.empty()) return;
    const size_t w = content_.size();
    for (auto& t : tokens) {
      size_t b = 0, e = t.size();
      for (size_t k = 0; k < start_ && e - b >= w && t.compare(b, w, content_) == 0; ++k) b += w;
      for (size_t k = 0; k < stop_ && e - b >= w && t.compare(e - w, w, content_) == 0; ++k) e -= w;
      t = t.substr(b, e - b);
    }
  }

 private:
  std::string content_;
  size_t start_, stop_;
};

// The replacement character back to a space; in the first token it is
// dropped instead when a space was prepended at encoding.
class Metaspace final : public Decoder {
 public:
  Metaspace(std::string replacement, bool drop_first)
      : repl_(std::move(replacement)), drop_first_(drop_first) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string out;
      const std::string& t = tokens[i];
      for (size_t pos = 0;;) {
        const size_t hit = t.find(repl_, pos);
        out.append(t, pos, hit == std::string::npos ? std::string::npos : hit - pos);
        if (hit == std::string::npos) break;
        if (!(i == 0 && drop_first_)) out.push_back(' ');
        pos = hit + repl_.size();
      }
      tokens[i] = std::move(out);
    }
  }

 private:
  std::string repl_;
  bool drop_first_;
};

class Sequence final : public Decoder {
 public:
  explicit Sequence(std::vector<std::unique_ptr<Decoder>> parts) : parts_(std::move(parts)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (const auto& p : parts_) p->decode_chain(tokens);
  }
  void decode_chain_raw(std::vector<std::string>& tokens) const override {
    for (const auto& p : parts_) p->decode_chain_raw(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> parts_;
};

}  // namespace

Result<std::unique_ptr<Decoder>> make_decoder(const nlohmann::json& spec) {
  if (spec.is_null()) return std::unique_ptr<Decoder>();
  if (!spec.is_object() || !spec.contains("type"))
    return make_error("decoder: not an object with a type");
  const std::string type = spec["type"].get<std::string>();
  if (type == "ByteLevel") return std::unique_ptr<Decoder>(new ByteLevel());
  if (type == "ByteFallback") return std::unique_ptr<Decoder>(new ByteFallback());
  if (type == "Fuse") return std::unique_ptr<Decoder>(new Fuse());
  if (type == "Strip")
    return std::unique_ptr<Decoder>(new Strip(
        spec.value("content", " "), spec.value("start", size_t{0}), spec.value("stop", size_t{0})));
  if (type == "Replace") {
    auto p = ReplacePattern::from_json(spec);
    if (!p) return make_error("decoder Replace: " + p.error());
    return std::unique_ptr<Decoder>(new Replace(std::move(p.value())));
  }
  if (type == "Metaspace") {
    bool drop_first = true;
    if (spec.contains("prepend_scheme"))
      drop_first = spec["prepend_scheme"].get<std::string>() != "never";
    else if (spec.contains("add_prefix_space"))
      drop_first = spec.value("add_prefix_space", true);
    return std::unique_ptr<Decoder>(
        new Metaspace(spec.value("replacement", "\xE2\x96\x81"), drop_first));
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Decoder>> parts;
    for (const auto& sub : spec.value("decoders", nlohmann::json::array())) {
      auto d = make_decoder(sub);
      if (!d) return make_error(d.error());
      if (d.value()) parts.push_back(std::move(d.value()));
    }
    return std::unique_ptr<Decoder>(new Sequence(std::move(parts)));
  }
  return make_error("decoder type '" + type + "' is not supported");
}

}  // namespace moe::tok
