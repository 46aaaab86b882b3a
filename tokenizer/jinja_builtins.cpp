#include "tokenizer/jinja_builtins.h"

#include <utf8proc.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <initializer_list>
#include <unordered_map>
#include <unordered_set>

namespace moe::jinja {

namespace {

// ---- arguments -----------------------------------------------------------------

// Reads a builtin's arguments the way Python binds them: by position, then by
// keyword, else the default; anything left over is an error.
class Args {
 public:
  Args(std::string fn, CallArgs& a, std::initializer_list<const char*> names)
      : fn_(fn), a_(a), names_(names) {
    if (a.positional.size() > names_.size())
      throw TemplateError(fn_ + "() takes at most " + std::to_string(names_.size()) +
                          " argument(s), " + std::to_string(a.positional.size()) + " given");
    for (const auto& kv : a.keyword)
      if (std::find(names_.begin(), names_.end(), kv.first) == names_.end())
        throw TemplateError(fn_ + "() got an unexpected keyword argument '" + kv.first + "'");
  }

  Value get(size_t i, Value dflt = Value()) const {
    if (i < a_.positional.size()) return a_.positional[i];
    for (const auto& kv : a_.keyword)
      if (kv.first == names_[i]) return kv.second;
    return dflt;
  }
  bool has(size_t i) const { return !get(i).is_undefined(); }

  std::string str(size_t i, const std::string& dflt) const {
    Value v = get(i);
    if (v.is_undefined()) return dflt;
    if (!v.is_string())
      throw TemplateError(fn_ + "() argument '" + names_[i] + "' must be a string");
    return v.as_string();
  }
  int64_t integer(size_t i, int64_t dflt) const {
    Value v = get(i);
    if (v.is_undefined() || v.is_none()) return dflt;
    if (!v.is_int() && !v.is_bool())
      throw TemplateError(fn_ + "() argument '" + names_[i] + "' must be an integer");
    return v.to_int();
  }
  bool flag(size_t i, bool dflt) const {
    Value v = get(i);
    return v.is_undefined() ? dflt : v.truthy();
  }

 private:
  std::string fn_;
  CallArgs& a_;
  std::vector<const char*> names_;
};

// ---- strings -------------------------------------------------------------------

bool is_ws(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
bool is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

// Case mapping over code points (utf8proc's simple mappings: one code point
// to one, so 'ß'.upper() stays 'ß' where Python gives 'SS').
template <typename F>
std::string map_codepoints(const std::string& s, F f) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    utf8proc_int32_t cp = 0;
    auto n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data()) + i,
                              static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
    if (n <= 0) {  // not UTF-8: the byte passes through
      out += s[i++];
      continue;
    }
    utf8proc_uint8_t buf[4];
    auto len = utf8proc_encode_char(f(cp), buf);
    out.append(reinterpret_cast<const char*>(buf), static_cast<size_t>(len));
    i += static_cast<size_t>(n);
  }
  return out;
}

bool is_cased(utf8proc_int32_t cp) {
  auto cat = utf8proc_category(cp);
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT;
}

std::string upper(const std::string& s) { return map_codepoints(s, utf8proc_toupper); }
std::string lower(const std::string& s) { return map_codepoints(s, utf8proc_tolower); }
std::string swapcase(const std::string& s) {
  return map_codepoints(s, [](utf8proc_int32_t cp) {
    return utf8proc_category(cp) == UTF8PROC_CATEGORY_LU ? utf8proc_tolower(cp)
                                                         : utf8proc_toupper(cp);
  });
}

// Python's str.strip family: `chars` undefined or none means whitespace.
std::string strip(const std::string& s, const Value& chars, bool left, bool right) {
  auto drop = [&](char c) {
    if (chars.is_undefined() || chars.is_none()) return is_ws(c);
    return chars.as_string().find(c) != std::string::npos;
  };
  if (!chars.is_undefined() && !chars.is_none() && !chars.is_string())
    throw TemplateError("strip arg must be None or str");
  size_t b = 0, e = s.size();
  if (left)
    while (b < e && drop(s[b])) ++b;
  if (right)
    while (e > b && drop(s[e - 1])) --e;
  return s.substr(b, e - b);
}

// Python's str.title(): a cased letter after an uncased character starts a word.
std::string py_title(const std::string& s) {
  bool prev_cased = false;
  return map_codepoints(s, [&](utf8proc_int32_t cp) {
    utf8proc_int32_t out = prev_cased ? utf8proc_tolower(cp) : utf8proc_totitle(cp);
    prev_cased = is_cased(cp);
    return out;
  });
}

// Jinja's title filter: words begin after whitespace, '-', '(', '{', '[' or '<'.
std::string jinja_title(const std::string& s) {
  bool word_start = true;
  return map_codepoints(s, [&](utf8proc_int32_t cp) {
    utf8proc_int32_t out = word_start ? utf8proc_toupper(cp) : utf8proc_tolower(cp);
    word_start = cp < 0x80 && (is_ws(static_cast<char>(cp)) || cp == '-' || cp == '(' ||
                               cp == '{' || cp == '[' || cp == '<');
    return out;
  });
}

// Python 3.8+: the first character in title case, the rest lower case.
std::string capitalize(const std::string& s) {
  bool first = true;
  return map_codepoints(s, [&](utf8proc_int32_t cp) {
    utf8proc_int32_t out = first ? utf8proc_totitle(cp) : utf8proc_tolower(cp);
    first = false;
    return out;
  });
}

std::string replace_all(const std::string& s, const std::string& from, const std::string& to,
                        int64_t count) {
  std::string out;
  if (from.empty()) {  // Python inserts `to` around every character
    std::vector<size_t> cps = codepoint_offsets(s);
    int64_t done = 0;
    for (size_t i = 0; i + 1 < cps.size(); ++i) {
      if (count < 0 || done < count) {
        out += to;
        ++done;
      }
      out.append(s, cps[i], cps[i + 1] - cps[i]);
    }
    if (count < 0 || done < count) out += to;
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    out.append(s, pos, hit - pos);
    out += to;
    pos = hit + from.size();
    ++done;
  }
  out.append(s, pos);
  return out;
}

Value split(const std::string& s, const Value& sep_v, int64_t maxsplit) {
  List parts;
  if (sep_v.is_undefined() || sep_v.is_none()) {
    size_t i = 0;
    while (true) {
      while (i < s.size() && is_ws(s[i])) ++i;
      if (i >= s.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
        size_t e = s.size();
        while (e > i && is_ws(s[e - 1])) --e;
        parts.emplace_back(s.substr(i, e - i));
        break;
      }
      size_t j = i;
      while (j < s.size() && !is_ws(s[j])) ++j;
      parts.emplace_back(s.substr(i, j - i));
      i = j;
    }
    return Value::list(std::move(parts));
  }
  if (!sep_v.is_string()) throw TemplateError("split() separator must be a string or none");
  const std::string& sep = sep_v.as_string();
  if (sep.empty()) throw TemplateError("empty separator");
  size_t pos = 0;
  while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
    size_t hit = s.find(sep, pos);
    if (hit == std::string::npos) break;
    parts.emplace_back(s.substr(pos, hit - pos));
    pos = hit + sep.size();
  }
  parts.emplace_back(s.substr(pos));
  return Value::list(std::move(parts));
}

bool affix_match(const std::string& s, const Value& affix, bool prefix) {
  auto one = [&](const Value& a) {
    if (!a.is_string())
      throw TemplateError(std::string(prefix ? "startswith" : "endswith") +
                          "() argument must be str or a tuple of str");
    const std::string& x = a.as_string();
    if (x.size() > s.size()) return false;
    return prefix ? s.compare(0, x.size(), x) == 0
                  : s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  if (affix.is_list()) return std::any_of(affix.as_list().begin(), affix.as_list().end(), one);
  return one(affix);
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

size_t length_of(const Value& v) {
  switch (v.type()) {
    case Value::Type::Undefined:
      return 0;
    case Value::Type::String:
      return codepoint_count(v.as_string());
    case Value::Type::List:
      return v.as_list().size();
    case Value::Type::Dict:
      return v.as_dict().size();
    default:
      throw TemplateError("object of type '" + v.type_name() + "' has no len()");
  }
}

// `a.b.c` through items and attributes, as Jinja's attribute filters read it.
Value lookup_path(const Value& item, const std::string& path) {
  Value v = item;
  size_t pos = 0;
  while (true) {
    size_t dot = path.find('.', pos);
    std::string part = path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    bool numeric = !part.empty() && std::all_of(part.begin(), part.end(),
                                                [](char c) { return c >= '0' && c <= '9'; });
    if (v.is_undefined()) return v;
    v = numeric ? get_item(v, Value(static_cast<int64_t>(std::stoll(part))))
                : get_item(v, Value(part));
    if (dot == std::string::npos) return v;
    pos = dot + 1;
  }
}

Value sandbox_refusal(const std::string& type, const std::string& name) {
  return Value::function(name, [type, name](Interpreter&, CallArgs&) -> Value {
    throw TemplateError("access to attribute '" + name + "' of '" + type +
                        "' object is unsafe: chat templates cannot modify values");
  });
}

using Method = std::function<Value(Interpreter&, CallArgs&)>;

Value make_method(const std::string& name, Method m) { return Value::function(name, std::move(m)); }

Value string_method(const std::string& s, const std::string& name) {
  if (name == "strip" || name == "lstrip" || name == "rstrip")
    return make_method(name, [s, name](Interpreter&, CallArgs& a) {
      Args args(name, a, {"chars"});
      return Value(strip(s, args.get(0), name != "rstrip", name != "lstrip"));
    });
  if (name == "split")
    return make_method(name, [s](Interpreter&, CallArgs& a) {
      Args args("split", a, {"sep", "maxsplit"});
      return split(s, args.get(0), args.integer(1, -1));
    });
  if (name == "startswith" || name == "endswith")
    return make_method(name, [s, name](Interpreter&, CallArgs& a) {
      Args args(name, a, {"prefix"});
      return Value(affix_match(s, args.get(0), name == "startswith"));
    });
  if (name == "upper")
    return make_method(name, [s](Interpreter&, CallArgs& a) {
      Args("upper", a, {});
      return Value(upper(s));
    });
  if (name == "lower")
    return make_method(name, [s](Interpreter&, CallArgs& a) {
      Args("lower", a, {});
      return Value(lower(s));
    });
  if (name == "swapcase")
    return make_method(name, [s](Interpreter&, CallArgs& a) {
      Args("swapcase", a, {});
      return Value(swapcase(s));
    });
  if (name == "title")
    return make_method(name, [s](Interpreter&, CallArgs& a) {
      Args("title", a, {});
      return Value(py_title(s));
    });
  if (name == "capitalize")
    return make_method(name, [s](Interpreter&, CallArgs& a) {
      Args("capitalize", a, {});
      return Value(capitalize(s));
    });
  if (name == "replace")
    return make_method(name, [s](Interpreter& in, CallArgs& a) {
      Args args("replace", a, {"old", "new", "count"});
      std::string out = replace_all(s, args.str(0, ""), args.str(1, ""), args.integer(2, -1));
      in.check_size(out.size());
      return Value(std::move(out));
    });
  if (name == "find" || name == "rfind" || name == "count")
    return make_method(name, [s, name](Interpreter&, CallArgs& a) {
      Args args(name, a, {"sub"});
      std::string sub = args.str(0, "");
      if (name == "count") {
        if (sub.empty()) return Value(static_cast<int64_t>(codepoint_count(s) + 1));
        int64_t n = 0;
        for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
        return Value(n);
      }
      size_t p = name == "find" ? s.find(sub) : s.rfind(sub);
      return Value(p == std::string::npos ? int64_t{-1}
                                          : static_cast<int64_t>(codepoint_count(s.substr(0, p))));
    });
  if (name == "join")
    return make_method(name, [s](Interpreter& in, CallArgs& a) {
      Args args("join", a, {"iterable"});
      std::string out;
      bool first = true;
      for (const Value& v : iterate(args.get(0))) {
        if (!v.is_string())
          throw TemplateError("sequence item: expected str instance, " + v.type_name() + " found");
        if (!first) out += s;
        first = false;
        out += v.as_string();
        in.check_size(out.size());
      }
      return Value(std::move(out));
    });
  if (name == "splitlines")
    return make_method(name, [s](Interpreter&, CallArgs& a) {
      Args("splitlines", a, {});
      List lines;
      size_t pos = 0;
      while (pos < s.size()) {
        size_t nl = s.find_first_of("\r\n", pos);
        if (nl == std::string::npos) {
          lines.emplace_back(s.substr(pos));
          break;
        }
        lines.emplace_back(s.substr(pos, nl - pos));
        pos = nl + ((s[nl] == '\r' && nl + 1 < s.size() && s[nl + 1] == '\n') ? 2 : 1);
      }
      return Value::list(std::move(lines));
    });
  if (name == "removeprefix" || name == "removesuffix")
    return make_method(name, [s, name](Interpreter&, CallArgs& a) {
      Args args(name, a, {"affix"});
      std::string x = args.str(0, "");
      if (name == "removeprefix")
        return Value(affix_match(s, Value(x), true) ? s.substr(x.size()) : s);
      return Value(affix_match(s, Value(x), false) ? s.substr(0, s.size() - x.size()) : s);
    });
  if (name == "isdigit" || name == "isalpha" || name == "isalnum" || name == "isspace" ||
      name == "isupper" || name == "islower")
    return make_method(name, [s, name](Interpreter&, CallArgs& a) {
      Args(name, a, {});
      if (s.empty()) return Value(false);
      auto all = [&](auto pred) { return std::all_of(s.begin(), s.end(), pred); };
      if (name == "isdigit") return Value(all([](char c) { return c >= '0' && c <= '9'; }));
      if (name == "isalpha") return Value(all(is_alpha));
      if (name == "isalnum")
        return Value(all([](char c) { return is_alpha(c) || (c >= '0' && c <= '9'); }));
      if (name == "isspace") return Value(all(is_ws));
      bool cased = std::any_of(s.begin(), s.end(), is_alpha);
      if (name == "isupper") return Value(cased && s == upper(s));
      return Value(cased && s == lower(s));
    });
  return Value();
}

Value dict_method(const Value& self, const std::string& name) {
  if (name == "items" || name == "keys" || name == "values")
    return make_method(name, [self, name](Interpreter&, CallArgs& a) {
      Args(name, a, {});
      List out;
      for (const auto& [k, v] : self.as_dict().entries()) {
        if (name == "items")
          out.push_back(Value::tuple({Value(k), v}));
        else
          out.push_back(name == "keys" ? Value(k) : v);
      }
      return Value::list(std::move(out));
    });
  if (name == "get")
    return make_method(name, [self](Interpreter&, CallArgs& a) {
      Args args("get", a, {"key", "default"});
      Value key = args.get(0);
      const Value* v = key.is_string() ? self.as_dict().find(key.as_string()) : nullptr;
      return v ? *v : args.get(1, Value(None{}));
    });
  if (name == "copy")
    return make_method(name, [self](Interpreter&, CallArgs& a) {
      Args("copy", a, {});
      Value d = Value::dict();
      for (const auto& [k, v] : self.as_dict().entries()) d.as_dict().set(k, v);
      return d;
    });
  static const std::unordered_set<std::string> kMutating = {"update", "pop", "popitem",
                                                            "setdefault", "clear"};
  if (kMutating.count(name)) return sandbox_refusal("dict", name);
  return Value();
}

Value list_method(const Value& self, const std::string& name) {
  if (name == "index" || name == "count")
    return make_method(name, [self, name](Interpreter&, CallArgs& a) {
      Args args(name, a, {"value"});
      Value x = args.get(0);
      const List& l = self.as_list();
      int64_t n = 0;
      for (size_t i = 0; i < l.size(); ++i) {
        if (!equals(l[i], x)) continue;
        if (name == "index") return Value(static_cast<int64_t>(i));
        ++n;
      }
      if (name == "index") throw TemplateError(to_repr(x) + " is not in list");
      return Value(n);
    });
  if (name == "copy")
    return make_method(name, [self](Interpreter&, CallArgs& a) {
      Args("copy", a, {});
      return Value::list(self.as_list());
    });
  static const std::unordered_set<std::string> kMutating = {"append", "extend",  "insert", "pop",
                                                            "remove", "reverse", "sort",   "clear"};
  if (kMutating.count(name)) return sandbox_refusal("list", name);
  return Value();
}

// ---- tests -----------------------------------------------------------------------

using TestFn = std::function<bool(Interpreter&, const Value&, CallArgs&)>;

const std::unordered_map<std::string, TestFn>& tests() {
  static const std::unordered_map<std::string, TestFn> table = [] {
    std::unordered_map<std::string, TestFn> t;
    auto plain = [](std::function<bool(const Value&)> f) {
      return [f](Interpreter&, const Value& v, CallArgs& a) {
        Args("test", a, {});
        return f(v);
      };
    };
    auto with_arg = [](std::function<bool(const Value&, const Value&)> f) {
      return [f](Interpreter&, const Value& v, CallArgs& a) {
        Args args("test", a, {"other"});
        return f(v, args.get(0));
      };
    };
    t["defined"] = plain([](const Value& v) { return !v.is_undefined(); });
    t["undefined"] = plain([](const Value& v) { return v.is_undefined(); });
    t["none"] = plain([](const Value& v) { return v.is_none(); });
    t["boolean"] = plain([](const Value& v) { return v.is_bool(); });
    t["true"] = plain([](const Value& v) { return v.is_bool() && v.as_bool(); });
    t["false"] = plain([](const Value& v) { return v.is_bool() && !v.as_bool(); });
    t["integer"] = plain([](const Value& v) { return v.is_int(); });
    t["float"] = plain([](const Value& v) { return v.is_float(); });
    t["number"] = plain([](const Value& v) { return v.is_number(); });
    t["string"] = plain([](const Value& v) { return v.is_string(); });
    t["mapping"] = plain([](const Value& v) { return v.is_dict(); });
    t["iterable"] = plain([](const Value& v) {
      return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined();
    });
    t["sequence"] = plain([](const Value& v) {
      return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined();
    });
    t["callable"] = plain([](const Value& v) { return v.is_callable(); });
    t["lower"] = plain(
        [](const Value& v) { return v.is_string() && v.as_string() == lower(v.as_string()); });
    t["upper"] = plain(
        [](const Value& v) { return v.is_string() && v.as_string() == upper(v.as_string()); });
    auto int_of = [](const Value& v) {
      require_defined(v);
      if (!v.is_int() && !v.is_bool())
        throw TemplateError("expected an integer, got " + v.type_name());
      return v.to_int();
    };
    t["even"] = plain([int_of](const Value& v) { return int_of(v) % 2 == 0; });
    t["odd"] = plain([int_of](const Value& v) { return int_of(v) % 2 != 0; });
    t["divisibleby"] = with_arg([int_of](const Value& v, const Value& n) {
      int64_t d = int_of(n);
      if (d == 0) throw TemplateError("integer division or modulo by zero");
      return int_of(v) % d == 0;
    });
    t["sameas"] = with_arg([](const Value& a, const Value& b) {
      if (a.type() != b.type()) return false;
      if (a.is_list()) return &a.as_list() == &b.as_list();
      if (a.is_dict()) return &a.as_dict() == &b.as_dict();
      return equals(a, b);
    });
    t["in"] = with_arg([](const Value& a, const Value& seq) {
      if (seq.is_string())
        return a.is_string() && seq.as_string().find(a.as_string()) != std::string::npos;
      if (seq.is_dict()) return a.is_string() && seq.as_dict().find(a.as_string()) != nullptr;
      for (const Value& v : iterate(seq))
        if (equals(v, a)) return true;
      return false;
    });
    auto eq = with_arg([](const Value& a, const Value& b) { return equals(a, b); });
    auto ne = with_arg([](const Value& a, const Value& b) { return !equals(a, b); });
    auto lt = with_arg([](const Value& a, const Value& b) { return less(a, b); });
    auto le = with_arg([](const Value& a, const Value& b) { return !less(b, a); });
    auto gt = with_arg([](const Value& a, const Value& b) { return less(b, a); });
    auto ge = with_arg([](const Value& a, const Value& b) { return !less(a, b); });
    for (const char* n : {"eq", "equalto", "=="}) t[n] = eq;
    for (const char* n : {"ne", "!="}) t[n] = ne;
    for (const char* n : {"lt", "lessthan", "<"}) t[n] = lt;
    for (const char* n : {"le", "<="}) t[n] = le;
    for (const char* n : {"gt", "greaterthan", ">"}) t[n] = gt;
    for (const char* n : {"ge", ">="}) t[n] = ge;
    return t;
  }();
  return table;
}

// ---- filters -----------------------------------------------------------------------

using FilterFn = std::function<Value(Interpreter&, const Value&, CallArgs&)>;

// select/reject/selectattr/rejectattr: which items pass; `first_test_arg` is
// where the test's name sits among the positional arguments.
Value filter_items(Interpreter& in, const Value& seq, CallArgs& a, bool by_attribute,
                   bool keep_passing) {
  std::string attribute;
  size_t test_at = 0;
  if (by_attribute) {
    if (a.positional.empty() || !a.positional[0].is_string())
      throw TemplateError("selectattr/rejectattr need an attribute name");
    attribute = a.positional[0].as_string();
    test_at = 1;
  }
  std::string test;
  if (a.positional.size() > test_at) {
    if (!a.positional[test_at].is_string()) throw TemplateError("the test's name must be a string");
    test = a.positional[test_at].as_string();
  }
  CallArgs test_args;
  for (size_t i = test_at + 1; i < a.positional.size(); ++i)
    test_args.positional.push_back(a.positional[i]);
  test_args.keyword = a.keyword;
  List out;
  for (const Value& item : iterate(seq)) {
    Value subject = by_attribute ? lookup_path(item, attribute) : item;
    bool pass;
    if (test.empty()) {
      pass = subject.truthy();
    } else {
      CallArgs copy = test_args;
      pass = apply_test(in, test, subject, copy);
    }
    if (pass == keep_passing) out.push_back(item);
  }
  return Value::list(std::move(out));
}

Value sorted_by(const Value& seq, bool reverse, bool case_sensitive, const Value& attribute) {
  List items = iterate(seq);
  auto key = [&](const Value& v) {
    Value k = attribute.is_string() ? lookup_path(v, attribute.as_string()) : v;
    if (!case_sensitive && k.is_string()) return Value(lower(k.as_string()));
    return k;
  };
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    return reverse ? less(key(y), key(x)) : less(key(x), key(y));
  });
  return Value::list(std::move(items));
}

const std::unordered_map<std::string, FilterFn>& filters() {
  static const std::unordered_map<std::string, FilterFn> table = [] {
    std::unordered_map<std::string, FilterFn> f;
    f["trim"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args args("trim", a, {"chars"});
      return Value(strip(to_str(v), args.get(0), true, true));
    };
    f["length"] = f["count"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args("length", a, {});
      return Value(static_cast<int64_t>(length_of(v)));
    };
    f["upper"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args("upper", a, {});
      return Value(upper(to_str(v)));
    };
    f["lower"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args("lower", a, {});
      return Value(lower(to_str(v)));
    };
    f["title"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args("title", a, {});
      return Value(jinja_title(to_str(v)));
    };
    f["capitalize"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args("capitalize", a, {});
      return Value(capitalize(to_str(v)));
    };
    f["tojson"] = [](Interpreter& in, const Value& v, CallArgs& a) {
      Args args("tojson", a, {"ensure_ascii", "indent", "separators", "sort_keys"});
      JsonStyle st;
      st.ensure_ascii = args.flag(0, false);
      st.indent = static_cast<int>(args.integer(1, -1));
      Value seps = args.get(2);
      if (seps.is_list()) {
        if (seps.as_list().size() != 2 || !seps.as_list()[0].is_string() ||
            !seps.as_list()[1].is_string())
          throw TemplateError("tojson separators must be two strings");
        st.item_separator = seps.as_list()[0].as_string();
        st.key_separator = seps.as_list()[1].as_string();
      }
      st.sort_keys = args.flag(3, false);
      std::string out = to_json_text(v, st);
      in.check_size(out.size());
      return Value(std::move(out));
    };
    f["string"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args("string", a, {});
      return Value(to_str(v));
    };
    f["safe"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args("safe", a, {});
      return v;
    };
    f["e"] = f["escape"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args("escape", a, {});
      return Value(html_escape(to_str(v)));
    };
    f["int"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args args("int", a, {"default", "base"});
      Value dflt = args.get(0, Value(int64_t{0}));
      if (v.is_int() || v.is_bool()) return Value(v.to_int());
      if (v.is_float())
        return std::isfinite(v.as_float()) ? Value(static_cast<int64_t>(v.as_float())) : dflt;
      if (!v.is_string()) return dflt;
      std::string s = strip(v.as_string(), Value(), true, true);
      int64_t base = args.integer(1, 10);
      errno = 0;
      char* end = nullptr;
      long long r = std::strtoll(s.c_str(), &end, static_cast<int>(base));
      if (!s.empty() && end && *end == '\0' && errno == 0) return Value(static_cast<int64_t>(r));
      double d = std::strtod(s.c_str(), &end);
      if (!s.empty() && end && *end == '\0' && std::isfinite(d))
        return Value(static_cast<int64_t>(d));
      return dflt;
    };
    f["float"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args args("float", a, {"default"});
      Value dflt = args.get(0, Value(0.0));
      if (v.is_number()) return Value(v.to_double());
      if (!v.is_string()) return dflt;
      std::string s = strip(v.as_string(), Value(), true, true);
      char* end = nullptr;
      double d = std::strtod(s.c_str(), &end);
      return (!s.empty() && end && *end == '\0') ? Value(d) : dflt;
    };
    f["first"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args("first", a, {});
      List items = iterate(v);
      return items.empty() ? Value(Undefined{"first"}) : items.front();
    };
    f["last"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args("last", a, {});
      List items = iterate(v);
      return items.empty() ? Value(Undefined{"last"}) : items.back();
    };
    f["join"] = [](Interpreter& in, const Value& v, CallArgs& a) {
      Args args("join", a, {"d", "attribute"});
      std::string sep = to_str(args.get(0, Value("")));
      Value attribute = args.get(1);
      std::string out;
      bool first = true;
      for (const Value& item : iterate(v)) {
        if (!first) out += sep;
        first = false;
        out += to_str(attribute.is_string() ? lookup_path(item, attribute.as_string()) : item);
        in.check_size(out.size());
      }
      return Value(std::move(out));
    };
    f["default"] = f["d"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args args("default", a, {"default_value", "boolean"});
      bool use_default = args.flag(1, false) ? !v.truthy() : v.is_undefined();
      return use_default ? args.get(0, Value("")) : v;
    };
    f["replace"] = [](Interpreter& in, const Value& v, CallArgs& a) {
      Args args("replace", a, {"old", "new", "count"});
      std::string out =
          replace_all(to_str(v), to_str(args.get(0)), to_str(args.get(1)), args.integer(2, -1));
      in.check_size(out.size());
      return Value(std::move(out));
    };
    f["list"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args("list", a, {});
      return Value::list(iterate(v));
    };
    f["items"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args("items", a, {});
      List out;
      if (v.is_undefined()) return Value::list();
      if (!v.is_dict())
        throw TemplateError("can only get item pairs from a mapping, not " + v.type_name());
      for (const auto& [k, x] : v.as_dict().entries()) out.push_back(Value::tuple({Value(k), x}));
      return Value::list(std::move(out));
    };
    f["attr"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args args("attr", a, {"name"});
      // Python attributes only: a dict's keys are not attributes here
      std::string name = args.str(0, "");
      require_defined(v);
      Value m = method_of(v, name);
      return m.is_undefined() ? Value(Undefined{name}) : m;
    };
    f["select"] = [](Interpreter& in, const Value& v, CallArgs& a) {
      return filter_items(in, v, a, false, true);
    };
    f["reject"] = [](Interpreter& in, const Value& v, CallArgs& a) {
      return filter_items(in, v, a, false, false);
    };
    f["selectattr"] = [](Interpreter& in, const Value& v, CallArgs& a) {
      return filter_items(in, v, a, true, true);
    };
    f["rejectattr"] = [](Interpreter& in, const Value& v, CallArgs& a) {
      return filter_items(in, v, a, true, false);
    };
    f["map"] = [](Interpreter& in, const Value& v, CallArgs& a) {
      List out;
      const Value* attribute = nullptr;
      const Value* dflt = nullptr;
      for (const auto& kv : a.keyword) {
        if (kv.first == "attribute")
          attribute = &kv.second;
        else if (kv.first == "default")
          dflt = &kv.second;
      }
      if (attribute) {
        if (!attribute->is_string()) throw TemplateError("map(attribute=) needs a string");
        for (const Value& item : iterate(v)) {
          Value x = lookup_path(item, attribute->as_string());
          out.push_back(x.is_undefined() && dflt ? *dflt : x);
        }
        return Value::list(std::move(out));
      }
      if (a.positional.empty() || !a.positional[0].is_string())
        throw TemplateError("map() needs a filter name or attribute=");
      std::string name = a.positional[0].as_string();
      CallArgs rest;
      rest.positional.assign(a.positional.begin() + 1, a.positional.end());
      rest.keyword = a.keyword;
      for (const Value& item : iterate(v)) {
        CallArgs copy = rest;
        out.push_back(apply_filter(in, name, item, copy));
      }
      return Value::list(std::move(out));
    };
    f["abs"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args("abs", a, {});
      if (v.is_float()) return Value(std::fabs(v.as_float()));
      if (v.is_int() || v.is_bool()) {
        if (v.to_int() == INT64_MIN) throw TemplateError("integer overflow");
        return Value(v.to_int() < 0 ? -v.to_int() : v.to_int());
      }
      throw TemplateError("bad operand type for abs(): '" + v.type_name() + "'");
    };
    f["round"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args args("round", a, {"precision", "method"});
      if (!v.is_number()) throw TemplateError("round needs a number, got " + v.type_name());
      int64_t precision = args.integer(0, 0);
      std::string method = args.str(1, "common");
      double scale = std::pow(10.0, static_cast<double>(precision));
      double x = v.to_double() * scale;
      if (method == "common")
        x = std::nearbyint(x);  // Python's round(): halves to even
      else if (method == "ceil")
        x = std::ceil(x);
      else if (method == "floor")
        x = std::floor(x);
      else
        throw TemplateError("method must be common, ceil or floor");
      return Value(x / scale);
    };
    f["reverse"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args("reverse", a, {});
      if (v.is_string()) {
        std::vector<size_t> cps = codepoint_offsets(v.as_string());
        std::string out;
        for (size_t i = cps.size() - 1; i > 0; --i)
          out.append(v.as_string(), cps[i - 1], cps[i] - cps[i - 1]);
        return Value(std::move(out));
      }
      List items = iterate(v);
      std::reverse(items.begin(), items.end());
      return Value::list(std::move(items));
    };
    f["sort"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args args("sort", a, {"reverse", "case_sensitive", "attribute"});
      return sorted_by(v, args.flag(0, false), args.flag(1, false), args.get(2));
    };
    f["unique"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args args("unique", a, {"case_sensitive", "attribute"});
      bool case_sensitive = args.flag(0, false);
      Value attribute = args.get(1);
      List out, seen;
      for (const Value& item : iterate(v)) {
        Value k = attribute.is_string() ? lookup_path(item, attribute.as_string()) : item;
        if (!case_sensitive && k.is_string()) k = Value(lower(k.as_string()));
        if (std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, k); }))
          continue;
        seen.push_back(k);
        out.push_back(item);
      }
      return Value::list(std::move(out));
    };
    f["sum"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args args("sum", a, {"attribute", "start"});
      Value attribute = args.get(0);
      Value total = args.get(1, Value(int64_t{0}));
      for (const Value& item : iterate(v)) {
        Value x = attribute.is_string() ? lookup_path(item, attribute.as_string()) : item;
        if (!x.is_number() || !total.is_number())
          throw TemplateError("sum() needs numbers, got " + x.type_name());
        int64_t r;
        if ((x.is_float() || total.is_float()))
          total = Value(total.to_double() + x.to_double());
        else if (__builtin_add_overflow(total.to_int(), x.to_int(), &r))
          throw TemplateError("integer overflow");
        else
          total = Value(r);
      }
      return total;
    };
    for (const char* name : {"min", "max"}) {
      bool want_max = std::string(name) == "max";
      f[name] = [want_max](Interpreter&, const Value& v, CallArgs& a) {
        Args args(want_max ? "max" : "min", a, {"case_sensitive", "attribute"});
        Value sorted = sorted_by(v, false, args.flag(0, false), args.get(1));
        const List& items = sorted.as_list();
        if (items.empty()) return Value(Undefined{want_max ? "max" : "min"});
        return want_max ? items.back() : items.front();
      };
    }
    f["indent"] = [](Interpreter& in, const Value& v, CallArgs& a) {
      Args args("indent", a, {"width", "first", "blank"});
      Value w = args.get(0, Value(int64_t{4}));
      if (!w.is_string() && !w.is_int() && !w.is_bool())
        throw TemplateError("indent width must be an integer or a string");
      if (!w.is_string()) in.check_size(static_cast<size_t>(std::max<int64_t>(0, w.to_int())));
      std::string pad =
          w.is_string() ? w.as_string()
                        : std::string(static_cast<size_t>(std::max<int64_t>(0, w.to_int())), ' ');
      bool first = args.flag(1, false), blank = args.flag(2, false);
      std::string s = to_str(v);
      std::vector<std::string> lines;
      size_t pos = 0;
      while (pos < s.size()) {
        size_t nl = s.find('\n', pos);
        if (nl == std::string::npos) nl = s.size();
        lines.push_back(s.substr(pos, nl - pos));
        pos = nl + 1;
      }
      std::string out;
      for (size_t i = 0; i < lines.size(); ++i) {
        if (i > 0) out += '\n';
        if ((i > 0 || first) && (blank || !lines[i].empty())) out += pad;
        out += lines[i];
        in.check_size(out.size());
      }
      if (lines.empty() && first) out = pad;
      return Value(std::move(out));
    };
    f["dictsort"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args args("dictsort", a, {"case_sensitive", "by", "reverse"});
      if (!v.is_dict()) throw TemplateError("dictsort needs a mapping, got " + v.type_name());
      bool case_sensitive = args.flag(0, false), reverse = args.flag(2, false);
      std::string by = args.str(1, "key");
      if (by != "key" && by != "value")
        throw TemplateError("You can only sort by either \"key\" or \"value\"");
      List pairs;
      for (const auto& [k, x] : v.as_dict().entries()) pairs.push_back(Value::tuple({Value(k), x}));
      auto key = [&](const Value& pair) {
        Value k = pair.as_list()[by == "key" ? 0 : 1];
        return (!case_sensitive && k.is_string()) ? Value(lower(k.as_string())) : k;
      };
      std::stable_sort(pairs.begin(), pairs.end(), [&](const Value& x, const Value& y) {
        return reverse ? less(key(y), key(x)) : less(key(x), key(y));
      });
      return Value::list(std::move(pairs));
    };
    f["wordcount"] = [](Interpreter&, const Value& v, CallArgs& a) {
      Args("wordcount", a, {});
      return Value(static_cast<int64_t>(split(to_str(v), Value(), -1).as_list().size()));
    };
    return f;
  }();
  return table;
}

}  // namespace

// ---- entry points ----------------------------------------------------------------

Value apply_filter(Interpreter& in, const std::string& name, const Value& subject, CallArgs& args) {
  auto it = filters().find(name);
  if (it == filters().end()) throw TemplateError("unknown filter '" + name + "'");
  in.count_step();
  return it->second(in, subject, args);
}

bool apply_test(Interpreter& in, const std::string& name, const Value& subject, CallArgs& args) {
  auto it = tests().find(name);
  if (it == tests().end()) throw TemplateError("unknown test '" + name + "'");
  in.count_step();
  return it->second(in, subject, args);
}

Value method_of(const Value& object, const std::string& name) {
  if (object.is_string()) return string_method(object.as_string(), name);
  if (object.is_dict() && !object.as_dict().is_namespace) return dict_method(object, name);
  if (object.is_list()) return list_method(object, name);
  return Value();
}

// Jinja's sandbox refuses ranges longer than this.
static constexpr int64_t kMaxRange = 100000;

void add_globals(Interpreter& in) {
  in.set_global(
      "range", Value::function("range", [](Interpreter&, CallArgs& a) {
        if (!a.keyword.empty()) throw TemplateError("range() takes no keyword arguments");
        std::vector<int64_t> n;
        for (const Value& v : a.positional) {
          if (!v.is_int() && !v.is_bool())
            throw TemplateError("range() arguments must be integers, got " + v.type_name());
          n.push_back(v.to_int());
        }
        if (n.empty() || n.size() > 3) throw TemplateError("range expected 1 to 3 arguments");
        int64_t start = n.size() == 1 ? 0 : n[0], stop = n.size() == 1 ? n[0] : n[1],
                step = n.size() == 3 ? n[2] : 1;
        if (step == 0) throw TemplateError("range() arg 3 must not be zero");
        // Items counted in 128 bits, so that no step can overflow.
        const __int128 span =
            step > 0 ? static_cast<__int128>(stop) - start : static_cast<__int128>(start) - stop;
        const __int128 stride =
            step > 0 ? static_cast<__int128>(step) : -static_cast<__int128>(step);
        const __int128 count = span <= 0 ? 0 : (span + stride - 1) / stride;
        if (count > kMaxRange)
          throw TemplateError("range too big (more than " + std::to_string(kMaxRange) + " items)");
        List out;
        for (__int128 k = 0; k < count; ++k)
          out.emplace_back(static_cast<int64_t>(start + k * step));
        return Value::list(std::move(out));
      }));
  auto make_dict = [](CallArgs& a, bool is_namespace, const char* fn) {
    Value d = Value::dict();
    d.as_dict().is_namespace = is_namespace;
    if (a.positional.size() > 1)
      throw TemplateError(std::string(fn) + "() takes at most one positional argument");
    if (!a.positional.empty()) {
      const Value& init = a.positional[0];
      if (!init.is_dict()) throw TemplateError(std::string(fn) + "() argument must be a mapping");
      for (const auto& [k, v] : init.as_dict().entries()) d.as_dict().set(k, v);
    }
    for (const auto& [k, v] : a.keyword) d.as_dict().set(k, v);
    return d;
  };
  in.set_global("namespace", Value::function("namespace", [make_dict](Interpreter&, CallArgs& a) {
                  return make_dict(a, true, "namespace");
                }));
  in.set_global("dict", Value::function("dict", [make_dict](Interpreter&, CallArgs& a) {
                  return make_dict(a, false, "dict");
                }));
  in.set_global("raise_exception",
                Value::function("raise_exception", [](Interpreter&, CallArgs& a) -> Value {
                  Args args("raise_exception", a, {"message"});
                  throw TemplateError(to_str(args.get(0)), 0, true);
                }));
  in.set_global("strftime_now", Value::function("strftime_now", [](Interpreter&, CallArgs& a) {
                  Args args("strftime_now", a, {"format"});
                  std::string fmt = args.str(0, "");
                  std::time_t now = std::time(nullptr);
                  std::tm local{};
                  localtime_r(&now, &local);
                  char buf[512];
                  size_t n = fmt.empty() ? 0 : std::strftime(buf, sizeof(buf), fmt.c_str(), &local);
                  return Value(std::string(buf, n));
                }));
}

static void check_expr(const Expr* e);

static void check_body(const Body& body) {
  for (const StmtPtr& s : body) {
    check_expr(s->expr.get());
    check_expr(s->cond.get());
    for (const ExprPtr& c : s->conds) check_expr(c.get());
    for (const Body& b : s->bodies) check_body(b);
    check_body(s->body);
    check_body(s->else_body);
    for (const MacroParam& p : s->params) check_expr(p.default_value.get());
    for (const ExprPtr& f : s->filters) check_expr(f.get());
  }
}

static void check_expr(const Expr* e) {
  if (!e) return;
  if (e->kind == ExprKind::Filter && !filters().count(e->name))
    throw TemplateError("unknown filter '" + e->name + "'", e->line);
  if (e->kind == ExprKind::Test && !tests().count(e->name))
    throw TemplateError("unknown test '" + e->name + "'", e->line);
  for (const Expr* c : {e->object.get(), e->lhs.get(), e->rhs.get(), e->cond.get(), e->start.get(),
                        e->stop.get(), e->step.get()})
    check_expr(c);
  for (const ExprPtr& c : e->items) check_expr(c.get());
  for (const ExprPtr& c : e->keys) check_expr(c.get());
  for (const auto& kv : e->kwargs) check_expr(kv.second.get());
}

void check_names(const Program& program) { check_body(program.body); }

}  // namespace moe::jinja
