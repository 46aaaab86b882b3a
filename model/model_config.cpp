#include "model/model_config.h"

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <sstream>

namespace moe {

namespace {

using json = nlohmann::json;

// Reads keys of config.json; a null value counts as absent, as the hub writes
// `"head_dim": null` for "use the default".
class ConfigReader {
 public:
  ConfigReader(const json& j, std::string where) : j_(j), where_(std::move(where)) {}

  bool has(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }
  const json& at(const char* key) const { return j_[key]; }

  // The first present key of `keys` (a hub spelling and its newer spellings).
  const char* first_of(std::initializer_list<const char*> keys) const {
    for (const char* k : keys)
      if (has(k)) return k;
    return nullptr;
  }

  Status need_int(const char* key, int* out) const { return need_int_of({key}, out); }

  Status need_int_of(std::initializer_list<const char*> keys, int* out) const {
    const char* k = first_of(keys);
    if (!k) {
      std::string names;
      for (const char* n : keys) names += std::string(names.empty() ? "'" : " or '") + n + "'";
      return make_error(where_ + ": missing key " + names);
    }
    return read_int(k, out);
  }

  // An integer key's value, refused past 2^30 either way (no dimension of
  // a real model comes near; reading it as int would wrap).
  Status read_int(const char* key, int* out) const {
    if (!j_[key].is_number_integer())
      return make_error(where_ + ": key '" + key + "' is not an integer");
    const int64_t v = j_[key].is_number_unsigned() && j_[key].get<uint64_t>() > uint64_t(INT64_MAX)
                          ? INT64_MAX
                          : j_[key].get<int64_t>();
    if (v > (int64_t(1) << 30) || v < -(int64_t(1) << 30))
      return make_error(where_ + ": key '" + key + "' is " + j_[key].dump() + ", out of range");
    *out = int(v);
    return Status::ok_status();
  }

  Status opt_int(const char* key, int* out) const {
    if (!has(key)) return Status::ok_status();
    return read_int(key, out);
  }

  Status opt_float(const char* key, float* out) const {
    if (!has(key)) return Status::ok_status();
    if (!j_[key].is_number()) return make_error(where_ + ": key '" + key + "' is not a number");
    *out = j_[key].get<float>();
    return Status::ok_status();
  }

  Status opt_bool(const char* key, bool* out) const {
    if (!has(key)) return Status::ok_status();
    if (!j_[key].is_boolean()) return make_error(where_ + ": key '" + key + "' is not true/false");
    *out = j_[key].get<bool>();
    return Status::ok_status();
  }

  Status opt_string(const char* key, std::string* out) const {
    if (!has(key)) return Status::ok_status();
    if (!j_[key].is_string()) return make_error(where_ + ": key '" + key + "' is not a string");
    *out = j_[key].get<std::string>();
    return Status::ok_status();
  }

  const std::string& where() const { return where_; }

 private:
  const json& j_;
  std::string where_;
};

bool arch_from_model_type(const std::string& t, Arch* out) {
  static constexpr std::pair<const char*, Arch> kTypes[] = {
      {"qwen2_moe", Arch::qwen2_moe}, {"qwen3_moe", Arch::qwen3_moe},
      {"mixtral", Arch::mixtral},     {"olmoe", Arch::olmoe},
      {"qwen2", Arch::qwen2},         {"deepseek_v2", Arch::deepseek_v2},
  };
  for (const auto& [name, a] : kTypes)
    if (t == name) {
      *out = a;
      return true;
    }
  return false;
}

// Rope settings: transformers-5 `rope_parameters` {rope_theta, rope_type, ...},
// or the hub's top-level `rope_theta` plus an optional `rope_scaling`.
Status parse_rope(const ConfigReader& c, RopeConfig* rope) {
  MOE_TRY(c.opt_float("rope_theta", &rope->theta));
  const char* key = c.first_of({"rope_parameters", "rope_scaling"});
  if (!key) return Status::ok_status();
  const json& p = c.at(key);
  if (!p.is_object()) return make_error(c.where() + ": key '" + key + "' is not an object");
  ConfigReader r(p, c.where() + " (" + key + ")");
  MOE_TRY(r.opt_float("rope_theta", &rope->theta));
  MOE_TRY(r.opt_string("type", &rope->type));
  MOE_TRY(r.opt_string("rope_type", &rope->type));
  MOE_TRY(r.opt_float("factor", &rope->factor));
  MOE_TRY(r.opt_int("original_max_position_embeddings", &rope->original_max_position));
  MOE_TRY(r.opt_float("beta_fast", &rope->beta_fast));
  MOE_TRY(r.opt_float("beta_slow", &rope->beta_slow));
  MOE_TRY(r.opt_float("mscale", &rope->mscale));
  MOE_TRY(r.opt_float("mscale_all_dim", &rope->mscale_all_dim));
  static constexpr const char* kKnown[] = {"default", "linear", "dynamic", "yarn"};
  if (std::find_if(std::begin(kKnown), std::end(kKnown),
                   [&](const char* k) { return rope->type == k; }) == std::end(kKnown))
    return make_error(c.where() + ": unsupported rope type '" + rope->type + "'");
  return Status::ok_status();
}

// eos_token_id may be an int, a list of ints or null.
Status append_ids(const ConfigReader& c, const char* key, std::vector<int32_t>* ids) {
  if (!c.has(key)) return Status::ok_status();
  const json& v = c.at(key);
  auto add = [&](const json& x) -> Status {
    if (!x.is_number_integer())
      return make_error(c.where() + ": key '" + key + "' holds a non-integer");
    const int32_t id = x.get<int32_t>();
    if (std::find(ids->begin(), ids->end(), id) == ids->end()) ids->push_back(id);
    return Status::ok_status();
  };
  if (v.is_array()) {
    for (const auto& x : v) MOE_TRY(add(x));
    return Status::ok_status();
  }
  return add(v);
}

Result<json> parse_json(const std::string& text, const std::string& what) {
  try {
    return json::parse(text);
  } catch (const std::exception& e) {
    return make_error(what + ": does not parse: " + e.what());
  }
}

Result<std::string> read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error(path + ": cannot open: " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Status parse_moe(const ConfigReader& c, ModelDesc* d) {
  MoeConfig& m = d->moe;
  MOE_TRY(c.need_int_of({"num_experts", "num_local_experts", "n_routed_experts"}, &m.n_experts));
  MOE_TRY(c.need_int("num_experts_per_tok", &m.top_k));
  MOE_TRY(c.opt_bool("norm_topk_prob", &m.norm_topk_prob));
  d->layer_is_moe.assign(size_t(d->n_layers), true);

  switch (d->arch) {
    case Arch::qwen2_moe:
    case Arch::qwen3_moe: {
      MOE_TRY(c.need_int("moe_intermediate_size", &m.expert_intermediate));
      int step = 1;
      MOE_TRY(c.opt_int("decoder_sparse_step", &step));
      if (step < 1) return make_error(c.where() + ": decoder_sparse_step must be >= 1");
      std::vector<int> mlp_only;
      if (c.has("mlp_only_layers")) {
        if (!c.at("mlp_only_layers").is_array())
          return make_error(c.where() + ": 'mlp_only_layers' is not a list");
        for (const auto& x : c.at("mlp_only_layers")) {
          if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= d->n_layers)
            return make_error(c.where() + ": 'mlp_only_layers' holds " + x.dump().substr(0, 32) +
                              ", not a layer index (0 to num_hidden_layers - 1)");
          mlp_only.push_back(x.get<int>());
        }
      }
      for (int l = 0; l < d->n_layers; ++l)
        d->layer_is_moe[size_t(l)] =
            m.n_experts > 0 && (l + 1) % step == 0 &&
            std::find(mlp_only.begin(), mlp_only.end(), l) == mlp_only.end();
      if (d->arch == Arch::qwen2_moe) {
        MOE_TRY(c.need_int("shared_expert_intermediate_size", &m.shared_intermediate));
        if (m.shared_intermediate < 0)  // 0: no shared expert; below that it would be dropped in silence
          return make_error(c.where() + ": shared_expert_intermediate_size is " +
                            std::to_string(m.shared_intermediate) + ", not a width");
        m.shared_expert_gate = m.shared_intermediate > 0;
      }
      break;
    }
    case Arch::mixtral:
      MOE_TRY(c.need_int("intermediate_size", &m.expert_intermediate));
      m.norm_topk_prob = true;  // Mixtral always renormalises its top-k weights
      break;
    case Arch::olmoe:
      MOE_TRY(c.need_int("intermediate_size", &m.expert_intermediate));
      break;
    case Arch::deepseek_v2: {
      MOE_TRY(c.need_int("moe_intermediate_size", &m.expert_intermediate));
      MOE_TRY(c.opt_int("n_shared_experts", &m.n_shared_experts));
      if (m.n_shared_experts < 0)
        return make_error(c.where() + ": n_shared_experts is " + std::to_string(m.n_shared_experts) +
                          ", not a count");
      m.shared_intermediate = m.n_shared_experts * m.expert_intermediate;
      MOE_TRY(c.opt_float("routed_scaling_factor", &m.routed_scaling));
      MOE_TRY(c.opt_string("topk_method", &m.topk_method));
      if (m.topk_method != "greedy" && m.topk_method != "group_limited_greedy")
        return make_error(c.where() + ": unsupported topk_method '" + m.topk_method + "'");
      MOE_TRY(c.opt_int("n_group", &m.n_group));
      MOE_TRY(c.opt_int("topk_group", &m.topk_group));
      if (m.n_group < 1 || m.topk_group < 1 || m.topk_group > m.n_group ||
          m.n_experts % m.n_group != 0)
        return make_error(c.where() + ": n_group / topk_group do not fit n_routed_experts");
      int first_dense = 0, freq = 1;
      MOE_TRY(c.opt_int("first_k_dense_replace", &first_dense));
      MOE_TRY(c.opt_int("moe_layer_freq", &freq));
      if (freq < 1) return make_error(c.where() + ": moe_layer_freq must be >= 1");
      for (int l = 0; l < d->n_layers; ++l)
        d->layer_is_moe[size_t(l)] = m.n_experts > 0 && l >= first_dense && l % freq == 0;
      break;
    }
    case Arch::qwen2:
      break;
  }
  if (m.n_experts > 4096)
    return make_error(c.where() + ": the expert count (num_experts, num_local_experts or n_routed_experts) is " +
                      std::to_string(m.n_experts) + ", more than 4096 (no model has that many; the file is likely corrupt)");
  if (m.n_experts < 1 || m.top_k < 1 || m.top_k > m.n_experts)
    return make_error(c.where() + ": num_experts_per_tok (" + std::to_string(m.top_k) +
                      ") must be between 1 and the number of experts (" +
                      std::to_string(m.n_experts) + ")");
  if (m.expert_intermediate < 1)
    return make_error(c.where() + ": the expert intermediate size must be positive");
  return Status::ok_status();
}

}  // namespace

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::qwen2_moe:
      return "qwen2_moe";
    case Arch::qwen3_moe:
      return "qwen3_moe";
    case Arch::mixtral:
      return "mixtral";
    case Arch::olmoe:
      return "olmoe";
    case Arch::qwen2:
      return "qwen2";
    case Arch::deepseek_v2:
      return "deepseek_v2";
  }
  return "?";
}

int ModelDesc::n_moe_layers() const {
  return int(std::count(layer_is_moe.begin(), layer_is_moe.end(), true));
}

int ModelDesc::moe_layer_index(int layer) const {
  if (layer < 0 || size_t(layer) >= layer_is_moe.size() || !layer_is_moe[size_t(layer)]) return -1;
  return int(std::count(layer_is_moe.begin(), layer_is_moe.begin() + layer, true));
}

Result<ModelDesc> parse_model_desc(const std::string& config_json_text) {
  return parse_model_desc(config_json_text, "");
}

Result<ModelDesc> parse_model_desc(const std::string& config_json_text,
                                   const std::string& generation_config_text) {
  auto parsed = parse_json(config_json_text, "config.json");
  if (!parsed) return make_error(parsed.error());
  const json& j = *parsed;
  if (!j.is_object()) return make_error("config.json: not a JSON object");

  ModelDesc d;
  ConfigReader base(j, "config.json");
  if (!base.has("model_type")) return make_error("config.json: missing key 'model_type'");
  MOE_TRY(base.opt_string("model_type", &d.model_type));
  if (!arch_from_model_type(d.model_type, &d.arch))
    return make_error("config.json: unsupported model_type '" + d.model_type +
                      "' (supported: qwen2_moe, qwen3_moe, mixtral, olmoe, qwen2, deepseek_v2)");
  const ConfigReader c(j, "config.json (" + d.model_type + ")");

  MOE_TRY(c.need_int("vocab_size", &d.vocab_size));
  MOE_TRY(c.need_int("hidden_size", &d.hidden_size));
  MOE_TRY(c.need_int("num_hidden_layers", &d.n_layers));
  MOE_TRY(c.need_int("num_attention_heads", &d.n_heads));
  if (d.vocab_size < 1 || d.hidden_size < 1 || d.n_layers < 1 || d.n_heads < 1)
    return make_error(
        c.where() +
        ": vocab_size, hidden_size, num_hidden_layers and num_attention_heads must be positive");
  // Bounds far past any real model: tables are sized by these before the
  // weights are checked against them, so a corrupt value would allocate
  // gigabytes (or fail to) first.
  struct Cap {
    const char* key;
    int value, max;
  };
  for (const Cap& cap : {Cap{"vocab_size", d.vocab_size, 1 << 24}, Cap{"hidden_size", d.hidden_size, 1 << 17},
                         Cap{"num_hidden_layers", d.n_layers, 4096}, Cap{"num_attention_heads", d.n_heads, 4096}})
    if (cap.value > cap.max)
      return make_error(c.where() + ": " + cap.key + " is " + std::to_string(cap.value) + ", more than " +
                        std::to_string(cap.max) + " (no model has that many; the file is likely corrupt)");
  d.n_kv_heads = d.n_heads;
  MOE_TRY(c.opt_int("num_key_value_heads", &d.n_kv_heads));
  if (c.has("head_dim")) {
    MOE_TRY(c.need_int("head_dim", &d.head_dim));
  } else {
    if (d.hidden_size % d.n_heads != 0)
      return make_error(c.where() +
                        ": no head_dim and hidden_size is not a multiple of num_attention_heads");
    d.head_dim = d.hidden_size / d.n_heads;
  }
  MOE_TRY(c.opt_int("intermediate_size", &d.intermediate_size));
  if (d.intermediate_size < 0)  // unused where every layer is MoE, but a sign of a corrupt file
    return make_error(c.where() + ": intermediate_size is " + std::to_string(d.intermediate_size) +
                      ", not a width");
  MOE_TRY(c.opt_float("rms_norm_eps", &d.rms_eps));
  MOE_TRY(c.opt_bool("tie_word_embeddings", &d.tie_embeddings));
  MOE_TRY(c.opt_int("max_position_embeddings", &d.max_position));
  MOE_TRY(parse_rope(c, &d.rope));
  // What would turn every output into NaN or noise rather than fail.
  if (!(d.rms_eps > 0) || !std::isfinite(d.rms_eps))
    return make_error(c.where() + ": rms_norm_eps must be a positive number");
  if (!(d.rope.theta > 0) || !std::isfinite(d.rope.theta))
    return make_error(c.where() + ": rope_theta must be a positive number");
  if (!(d.rope.factor > 0) || !std::isfinite(d.rope.factor))
    return make_error(c.where() + ": the rope scaling factor must be a positive number");
  if (d.max_position < 0) return make_error(c.where() + ": max_position_embeddings must not be negative");

  switch (d.arch) {
    case Arch::qwen2:
    case Arch::qwen2_moe:
      d.qkv_bias = true;  // Qwen2 projections always carry q/k/v biases
      break;
    default:
      MOE_TRY(c.opt_bool("attention_bias", &d.qkv_bias));
      break;
  }
  if (d.arch == Arch::qwen3_moe) d.qk_norm = QkNorm::per_head;
  if (d.arch == Arch::olmoe) d.qk_norm = QkNorm::whole;

  if (d.arch == Arch::deepseek_v2) {
    d.attention = AttentionKind::mla;
    MOE_TRY(c.opt_int("q_lora_rank", &d.mla.q_lora_rank));  // null: a dense q_proj
    MOE_TRY(c.need_int("kv_lora_rank", &d.mla.kv_lora_rank));
    MOE_TRY(c.need_int("qk_nope_head_dim", &d.mla.qk_nope_head_dim));
    MOE_TRY(c.need_int("qk_rope_head_dim", &d.mla.qk_rope_head_dim));
    MOE_TRY(c.need_int("v_head_dim", &d.mla.v_head_dim));
  } else if (d.n_kv_heads < 1 || d.n_heads % d.n_kv_heads != 0) {
    return make_error(c.where() + ": num_key_value_heads (" + std::to_string(d.n_kv_heads) +
                      ") does not divide num_attention_heads (" + std::to_string(d.n_heads) + ")");
  }

  if (d.arch == Arch::qwen2) {
    d.layer_is_moe.assign(size_t(d.n_layers), false);
  } else {
    MOE_TRY(parse_moe(c, &d));
  }
  const bool has_dense =
      std::find(d.layer_is_moe.begin(), d.layer_is_moe.end(), false) != d.layer_is_moe.end();
  if (has_dense && d.intermediate_size < 1)
    return make_error(c.where() +
                      ": missing key 'intermediate_size' (the width of the dense layers' MLP)");

  MOE_TRY(append_ids(c, "eos_token_id", &d.eos_token_ids));
  MOE_TRY(c.opt_int("bos_token_id", &d.bos_token_id));

  if (!generation_config_text.empty()) {
    auto g = parse_json(generation_config_text, "generation_config.json");
    if (!g) return make_error(g.error());
    if (!g->is_object()) return make_error("generation_config.json: not a JSON object");
    const ConfigReader gc(*g, "generation_config.json");
    MOE_TRY(append_ids(gc, "eos_token_id", &d.eos_token_ids));
    if (d.bos_token_id < 0) MOE_TRY(gc.opt_int("bos_token_id", &d.bos_token_id));
  }
  return d;
}

Result<ModelDesc> load_model_desc(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path config_path = fs::path(dir) / "config.json";
  auto text = read_text(config_path.string());
  if (!text) return make_error(text.error());
  std::string gen;
  const fs::path gen_path = fs::path(dir) / "generation_config.json";
  if (fs::exists(gen_path)) {
    auto g = read_text(gen_path.string());
    if (!g) return make_error(g.error());
    gen = std::move(*g);
  }
  auto d = parse_model_desc(*text, gen);
  if (!d) return make_error(dir + ": " + d.error());
  return d;
}

}  // namespace moe
