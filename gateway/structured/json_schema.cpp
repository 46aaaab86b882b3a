#include "gateway/structured/json_schema.h"

#include "gateway/structured/json_grammar.h"

#include <map>
#include <set>

namespace moe::gw::structured {
namespace {

using json = nlohmann::json;

// Keywords that only describe: they pass.
const std::set<std::string>& annotations() {
  static const std::set<std::string> s = {"title", "description", "default", "examples", "$schema", "$id",
                                          "$comment", "strict", "deprecated", "readOnly", "writeOnly"};
  return s;
}
// Keywords this compiler enforces.
const std::set<std::string>& enforced() {
  static const std::set<std::string> s = {"type",  "properties", "required", "additionalProperties", "items",
                                          "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "$ref",
                                          "$defs", "definitions", "nullable"};
  return s;
}

class Compiler {
 public:
  explicit Compiler(const json& root) : root_(root) {
    schema_.nodes.resize(2);
    schema_.nodes[kAnyNode].kind = NodeKind::any;
    schema_.nodes[kAnyLiteralsNode].kind = NodeKind::literals;
    schema_.nodes[kAnyLiteralsNode].literals = {"true", "false", "null"};
  }

  Result<std::shared_ptr<const Schema>> run() {
    const int r = node(root_, "#");
    if (!error_.empty()) return make_error(error_);
    if (schema_.nodes.size() > size_t(kMaxNodes))
      return make_error("the schema compiles to " + std::to_string(schema_.nodes.size()) + " nodes, more than " +
                        std::to_string(kMaxNodes));
    flatten_alternatives();
    if (!error_.empty()) return make_error(error_);
    // One frame is kept for the markup around tool calls (tool_call_sequence).
    if (frames_needed(schema_, r) > kMaxDepth - 1)
      return make_error("the schema requires values nested deeper than " + std::to_string(kMaxDepth - 1) +
                        " levels (each object, key, array and value a level), or a required recursion that never "
                        "ends: no output could complete it");
    schema_.root = r;
    schema_.key = root_.dump();
    return std::make_shared<const Schema>(std::move(schema_));
  }

 private:
  int fail(const std::string& why) {
    if (error_.empty()) error_ = why;
    return kAnyNode;
  }
  int add(SchemaNode n) {
    schema_.nodes.push_back(std::move(n));
    return int(schema_.nodes.size()) - 1;
  }
  int literal_node(std::vector<std::string> texts, const std::string& path) {
    for (const std::string& t : texts)
      if (t.size() > size_t(kMaxLiteralBytes))
        return fail("a value of 'enum' or 'const' at " + path + " is " + std::to_string(t.size()) +
                    " bytes of JSON, more than " + std::to_string(kMaxLiteralBytes));
    SchemaNode n;
    n.kind = NodeKind::literals;
    n.literals = std::move(texts);
    return add(std::move(n));
  }

  int node(const json& s, const std::string& path) {
    if (!error_.empty()) return kAnyNode;
    if (s.is_boolean()) return s.get<bool>() ? kAnyNode : fail("schema at " + path + " is false: nothing can match it");
    if (!s.is_object()) return fail("schema at " + path + " must be an object");
    if (++depth_ > 64) return fail("schema at " + path + " nests deeper than 64");
    struct Leave {
      int& d;
      ~Leave() { --d; }
    } leave{depth_};
    for (const auto& [k, v] : s.items()) {
      if (annotations().count(k) || enforced().count(k)) continue;
      return fail("schema keyword '" + k + "' at " + path + " is not supported (it would not be enforced)");
    }
    if (const auto r = s.find("$ref"); r != s.end()) {
      // A reference stands alone: keywords beside it would have to hold as
      // well, which the compiler does not merge.
      for (const auto& [k, v] : s.items())
        if (k != "$ref" && k != "$defs" && k != "definitions" && !annotations().count(k))
          return fail("'" + k + "' beside '$ref' at " + path + " is not supported (it would not be enforced)");
      return ref(*r, path);
    }

    int n = -1;
    if (s.contains("enum") || s.contains("const")) {
      const char* kw = s.contains("enum") ? "enum" : "const";
      // The values are exact: beside them only a 'type' (which each value
      // must have) and 'nullable' mean something.
      for (const auto& [k, v] : s.items())
        if (k != kw && k != "type" && k != "nullable" && k != "$defs" && k != "definitions" && !annotations().count(k))
          return fail("'" + k + "' beside '" + kw + "' at " + path + " is not supported (it would not be enforced)");
      std::vector<json> values;
      if (std::string(kw) == "enum") {
        const json& e = s["enum"];
        if (!e.is_array() || e.empty()) return fail("'enum' at " + path + " must be a non-empty array");
        if (e.size() > size_t(kMaxLiterals)) return fail("'enum' at " + path + " has more than 64 values");
        values.assign(e.begin(), e.end());
      } else {
        values.push_back(s["const"]);
      }
      std::vector<std::string> texts;
      for (const json& v : values) {
        const int fits = has_type(s, v, path);
        if (fits < 0) return kAnyNode;  // a bad 'type' (error_ set)
        if (fits == 0) {
          if (std::string(kw) == "const")
            return fail("'const' at " + path + " is " + v.dump().substr(0, 64) + ", which is not of its 'type'");
          continue;  // an enum value of another type can never be produced
        }
        texts.push_back(v.dump());
      }
      if (texts.empty()) return fail("no value of 'enum' at " + path + " is of its 'type'");
      n = literal_node(std::move(texts), path);
    } else if (s.contains("anyOf") || s.contains("oneOf")) {
      const char* kw = s.contains("anyOf") ? "anyOf" : "oneOf";
      const json& list = s[kw];
      if (!list.is_array() || list.empty()) return fail(std::string("'") + kw + "' at " + path + " must be a non-empty array");
      if (list.size() > size_t(kMaxAlternatives)) return fail(std::string("'") + kw + "' at " + path + " has more than 8 options");
      // Sibling keywords (e.g. a shared "type") would have to hold for every
      // option; only annotations may stand beside the list.
      for (const auto& [k, v] : s.items())
        if (k != kw && !annotations().count(k) && k != "$defs" && k != "definitions")
          return fail("'" + k + "' beside '" + kw + "' at " + path + " is not supported");
      SchemaNode alt;
      alt.kind = NodeKind::alternatives;
      for (size_t i = 0; i < list.size(); ++i) alt.options.push_back(node(list[i], path + "/" + kw + "/" + std::to_string(i)));
      n = add(std::move(alt));
    } else {
      n = typed(s, path);
    }
    if (const auto nb = s.find("nullable"); nb != s.end() && nb->is_boolean() && nb->get<bool>()) {
      SchemaNode alt;
      alt.kind = NodeKind::alternatives;
      alt.options = {n, literal_node({"null"}, path)};
      n = add(std::move(alt));
    }
    return n;
  }

  // The names a 'type' lists (one, or a list of 1 to 8), each known; false
  // (the error set) when it is malformed.
  bool types_of(const json& t, const std::string& path, std::vector<std::string>* types) {
    if (t.is_string()) {
      types->push_back(t.get<std::string>());
    } else if (t.is_array() && !t.empty() && t.size() <= size_t(kMaxAlternatives)) {
      for (const json& x : t) {
        if (!x.is_string()) return fail("'type' at " + path + " must be a string or a list of strings"), false;
        types->push_back(x.get<std::string>());
      }
    } else {
      return fail("'type' at " + path + " must be a string or a list of 1 to 8 strings"), false;
    }
    static const std::set<std::string> known = {"object", "array", "string", "number", "integer", "boolean", "null"};
    for (const std::string& ty : *types)
      if (!known.count(ty)) return fail("'type' at " + path + ": unknown type '" + ty + "'"), false;
    return true;
  }

  // Whether `v` is of the 'type' beside it (1), not (0), or no 'type' is
  // there (1); -1 when the 'type' itself is malformed.
  int has_type(const json& s, const json& v, const std::string& path) {
    const auto t = s.find("type");
    if (t == s.end()) return 1;
    std::vector<std::string> types;
    if (!types_of(*t, path, &types)) return -1;
    const bool integral =
        v.is_number_integer() || (v.is_number_float() && v.get<double>() == double(int64_t(v.get<double>())));
    for (const std::string& ty : types)
      if ((ty == "string" && v.is_string()) || (ty == "number" && v.is_number()) || (ty == "integer" && v.is_number() && integral) ||
          (ty == "boolean" && v.is_boolean()) || (ty == "null" && v.is_null()) || (ty == "object" && v.is_object()) ||
          (ty == "array" && v.is_array()))
        return 1;
    return 0;
  }

  int ref(const json& r, const std::string& path) {
    if (!r.is_string()) return fail("'$ref' at " + path + " must be a string");
    const std::string target = r.get<std::string>();
    if (target == "#") return fail("'$ref' at " + path + " to the whole schema is not supported");
    auto it = refs_.find(target);
    if (it != refs_.end()) return it->second;
    std::string name;
    const json* defs = nullptr;
    for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
      const std::string p = prefix;
      if (target.rfind(p, 0) == 0) {
        name = target.substr(p.size());
        const auto d = root_.find(p.substr(2, p.size() - 3));
        if (d != root_.end()) defs = &*d;
      }
    }
    if (!defs || name.empty() || !defs->is_object() || !defs->contains(name))
      return fail("'$ref' at " + path + " names '" + target + "', which is not a definition of this schema");
    // A placeholder first, so a recursive reference finds it.
    const int slot = add(SchemaNode{});
    refs_[target] = slot;
    pending_.insert(slot);
    const int body = node((*defs)[name], target);
    pending_.erase(slot);
    if (!error_.empty()) return kAnyNode;
    // A definition that is only a reference back into the chain being
    // resolved (a -> b -> a) has no schema of its own.
    if (pending_.count(body) || body == slot)
      return fail("'$ref' at " + path + " names '" + target + "', whose definition only refers back to itself");
    SchemaNode copy = schema_.nodes[size_t(body)];
    schema_.nodes[size_t(slot)] = std::move(copy);
    return slot;
  }

  int typed(const json& s, const std::string& path) {
    const auto t = s.find("type");
    if (t == s.end()) {
      // No type: what the keywords present describe, else any value.
      if (s.contains("properties") || s.contains("required") || s.contains("additionalProperties"))
        return object(s, path);
      if (s.contains("items")) return array(s, path);
      return kAnyNode;
    }
    std::vector<std::string> types;
    if (!types_of(*t, path, &types)) return kAnyNode;
    std::vector<int> options;
    for (const std::string& ty : types) {
      if (ty == "object") {
        options.push_back(object(s, path));
      } else if (ty == "array") {
        options.push_back(array(s, path));
      } else if (ty == "string" || ty == "number" || ty == "integer") {
        SchemaNode n;
        n.kind = ty == "string" ? NodeKind::string : ty == "number" ? NodeKind::number : NodeKind::integer;
        options.push_back(add(std::move(n)));
      } else if (ty == "boolean") {
        options.push_back(literal_node({"true", "false"}, path));
      } else {  // null (types_of knows no other)
        options.push_back(literal_node({"null"}, path));
      }
    }
    if (options.size() == 1) return options[0];
    SchemaNode alt;
    alt.kind = NodeKind::alternatives;
    alt.options = std::move(options);
    return add(std::move(alt));
  }

  int object(const json& s, const std::string& path) {
    SchemaNode n;
    n.kind = NodeKind::object;
    std::map<std::string, size_t> index;
    if (const auto p = s.find("properties"); p != s.end()) {
      if (!p->is_object()) return fail("'properties' at " + path + " must be an object");
      if (p->size() > size_t(kMaxProperties)) return fail("'properties' at " + path + " has more than 64 names");
      for (const auto& [name, sub] : p->items()) {
        for (unsigned char ch : name)
          if (ch < 0x20 || ch == '"' || ch == '\\')
            return fail("property name '" + name + "' at " + path + " needs escapes, which are not supported");
        if (name.size() > size_t(kMaxLiteralBytes))
          return fail("a property name at " + path + " is longer than " + std::to_string(kMaxLiteralBytes) + " bytes");
        index[name] = n.names.size();
        n.names.push_back(name);
        n.props.push_back(-1);
      }
      size_t i = 0;
      for (const auto& [name, sub] : p->items()) n.props[i++] = node(sub, path + "/properties/" + name);
    }
    if (const auto r = s.find("required"); r != s.end()) {
      if (!r->is_array()) return fail("'required' at " + path + " must be an array of names");
      for (const json& name : *r) {
        if (!name.is_string() || !index.count(name.get<std::string>()))
          return fail("'required' at " + path + " names " + name.dump() + ", which is not among 'properties'");
        n.required |= uint64_t(1) << index[name.get<std::string>()];
      }
    }
    // Unspecified additionalProperties: none beyond the named ones when
    // there are some (what strict mode asks for), any when there are none.
    n.additional = n.names.empty() ? kAnyNode : -1;
    if (const auto a = s.find("additionalProperties"); a != s.end()) {
      if (a->is_boolean())
        n.additional = a->get<bool>() ? kAnyNode : -1;
      else
        n.additional = node(*a, path + "/additionalProperties");
    }
    return add(std::move(n));
  }

  int array(const json& s, const std::string& path) {
    SchemaNode n;
    n.kind = NodeKind::array;
    n.items = kAnyNode;
    if (const auto it = s.find("items"); it != s.end()) {
      if (it->is_array()) return fail("'items' as a list (tuples) at " + path + " is not supported");
      n.items = node(*it, path + "/items");
    }
    for (const char* kw : {"minItems", "maxItems"}) {
      const auto v = s.find(kw);
      if (v == s.end()) continue;
      if (!v->is_number_integer() || v->get<int64_t>() < 0 || v->get<int64_t>() > 65535)
        return fail(std::string("'") + kw + "' at " + path + " must be an integer 0..65535");
      (std::string(kw) == "minItems" ? n.min_items : n.max_items) = int(v->get<int64_t>());
    }
    if (n.min_items > n.max_items) return fail("'minItems' above 'maxItems' at " + path);
    return add(std::move(n));
  }

  // Alternatives never hold alternatives: each one's options become the
  // distinct non-alternative nodes it reaches (a $ref cycle through anyOf
  // adds nothing), at most kMaxAlternatives. The recogniser then expands
  // one level per byte, never a tree of them, and never loops.
  void flatten_alternatives() {
    for (size_t i = 0; i < schema_.nodes.size(); ++i) {
      if (schema_.nodes[i].kind != NodeKind::alternatives) continue;
      std::vector<int> leaves, stack = {int(i)};
      std::set<int> seen = {int(i)};
      while (!stack.empty()) {
        const int at = stack.back();
        stack.pop_back();
        for (int o : schema_.nodes[size_t(at)].options) {
          if (!seen.insert(o).second) continue;
          if (schema_.nodes[size_t(o)].kind == NodeKind::alternatives)
            stack.push_back(o);
          else
            leaves.push_back(o);
        }
      }
      if (leaves.empty()) {
        fail("an anyOf/oneOf of this schema can match nothing: its options only refer to each other");
        return;
      }
      if (leaves.size() > size_t(kMaxAlternatives)) {
        fail("an anyOf/oneOf of this schema has more than 8 options once the nested ones are merged");
        return;
      }
      schema_.nodes[i].options = std::move(leaves);
    }
  }

  const json& root_;
  Schema schema_;
  std::map<std::string, int> refs_;
  std::set<int> pending_;  // reference slots whose definitions are being compiled
  std::string error_;
  int depth_ = 0;
};

}  // namespace

Result<std::shared_ptr<const Schema>> compile_json_schema(const nlohmann::json& schema) {
  return Compiler(schema).run();
}

std::shared_ptr<const Schema> tool_call_sequence(const Schema& value, const std::string& open, const std::string& close,
                                                 const std::string& separator) {
  Schema s = value;
  auto literal = [&](const std::string& text) {
    SchemaNode n;
    n.kind = NodeKind::literals;
    n.literals = {text};
    s.nodes.push_back(std::move(n));
    return int(s.nodes.size()) - 1;
  };
  SchemaNode seq;
  seq.kind = NodeKind::sequence;
  seq.options = {literal(open), value.root};
  if (!close.empty()) seq.options.push_back(literal(close));
  seq.items = separator.empty() ? -1 : literal(separator);
  s.nodes.push_back(std::move(seq));
  s.root = int(s.nodes.size()) - 1;
  s.key = "sequence:" + std::to_string(open.size()) + ":" + open + close + "|" + separator + "|" + value.key;
  return std::make_shared<const Schema>(std::move(s));
}

std::shared_ptr<const Schema> any_object_schema() {
  static const std::shared_ptr<const Schema> s = [] {
    auto r = compile_json_schema(nlohmann::json{{"type", "object"}});
    return *r;
  }();
  return s;
}

}  // namespace moe::gw::structured
