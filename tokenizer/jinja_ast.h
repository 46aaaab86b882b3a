#pragma once
// The syntax tree of a parsed template: expressions and statements, each with
// the source line it came from (for error messages).

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/jinja_value.h"

namespace moe::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

enum class ExprKind {
  Literal,  // value
  Name,     // name
  List,     // items
  Tuple,    // items (behaves as a list)
  Dict,     // keys[i] → items[i]
  Attr,     // object.name
  Item,     // object[index]
  Slice,    // object[start:stop:step]; absent parts are null
  Call,     // callee(args…, kwargs…)
  Filter,   // object|name(args…, kwargs…)
  Test,     // object is [not] name(args…)
  Unary,    // op ("-", "+", "not") operand
  Binary,   // lhs op rhs: arithmetic, "~", "and", "or"
  Compare,  // object ops[0] items[0] ops[1] items[1] …: "==", "!=", "<", "<=", ">", ">=", "in",
            // "not in"
  Cond,     // then if cond else otherwise (otherwise may be null: undefined)
};

struct Expr {
  ExprKind kind;
  int line = 0;
  int depth = 1;  // height of this subtree: bounded so that evaluating it cannot exhaust the stack
  Value value;    // Literal
  std::string name;           // Name, Attr, Filter, Test; the operator for Unary, Binary, Compare
  bool negated = false;       // Test: `is not`
  ExprPtr object;             // Attr, Item, Slice, Call (the callee), Filter, Test, Unary (operand)
  ExprPtr lhs, rhs;           // Binary; Item's index is lhs; Cond: lhs=then, rhs=otherwise
  ExprPtr cond;               // Cond
  ExprPtr start, stop, step;  // Slice
  std::vector<ExprPtr> items;  // List, Tuple, Dict values, call/filter/test arguments
  std::vector<ExprPtr> keys;   // Dict keys
  std::vector<std::pair<std::string, ExprPtr>> kwargs;  // Call, Filter, Test
  std::vector<std::string> ops;                         // Compare: a chain `a < b < c` holds two
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

enum class StmtKind {
  Text,      // text
  Output,    // {{ expr }}
  If,        // conds[i] → bodies[i]; else_body
  For,       // for targets in expr [if cond]: body; else_body
  Set,       // targets = expr, or attribute `target.attr = expr`
  SetBlock,  // {% set name %}body{% endset %}, optionally through filters
  Macro,     // {% macro name(params) %}body{% endmacro %}
  Break,
  Continue,
  FilterBlock,  // {% filter f %}body{% endfilter %}
  Scope,        // a body rendered as it is ({% generation %})
};

struct MacroParam {
  std::string name;
  ExprPtr default_value;  // null: none
};

struct Stmt {
  StmtKind kind;
  int line = 0;
  std::string text;                  // Text
  ExprPtr expr;                      // Output, For (iterable), Set (value)
  ExprPtr cond;                      // For (the `if` filter)
  std::vector<ExprPtr> conds;        // If
  std::vector<Body> bodies;          // If
  Body body;                         // For, SetBlock, Macro, FilterBlock, Scope
  Body else_body;                    // If, For
  std::vector<std::string> targets;  // For, Set: names (several means unpacking)
  std::string attr;                  // Set: `set ns.attr = …` (targets[0] is ns)
  std::string name;                  // Macro
  std::vector<MacroParam> params;    // Macro
  std::vector<ExprPtr> filters;  // SetBlock, FilterBlock: Filter expressions whose object is null
};

struct Program {
  Body body;
};

}  // namespace moe::jinja
