#include "residency/routing_profile.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

namespace moe {
namespace {

constexpr const char* kFormat = "moe-routing-profile";
constexpr int kVersion = 1;
// A profile names at most this many layers and experts (a sanity bound on
// a file read from disk, far above any model's).
constexpr int kMaxLayers = 1024;
constexpr int kMaxExperts = 4096;

}  // namespace

RoutingProfile RoutingProfile::shaped(std::vector<int> model_layers, int n_experts, int top_k) {
  RoutingProfile p;
  p.n_experts = n_experts;
  p.top_k = top_k;
  p.model_layers = std::move(model_layers);
  p.counts.assign(p.model_layers.size() * size_t(std::max(n_experts, 0)), 0);
  return p;
}

RoutingProfile RoutingProfile::for_model(const ModelDesc& desc, std::string model_id) {
  std::vector<int> layers;
  for (int l = 0; l < desc.n_layers; ++l)
    if (desc.moe_layer_index(l) >= 0) layers.push_back(l);
  RoutingProfile p = shaped(std::move(layers), desc.moe.n_experts, desc.moe.top_k);
  p.model = std::move(model_id);
  p.architecture = desc.model_type;
  return p;
}

void RoutingProfile::add(std::span<const uint64_t> usage, uint64_t n_tokens) {
  // Saturating: a count past 2^64 stays at the top instead of wrapping.
  auto sat = [](uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; };
  const size_t n = std::min(usage.size(), counts.size());
  for (size_t i = 0; i < n; ++i) counts[i] = sat(counts[i], usage[i]);
  tokens = sat(tokens, n_tokens);
}

std::string RoutingProfile::mismatch(const std::vector<int>& layers, int experts) const {
  if (experts != n_experts)
    return "the profile has " + std::to_string(n_experts) + " experts a layer, the model " + std::to_string(experts);
  if (layers != model_layers)
    return "the profile has " + std::to_string(model_layers.size()) + " MoE layers, the model " +
           std::to_string(layers.size()) + (layers.size() == model_layers.size() ? " at other layer indices" : "");
  return "";
}

std::vector<double> RoutingProfile::rates(int moe_layer) const {
  std::vector<double> r(static_cast<size_t>(n_experts), 0.0);
  if (tokens == 0) return r;
  for (int e = 0; e < n_experts; ++e) r[size_t(e)] = std::min(1.0, double(count(moe_layer, e)) / double(tokens));
  return r;
}

std::vector<ExpertKey> RoutingProfile::warm_order() const {
  std::vector<ExpertKey> keys;
  for (int ml = 0; ml < n_moe_layers(); ++ml)
    for (int e = 0; e < n_experts; ++e)
      if (count(ml, e) > 0) keys.push_back({ml, e});
  // Stable over (layer, expert) order: ties keep it.
  std::stable_sort(keys.begin(), keys.end(),
                   [&](const ExpertKey& a, const ExpertKey& b) { return count(a.layer, a.expert) > count(b.layer, b.expert); });
  return keys;
}

double RoutingProfile::coverage(size_t islands) const {
  // In doubles: counts near 2^64 from a hostile file cannot wrap a sum.
  const double all = std::accumulate(counts.begin(), counts.end(), 0.0, [](double a, uint64_t c) { return a + double(c); });
  if (all == 0) return 1.0;
  const std::vector<ExpertKey> order = warm_order();
  double held = 0;
  for (size_t i = 0; i < std::min(islands, order.size()); ++i) held += double(count(order[i].layer, order[i].expert));
  return held / all;
}

std::string format_routing_profile(const RoutingProfile& p) {
  // One layer a line: a large profile (48 x 128) stays readable in a diff.
  std::ostringstream o;
  nlohmann::json head = {{"format", kFormat},        {"version", kVersion},      {"model", p.model},
                         {"architecture", p.architecture}, {"n_experts", p.n_experts}, {"top_k", p.top_k},
                         {"tokens", p.tokens},       {"source", p.source}};
  std::string h = head.dump();
  h.pop_back();  // the closing brace: the layers follow
  o << h << ",\n \"layers\": [";
  for (int ml = 0; ml < p.n_moe_layers(); ++ml) {
    o << (ml ? ",\n  " : "\n  ") << "{\"layer\": " << p.model_layers[size_t(ml)] << ", \"counts\": [";
    for (int e = 0; e < p.n_experts; ++e) o << (e ? "," : "") << p.count(ml, e);
    o << "]}";
  }
  o << "\n]}\n";
  return o.str();
}

Result<RoutingProfile> parse_routing_profile(std::string_view text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return make_error(std::string("not JSON: ") + e.what());
  }
  if (!j.is_object()) return make_error("not a JSON object");
  auto str = [&](const char* key, std::string* out) -> Status {
    if (!j.contains(key)) return {};
    if (!j[key].is_string()) return make_error(std::string("'") + key + "' is not a string");
    *out = j[key].get<std::string>();
    return {};
  };
  auto uint = [&](const nlohmann::json& v, uint64_t max, const std::string& what, uint64_t* out) -> Status {
    if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 0))
      return make_error(what + " is not a non-negative integer");
    const uint64_t x = v.get<uint64_t>();
    if (x > max) return make_error(what + " is " + std::to_string(x) + ", past " + std::to_string(max));
    *out = x;
    return {};
  };
  std::string format;
  MOE_TRY(str("format", &format));
  if (format != kFormat) return make_error("'format' is not \"" + std::string(kFormat) + "\"");
  if (!j.contains("version") || !j["version"].is_number_integer() || j["version"].get<int64_t>() != kVersion)
    return make_error("'version' is not " + std::to_string(kVersion));
  RoutingProfile p;
  MOE_TRY(str("model", &p.model));
  MOE_TRY(str("architecture", &p.architecture));
  MOE_TRY(str("source", &p.source));
  uint64_t v = 0;
  if (!j.contains("n_experts")) return make_error("no 'n_experts'");
  MOE_TRY(uint(j["n_experts"], kMaxExperts, "'n_experts'", &v));
  if (v == 0) return make_error("'n_experts' is 0");
  p.n_experts = int(v);
  if (j.contains("top_k")) {
    MOE_TRY(uint(j["top_k"], uint64_t(p.n_experts), "'top_k'", &v));
    p.top_k = int(v);
  }
  if (j.contains("tokens")) MOE_TRY(uint(j["tokens"], UINT64_MAX, "'tokens'", &p.tokens));
  if (!j.contains("layers") || !j["layers"].is_array()) return make_error("no 'layers' array");
  const auto& layers = j["layers"];
  if (layers.size() > size_t(kMaxLayers)) return make_error("more than " + std::to_string(kMaxLayers) + " layers");
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& l = layers[i];
    const std::string at = "layers[" + std::to_string(i) + "]";
    if (!l.is_object() || !l.contains("layer") || !l.contains("counts") || !l["counts"].is_array())
      return make_error(at + " is not {\"layer\", \"counts\": [...]}");
    MOE_TRY(uint(l["layer"], kMaxLayers, at + ".layer", &v));
    if (!p.model_layers.empty() && int(v) <= p.model_layers.back())
      return make_error(at + ".layer " + std::to_string(v) + " does not follow layer " +
                        std::to_string(p.model_layers.back()));
    p.model_layers.push_back(int(v));
    const auto& c = l["counts"];
    if (c.size() != size_t(p.n_experts))
      return make_error(at + " has " + std::to_string(c.size()) + " counts, not n_experts = " +
                        std::to_string(p.n_experts));
    for (size_t e = 0; e < c.size(); ++e) {
      uint64_t x = 0;
      MOE_TRY(uint(c[e], UINT64_MAX, at + ".counts[" + std::to_string(e) + "]", &x));
      p.counts.push_back(x);
    }
  }
  return p;
}

Result<RoutingProfile> read_routing_profile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return make_error("cannot open routing profile " + path);
  // 1024 layers x 4096 experts of 20 digits is ~84 MB: anything larger is not a profile.
  std::error_code ec;
  if (const auto size = std::filesystem::file_size(path, ec); !ec && size > (size_t(128) << 20))
    return make_error("routing profile " + path + " is " + std::to_string(size >> 20) + " MiB, past the 128 MiB a profile can take");
  std::ostringstream s;
  s << f.rdbuf();
  if (f.bad()) return make_error("cannot read routing profile " + path);
  auto p = parse_routing_profile(s.str());
  if (!p.ok()) return make_error("routing profile " + path + ": " + p.error());
  return p;
}

Status write_routing_profile(const std::string& path, const RoutingProfile& p) {
  const std::string text = format_routing_profile(p);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return make_error("cannot write " + tmp + ": " + std::strerror(errno));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t w = ::write(fd, text.data() + done, text.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      ::unlink(tmp.c_str());
      return make_error("cannot write " + tmp + ": " + why);
    }
    done += size_t(w);
  }
  const bool synced = ::fsync(fd) == 0;
  const std::string why_sync = synced ? "" : std::strerror(errno);
  if (::close(fd) != 0 || !synced) {
    const std::string why = synced ? std::strerror(errno) : why_sync;
    ::unlink(tmp.c_str());
    return make_error("cannot write " + tmp + ": " + why);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    return make_error("cannot rename " + tmp + " to " + path + ": " + why);
  }
  // The rename itself to disk: the folder's entry.
  const std::string dir = std::filesystem::path(path).parent_path().string();
  if (const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
  return {};
}

}  // namespace moe
