#pragma once
// Template source → tokens. Text between tags becomes Data tokens, already
// trimmed the way Jinja's lexer trims it for the options chat templates are
// rendered with (trim_blocks, lstrip_blocks, `-` and `+` markers); comments
// and {% raw %} are resolved here, so the parser never sees them.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moe::jinja {

enum class TokenKind {
  Data,        // literal template text
  VarBegin,    // {{
  VarEnd,      // }}
  BlockBegin,  // {%
  BlockEnd,    // %}
  Name,
  String,  // text holds the unescaped value
  Int,
  Float,
  Op,   // text holds the operator: "==", "(", "|", ...
  End,  // end of the source
};

struct Token {
  TokenKind kind;
  std::string text;
  int line = 1;
  int64_t int_value = 0;
  double float_value = 0;
};

struct LexOptions {
  bool trim_blocks = true;    // drop the first newline after a block tag
  bool lstrip_blocks = true;  // drop spaces and tabs before a block tag that starts a line
  bool keep_trailing_newline = false;
};

// Throws TemplateError (with the line) on an unterminated tag, comment or
// string, or a character that cannot start a token.
std::vector<Token> lex(std::string_view source, const LexOptions& options = {});

}  // namespace moe::jinja
