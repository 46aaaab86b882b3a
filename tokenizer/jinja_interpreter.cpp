#include "tokenizer/jinja_interpreter.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "tokenizer/jinja_builtins.h"

namespace moe::jinja {

// ---- access helpers ----------------------------------------------------------

Value Scope::lookup(const std::string& name) const {
  for (const Scope* s = this; s; s = s->parent) {
    auto it = s->vars.find(name);
    if (it != s->vars.end()) return it->second;
  }
  return Value(Undefined{name});
}

void require_defined(const Value& v) {
  if (v.is_undefined())
    throw TemplateError("'" + (v.undefined_name().empty() ? "value" : v.undefined_name()) +
                        "' is undefined");
}

Value get_attr(const Value& object, const std::string& name) {
  require_defined(object);
  if (object.is_dict()) {
    if (!object.as_dict().is_namespace) {
      Value m = method_of(object, name);
      if (!m.is_undefined()) return m;
    }
    const Value* v = object.as_dict().find(name);
    return v ? *v : Value(Undefined{name});
  }
  Value m = method_of(object, name);
  if (!m.is_undefined()) return m;
  return Value(Undefined{name});
}

// Python's index normalisation: negative counts from the end; nullopt when out of range.
static bool normalise_index(int64_t& i, size_t size) {
  if (i < 0) i += static_cast<int64_t>(size);
  return i >= 0 && static_cast<uint64_t>(i) < size;
}

Value get_item(const Value& object, const Value& key) {
  require_defined(object);
  if (object.is_dict()) {
    if (key.is_string()) {
      const Value* v = object.as_dict().find(key.as_string());
      if (v) return *v;
      return get_attr(object, key.as_string());
    }
    return Value(Undefined{to_str(key)});
  }
  if ((object.is_list() || object.is_string()) && (key.is_int() || key.is_bool())) {
    int64_t i = key.to_int();
    if (object.is_list()) {
      const List& l = object.as_list();
      return normalise_index(i, l.size()) ? l[static_cast<size_t>(i)]
                                          : Value(Undefined{to_str(key)});
    }
    const std::string& s = object.as_string();
    std::vector<size_t> cps = codepoint_offsets(s);
    if (!normalise_index(i, cps.size() - 1)) return Value(Undefined{to_str(key)});
    size_t at = static_cast<size_t>(i);
    return Value(s.substr(cps[at], cps[at + 1] - cps[at]));
  }
  if (key.is_string()) return get_attr(object, key.as_string());
  return Value(Undefined{to_str(key)});
}

List iterate(const Value& v) {
  switch (v.type()) {
    case Value::Type::Undefined:
      return {};
    case Value::Type::List: {
      List items = v.as_list();
      items.is_tuple = false;  // what filters build from it are lists, as in Python
      return items;
    }
    case Value::Type::Dict: {
      List keys;
      for (const auto& e : v.as_dict().entries()) keys.emplace_back(e.first);
      return keys;
    }
    case Value::Type::String: {
      const std::string& s = v.as_string();
      std::vector<size_t> cps = codepoint_offsets(s);
      List chars;
      for (size_t i = 0; i + 1 < cps.size(); ++i)
        chars.emplace_back(s.substr(cps[i], cps[i + 1] - cps[i]));
      return chars;
    }
    default:
      throw TemplateError("'" + v.type_name() + "' object is not iterable");
  }
}

// How deeply lists and dicts nest inside v, looking no deeper than `limit`.
static int nesting_depth(const Value& v, int limit) {
  if (limit <= 0) return 1;
  int deepest = 0;
  if (v.is_list()) {
    for (const Value& e : v.as_list()) deepest = std::max(deepest, nesting_depth(e, limit - 1));
    return deepest + 1;
  }
  if (v.is_dict()) {
    for (const auto& e : v.as_dict().entries())
      deepest = std::max(deepest, nesting_depth(e.second, limit - 1));
    return deepest + 1;
  }
  return 0;
}

// Values built by the template are kept shallow enough to print, compare and
// free without deep recursion.
static void check_nesting(const Value& v) {
  if (nesting_depth(v, kMaxValueDepth + 1) > kMaxValueDepth)
    throw TemplateError("value nested too deeply");
}

// ---- Interpreter -------------------------------------------------------------

Interpreter::Interpreter(const Program& program, RenderLimits limits)
    : program_(program), limits_(limits) {
  add_globals(*this);
}

std::string Interpreter::render() {
  std::string out;
  out_ = &out;
  Scope root(&globals_);
  root_ = &root;
  exec(program_.body, root);
  root_ = nullptr;
  out_ = nullptr;
  return out;
}

void Interpreter::count_step() {
  if (++steps_ > limits_.max_steps)
    throw TemplateError("template ran too long (more than " + std::to_string(limits_.max_steps) +
                        " steps)");
}

void Interpreter::check_size(size_t bytes) const {
  if (bytes > limits_.max_output_bytes || written_ + bytes > limits_.max_output_bytes)
    throw TemplateError("template output too large (more than " +
                        std::to_string(limits_.max_output_bytes) + " bytes)");
}

void Interpreter::write(const std::string& text) {
  check_size(text.size());
  written_ += text.size();
  out_->append(text);
}

std::string Interpreter::capture(const Body& body, Scope& scope) {
  std::string buffer;
  std::string* saved = out_;
  out_ = &buffer;
  try {
    exec(body, scope);
  } catch (...) {
    out_ = saved;
    throw;
  }
  out_ = saved;
  return buffer;
}

Interpreter::Flow Interpreter::exec(const Body& body, Scope& scope) {
  for (const StmtPtr& s : body) {
    Flow f = exec_stmt(*s, scope);
    if (f != Flow::Normal) return f;
  }
  return Flow::Normal;
}

Interpreter::Flow Interpreter::exec_stmt(const Stmt& s, Scope& scope) {
  try {
    count_step();
    switch (s.kind) {
      case StmtKind::Text:
        write(s.text);
        return Flow::Normal;
      case StmtKind::Output:
        write(to_str(eval(*s.expr, scope)));
        return Flow::Normal;
      case StmtKind::If:
        for (size_t i = 0; i < s.conds.size(); ++i)
          if (eval(*s.conds[i], scope).truthy()) return exec(s.bodies[i], scope);
        return exec(s.else_body, scope);
      case StmtKind::For:
        return exec_for(s, scope);
      case StmtKind::Set:
        exec_set(s, scope);
        return Flow::Normal;
      case StmtKind::SetBlock: {
        Value v = apply_filters(s.filters, Value(capture(s.body, scope)), scope);
        scope.vars[s.targets[0]] = std::move(v);
        return Flow::Normal;
      }
      case StmtKind::Macro:
        scope.vars[s.name] = make_macro(s);
        return Flow::Normal;
      case StmtKind::Break:
        return Flow::Break;
      case StmtKind::Continue:
        return Flow::Continue;
      case StmtKind::FilterBlock:
        write(to_str(apply_filters(s.filters, Value(capture(s.body, scope)), scope)));
        return Flow::Normal;
      case StmtKind::Scope:
        return exec(s.body, scope);
    }
  } catch (TemplateError& e) {
    if (e.line == 0) e.line = s.line;
    throw;
  }
  return Flow::Normal;
}

static void bind_targets(Scope& scope, const std::vector<std::string>& targets, const Value& v) {
  if (targets.size() == 1) {
    scope.vars[targets[0]] = v;
    return;
  }
  List items = iterate(v);
  if (items.size() != targets.size())
    throw TemplateError("cannot unpack " + std::to_string(items.size()) + " values into " +
                        std::to_string(targets.size()) + " names");
  for (size_t i = 0; i < targets.size(); ++i) scope.vars[targets[i]] = items[i];
}

Interpreter::Flow Interpreter::exec_for(const Stmt& s, Scope& scope) {
  List all = iterate(eval(*s.expr, scope));
  List items;
  if (s.cond) {
    for (Value& v : all) {
      Scope probe(&scope);
      bind_targets(probe, s.targets, v);
      if (eval(*s.cond, probe).truthy()) items.push_back(std::move(v));
    }
  } else {
    items = std::move(all);
  }
  const int64_t n = static_cast<int64_t>(items.size());
  // loop.cycle(a, b, …): the argument for this iteration, round-robin.
  auto index_box = std::make_shared<int64_t>(0);
  Value cycle = Value::function("cycle", [index_box](Interpreter&, CallArgs& args) -> Value {
    if (args.positional.empty()) throw TemplateError("no items for cycling given");
    return args.positional[static_cast<size_t>(*index_box) % args.positional.size()];
  });
  // One loop object per loop, updated in place: building it afresh for every
  // iteration would dominate the cost of tight loops.
  Value loop = Value::dict();
  Dict& d = loop.as_dict();
  for (const char* key : {"index", "index0", "revindex", "revindex0", "first", "last", "length",
                          "depth", "depth0", "previtem", "nextitem", "cycle"})
    d.set(key, Value());
  d.set("length", Value(n));
  d.set("depth", Value(int64_t{1}));
  d.set("depth0", Value(int64_t{0}));
  d.set("cycle", cycle);
  Value* index = d.find("index");
  Value* index0 = d.find("index0");
  Value* revindex = d.find("revindex");
  Value* revindex0 = d.find("revindex0");
  Value* first = d.find("first");
  Value* last = d.find("last");
  Value* previtem = d.find("previtem");
  Value* nextitem = d.find("nextitem");
  for (int64_t i = 0; i < n; ++i) {
    count_step();
    *index_box = i;
    Scope body_scope(&scope);  // each iteration starts afresh, as in Jinja
    bind_targets(body_scope, s.targets, items[static_cast<size_t>(i)]);
    *index = Value(i + 1);
    *index0 = Value(i);
    *revindex = Value(n - i);
    *revindex0 = Value(n - i - 1);
    *first = Value(i == 0);
    *last = Value(i == n - 1);
    *previtem = i > 0 ? items[static_cast<size_t>(i - 1)] : Value(Undefined{"previtem"});
    *nextitem = i + 1 < n ? items[static_cast<size_t>(i + 1)] : Value(Undefined{"nextitem"});
    body_scope.vars["loop"] = loop;
    if (exec(s.body, body_scope) == Flow::Break) break;
  }
  if (n == 0) return exec(s.else_body, scope);
  return Flow::Normal;
}

void Interpreter::exec_set(const Stmt& s, Scope& scope) {
  Value v = eval(*s.expr, scope);
  if (s.attr.empty()) {
    bind_targets(scope, s.targets, v);
    return;
  }
  Value target = scope.lookup(s.targets[0]);
  if (!target.is_dict() || !target.as_dict().is_namespace)
    throw TemplateError("cannot assign attribute on non-namespace object '" + s.targets[0] + "'");
  target.as_dict().set(s.attr, std::move(v));
  check_nesting(target);
}

Value Interpreter::apply_filters(const std::vector<ExprPtr>& filters, Value subject, Scope& scope) {
  for (const ExprPtr& f : filters) {
    CallArgs args = eval_args(*f, scope);
    subject = apply_filter(*this, f->name, subject, args);
  }
  return subject;
}

Value Interpreter::make_macro(const Stmt& s) {
  const Stmt* def = &s;
  return Value::function(s.name, [def](Interpreter& in, CallArgs& args) -> Value {
    if (args.positional.size() > def->params.size())
      throw TemplateError("macro '" + def->name + "' takes not more than " +
                          std::to_string(def->params.size()) + " argument(s)");
    if (++in.call_depth_ > in.limits_.max_call_depth) {
      --in.call_depth_;
      throw TemplateError("macro calls nested too deeply (more than " +
                          std::to_string(in.limits_.max_call_depth) + ")");
    }
    // A macro sees the template's top-level variables (even those set after
    // its definition, as in Jinja), not its caller's locals.
    Scope scope(in.root_ ? in.root_ : &in.globals_);
    std::string out;
    try {
      for (size_t i = 0; i < def->params.size(); ++i) {
        const MacroParam& p = def->params[i];
        Value v(Undefined{p.name});
        if (i < args.positional.size()) {
          v = args.positional[i];
        } else {
          auto it = std::find_if(args.keyword.begin(), args.keyword.end(),
                                 [&](auto& kv) { return kv.first == p.name; });
          if (it != args.keyword.end()) {
            v = it->second;
          } else if (p.default_value) {
            v = in.eval(*p.default_value, scope);
          }
        }
        scope.vars[p.name] = std::move(v);
      }
      for (const auto& kv : args.keyword) {
        bool known = std::any_of(def->params.begin(), def->params.end(),
                                 [&](auto& p) { return p.name == kv.first; });
        if (!known)
          throw TemplateError("macro '" + def->name + "' takes no keyword argument '" + kv.first +
                              "'");
      }
      out = in.capture(def->body, scope);
    } catch (...) {
      --in.call_depth_;
      throw;
    }
    --in.call_depth_;
    return Value(std::move(out));
  });
}

Value Interpreter::call(const Value& callee, CallArgs& args) {
  if (callee.is_callable()) return callee.as_callable().fn(*this, args);
  require_defined(callee);
  throw TemplateError("'" + callee.type_name() + "' object is not callable");
}

CallArgs Interpreter::eval_args(const Expr& e, Scope& scope) {
  CallArgs args;
  for (const ExprPtr& a : e.items) args.positional.push_back(eval(*a, scope));
  for (const auto& [k, a] : e.kwargs) args.keyword.emplace_back(k, eval(*a, scope));
  return args;
}

Value Interpreter::eval(const Expr& e, Scope& scope) {
  try {
    count_step();
    return eval_inner(e, scope);
  } catch (TemplateError& err) {
    if (err.line == 0) err.line = e.line;
    throw;
  }
}

// Python's slice semantics over n elements.
static std::vector<size_t> slice_indices(size_t n, const Value& start_v, const Value& stop_v,
                                         const Value& step_v) {
  auto as_index = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.is_undefined() || v.is_none()) return std::nullopt;
    if (!v.is_int() && !v.is_bool())
      throw TemplateError(std::string("slice ") + what + " must be an integer or none");
    return v.to_int();
  };
  const int64_t len = static_cast<int64_t>(n);
  int64_t step = as_index(step_v, "step").value_or(1);
  if (step == 0) throw TemplateError("slice step cannot be zero");
  auto clamp = [&](std::optional<int64_t> v, int64_t dflt) {
    if (!v) return dflt;
    int64_t i = *v;
    if (i < 0) i += len;
    if (step > 0) return std::clamp<int64_t>(i, 0, len);
    return std::clamp<int64_t>(i, -1, len - 1);
  };
  int64_t start = clamp(as_index(start_v, "start"), step > 0 ? 0 : len - 1);
  int64_t stop = clamp(as_index(stop_v, "stop"), step > 0 ? len : -1);
  std::vector<size_t> out;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
    out.push_back(static_cast<size_t>(i));
  return out;
}

Value Interpreter::eval_inner(const Expr& e, Scope& scope) {
  switch (e.kind) {
    case ExprKind::Literal:
      return e.value;
    case ExprKind::Name:
      return scope.lookup(e.name);
    case ExprKind::List:
    case ExprKind::Tuple: {
      List items;
      items.reserve(e.items.size());
      for (const ExprPtr& i : e.items) items.push_back(eval(*i, scope));
      items.is_tuple = e.kind == ExprKind::Tuple;
      Value v = Value::list(std::move(items));
      check_nesting(v);
      return v;
    }
    case ExprKind::Dict: {
      Value d = Value::dict();
      for (size_t i = 0; i < e.keys.size(); ++i) {
        Value k = eval(*e.keys[i], scope);
        if (!k.is_string())
          throw TemplateError("dict keys must be strings in chat templates, got " + k.type_name());
        d.as_dict().set(k.as_string(), eval(*e.items[i], scope));
      }
      check_nesting(d);
      return d;
    }
    case ExprKind::Attr:
      return get_attr(eval(*e.object, scope), e.name);
    case ExprKind::Item:
      return get_item(eval(*e.object, scope), eval(*e.lhs, scope));
    case ExprKind::Slice: {
      Value obj = eval(*e.object, scope);
      require_defined(obj);
      Value start = e.start ? eval(*e.start, scope) : Value(None{});
      Value stop = e.stop ? eval(*e.stop, scope) : Value(None{});
      Value step = e.step ? eval(*e.step, scope) : Value(None{});
      if (obj.is_list()) {
        const List& l = obj.as_list();
        List out;
        for (size_t i : slice_indices(l.size(), start, stop, step)) out.push_back(l[i]);
        return Value::list(std::move(out));
      }
      if (obj.is_string()) {
        const std::string& s = obj.as_string();
        std::vector<size_t> cps = codepoint_offsets(s);
        std::string out;
        for (size_t i : slice_indices(cps.size() - 1, start, stop, step))
          out.append(s, cps[i], cps[i + 1] - cps[i]);
        return Value(std::move(out));
      }
      throw TemplateError("'" + obj.type_name() + "' object is not subscriptable");
    }
    case ExprKind::Call: {
      Value callee = eval(*e.object, scope);
      CallArgs args = eval_args(e, scope);
      return call(callee, args);
    }
    case ExprKind::Filter: {
      Value subject = eval(*e.object, scope);
      CallArgs args = eval_args(e, scope);
      return apply_filter(*this, e.name, subject, args);
    }
    case ExprKind::Test: {
      Value subject = eval(*e.object, scope);
      CallArgs args = eval_args(e, scope);
      bool r = apply_test(*this, e.name, subject, args);
      return Value(e.negated ? !r : r);
    }
    case ExprKind::Unary: {
      Value v = eval(*e.object, scope);
      if (e.name == "not") return Value(!v.truthy());
      require_defined(v);
      if (!v.is_number())
        throw TemplateError("bad operand type for unary " + e.name + ": '" + v.type_name() + "'");
      if (e.name == "+") return v.is_bool() ? Value(v.to_int()) : v;
      if (v.is_float()) return Value(-v.as_float());
      if (v.to_int() == std::numeric_limits<int64_t>::min())
        throw TemplateError("integer overflow");
      return Value(-v.to_int());
    }
    case ExprKind::Binary:
      return eval_binary(e, scope);
    case ExprKind::Compare:
      return eval_compare(e, scope);
    case ExprKind::Cond:
      if (eval(*e.cond, scope).truthy()) return eval(*e.lhs, scope);
      return e.rhs ? eval(*e.rhs, scope) : Value(Undefined{});
  }
  return Value();
}

[[noreturn]] static void bad_operands(const std::string& op, const Value& a, const Value& b) {
  throw TemplateError("unsupported operand type(s) for " + op + ": '" + a.type_name() + "' and '" +
                      b.type_name() + "'");
}

// Integer arithmetic that fails on overflow instead of wrapping (Python's
// ints never wrap; templates have no use for numbers this large).
static Value checked_int(const char* op, int64_t a, int64_t b) {
  int64_t r = 0;
  bool overflow = op[0] == '+'   ? __builtin_add_overflow(a, b, &r)
                  : op[0] == '-' ? __builtin_sub_overflow(a, b, &r)
                                 : __builtin_mul_overflow(a, b, &r);
  if (overflow) throw TemplateError("integer overflow");
  return Value(r);
}

Value Interpreter::eval_binary(const Expr& e, Scope& scope) {
  const std::string& op = e.name;
  if (op == "and") {
    Value l = eval(*e.lhs, scope);
    return l.truthy() ? eval(*e.rhs, scope) : l;
  }
  if (op == "or") {
    Value l = eval(*e.lhs, scope);
    return l.truthy() ? l : eval(*e.rhs, scope);
  }
  Value a = eval(*e.lhs, scope);
  Value b = eval(*e.rhs, scope);
  if (op == "~") {
    std::string l = to_str(a), r = to_str(b);
    check_size(l.size() + r.size());
    return Value(l + r);
  }
  require_defined(a);
  require_defined(b);
  const bool ints = (a.is_int() || a.is_bool()) && (b.is_int() || b.is_bool());
  const bool nums = a.is_number() && b.is_number();
  if (op == "+") {
    if (ints) return checked_int("+", a.to_int(), b.to_int());
    if (nums) return Value(a.to_double() + b.to_double());
    if (a.is_string() && b.is_string()) {
      check_size(a.as_string().size() + b.as_string().size());
      return Value(a.as_string() + b.as_string());
    }
    if (a.is_list() && b.is_list()) {
      List out = a.as_list();
      out.insert(out.end(), b.as_list().begin(), b.as_list().end());
      return Value::list(std::move(out));
    }
    bad_operands(op, a, b);
  }
  if (op == "-") {
    if (ints) return checked_int("-", a.to_int(), b.to_int());
    if (nums) return Value(a.to_double() - b.to_double());
    bad_operands(op, a, b);
  }
  if (op == "*") {
    if (ints) return checked_int("*", a.to_int(), b.to_int());
    if (nums) return Value(a.to_double() * b.to_double());
    const Value& seq = a.is_int() || a.is_bool() ? b : a;
    const Value& count = a.is_int() || a.is_bool() ? a : b;
    if ((count.is_int() || count.is_bool()) && (seq.is_string() || seq.is_list())) {
      int64_t n = std::max<int64_t>(0, count.to_int());
      const size_t unit = seq.is_string() ? seq.as_string().size() : seq.as_list().size();
      if (unit == 0) n = 0;
      if (n > 0 && static_cast<uint64_t>(n) > limits_.max_output_bytes / unit)
        check_size(limits_.max_output_bytes + 1);
      if (seq.is_string()) {
        check_size(static_cast<size_t>(n) * seq.as_string().size());
        std::string out;
        for (int64_t i = 0; i < n; ++i) out += seq.as_string();
        return Value(std::move(out));
      }
      check_size(static_cast<size_t>(n) * seq.as_list().size());
      List out;
      for (int64_t i = 0; i < n; ++i)
        out.insert(out.end(), seq.as_list().begin(), seq.as_list().end());
      return Value::list(std::move(out));
    }
    bad_operands(op, a, b);
  }
  if (!nums) bad_operands(op, a, b);
  if (op == "/") {
    if (b.to_double() == 0.0) throw TemplateError("division by zero");
    return Value(a.to_double() / b.to_double());
  }
  if (op == "//" || op == "%") {
    if (b.to_double() == 0.0)
      throw TemplateError(op == "%" ? "modulo by zero" : "integer division or modulo by zero");
    if (ints) {
      int64_t x = a.to_int(), y = b.to_int();
      if (x == std::numeric_limits<int64_t>::min() && y == -1)
        throw TemplateError("integer overflow");
      int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) {  // Python floors toward negative infinity
        q -= 1;
        m += y;
      }
      return Value(op == "//" ? q : m);
    }
    double x = a.to_double(), y = b.to_double();
    double m = std::fmod(x, y);
    if (m != 0 && ((m < 0) != (y < 0))) m += y;
    return Value(op == "//" ? std::floor(x / y) : m);
  }
  if (op == "**") {
    if (ints && b.to_int() >= 0) {
      const int64_t base = a.to_int(), exp = b.to_int();
      if (exp == 0 || base == 1) return Value(int64_t{1});
      if (base == 0) return Value(int64_t{0});
      if (base == -1) return Value(exp % 2 == 0 ? int64_t{1} : int64_t{-1});
      int64_t result = 1;  // |base| >= 2: overflows within 63 steps
      for (int64_t i = 0; i < exp; ++i)
        if (__builtin_mul_overflow(result, base, &result)) throw TemplateError("integer overflow");
      return Value(result);
    }
    return Value(std::pow(a.to_double(), b.to_double()));
  }
  throw TemplateError("unknown operator '" + op + "'");
}

static bool contains(const Value& container, const Value& item) {
  switch (container.type()) {
    case Value::Type::Undefined:
      return false;
    case Value::Type::String:
      if (!item.is_string())
        throw TemplateError("'in <string>' requires string as left operand, not " +
                            item.type_name());
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Value::Type::List:
      return std::any_of(container.as_list().begin(), container.as_list().end(),
                         [&](const Value& v) { return equals(v, item); });
    case Value::Type::Dict:
      return item.is_string() && container.as_dict().find(item.as_string()) != nullptr;
    default:
      throw TemplateError("argument of type '" + container.type_name() + "' is not iterable");
  }
}

Value Interpreter::eval_compare(const Expr& e, Scope& scope) {
  Value left = eval(*e.object, scope);
  for (size_t i = 0; i < e.ops.size(); ++i) {
    Value right = eval(*e.items[i], scope);
    const std::string& op = e.ops[i];
    bool r;
    if (op == "==") {
      r = equals(left, right);
    } else if (op == "!=") {
      r = !equals(left, right);
    } else if (op == "in") {
      r = contains(right, left);
    } else if (op == "not in") {
      r = !contains(right, left);
    } else {
      require_defined(left);
      require_defined(right);
      if (op == "<")
        r = less(left, right);
      else if (op == ">")
        r = less(right, left);
      else if (op == "<=")
        r = !less(right, left);
      else
        r = !less(left, right);
    }
    if (!r) return Value(false);
    left = std::move(right);
  }
  return Value(true);
}

}  // namespace moe::jinja
