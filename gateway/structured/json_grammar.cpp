#include "gateway/structured/json_grammar.h"

#include <algorithm>
#include <cstring>

namespace moe::gw::structured {
namespace {

enum Kind : uint8_t { kValue, kObject, kKey, kArray, kString, kNumber, kLiteral, kSequence };
enum ObjectStage : uint8_t { kOpen, kAfterKey, kAfterValue, kExpectKey };
enum KeyStage : uint8_t { kName, kFree };
enum ArrayStage : uint8_t { kArrayOpen, kArrayAfterValue };
enum StringStage : uint8_t { kContent, kEscape, kHex };
enum NumberStage : uint8_t { kMinus, kZero, kInt, kDot, kFrac, kE, kESign, kExp };

bool is_ws(uint8_t b) { return b == ' ' || b == '\n' || b == '\t' || b == '\r'; }

// Whitespace between tokens takes two forms: one space ("a": 1, "b"), or
// one newline and an indentation of spaces; no tabs, no carriage returns.
// (Small models otherwise fill the text with it.) ws: bit 7 set after the
// newline, the low bits count the spaces.
constexpr uint8_t kNewline = 0x80;
bool whitespace(Frame& t, uint8_t b) {
  const bool nl = t.ws & kNewline;
  const int spaces = t.ws & 0x7f;
  if (b == '\n') {
    if (nl || spaces > 0) return false;
    t.ws = kNewline;
    return true;
  }
  if (b != ' ') return false;
  if (spaces >= (nl ? kMaxIndent : 1)) return false;
  ++t.ws;
  return true;
}
bool is_digit(uint8_t b) { return b >= '0' && b <= '9'; }
bool is_hex(uint8_t b) { return is_digit(b) || (b >= 'a' && b <= 'f') || (b >= 'A' && b <= 'F'); }

Frame make(int node, Kind kind, uint8_t stage = 0) {
  Frame f;
  f.node = uint16_t(node);
  f.kind = kind;
  f.stage = stage;
  return f;
}

void copy_stack(const Stack& from, Stack* to) {
  to->depth = from.depth;
  std::memcpy(to->f.data(), from.f.data(), sizeof(Frame) * from.depth);
}

bool push(Stack& s, const Frame& f) {
  if (s.depth == kMaxDepth) return false;
  s.f[s.depth++] = f;
  return true;
}

// An object node's names and the node of other properties (any objects: none, any).
const std::vector<std::string>& names_of(const Schema& sc, int node) {
  static const std::vector<std::string> none;
  return sc.nodes[size_t(node)].kind == NodeKind::object ? sc.nodes[size_t(node)].names : none;
}
int additional_of(const Schema& sc, int node) {
  return sc.nodes[size_t(node)].kind == NodeKind::object ? sc.nodes[size_t(node)].additional : kAnyNode;
}
uint64_t all_bits(size_t n) { return n >= 64 ? ~uint64_t(0) : (uint64_t(1) << n) - 1; }

// UTF-8 inside strings and names: `remaining` continuation bytes are due,
// the next one within `range` (0: 80-BF; 1: A0-BF; 2: 80-9F; 3: 90-BF;
// 4: 80-8F, the second bytes that keep E0, ED, F0 and F4 well formed).
bool utf8_step(uint8_t b, uint8_t& remaining, uint16_t& range) {
  if (remaining > 0) {
    static const uint8_t lo[] = {0x80, 0xA0, 0x80, 0x90, 0x80}, hi[] = {0xBF, 0xBF, 0x9F, 0xBF, 0x8F};
    if (b < lo[range] || b > hi[range]) return false;
    --remaining;
    range = 0;
    return true;
  }
  if (b < 0x80) return true;
  if (b >= 0xC2 && b <= 0xDF) {
    remaining = 1;
  } else if (b >= 0xE0 && b <= 0xEF) {
    remaining = 2;
    range = b == 0xE0 ? 1 : b == 0xED ? 2 : 0;
  } else if (b >= 0xF0 && b <= 0xF4) {
    remaining = 3;
    range = b == 0xF0 ? 3 : b == 0xF4 ? 4 : 0;
  } else {
    return false;
  }
  return true;
}

// An array's item count as its frame keeps it: exact under a maxItems,
// else no more than minItems (past it only "enough" matters), so the items
// of a long array share states (and cached masks).
uint16_t count_items(int n, int min_items, int max_items) {
  return uint16_t(max_items < 65535 ? n : std::min(n, min_items));
}

// One number's first byte.
bool start_number(Frame& t, uint8_t b) {
  t.kind = kNumber;
  t.aux = 0;
  if (b == '-') {
    t.stage = kMinus;
  } else if (b == '0') {
    t.stage = kZero;
  } else if (b >= '1' && b <= '9') {
    t.stage = kInt;
    t.aux = 1;
  } else {
    return false;
  }
  return true;
}

// One byte on one stack; survivors go to `out` (several at alternatives).
// `s` is the caller's copy (of its frames in use only).
void step(const Schema& sc, Stack& s, uint8_t b, GrammarState* out) {
  for (;;) {
    if (s.depth == 0) return;  // nothing may follow the value
    Frame& t = s.f[s.depth - 1];
    const SchemaNode& n = sc.nodes[t.node];
    switch (t.kind) {
      case kValue: {
        // Alternatives first: each option decides whether whitespace may
        // come before it (raw text may not), so whitespace never leaves a
        // state that no byte can follow.
        if (n.kind == NodeKind::alternatives) {
          for (int o : n.options) {
            Stack c;
            copy_stack(s, &c);
            c.f[c.depth - 1].node = uint16_t(o);
            step(sc, c, b, out);
          }
          return;
        }
        // Parts of a sequence are raw text and JSON values right after it;
        // raw text takes no whitespace before it.
        const bool in_sequence = s.depth >= 2 && s.f[s.depth - 2].kind == kSequence;
        if (is_ws(b) && n.kind != NodeKind::sequence && !(in_sequence && n.kind == NodeKind::literals))
          return whitespace(t, b) ? out->add(s) : void();
        switch (n.kind) {
          case NodeKind::alternatives:
            return;  // above
          case NodeKind::literals:
            t.kind = kLiteral;
            t.bits = all_bits(n.literals.size());
            t.pos = 0;
            continue;  // the literal takes this byte
          case NodeKind::sequence:
            if (t.ws != 0) return;  // raw text: no whitespace before it
            t.kind = kSequence;
            t.pos = 0;
            continue;
          case NodeKind::object:
            if (b != '{') return;
            t = make(t.node, kObject, kOpen);
            return out->add(s);
          case NodeKind::array:
            if (b != '[') return;
            t = make(t.node, kArray, kArrayOpen);
            return out->add(s);
          case NodeKind::string:
            if (b != '"') return;
            t = make(t.node, kString, kContent);
            return out->add(s);
          case NodeKind::number:
          case NodeKind::integer:
            if (!start_number(t, b)) return;
            return out->add(s);
          case NodeKind::any:
            if (b == '{') {
              t = make(t.node, kObject, kOpen);
            } else if (b == '[') {
              t = make(t.node, kArray, kArrayOpen);
            } else if (b == '"') {
              t = make(t.node, kString, kContent);
            } else if (b == 't' || b == 'f' || b == 'n') {
              t = make(kAnyLiteralsNode, kLiteral);
              t.bits = all_bits(3);
              continue;
            } else if (!start_number(t, b)) {
              return;
            }
            return out->add(s);
        }
        return;
      }
      case kObject: {
        if (is_ws(b)) return whitespace(t, b) ? out->add(s) : void();
        const std::vector<std::string>& names = names_of(sc, t.node);
        const int additional = additional_of(sc, t.node);
        const uint64_t unseen = all_bits(names.size()) & ~t.bits;
        const uint64_t required = n.kind == NodeKind::object ? n.required : 0;
        auto open_key = [&]() {
          if (unseen == 0 && additional < 0) return false;
          t.ws = 0;
          Frame k = make(t.node, kKey, unseen ? kName : kFree);
          k.bits = unseen;
          return push(s, k);
        };
        switch (t.stage) {
          case kOpen:
            if (b == '"') return open_key() ? out->add(s) : void();
            if (b == '}' && (required & ~t.bits) == 0) {
              --s.depth;
              return out->add(s);
            }
            return;
          case kExpectKey:
            if (b == '"') return open_key() ? out->add(s) : void();
            return;
          case kAfterKey: {
            if (b != ':') return;
            const int child = t.aux == 255 ? additional : n.props[t.aux];
            t.stage = kAfterValue;
            t.ws = 0;
            return push(s, make(child, kValue)) ? out->add(s) : void();
          }
          case kAfterValue:
            if (b == ',' && (unseen != 0 || additional >= 0)) {
              t.stage = kExpectKey;
              t.ws = 0;
              return out->add(s);
            }
            if (b == '}' && (required & ~t.bits) == 0) {
              --s.depth;
              return out->add(s);
            }
            return;
        }
        return;
      }
      case kKey: {
        Frame& parent = s.f[s.depth - 2];
        const std::vector<std::string>& names = names_of(sc, t.node);
        const int additional = additional_of(sc, t.node);
        if (t.stage == kFree && t.aux > 0) return utf8_step(b, t.aux, t.pos) ? out->add(s) : void();
        // In kName the bytes so far are the first t.pos of every name still
        // matching: where they leave a character, if another name takes
        // over (kFree) or the key ends here.
        auto name_utf8 = [&](uint8_t& remaining, uint16_t& range) {
          remaining = 0, range = 0;
          for (size_t i = 0; i < names.size(); ++i)
            if (t.bits >> i & 1) {
              for (size_t j = 0; j < t.pos; ++j) utf8_step(uint8_t(names[i][j]), remaining, range);
              return;
            }
        };
        if (b == '"') {
          int named = -1;
          if (t.stage == kName)
            for (size_t i = 0; i < names.size(); ++i)
              if ((t.bits >> i & 1) && names[i].size() == t.pos) named = int(i);
          if (named < 0 && additional < 0) return;
          if (named < 0 && t.stage == kName) {  // another name: it must not end inside a character
            uint8_t remaining;
            uint16_t range;
            name_utf8(remaining, range);
            if (remaining > 0) return;
          }
          if (named >= 0) parent.bits |= uint64_t(1) << named;
          parent.aux = named >= 0 ? uint8_t(named) : 255;
          parent.stage = kAfterKey;
          parent.ws = 0;
          --s.depth;
          return out->add(s);
        }
        if (b == '\\' || b < 0x20) return;  // names without escapes
        if (t.stage == kName) {
          uint64_t still = 0;
          for (size_t i = 0; i < names.size(); ++i)
            if ((t.bits >> i & 1) && names[i].size() > t.pos && uint8_t(names[i][t.pos]) == b) still |= uint64_t(1) << i;
          if (still) {
            t.bits = still;
            ++t.pos;
            return out->add(s);
          }
          if (additional < 0) return;
          // Another name: it goes on from where the matched bytes left a
          // character (a lead byte of a listed name wants its continuation).
          uint8_t remaining;
          uint16_t range;
          name_utf8(remaining, range);
          t.stage = kFree;
          t.aux = remaining;
          t.pos = range;
        }
        return utf8_step(b, t.aux, t.pos) ? out->add(s) : void();
      }
      case kArray: {
        if (is_ws(b)) return whitespace(t, b) ? out->add(s) : void();
        const int items = n.kind == NodeKind::array ? n.items : kAnyNode;
        const int min_items = n.kind == NodeKind::array ? n.min_items : 0;
        const int max_items = n.kind == NodeKind::array ? n.max_items : 65535;
        if (t.stage == kArrayOpen) {
          if (b == ']') {
            if (min_items > 0) return;
            --s.depth;
            return out->add(s);
          }
          if (max_items == 0) return;
          t.stage = kArrayAfterValue;
          t.pos = count_items(1, min_items, max_items);
          t.ws = 0;
          if (!push(s, make(items, kValue))) return;
          continue;  // the item takes this byte
        }
        if (b == ',' && t.pos < max_items) {
          t.pos = count_items(t.pos + 1, min_items, max_items);
          t.ws = 0;
          return push(s, make(items, kValue)) ? out->add(s) : void();
        }
        if (b == ']' && t.pos >= min_items) {
          --s.depth;
          return out->add(s);
        }
        return;
      }
      case kString:
        switch (t.stage) {
          case kContent:
            if (t.aux > 0) return utf8_step(b, t.aux, t.pos) ? out->add(s) : void();
            if (b == '"') {
              --s.depth;
              return out->add(s);
            }
            if (b == '\\') t.stage = kEscape;
            else if (b < 0x20 || !utf8_step(b, t.aux, t.pos)) return;
            return out->add(s);
          case kEscape:
            if (b == 'u') {
              t.stage = kHex;
              t.aux = 0;
            } else if (std::strchr("\"\\/bfnrt", b) && b != 0) {
              t.stage = kContent;
            } else {
              return;
            }
            return out->add(s);
          case kHex:
            if (!is_hex(b)) return;
            if (++t.aux == 4) {
              t.stage = kContent;
              t.aux = 0;
            }
            return out->add(s);
        }
        return;
      case kNumber: {
        const bool integer = n.kind == NodeKind::integer;
        // Parts short enough to read back: an integer within int64, an
        // exponent of two digits (finite doubles).
        const int max_digits = t.stage == kExp ? 2 : integer ? 18 : kMaxDigits;
        auto digit = [&](uint8_t next_stage, bool count) {
          if (count && ++t.aux > max_digits) return false;
          if (!count) t.aux = 1;
          t.stage = next_stage;
          return true;
        };
        bool ended = false;
        switch (t.stage) {
          case kMinus:
            if (b == '0') t.stage = kZero;
            else if (b >= '1' && b <= '9') digit(kInt, false);
            else return;
            return out->add(s);
          case kZero:
          case kInt:
          case kFrac:
            if (is_digit(b)) {
              if (t.stage == kZero) return;  // no leading zeros
              if (!digit(t.stage, true)) return;
              return out->add(s);
            }
            if (b == '.' && !integer && t.stage != kFrac) {
              t.stage = kDot;
              return out->add(s);
            }
            if ((b == 'e' || b == 'E') && !integer) {
              t.stage = kE;
              return out->add(s);
            }
            ended = true;
            break;
          case kDot:
            if (!is_digit(b)) return;
            digit(kFrac, false);
            return out->add(s);
          case kE:
            if (b == '+' || b == '-') {
              t.stage = kESign;
              return out->add(s);
            }
            if (!is_digit(b)) return;
            digit(kExp, false);
            return out->add(s);
          case kESign:
            if (!is_digit(b)) return;
            digit(kExp, false);
            return out->add(s);
          case kExp:
            if (is_digit(b)) {
              if (!digit(kExp, true)) return;
              return out->add(s);
            }
            ended = true;
            break;
        }
        if (!ended) return;
        --s.depth;  // the number is whole; the byte is the parent's
        continue;
      }
      case kSequence: {
        // pos: the next part; all done, another round after the separator.
        if (t.pos < n.options.size()) {
          const int part = n.options[t.pos++];
          if (!push(s, make(part, kValue))) return;
          continue;  // the part takes this byte
        }
        if (n.items < 0) {
          --s.depth;  // whole; the byte is the parent's
          continue;
        }
        t.pos = 0;
        Frame sep = make(n.items, kLiteral);
        sep.bits = 1;
        if (!push(s, sep)) return;
        continue;
      }
      case kLiteral: {
        const std::vector<std::string>& lits = n.literals;
        uint64_t still = 0, whole = 0, longer = 0;
        for (size_t i = 0; i < lits.size(); ++i) {
          if (!(t.bits >> i & 1)) continue;
          if (lits[i].size() == t.pos) whole |= uint64_t(1) << i;
          if (lits[i].size() > t.pos && uint8_t(lits[i][t.pos]) == b) still |= uint64_t(1) << i;
        }
        if (still) {
          t.bits = still;
          ++t.pos;
          for (size_t i = 0; i < lits.size(); ++i)
            if ((still >> i & 1) && lits[i].size() > t.pos) longer |= uint64_t(1) << i;
          if (!longer) --s.depth;  // every candidate ends here: the value is whole
          return out->add(s);
        }
        if (!whole) return;
        --s.depth;  // a candidate ended before this byte: the byte is the parent's
        continue;
      }
    }
    return;
  }
}

}  // namespace

int frames_needed(const Schema& sc, int node) {
  // The least fixed point from "too deep" everywhere down: a node's need
  // only falls as its children's do, so passes stop once none changes
  // (at most kMaxDepth + 1 of them, each value falling at least one step).
  constexpr int kTooDeep = kMaxDepth + 1;
  std::vector<int> need(sc.nodes.size(), kTooDeep);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t i = 0; i < sc.nodes.size(); ++i) {
      const SchemaNode& n = sc.nodes[i];
      int v = 1;
      switch (n.kind) {
        case NodeKind::any:
        case NodeKind::literals:
        case NodeKind::string:
        case NodeKind::number:
        case NodeKind::integer:
          break;
        case NodeKind::object:
          for (size_t p = 0; p < n.props.size(); ++p)
            if (n.required >> p & 1) v = std::max(v, 1 + std::max(1, need[size_t(n.props[p])]));
          break;
        case NodeKind::array:
          if (n.min_items > 0) v = 1 + need[size_t(n.items)];
          break;
        case NodeKind::alternatives:
          v = kTooDeep;
          for (int o : n.options) v = std::min(v, need[size_t(o)]);
          break;
        case NodeKind::sequence:
          for (int o : n.options) v = std::max(v, 1 + need[size_t(o)]);
          break;
      }
      v = std::min(v, kTooDeep);
      if (v < need[i]) {
        need[i] = v;
        changed = true;
      }
    }
  }
  return need[size_t(node)];
}

bool Stack::operator==(const Stack& o) const {
  return depth == o.depth && std::memcmp(f.data(), o.f.data(), sizeof(Frame) * depth) == 0;
}

GrammarState GrammarState::start(const Schema& schema) {
  GrammarState g;
  Stack s;
  s.f[0] = make(schema.root, kValue);
  s.depth = 1;
  g.add(s);
  return g;
}

void GrammarState::add(const Stack& s) {
  for (int i = 0; i < n_; ++i)
    if (s_[size_t(i)] == s) return;
  if (n_ == kMaxStacks) return;  // more alternatives alive than kept: the rest are dropped
  copy_stack(s, &s_[size_t(n_++)]);
}

void GrammarState::feed(const Schema& schema, uint8_t byte, GrammarState* out) const {
  out->n_ = 0;
  Stack s;
  for (int i = 0; i < n_; ++i) {
    copy_stack(s_[size_t(i)], &s);
    step(schema, s, byte, out);
  }
}

bool GrammarState::feed(const Schema& schema, std::string_view bytes) {
  GrammarState next;
  for (char c : bytes) {
    feed(schema, uint8_t(c), &next);
    *this = next;
    if (empty()) return false;
  }
  return true;
}

bool GrammarState::finishable(const Schema& schema) const {
  for (int i = 0; i < n_; ++i) {
    const Stack& s = s_[size_t(i)];
    if (s.depth == 0) return true;
    if (s.depth != 1) continue;
    const Frame& t = s.f[0];
    if (t.kind == kNumber && (t.stage == kZero || t.stage == kInt || t.stage == kFrac || t.stage == kExp)) return true;
    if (t.kind == kLiteral) {
      const auto& lits = schema.nodes[t.node].literals;
      for (size_t j = 0; j < lits.size(); ++j)
        if ((t.bits >> j & 1) && lits[j].size() == t.pos) return true;
    }
    // A sequence whose parts are all done (its round may start again or not).
    if (t.kind == kSequence && t.pos >= schema.nodes[t.node].options.size()) return true;
  }
  return false;
}

bool GrammarState::in_string_content() const {
  if (n_ == 0) return false;
  for (int i = 0; i < n_; ++i) {
    const Stack& s = s_[size_t(i)];
    if (s.depth == 0) return false;
    const Frame& t = s.f[s.depth - 1];
    if (t.kind != kString || t.stage != kContent || t.aux != 0) return false;
  }
  return true;
}

bool GrammarState::closed() const {
  if (n_ == 0) return false;
  for (int i = 0; i < n_; ++i)
    if (s_[size_t(i)].depth != 0) return false;
  return true;
}

std::string GrammarState::key() const {
  std::string k;
  for (int i = 0; i < n_; ++i) {
    const Stack& s = s_[size_t(i)];
    k.push_back(char(s.depth));
    k.append(reinterpret_cast<const char*>(s.f.data()), sizeof(Frame) * s.depth);
  }
  return k;
}

}  // namespace moe::gw::structured
