#pragma once
// Tokens → syntax tree, by recursive descent over Jinja's grammar (the same
// operator precedence as Jinja, so `a ~ b + c` groups as Jinja groups it).

#include <string_view>

#include "tokenizer/jinja_ast.h"

namespace moe::jinja {

// Nesting deeper than this (brackets, blocks, unary operators) is refused, so
// a hostile template cannot exhaust the stack while parsing or rendering.
inline constexpr int kMaxParseDepth = 128;
// The height of one expression's tree (long chains like a + b + c + … or
// a.b.c.… grow it without nesting brackets).
inline constexpr int kMaxExprDepth = 256;

// Throws TemplateError with the line of the offending token: unknown tags,
// unbalanced blocks, unexpected tokens, too deep nesting.
Program parse_template(std::string_view source);

}  // namespace moe::jinja
