#include "protocol/redis_schema.h"

#include <charconv>

namespace moe::protocol {
namespace {

// A decimal number of digits only (no sign, no spaces), at most `max`.
bool parse_decimal(std::string_view s, uint64_t max, uint64_t* out) {
  if (s.empty() || s.front() < '0' || s.front() > '9') return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size() && *out <= max;
}

// Bytes from Redis may be anyone's: errors quote only the start of them.
std::string quoted(std::string_view s) { return "'" + std::string(s.substr(0, 40)) + "'"; }

std::string str(std::string_view s) { return std::string(s); }

std::string model_key(std::string_view model, std::string_view stream) {
  std::string key = "moe:";
  key.append(model).append(1, ':').append(stream);
  return key;
}

}  // namespace

// ------------------------------------------------------------------- keys

std::string redis_model_name(std::string_view model_path) {
  while (model_path.size() > 1 && model_path.back() == '/') model_path.remove_suffix(1);
  const size_t slash = model_path.rfind('/');
  return std::string(slash == std::string_view::npos ? model_path : model_path.substr(slash + 1));
}

std::string resident_stream_key(std::string_view model) { return model_key(model, "resident"); }
std::string routing_stream_key(std::string_view model) { return model_key(model, "routing"); }
std::string events_stream_key(std::string_view model) { return model_key(model, "events"); }

std::string session_key(std::string_view owner, std::string_view id) {
  std::string key = "moe:session:";
  key.append(owner).append(1, ':').append(id);
  return key;
}

std::string session_owner_of_key(std::string_view key_digest) {
  return "k" + std::string(key_digest);
}

// ---------------------------------------------------------- stream entries

StreamFields resident_entry(std::string_view worker, std::string_view kind,
                            std::string_view experts) {
  return {str(stream_field::kWorker),  str(worker), str(stream_field::kKind), str(kind),
          str(stream_field::kExperts), str(experts)};
}

StreamFields routing_entry(std::string_view worker, uint64_t seq, std::string_view layers,
                           uint64_t bucket) {
  StreamFields f = {str(stream_field::kWorker), str(worker),
                    str(stream_field::kSeq),    std::to_string(seq),
                    str(stream_field::kLayers), str(layers)};
  if (bucket != 0) {
    f.push_back(str(stream_field::kBucket));
    f.push_back(std::to_string(bucket));
  }
  return f;
}

StreamFields warm_event(std::string_view experts) {
  return {str(stream_field::kType), str(kEventWarm), str(stream_field::kExperts), str(experts)};
}

StreamFields session_event(std::string_view session_digest, size_t messages) {
  return {str(stream_field::kType), str(kEventSession),           str(stream_field::kSession),
          str(session_digest),      str(stream_field::kMessages), std::to_string(messages)};
}

std::vector<std::string> stream_append_command(std::string_view stream, uint64_t max_len,
                                               const StreamFields& fields) {
  std::vector<std::string> args = {"XADD", std::string(stream),     "MAXLEN",
                                   "~",    std::to_string(max_len), "*"};
  args.insert(args.end(), fields.begin(), fields.end());
  return args;
}

const std::string* find_field(const StreamFields& fields, std::string_view name) {
  for (size_t i = 0; i + 1 < fields.size(); i += 2)
    if (fields[i] == name) return &fields[i + 1];
  return nullptr;
}

// ------------------------------------------------------------ expert lists

std::string format_expert_list(std::span<const ExpertRef> experts) {
  std::string out;
  for (const ExpertRef& e : experts) {
    if (!out.empty()) out += ' ';
    out.append(std::to_string(e.layer)).append(1, ':').append(std::to_string(e.expert));
  }
  return out;
}

Result<std::vector<ExpertRef>> parse_expert_list(std::string_view text) {
  if (text.size() > kMaxExpertListBytes)
    return make_error("an expert list of " + std::to_string(text.size()) +
                      " bytes is longer than any worker writes");
  std::vector<ExpertRef> out;
  size_t i = 0;
  while (i < text.size()) {
    if (text[i] == ' ') {
      ++i;
      continue;
    }
    size_t end = text.find(' ', i);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view item = text.substr(i, end - i);
    const size_t colon = item.find(':');
    uint64_t layer = 0, expert = 0;
    if (colon == std::string_view::npos || !parse_decimal(item.substr(0, colon), 65535, &layer) ||
        !parse_decimal(item.substr(colon + 1), 65535, &expert))
      return make_error("not a layer:expert pair: " + quoted(item));
    if (out.size() == kMaxExpertsPerMessage)
      return make_error("more than " + std::to_string(kMaxExpertsPerMessage) +
                        " experts in a list");
    out.push_back({uint16_t(layer), uint16_t(expert)});
    i = end;
  }
  return out;
}

// -------------------------------------------------------- routing summaries

std::string format_routing_layers(std::span<const uint32_t> usage, uint32_t n_experts) {
  std::string out;
  const size_t E = n_experts ? n_experts : 1;
  for (size_t l = 0; l * E < usage.size(); ++l) {
    std::string part;
    for (size_t e = 0; e < E && l * E + e < usage.size(); ++e) {
      const uint32_t n = usage[l * E + e];
      if (!n) continue;
      if (!part.empty()) part += ',';
      part.append(std::to_string(e)).append(1, '=').append(std::to_string(n));
    }
    if (part.empty()) continue;
    if (!out.empty()) out += ' ';
    out.append(std::to_string(l)).append(1, ':').append(part);
  }
  return out;
}

Result<std::vector<float>> parse_routing_layers(std::string_view text, int n_layers,
                                                int n_experts) {
  if (n_layers < 0 || n_experts < 0)
    return make_error("a routing summary for a model of negative size");
  std::vector<float> out(size_t(n_layers) * size_t(n_experts), 0.0f);
  std::string_view rest = text;
  while (!rest.empty()) {
    const size_t sp = rest.find(' ');
    const std::string_view item = rest.substr(0, sp);
    rest = sp == std::string_view::npos ? std::string_view() : rest.substr(sp + 1);
    if (item.empty()) continue;
    const size_t colon = item.find(':');
    uint64_t layer = 0;
    if (colon == std::string_view::npos ||
        !parse_decimal(item.substr(0, colon), UINT32_MAX, &layer) || layer >= uint64_t(n_layers))
      return make_error("bad layer in " + quoted(item));
    std::string_view pairs = item.substr(colon + 1);
    while (!pairs.empty()) {
      const size_t comma = pairs.find(',');
      const std::string_view pair = pairs.substr(0, comma);
      pairs = comma == std::string_view::npos ? std::string_view() : pairs.substr(comma + 1);
      const size_t eq = pair.find('=');
      uint64_t expert = 0, tokens = 0;
      if (eq == std::string_view::npos || !parse_decimal(pair.substr(0, eq), UINT32_MAX, &expert) ||
          !parse_decimal(pair.substr(eq + 1), UINT64_MAX, &tokens) || expert >= uint64_t(n_experts))
        return make_error("bad expert=tokens " + quoted(pair));
      out[size_t(layer) * size_t(n_experts) + size_t(expert)] += float(tokens);
    }
  }
  return out;
}

}  // namespace moe::protocol
