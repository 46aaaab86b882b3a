#pragma once
// A JSON schema (the subset docs/structured-output.md lists) compiled into a
// graph of nodes the grammar walks (json_grammar.h). Keywords that would
// constrain a value without being enforced are refused, naming the keyword
// and where it sits.

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/result.h"

namespace moe::gw::structured {

enum class NodeKind : uint8_t { any, object, array, string, number, integer, literals, alternatives, sequence };

inline constexpr int kMaxProperties = 64;  // per object (a bit each)
inline constexpr int kMaxLiterals = 64;    // per enum
inline constexpr int kMaxAlternatives = 8;
inline constexpr int kMaxNodes = 16384;          // a compiled schema's nodes (the recogniser's frames name one in 16 bits)
inline constexpr int kMaxLiteralBytes = 16384;   // an enum or const value's JSON text, a property name

struct SchemaNode {
  NodeKind kind = NodeKind::any;
  // object: property names (no quote, backslash or control bytes), their
  // value nodes, which are required (bit i), and the node of any other
  // property (-1: none allowed).
  std::vector<std::string> names;
  std::vector<int> props;
  uint64_t required = 0;
  int additional = -1;
  // array
  int items = -1;
  int min_items = 0, max_items = std::numeric_limits<uint16_t>::max();
  // literals: the exact texts allowed (compact JSON: "\"red\"", "true", "3")
  std::vector<std::string> literals;
  // alternatives (anyOf / oneOf / a list of types); sequence: its parts in
  // order (raw text is a literals node), and, when `items` >= 0, the
  // literals node that starts another round of the parts.
  std::vector<int> options;
};

struct Schema {
  std::vector<SchemaNode> nodes;  // node 0: any value; node 1: the literals true, false, null
  int root = 0;
  std::string key;  // the schema's canonical text (what identifies it in caches)
};

inline constexpr int kAnyNode = 0;
inline constexpr int kAnyLiteralsNode = 1;

// `schema`: a JSON schema object. Errors name the keyword and its path.
Result<std::shared_ptr<const Schema>> compile_json_schema(const nlohmann::json& schema);
// response_format json_object: any JSON object.
std::shared_ptr<const Schema> any_object_schema();
// Raw text `open`, a value of `value`'s root, raw text `close`; repeated
// after `separator` when that is not empty (tool calls in a model's own
// markup: <tool_call>\n{…}\n</tool_call>).
std::shared_ptr<const Schema> tool_call_sequence(const Schema& value, const std::string& open, const std::string& close,
                                                 const std::string& separator);

}  // namespace moe::gw::structured
