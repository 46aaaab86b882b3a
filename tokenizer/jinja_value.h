#pragma once
// The values a chat template computes with. They follow Python's semantics,
// because the reference renderer is Jinja running in Python: ints and floats
// are distinct, lists and dicts are shared by reference, dicts keep insertion
// order, and printing a value gives what Python's str() gives.

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

namespace moe::jinja {

// A failure inside the interpreter. It unwinds to ChatTemplate's parse() or
// render(), the one boundary that turns it into a Result error. line 0 means
// "not yet known": the statement or expression being evaluated fills it in.
struct TemplateError : std::runtime_error {
  TemplateError(std::string msg, int line_ = 0, bool raised_ = false)
      : std::runtime_error(std::move(msg)), line(line_), raised(raised_) {}
  int line;
  bool raised;  // from raise_exception(): the message is the template author's
};

class Value;
class Interpreter;

// A list, or a tuple: the two behave alike here except when printed.
struct List : std::vector<Value> {
  using std::vector<Value>::vector;
  bool is_tuple = false;
};

// A dict with string keys in insertion order (Python 3.7+ semantics).
class Dict {
 public:
  const Value* find(std::string_view key) const;
  Value* find(std::string_view key);
  void set(std::string key, Value value);
  size_t size() const;  // defined below Value: the pair needs it complete
  const std::vector<std::pair<std::string, Value>>& entries() const { return entries_; }

  bool is_namespace = false;  // made by namespace(): the only object `set a.b = …` may modify

 private:
  std::vector<std::pair<std::string, Value>> entries_;
  std::unordered_map<std::string, size_t> index_;
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

// A builtin function, a bound method, or a macro.
struct Callable {
  std::string name;
  std::function<Value(Interpreter&, CallArgs&)> fn;
};

struct Undefined {
  std::string name;  // what was looked up, for "'x' is undefined"
};
struct None {};

class Value {
 public:
  enum class Type { Undefined, None, Bool, Int, Float, String, List, Dict, Callable };

  Value() : v_(Undefined{}) {}
  Value(Undefined u) : v_(std::move(u)) {}
  Value(None) : v_(None{}) {}
  Value(bool b) : v_(b) {}
  Value(int i) : v_(int64_t{i}) {}
  Value(int64_t i) : v_(i) {}
  Value(double d) : v_(d) {}
  Value(std::string s) : v_(std::move(s)) {}
  Value(const char* s) : v_(std::string(s)) {}
  Value(std::shared_ptr<List> l) : v_(std::move(l)) {}
  Value(std::shared_ptr<Dict> d) : v_(std::move(d)) {}
  Value(std::shared_ptr<const Callable> c) : v_(std::move(c)) {}

  static Value list(List items = {}) { return Value(std::make_shared<List>(std::move(items))); }
  static Value tuple(List items) {
    items.is_tuple = true;
    return list(std::move(items));
  }
  static Value dict() { return Value(std::make_shared<Dict>()); }
  static Value function(std::string name, std::function<Value(Interpreter&, CallArgs&)> fn);

  Type type() const { return static_cast<Type>(v_.index()); }
  bool is_undefined() const { return type() == Type::Undefined; }
  bool is_none() const { return type() == Type::None; }
  bool is_bool() const { return type() == Type::Bool; }
  bool is_int() const { return type() == Type::Int; }
  bool is_float() const { return type() == Type::Float; }
  bool is_number() const { return is_bool() || is_int() || is_float(); }
  bool is_string() const { return type() == Type::String; }
  bool is_list() const { return type() == Type::List; }
  bool is_dict() const { return type() == Type::Dict; }
  bool is_callable() const { return type() == Type::Callable; }

  bool as_bool() const { return std::get<bool>(v_); }
  int64_t as_int() const { return std::get<int64_t>(v_); }
  double as_float() const { return std::get<double>(v_); }
  const std::string& as_string() const { return std::get<std::string>(v_); }
  List& as_list() const { return *std::get<std::shared_ptr<List>>(v_); }
  Dict& as_dict() const { return *std::get<std::shared_ptr<Dict>>(v_); }
  const Callable& as_callable() const { return *std::get<std::shared_ptr<const Callable>>(v_); }
  const std::string& undefined_name() const { return std::get<Undefined>(v_).name; }

  // Numbers as Python sees them in arithmetic: bools count as ints.
  int64_t to_int() const { return is_bool() ? (as_bool() ? 1 : 0) : as_int(); }
  double to_double() const { return is_float() ? as_float() : static_cast<double>(to_int()); }

  // Python truthiness.
  bool truthy() const;
  // Python's type names, for error messages: 'str', 'int', 'NoneType', ...
  std::string type_name() const;

 private:
  std::variant<Undefined, None, bool, int64_t, double, std::string, std::shared_ptr<List>,
               std::shared_ptr<Dict>, std::shared_ptr<const Callable>>
      v_;
};

inline size_t Dict::size() const { return entries_.size(); }

// str(v) as Python prints it ('' for undefined).
std::string to_str(const Value& v);
// repr(v) as Python prints it, which is what str() of a list or dict uses.
std::string to_repr(const Value& v);
// repr() of a float, shortest round-trip digits: 1.0, 0.1, 1e+16, 1e-05.
std::string float_repr(double d);

// Python ==, and <; `less` throws TemplateError for unorderable types.
bool equals(const Value& a, const Value& b);
bool less(const Value& a, const Value& b);

// json.dumps(v, ensure_ascii, indent, separators, sort_keys) as Python writes it.
struct JsonStyle {
  bool ensure_ascii = false;
  int indent = -1;             // -1: all on one line
  std::string item_separator;  // empty: Python's default for the indent
  std::string key_separator;
  bool sort_keys = false;
};
std::string to_json_text(const Value& v, const JsonStyle& style);

// nlohmann::json / ordered_json to a Value (dict order kept as the json keeps it).
// Nesting deeper than this is refused (printing and comparing recurse).
inline constexpr int kMaxValueDepth = 256;

template <typename Json>
Value from_json(const Json& j, int depth = 0) {
  if (depth > kMaxValueDepth) throw TemplateError("value nested too deeply");
  if (j.is_null()) return Value(None{});
  if (j.is_boolean()) return Value(j.template get<bool>());
  if (j.is_number_unsigned()) {
    uint64_t u = j.template get<uint64_t>();
    if (u <= static_cast<uint64_t>(INT64_MAX)) return Value(static_cast<int64_t>(u));
    return Value(static_cast<double>(u));
  }
  if (j.is_number_integer()) return Value(j.template get<int64_t>());
  if (j.is_number_float()) return Value(j.template get<double>());
  if (j.is_string()) return Value(j.template get<std::string>());
  if (j.is_array()) {
    List items;
    items.reserve(j.size());
    for (const auto& e : j) items.push_back(from_json(e, depth + 1));
    return Value::list(std::move(items));
  }
  if (j.is_object()) {
    Value d = Value::dict();
    for (auto it = j.begin(); it != j.end(); ++it)
      d.as_dict().set(it.key(), from_json(it.value(), depth + 1));
    return d;
  }
  return Value(None{});  // binary and discarded values have no template meaning
}

// Strings are sequences of code points: these index UTF-8 text by code point.
// Returns the byte offset of every code point, plus the text's size at the end.
std::vector<size_t> codepoint_offsets(std::string_view s);
size_t codepoint_count(std::string_view s);

}  // namespace moe::jinja
