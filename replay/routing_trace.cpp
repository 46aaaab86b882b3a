#include "replay/routing_trace.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "model/safetensors.h"

namespace moe {

std::vector<ExpertKey> RoutingTrace::access_sequence() const {
  std::vector<ExpertKey> seq;
  for (const RoutingStep& s : steps)
    for (int e : s.experts) seq.push_back({s.layer, e});
  return seq;
}

namespace {

void grow_bounds(RoutingTrace& t, const RoutingStep& s) {
  t.n_layers = std::max(t.n_layers, s.layer + 1);
  for (int e : s.experts) t.n_experts = std::max(t.n_experts, e + 1);
  t.top_k = std::max(t.top_k, int(s.experts.size()));
}

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

}  // namespace

Result<RoutingTrace> parse_routing_jsonl(const std::string& text) {
  RoutingTrace t;
  std::istringstream in(text);
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = "routing trace line " + std::to_string(lineno) + ": ";
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) return make_error(where + "not a JSON object");
    RoutingStep s;
    if (!j.contains("layer") || !j["layer"].is_number_integer())
      return make_error(where + "missing integer \"layer\"");
    if (!j.contains("experts") || !j["experts"].is_array())
      return make_error(where + "missing array \"experts\"");
    s.layer = j["layer"].get<int>();
    if (j.contains("token") && j["token"].is_number_integer()) s.token = j["token"].get<int64_t>();
    for (const auto& e : j["experts"]) {
      if (!e.is_number_integer()) return make_error(where + "\"experts\" must hold integers");
      s.experts.push_back(e.get<int>());
    }
    if (s.layer < 0 || s.layer > 100000) return make_error(where + "layer out of range");
    for (int e : s.experts)
      if (e < 0 || e > 1000000) return make_error(where + "expert id out of range");
    grow_bounds(t, s);
    t.steps.push_back(std::move(s));
  }
  if (t.steps.empty()) return make_error("routing trace: no steps");
  return t;
}

RoutingTrace trace_from_topk(const std::vector<int>& topk, int n_layers, int64_t n_tokens,
                             int top_k) {
  RoutingTrace t;
  t.steps.reserve(size_t(n_layers) * size_t(n_tokens));
  for (int64_t tok = 0; tok < n_tokens; ++tok)
    for (int l = 0; l < n_layers; ++l) {
      RoutingStep s;
      s.token = tok;
      s.layer = l;
      const size_t base = (size_t(l) * size_t(n_tokens) + size_t(tok)) * size_t(top_k);
      s.experts.assign(topk.begin() + long(base), topk.begin() + long(base + size_t(top_k)));
      grow_bounds(t, s);
      t.steps.push_back(std::move(s));
    }
  return t;
}

Result<RoutingTrace> read_routing_trace(const std::string& path, const std::string& tensor) {
  if (ends_with(path, ".safetensors")) {
    auto ck = Checkpoint::open_file(path);
    if (!ck) return make_error(ck.error());
    const TensorView* tv = ck->find(tensor);
    if (!tv) return make_error(path + ": no tensor '" + tensor + "'");
    if (tv->shape.size() != 3)
      return make_error(path + ": '" + tensor + "' must be [layers, tokens, top_k]");
    const int n_layers = int(tv->shape[0]);
    const int64_t n_tokens = tv->shape[1];
    const int top_k = int(tv->shape[2]);
    const size_t n = size_t(tv->numel());
    std::vector<int> ids(n);
    for (size_t i = 0; i < n; ++i) {
      switch (tv->dtype) {
        case DType::i16: {
          int16_t v;
          std::memcpy(&v, tv->data + 2 * i, 2);
          ids[i] = v;
          break;
        }
        case DType::i32: {
          int32_t v;
          std::memcpy(&v, tv->data + 4 * i, 4);
          ids[i] = v;
          break;
        }
        case DType::i64: {
          int64_t v;
          std::memcpy(&v, tv->data + 8 * i, 8);
          ids[i] = int(v);
          break;
        }
        default:
          return make_error(path + ": '" + tensor + "' has dtype " + dtype_name(tv->dtype) +
                            ", want an integer");
      }
      if (ids[i] < 0) return make_error(path + ": '" + tensor + "' holds a negative expert id");
    }
    RoutingTrace t = trace_from_topk(ids, n_layers, n_tokens, top_k);
    if (t.steps.empty()) return make_error(path + ": '" + tensor + "' is empty");
    return t;
  }
  std::ifstream f(path, std::ios::binary);
  if (!f) return make_error("cannot open routing trace " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  auto r = parse_routing_jsonl(ss.str());
  if (!r) return make_error(path + ": " + r.error());
  return r;
}

}  // namespace moe
