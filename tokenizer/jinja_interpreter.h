#pragma once
// Renders a parsed template: walks the syntax tree with a chain of scopes,
// writing text to an output string. One Interpreter renders once; it is
// cheap to make and holds no state beyond that render.

#include <cstdint>
#include <string>
#include <unordered_map>

#include "tokenizer/jinja_ast.h"

namespace moe::jinja {

// Bounds on one render, so a hostile or buggy template fails with an error
// instead of running away.
struct RenderLimits {
  int max_call_depth = 64;                     // nested macro calls
  size_t max_output_bytes = size_t{64} << 20;  // text written, captures included
  uint64_t max_steps = 5'000'000;  // statements, expressions and loop iterations evaluated
};

// Variables: a scope looks names up in itself, then in its parent.
struct Scope {
  explicit Scope(Scope* parent_) : parent(parent_) {}
  Value lookup(const std::string& name) const;
  std::unordered_map<std::string, Value> vars;
  Scope* parent;
};

class Interpreter {
 public:
  Interpreter(const Program& program, RenderLimits limits = {});

  // Globals the template sees (messages, bos_token, …), set before render().
  void set_global(const std::string& name, Value value) { globals_.vars[name] = std::move(value); }

  // Throws TemplateError; the line is that of the failing statement or expression.
  std::string render();

  // ---- for builtins --------------------------------------------------------
  Value call(const Value& callee, CallArgs& args);
  // Throws when the text a builtin is about to build would pass the output limit.
  void check_size(size_t bytes) const;
  void count_step();

 private:
  enum class Flow { Normal, Break, Continue };

  Flow exec(const Body& body, Scope& scope);
  Flow exec_stmt(const Stmt& s, Scope& scope);
  Flow exec_for(const Stmt& s, Scope& scope);
  void exec_set(const Stmt& s, Scope& scope);
  Value make_macro(const Stmt& s);
  std::string capture(const Body& body, Scope& scope);
  Value apply_filters(const std::vector<ExprPtr>& filters, Value subject, Scope& scope);

  Value eval(const Expr& e, Scope& scope);
  Value eval_inner(const Expr& e, Scope& scope);
  Value eval_binary(const Expr& e, Scope& scope);
  Value eval_compare(const Expr& e, Scope& scope);
  CallArgs eval_args(const Expr& e, Scope& scope);

  void write(const std::string& text);

  const Program& program_;
  RenderLimits limits_;
  Scope globals_{nullptr};
  Scope* root_ = nullptr;       // the template's top-level scope during render()
  std::string* out_ = nullptr;  // where text goes: the result, or a capture
  size_t written_ = 0;          // all bytes written so far, captures included
  uint64_t steps_ = 0;
  int call_depth_ = 0;
};

// Attribute and item access with Jinja's rules: attributes of a dict are its
// methods, then its keys; a missing key or index gives undefined; access on
// undefined throws.
Value get_attr(const Value& object, const std::string& name);
Value get_item(const Value& object, const Value& key);

// The items a for loop walks: a list's elements, a dict's keys, a string's
// characters; undefined is empty. Throws for what Python cannot iterate.
List iterate(const Value& v);

// Throws "'x' is undefined" when v is undefined.
void require_defined(const Value& v);

}  // namespace moe::jinja
