#include "tokenizer/jinja_lexer.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "tokenizer/jinja_value.h"

namespace moe::jinja {

namespace {

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }

// Jinja reads the source with every newline spelled "\n" and, by default,
// without one trailing newline.
std::string normalise(std::string_view source, bool keep_trailing_newline) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!keep_trailing_newline && !out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

class Lexer {
 public:
  Lexer(std::string src, const LexOptions& opt) : src_(std::move(src)), opt_(opt) {}

  std::vector<Token> run() {
    while (pos_ < src_.size()) {
      size_t start = find_tag_start(pos_);
      if (start == std::string::npos) {
        emit_data(src_.substr(pos_), line_);
        advance_to(src_.size());
        break;
      }
      const char kind = src_[start + 1];
      size_t after = start + 2;
      char sign = 0;
      if (after < src_.size() && (src_[after] == '-' || src_[after] == '+')) sign = src_[after++];

      size_t raw_body = std::string::npos;
      if (kind == '%') raw_body = match_raw_begin(after);

      const int text_line = line_;
      std::string text = strip_before_tag(src_.substr(pos_, start - pos_), sign, kind != '{');
      emit_data(std::move(text), text_line);
      advance_to(after);

      if (kind == '#') {
        lex_comment();
      } else if (raw_body != std::string::npos) {
        advance_to(raw_body);
        line_starting_ = src_[raw_body - 1] == '\n';
        lex_raw_body();
      } else {
        lex_tag(kind);
      }
    }
    tokens_.push_back(Token{TokenKind::End, "", line_});
    return std::move(tokens_);
  }

 private:
  [[noreturn]] void fail(const std::string& msg, int line) { throw TemplateError(msg, line); }

  void advance_to(size_t to) {
    line_ += static_cast<int>(std::count(src_.begin() + static_cast<std::ptrdiff_t>(pos_),
                                         src_.begin() + static_cast<std::ptrdiff_t>(to), '\n'));
    pos_ = to;
  }

  size_t skip_spaces(size_t p) const {
    while (p < src_.size() && is_space(src_[p])) ++p;
    return p;
  }

  bool at(size_t p, std::string_view s) const { return src_.compare(p, s.size(), s) == 0; }

  size_t find_tag_start(size_t from) const {
    for (size_t p = src_.find('{', from); p != std::string::npos; p = src_.find('{', p + 1)) {
      if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#'))
        return p;
    }
    return std::string::npos;
  }

  // `{% raw %}`: returns where the raw body starts, or npos if this is not one.
  size_t match_raw_begin(size_t p) const {
    p = skip_spaces(p);
    if (!at(p, "raw")) return std::string::npos;
    p = skip_spaces(p + 3);
    if (at(p, "-%}")) return skip_spaces(p + 3);
    if (at(p, "%}")) return p + 2;
    return std::string::npos;
  }

  // Whitespace control on the text before a tag: `-` strips all whitespace;
  // lstrip_blocks strips a line's indentation before a block or comment tag.
  std::string strip_before_tag(std::string text, char sign, bool block_or_comment) const {
    if (sign == '-') {
      size_t end = text.size();
      while (end > 0 && is_space(text[end - 1])) --end;
      text.resize(end);
    } else if (sign != '+' && opt_.lstrip_blocks && block_or_comment) {
      size_t nl = text.rfind('\n');
      size_t line_start = nl == std::string::npos ? 0 : nl + 1;
      if (line_start > 0 || line_starting_) {
        bool blank = line_start < text.size();
        for (size_t i = line_start; i < text.size() && blank; ++i) blank = is_space(text[i]);
        if (blank) text.resize(line_start);
      }
    }
    return text;
  }

  void emit_data(std::string text, int line) {
    if (text.empty()) return;
    tokens_.push_back(Token{TokenKind::Data, std::move(text), line});
  }

  // The end of a block or comment tag: `+%}` keeps what follows, `-%}` eats the
  // following whitespace, plain `%}` eats one newline under trim_blocks.
  // `p` points at the `+`, `-` or the closing pair.
  size_t end_of_block_tag(size_t p) {
    if (src_[p] == '+') return p + 3;
    if (src_[p] == '-') return skip_spaces(p + 3);
    p += 2;
    if (opt_.trim_blocks && p < src_.size() && src_[p] == '\n') ++p;
    return p;
  }

  void finish_tag(size_t end) {
    advance_to(end);
    line_starting_ = end > 0 && src_[end - 1] == '\n';
  }

  void lex_comment() {
    const int begin_line = line_;
    size_t close = src_.find("#}", pos_);
    if (close == std::string::npos) fail("missing end of comment tag", begin_line);
    size_t p = close;
    if (close > pos_ && (src_[close - 1] == '-' || src_[close - 1] == '+')) p = close - 1;
    finish_tag(end_of_block_tag(p));
  }

  void lex_raw_body() {
    const int begin_line = line_;
    for (size_t p = src_.find("{%", pos_); p != std::string::npos; p = src_.find("{%", p + 1)) {
      size_t q = p + 2;
      char sign = 0;
      if (q < src_.size() && (src_[q] == '-' || src_[q] == '+')) sign = src_[q++];
      q = skip_spaces(q);
      if (!at(q, "endraw")) continue;
      q = skip_spaces(q + 6);
      if (!(at(q, "%}") ||
            (q < src_.size() && (src_[q] == '-' || src_[q] == '+') && at(q + 1, "%}"))))
        continue;
      const int text_line = line_;
      emit_data(strip_before_tag(src_.substr(pos_, p - pos_), sign, true), text_line);
      finish_tag(end_of_block_tag(q));
      return;
    }
    fail("missing end of raw directive", begin_line);
  }

  void lex_tag(char kind) {
    const bool is_block = kind == '%';
    const int begin_line = line_;
    tokens_.push_back(Token{is_block ? TokenKind::BlockBegin : TokenKind::VarBegin, "", line_});
    int depth = 0;  // open brackets: a closing `}}` inside a dict literal is not the tag's end
    while (true) {
      advance_to(skip_spaces(pos_));
      if (pos_ >= src_.size())
        fail(std::string("unexpected end of template: missing '") + (is_block ? "%}" : "}}") + "'",
             begin_line);
      if (depth == 0) {
        if (is_block && (at(pos_, "%}") || at(pos_, "-%}") || at(pos_, "+%}"))) {
          tokens_.push_back(Token{TokenKind::BlockEnd, "", line_});
          finish_tag(end_of_block_tag(pos_));
          return;
        }
        if (!is_block && (at(pos_, "}}") || at(pos_, "-}}"))) {
          tokens_.push_back(Token{TokenKind::VarEnd, "", line_});
          finish_tag(at(pos_, "-}}") ? skip_spaces(pos_ + 3) : pos_ + 2);
          return;
        }
      }
      const char c = src_[pos_];
      if (c == '\'' || c == '"') {
        lex_string();
      } else if (is_digit(c)) {
        lex_number();
      } else if (is_name_start(c)) {
        size_t end = pos_;
        while (end < src_.size() && is_name_char(src_[end])) ++end;
        tokens_.push_back(Token{TokenKind::Name, src_.substr(pos_, end - pos_), line_});
        advance_to(end);
      } else {
        static constexpr std::string_view kTwoChar[] = {"//", "**", "==", "!=", ">=", "<="};
        std::string op;
        for (std::string_view two : kTwoChar)
          if (at(pos_, two)) op = std::string(two);
        if (op.empty()) {
          if (std::string_view("+-/*%~[](){}><=.:|,;").find(c) == std::string_view::npos)
            fail(std::string("unexpected character '") + c + "' in tag", line_);
          op = std::string(1, c);
        }
        if (op == "(" || op == "[" || op == "{") ++depth;
        if (op == ")" || op == "]" || op == "}") {
          if (depth == 0) fail("unexpected '" + op + "'", line_);
          --depth;
        }
        tokens_.push_back(Token{TokenKind::Op, op, line_});
        advance_to(pos_ + op.size());
      }
    }
  }

  void lex_string() {
    const char quote = src_[pos_];
    const int begin_line = line_;
    std::string value;
    size_t p = pos_ + 1;
    while (true) {
      if (p >= src_.size()) fail("unterminated string", begin_line);
      char c = src_[p];
      if (c == quote) break;
      if (c != '\\') {
        value += c;
        ++p;
        continue;
      }
      if (p + 1 >= src_.size()) fail("unterminated string", begin_line);
      char e = src_[p + 1];
      p += 2;
      switch (e) {
        case 'n':
          value += '\n';
          break;
        case 't':
          value += '\t';
          break;
        case 'r':
          value += '\r';
          break;
        case '0':
          value += '\0';
          break;
        case 'a':
          value += '\a';
          break;
        case 'b':
          value += '\b';
          break;
        case 'f':
          value += '\f';
          break;
        case 'v':
          value += '\v';
          break;
        case '\\':
          value += '\\';
          break;
        case '\'':
          value += '\'';
          break;
        case '"':
          value += '"';
          break;
        case '\n':
          break;  // a backslash at the end of a line joins the lines
        case 'x':
        case 'u':
        case 'U': {
          size_t digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          bool ok = p + digits <= src_.size();
          for (size_t k = 0; ok && k < digits; ++k)
            ok = std::isxdigit(static_cast<unsigned char>(src_[p + k]));
          if (!ok) fail(std::string("truncated \\") + e + " escape in string", line_);
          uint32_t cp =
              static_cast<uint32_t>(std::strtoul(src_.substr(p, digits).c_str(), nullptr, 16));
          if (cp > 0x10FFFF) fail("escape out of the Unicode range in string", line_);
          append_utf8(value, cp);
          p += digits;
          break;
        }
        default:  // Python keeps unknown escapes as they are
          value += '\\';
          value += e;
      }
    }
    tokens_.push_back(Token{TokenKind::String, std::move(value), begin_line});
    advance_to(p + 1);
  }

  void lex_number() {
    size_t p = pos_;
    auto digits = [&] {
      while (p < src_.size() && (is_digit(src_[p]) ||
                                 (src_[p] == '_' && p + 1 < src_.size() && is_digit(src_[p + 1]))))
        ++p;
    };
    digits();
    bool is_float = false;
    if (p + 1 < src_.size() && src_[p] == '.' && is_digit(src_[p + 1])) {
      is_float = true;
      ++p;
      digits();
    }
    if (p < src_.size() && (src_[p] == 'e' || src_[p] == 'E')) {
      size_t q = p + 1;
      if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
      if (q < src_.size() && is_digit(src_[q])) {
        is_float = true;
        p = q;
        digits();
      }
    }
    std::string text = src_.substr(pos_, p - pos_);
    text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
    Token t{is_float ? TokenKind::Float : TokenKind::Int, text, line_};
    if (is_float) {
      t.float_value = std::strtod(text.c_str(), nullptr);
    } else {
      errno = 0;
      t.int_value = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == ERANGE) fail("integer literal too large: " + text, line_);
    }
    tokens_.push_back(std::move(t));
    advance_to(p);
  }

  std::string src_;
  LexOptions opt_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;  // the previous tag's match ended with a newline
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> lex(std::string_view source, const LexOptions& options) {
  return Lexer(normalise(source, options.keep_trailing_newline), options).run();
}

}  // namespace moe::jinja
