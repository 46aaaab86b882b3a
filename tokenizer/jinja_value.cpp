#include "tokenizer/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace moe::jinja {

// ---- Dict ----------------------------------------------------------------

const Value* Dict::find(std::string_view key) const {
  auto it = index_.find(std::string(key));
  return it == index_.end() ? nullptr : &entries_[it->second].second;
}

Value* Dict::find(std::string_view key) {
  auto it = index_.find(std::string(key));
  return it == index_.end() ? nullptr : &entries_[it->second].second;
}

void Dict::set(std::string key, Value value) {
  auto it = index_.find(key);
  if (it != index_.end()) {
    entries_[it->second].second = std::move(value);
    return;
  }
  index_.emplace(key, entries_.size());
  entries_.emplace_back(std::move(key), std::move(value));
}

// ---- Value ---------------------------------------------------------------

Value Value::function(std::string name, std::function<Value(Interpreter&, CallArgs&)> fn) {
  auto c = std::make_shared<Callable>();
  c->name = std::move(name);
  c->fn = std::move(fn);
  return Value(std::shared_ptr<const Callable>(std::move(c)));
}

bool Value::truthy() const {
  switch (type()) {
    case Type::Undefined:
    case Type::None:
      return false;
    case Type::Bool:
      return as_bool();
    case Type::Int:
      return as_int() != 0;
    case Type::Float:
      return as_float() != 0.0;
    case Type::String:
      return !as_string().empty();
    case Type::List:
      return !as_list().empty();
    case Type::Dict:
      return as_dict().size() != 0;
    case Type::Callable:
      return true;
  }
  return false;
}

std::string Value::type_name() const {
  switch (type()) {
    case Type::Undefined:
      return "Undefined";
    case Type::None:
      return "NoneType";
    case Type::Bool:
      return "bool";
    case Type::Int:
      return "int";
    case Type::Float:
      return "float";
    case Type::String:
      return "str";
    case Type::List:
      return "list";
    case Type::Dict:
      return as_dict().is_namespace ? "Namespace" : "dict";
    case Type::Callable:
      return "function";
  }
  return "object";
}

// ---- UTF-8 ---------------------------------------------------------------

static size_t utf8_length_at(std::string_view s, size_t i) {
  unsigned char c = static_cast<unsigned char>(s[i]);
  size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 1;
  if (i + len > s.size()) return 1;
  for (size_t k = 1; k < len; ++k)
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 1;  // invalid: one byte alone
  return len;
}

std::vector<size_t> codepoint_offsets(std::string_view s) {
  std::vector<size_t> offsets;
  offsets.reserve(s.size() + 1);
  for (size_t i = 0; i < s.size(); i += utf8_length_at(s, i)) offsets.push_back(i);
  offsets.push_back(s.size());
  return offsets;
}

size_t codepoint_count(std::string_view s) {
  size_t n = 0;
  for (size_t i = 0; i < s.size(); i += utf8_length_at(s, i)) ++n;
  return n;
}

// ---- printing --------------------------------------------------------------

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  if (d == 0.0) return std::signbit(d) ? "-0.0" : "0.0";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);  // e.g. "-1.2345e+05": shortest round-trip digits
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  int exp = std::stoi(sci.substr(e + 1));
  if (exp >= -4 && exp < 16) {
    int point = exp + 1;  // digits before the decimal point
    std::string out;
    if (point <= 0) {
      out = "0." + std::string(static_cast<size_t>(-point), '0') + digits;
    } else if (static_cast<size_t>(point) >= digits.size()) {
      out = digits + std::string(static_cast<size_t>(point) - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, static_cast<size_t>(point)) + "." +
            digits.substr(static_cast<size_t>(point));
    }
    return sign + out;
  }
  std::string out = digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  char expbuf[16];
  std::snprintf(expbuf, sizeof(expbuf), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
  return sign + out + expbuf;
}

static std::string string_repr(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  for (char ch : s) {
    unsigned char c = static_cast<unsigned char>(ch);
    if (ch == quote || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (ch == '\n') {
      out += "\\n";
    } else if (ch == '\r') {
      out += "\\r";
    } else if (ch == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  out += quote;
  return out;
}

static void check_depth(int depth) {
  if (depth > kMaxValueDepth) throw TemplateError("value nested too deeply");
}

static std::string repr_at(const Value& v, int depth) {
  check_depth(depth);
  switch (v.type()) {
    case Value::Type::String:
      return string_repr(v.as_string());
    case Value::Type::List: {
      const List& items = v.as_list();
      std::string out = items.is_tuple ? "(" : "[";
      bool first = true;
      for (const Value& e : items) {
        if (!first) out += ", ";
        first = false;
        out += repr_at(e, depth + 1);
      }
      if (items.is_tuple) return out + (items.size() == 1 ? ",)" : ")");
      return out + "]";
    }
    case Value::Type::Dict: {
      std::string out = v.as_dict().is_namespace ? "<Namespace {" : "{";
      bool first = true;
      for (const auto& [k, e] : v.as_dict().entries()) {
        if (!first) out += ", ";
        first = false;
        out += string_repr(k) + ": " + repr_at(e, depth + 1);
      }
      return out + (v.as_dict().is_namespace ? "}>" : "}");
    }
    default:
      return to_str(v);
  }
}

std::string to_repr(const Value& v) { return repr_at(v, 0); }

std::string to_str(const Value& v) {
  switch (v.type()) {
    case Value::Type::Undefined:
      return "";
    case Value::Type::None:
      return "None";
    case Value::Type::Bool:
      return v.as_bool() ? "True" : "False";
    case Value::Type::Int:
      return std::to_string(v.as_int());
    case Value::Type::Float:
      return float_repr(v.as_float());
    case Value::Type::String:
      return v.as_string();
    case Value::Type::List:
    case Value::Type::Dict:
      return to_repr(v);
    case Value::Type::Callable:
      return "<function " + v.as_callable().name + ">";
  }
  return "";
}

// ---- comparison ------------------------------------------------------------

static bool equals_at(const Value& a, const Value& b, int depth) {
  check_depth(depth);
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.to_double() == b.to_double();
    return a.to_int() == b.to_int();
  }
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case Value::Type::Undefined:
    case Value::Type::None:
      return true;
    case Value::Type::String:
      return a.as_string() == b.as_string();
    case Value::Type::List: {
      const List& x = a.as_list();
      const List& y = b.as_list();
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i)
        if (!equals_at(x[i], y[i], depth + 1)) return false;
      return true;
    }
    case Value::Type::Dict: {
      const Dict& x = a.as_dict();
      const Dict& y = b.as_dict();
      if (x.size() != y.size()) return false;
      for (const auto& [k, e] : x.entries()) {
        const Value* other = y.find(k);
        if (!other || !equals_at(e, *other, depth + 1)) return false;
      }
      return true;
    }
    case Value::Type::Callable:
      return &a.as_callable() == &b.as_callable();
    default:
      return false;
  }
}

bool equals(const Value& a, const Value& b) { return equals_at(a, b, 0); }

static bool less_at(const Value& a, const Value& b, int depth) {
  check_depth(depth);
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.to_double() < b.to_double();
    return a.to_int() < b.to_int();
  }
  if (a.is_string() && b.is_string())
    return a.as_string() < b.as_string();  // bytewise == code point order
  if (a.is_list() && b.is_list()) {
    const List& x = a.as_list();
    const List& y = b.as_list();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (less_at(x[i], y[i], depth + 1)) return true;
      if (less_at(y[i], x[i], depth + 1)) return false;
    }
    return x.size() < y.size();
  }
  throw TemplateError("'<' not supported between instances of '" + a.type_name() + "' and '" +
                      b.type_name() + "'");
}

bool less(const Value& a, const Value& b) { return less_at(a, b, 0); }

// ---- JSON ------------------------------------------------------------------

static void append_json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (size_t i = 0; i < s.size();) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    char buf[16];
    switch (c) {
      case '"':
        out += "\\\"";
        ++i;
        continue;
      case '\\':
        out += "\\\\";
        ++i;
        continue;
      case '\n':
        out += "\\n";
        ++i;
        continue;
      case '\r':
        out += "\\r";
        ++i;
        continue;
      case '\t':
        out += "\\t";
        ++i;
        continue;
      case '\b':
        out += "\\b";
        ++i;
        continue;
      case '\f':
        out += "\\f";
        ++i;
        continue;
      default:
        break;
    }
    if (c < 0x20) {
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
      ++i;
      continue;
    }
    if (c < 0x80 || !ensure_ascii) {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    size_t len = utf8_length_at(s, i);
    uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
    for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    if (cp >= 0x10000) {
      cp -= 0x10000;
      std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
    } else {
      std::snprintf(buf, sizeof(buf), "\\u%04x", cp);
    }
    out += buf;
    i += len;
  }
  out += '"';
}

static void append_json(std::string& out, const Value& v, const JsonStyle& st, int level) {
  check_depth(level);
  auto newline = [&](int lvl) {
    if (st.indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(st.indent) * static_cast<size_t>(lvl), ' ');
  };
  const std::string item_sep =
      !st.item_separator.empty() ? st.item_separator : (st.indent < 0 ? ", " : ",");
  const std::string key_sep = !st.key_separator.empty() ? st.key_separator : ": ";
  switch (v.type()) {
    case Value::Type::None:
      out += "null";
      return;
    case Value::Type::Bool:
      out += v.as_bool() ? "true" : "false";
      return;
    case Value::Type::Int:
      out += std::to_string(v.as_int());
      return;
    case Value::Type::Float: {
      double d = v.as_float();
      out += std::isnan(d)   ? "NaN"
             : std::isinf(d) ? (d < 0 ? "-Infinity" : "Infinity")
                             : float_repr(d);
      return;
    }
    case Value::Type::String:
      append_json_string(out, v.as_string(), st.ensure_ascii);
      return;
    case Value::Type::List: {
      const List& items = v.as_list();
      if (items.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += item_sep;
        newline(level + 1);
        append_json(out, items[i], st, level + 1);
      }
      newline(level);
      out += ']';
      return;
    }
    case Value::Type::Dict: {
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& e : v.as_dict().entries()) entries.push_back(&e);
      if (st.sort_keys)
        std::sort(entries.begin(), entries.end(),
                  [](auto* a, auto* b) { return a->first < b->first; });
      if (entries.empty()) {
        out += "{}";
        return;
      }
      out += '{';
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i) out += item_sep;
        newline(level + 1);
        append_json_string(out, entries[i]->first, st.ensure_ascii);
        out += key_sep;
        append_json(out, entries[i]->second, st, level + 1);
      }
      newline(level);
      out += '}';
      return;
    }
    default:
      throw TemplateError("Object of type " + v.type_name() + " is not JSON serializable");
  }
}

std::string to_json_text(const Value& v, const JsonStyle& style) {
  std::string out;
  append_json(out, v, style, 0);
  return out;
}

}  // namespace moe::jinja
