#include "model/gguf_model.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <thread>

#include "model/gguf_quants.h"
#include "model/gguf_tokenizer.h"
#include "model/packed_model.h"
#include "model/parallel_for.h"

namespace moe {

namespace {

using nlohmann::json;

struct ArchNames {
  const char* gguf;        // general.architecture
  const char* model_type;  // our config.json spelling
};

constexpr int64_t kMaxLayers = 4096;

constexpr ArchNames kArchs[] = {
    {"qwen2moe", "qwen2_moe"}, {"qwen3moe", "qwen3_moe"}, {"llama", "mixtral"},
    {"olmoe", "olmoe"},        {"deepseek2", "deepseek_v2"}, {"qwen2", "qwen2"},
};

bool is_float_type(uint32_t t) { return t == kGgmlF32 || t == kGgmlF16 || t == kGgmlBF16; }

DType float_dtype(uint32_t t) {
  return t == kGgmlF32 ? DType::f32 : t == kGgmlF16 ? DType::f16 : DType::bf16;
}

// Reads the architecture's metadata into the config.json our parser takes.
class ConfigWriter {
 public:
  ConfigWriter(const GgufFile& g, std::string arch) : g_(g), arch_(std::move(arch)) {}

  // `key` under the architecture's prefix, as an integer in [0, max] into j[field].
  Status int_key(const char* key, json& j, const char* field, bool required, int64_t max = kMaxSize) {
    int64_t v = 0;
    auto got = get_int(key, &v, max);
    if (!got) return make_error(got.error());
    if (!*got) {
      if (const GgufValue* a = g_.find_value(arch_ + "." + key); a && a->as_array())
        return make_error(g_.path() + ": '" + arch_ + "." + key + "' differs per layer; not supported");
      if (required) return make_error(g_.path() + ": missing metadata '" + arch_ + "." + key + "'");
      return Status::ok_status();
    }
    j[field] = v;
    return Status::ok_status();
  }
  Status float_key(const char* key, json& j, const char* field) {
    double v = 0;
    auto got = g_.get_float(arch_ + "." + key, &v);
    if (!got) return make_error(got.error());
    if (*got) j[field] = v;
    return Status::ok_status();
  }
  // Sizes and counts are refused outside [0, max] (a corrupt value would
  // otherwise size allocations).
  Result<bool> get_int(const char* key, int64_t* v, int64_t max = kMaxSize) {
    auto got = g_.get_int(arch_ + "." + key, v);
    if (got && *got && (*v < 0 || *v > max))
      return make_error(g_.path() + ": metadata '" + arch_ + "." + key + "' = " + std::to_string(*v) +
                        " is out of range (0.." + std::to_string(max) + ")");
    return got;
  }
  static constexpr int64_t kMaxSize = int64_t(1) << 30;
  Result<bool> get_float(const char* key, double* v) { return g_.get_float(arch_ + "." + key, v); }
  Result<bool> get_bool(const char* key, bool* v) { return g_.get_bool(arch_ + "." + key, v); }
  Result<bool> get_string(const char* key, std::string* v) { return g_.get_string(arch_ + "." + key, v); }

 private:
  const GgufFile& g_;
  std::string arch_;
};

const GgufTensor* layer_tensor(const GgufFile& g, int layer, const char* base) {
  return g.find_tensor("blk." + std::to_string(layer) + "." + base + ".weight");
}

Result<std::string> make_config(const GgufFile& g, const std::string& arch, const std::string& model_type,
                                const std::vector<int32_t>& eos_ids, int32_t bos_id) {
  ConfigWriter c(g, arch);
  json j;
  j["model_type"] = model_type;
  const GgufTensor* embed = g.find_tensor("token_embd.weight");
  if (!embed || embed->ne.size() != 2) return make_error(g.path() + ": no 2-D token_embd.weight");
  j["vocab_size"] = embed->ne[1];
  MOE_TRY(c.int_key("embedding_length", j, "hidden_size", true));
  MOE_TRY(c.int_key("block_count", j, "num_hidden_layers", true, kMaxLayers));
  MOE_TRY(c.int_key("attention.head_count", j, "num_attention_heads", true, 4096));
  MOE_TRY(c.int_key("attention.head_count_kv", j, "num_key_value_heads", false, 4096));
  MOE_TRY(c.int_key("feed_forward_length", j, "intermediate_size", false));
  MOE_TRY(c.int_key("context_length", j, "max_position_embeddings", false));
  MOE_TRY(c.float_key("attention.layer_norm_rms_epsilon", j, "rms_norm_eps"));
  MOE_TRY(c.float_key("rope.freq_base", j, "rope_theta"));
  if (!j.contains("rope_theta")) j["rope_theta"] = 10000.0;
  j["tie_word_embeddings"] = g.find_tensor("output.weight") == nullptr;
  const int layers = j["num_hidden_layers"].get<int>();

  // Rope scaling.
  std::string scaling;
  if (auto got = c.get_string("rope.scaling.type", &scaling); !got) return make_error(got.error());
  if (!scaling.empty() && scaling != "none") {
    json r;
    r["type"] = scaling;
    r["rope_type"] = scaling;
    double factor = 1.0;
    if (auto got = c.get_float("rope.scaling.factor", &factor); !got) return make_error(got.error());
    r["factor"] = factor;
    MOE_TRY(c.int_key("rope.scaling.original_context_length", r, "original_max_position_embeddings", false));
    MOE_TRY(c.float_key("rope.scaling.yarn_beta_fast", r, "beta_fast"));
    MOE_TRY(c.float_key("rope.scaling.yarn_beta_slow", r, "beta_slow"));
    double log_mul = 0;
    if (auto got = c.get_float("rope.scaling.yarn_log_multiplier", &log_mul); !got) return make_error(got.error());
    else if (*got) {
      // The converter writes 0.1 * mscale_all_dim; the attention scale and the
      // rope's magnitude then both follow mscale_all_dim (their ratio is 1).
      r["mscale"] = log_mul / 0.1;
      r["mscale_all_dim"] = log_mul / 0.1;
    }
    j["rope_scaling"] = r;
  }

  int64_t experts = 0;
  if (auto got = c.get_int("expert_count", &experts, 4096); !got) return make_error(got.error());
  const bool moe = experts > 0;
  if (model_type == "mixtral" && !moe)
    return make_error(g.path() + ": a dense 'llama' model; the llama architecture is served with experts (Mixtral) only");
  if (model_type != "qwen2" && !moe) return make_error(g.path() + ": " + arch + " without " + arch + ".expert_count");
  if (moe) {
    j["num_experts"] = experts;
    MOE_TRY(c.int_key("expert_used_count", j, "num_experts_per_tok", true, experts));
    // llama.cpp's own choice per architecture where the file does not say.
    bool norm = model_type == "qwen3_moe" || model_type == "mixtral";
    if (auto got = c.get_bool("expert_weights_norm", &norm); !got) return make_error(got.error());
    j["norm_topk_prob"] = norm;
    // The experts' width from their tensors (the metadata key differs by architecture).
    int first_moe = -1;
    for (int l = 0; l < layers && first_moe < 0; ++l)
      if (layer_tensor(g, l, "ffn_gate_exps")) first_moe = l;
    if (first_moe < 0) return make_error(g.path() + ": no blk.N.ffn_gate_exps tensor (per-expert tensors are not read)");
    const GgufTensor* gate = layer_tensor(g, first_moe, "ffn_gate_exps");
    if (gate->ne.size() != 3) return make_error(g.path() + ": '" + gate->name + "' is not 3-D");
    const int64_t inter = gate->ne[1];
    if (model_type == "mixtral" || model_type == "olmoe") {
      j["intermediate_size"] = inter;
    } else {
      j["moe_intermediate_size"] = inter;
    }
    if (model_type == "qwen2_moe" || model_type == "qwen3_moe") {
      std::vector<int> dense;
      for (int l = 0; l < layers; ++l)
        if (!layer_tensor(g, l, "ffn_gate_exps")) dense.push_back(l);
      j["mlp_only_layers"] = dense;
      if (!dense.empty() && !j.contains("intermediate_size")) {
        const GgufTensor* t = layer_tensor(g, dense.front(), "ffn_gate");
        if (t && t->ne.size() == 2) j["intermediate_size"] = t->ne[1];
      }
    }
    if (model_type == "qwen2_moe") {
      const GgufTensor* sh = layer_tensor(g, first_moe, "ffn_gate_shexp");
      j["shared_expert_intermediate_size"] = sh && sh->ne.size() == 2 ? sh->ne[1] : 0;
    }
    if (model_type == "deepseek_v2") {
      int64_t gating = 1;
      if (auto got = c.get_int("expert_gating_func", &gating); !got) return make_error(got.error());
      if (gating != 1)
        return make_error(g.path() + ": expert gating function " + std::to_string(gating) +
                          " (DeepSeek-V3's sigmoid routing) is not served; DeepSeek-V2's softmax is");
      MOE_TRY(c.int_key("expert_shared_count", j, "n_shared_experts", false));
      MOE_TRY(c.float_key("expert_weights_scale", j, "routed_scaling_factor"));
      MOE_TRY(c.int_key("leading_dense_block_count", j, "first_k_dense_replace", false));
      int64_t groups = 1, used = 1;
      if (auto got = c.get_int("expert_group_count", &groups); !got) return make_error(got.error());
      if (auto got = c.get_int("expert_group_used_count", &used); !got) return make_error(got.error());
      if (groups > 1) {
        j["topk_method"] = "group_limited_greedy";
        j["n_group"] = groups;
        j["topk_group"] = used;
      }
    }
  }

  if (model_type == "deepseek_v2") {
    int64_t q_lora = 0, kv_lora = 0, rope_dim = 0;
    if (auto got = c.get_int("attention.q_lora_rank", &q_lora); !got) return make_error(got.error());
    if (auto got = c.get_int("attention.kv_lora_rank", &kv_lora); !got || !*got)
      return make_error(got ? g.path() + ": missing metadata '" + arch + ".attention.kv_lora_rank'" : got.error());
    if (auto got = c.get_int("rope.dimension_count", &rope_dim); !got || !*got)
      return make_error(got ? g.path() + ": missing metadata '" + arch + ".rope.dimension_count'" : got.error());
    j["q_lora_rank"] = q_lora > 0 ? json(q_lora) : json(nullptr);
    j["kv_lora_rank"] = kv_lora;
    j["qk_rope_head_dim"] = rope_dim;
    // The per-head widths from the tensors: attn_k_b [nope, kv_lora, heads]
    // and attn_v_b [kv_lora, v, heads], or attn_kv_b [kv_lora, heads*(nope+v)].
    const int heads = j["num_attention_heads"].get<int>();
    int64_t nope = 0, v = 0;
    if (const GgufTensor* kb = layer_tensor(g, 0, "attn_k_b"); kb && kb->ne.size() == 3) {
      const GgufTensor* vb = layer_tensor(g, 0, "attn_v_b");
      if (!vb || vb->ne.size() != 3) return make_error(g.path() + ": attn_k_b without a 3-D attn_v_b");
      nope = kb->ne[0];
      v = vb->ne[1];
    } else {
      int64_t klen = 0, vlen = 0;
      bool kmla = false, vmla = false;
      if (auto got = c.get_int("attention.key_length_mla", &klen); !got) return make_error(got.error());
      else kmla = *got;
      if (auto got = c.get_int("attention.value_length_mla", &vlen); !got) return make_error(got.error());
      else vmla = *got;
      if (!kmla) {
        if (auto got = c.get_int("attention.key_length", &klen); !got || !*got)
          return make_error(g.path() + ": no key length for the MLA heads");
      }
      if (!vmla) {
        if (auto got = c.get_int("attention.value_length", &vlen); !got || !*got)
          return make_error(g.path() + ": no value length for the MLA heads");
      }
      nope = klen - rope_dim;
      v = vlen;
      const GgufTensor* kvb = layer_tensor(g, 0, "attn_kv_b");
      if (kvb && kvb->ne.size() == 2 && kvb->ne[1] != heads * (nope + v))
        return make_error(g.path() + ": attn_kv_b does not fit the MLA head widths");
    }
    j["qk_nope_head_dim"] = nope;
    j["v_head_dim"] = v;
    j["num_key_value_heads"] = heads;
  } else {
    int64_t klen = 0;
    if (auto got = c.get_int("attention.key_length", &klen); !got) return make_error(got.error());
    else if (*got) j["head_dim"] = klen;
    if (!j.contains("num_key_value_heads")) j["num_key_value_heads"] = j["num_attention_heads"];
  }
  if (model_type == "mixtral")
    j["attention_bias"] = layer_tensor(g, 0, "attn_q") && g.find_tensor("blk.0.attn_q.bias") != nullptr;

  if (!eos_ids.empty()) j["eos_token_id"] = eos_ids;
  if (bos_id >= 0) j["bos_token_id"] = bos_id;
  return j.dump(2, ' ', false, json::error_handler_t::replace);
}

// "blk.12.attn_q.weight" → (12, "attn_q", "weight"); false for other names.
bool split_layer_name(const std::string& name, int* layer, std::string* base, std::string* kind) {
  // By hand (names are at most 256 bytes, gguf_file.cpp): "blk." digits "." base "." kind.
  if (!name.starts_with("blk.")) return false;
  const size_t dot = name.find('.', 4);
  if (dot == std::string::npos || dot == 4 || dot > 4 + 6) return false;
  int n = 0;
  for (size_t i = 4; i < dot; ++i) {
    if (name[i] < '0' || name[i] > '9') return false;
    n = n * 10 + (name[i] - '0');
  }
  const size_t last = name.rfind('.');
  if (last <= dot + 1) return false;
  *kind = name.substr(last + 1);
  if (*kind != "weight" && *kind != "bias") return false;
  *layer = n;
  *base = name.substr(dot + 1, last - dot - 1);
  return true;
}

// Expert e's slice of a stacked expert tensor (ne [cols, rows, n_experts]).
size_t expert_slice_bytes(const GgufTensor& t) {
  return size_t(t.ne[1]) * ggml_row_bytes(*ggml_type_info(t.type), t.ne[0]);
}
const uint8_t* expert_slice(const GgufTensor& t, int64_t e) { return t.data + size_t(e) * expert_slice_bytes(t); }

// The Hugging Face name of a non-expert layer tensor ("" for one we do not use).
std::string hf_layer_name(Arch arch, int layer, const std::string& base, const std::string& kind) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const std::string moe_prefix = arch == Arch::mixtral ? "block_sparse_moe." : "mlp.";
  const std::string shared = arch == Arch::deepseek_v2 ? "mlp.shared_experts." : "mlp.shared_expert.";
  static const std::map<std::string, std::string> kAttention = {
      {"attn_norm", "input_layernorm"},
      {"ffn_norm", "post_attention_layernorm"},
      {"attn_q", "self_attn.q_proj"},
      {"attn_k", "self_attn.k_proj"},
      {"attn_v", "self_attn.v_proj"},
      {"attn_output", "self_attn.o_proj"},
      {"attn_q_norm", "self_attn.q_norm"},
      {"attn_k_norm", "self_attn.k_norm"},
      {"attn_q_a", "self_attn.q_a_proj"},
      {"attn_q_a_norm", "self_attn.q_a_layernorm"},
      {"attn_q_b", "self_attn.q_b_proj"},
      {"attn_kv_a_mqa", "self_attn.kv_a_proj_with_mqa"},
      {"attn_kv_a_norm", "self_attn.kv_a_layernorm"},
      {"attn_kv_b", "self_attn.kv_b_proj"},
      {"ffn_gate", "mlp.gate_proj"},
      {"ffn_up", "mlp.up_proj"},
      {"ffn_down", "mlp.down_proj"},
  };
  if (auto it = kAttention.find(base); it != kAttention.end()) return p + it->second + "." + kind;
  if (base == "ffn_gate_inp") return p + moe_prefix + "gate." + kind;
  if (base == "ffn_gate_shexp") return p + shared + "gate_proj." + kind;
  if (base == "ffn_up_shexp") return p + shared + "up_proj." + kind;
  if (base == "ffn_down_shexp") return p + shared + "down_proj." + kind;
  if (base == "ffn_gate_inp_shexp") return p + "mlp.shared_expert_gate." + kind;
  return "";
}

}  // namespace

// ---------------------------------------------------------------------------
// GgufTensorSource

Status GgufTensorSource::make(Entry& e, TensorView& v) const {
  // Every tensor's type was checked at open (GgufModelReader::read).
  const GgufTensor& t = *e.src;
  const GgmlTypeInfo* info = ggml_type_info(t.type);
  // A 1-D tensor un-permuted (a q/k bias) is rows of one value (F32, checked at open).
  const bool vector_rows = e.make == Make::unpermute_qk && t.ne.size() == 1;
  const int64_t row = vector_rows ? 1 : t.ne[0];
  const size_t row_bytes = ggml_row_bytes(*info, row);
  switch (e.make) {
    case Make::view:
      break;
    case Make::dequantize: {
      const int64_t rows = e.expert >= 0 ? t.ne[1] : t.numel() / row;
      const uint8_t* base = e.expert >= 0 ? expert_slice(t, e.expert) : t.data;
      e.storage.resize(size_t(rows * row));
      // An embedding or lm_head of 150k rows takes seconds on one core: by
      // chunks of rows on every core (threads_ as for the experts).
      constexpr int64_t kChunk = 256;
      const size_t chunks = size_t((rows + kChunk - 1) / kChunk);
      const size_t threads = std::min(chunks, threads_ > 0 ? size_t(threads_) : host_threads());
      parallel_for(chunks, threads, [&](size_t c) {
        const int64_t end = std::min(rows, int64_t(c + 1) * kChunk);
        for (int64_t r = int64_t(c) * kChunk; r < end; ++r)
          gguf_dequantize_row(t.type, base + size_t(r) * row_bytes, row, e.storage.data() + r * row);
      });
      break;
    }
    case Make::unpermute_qk: {
      // ggml's rope pairs neighbours (2i, 2i+1) of a head where the
      // Hugging Face weights pair (i, i + d/2): the converter interleaved each
      // head's rows; put them back.
      const int64_t rows = vector_rows ? t.ne[0] : t.ne[1];
      const int64_t hd = rows / e.heads, half = hd / 2;
      e.storage.resize(size_t(rows * row));
      for (int64_t h = 0; h < e.heads; ++h)
        for (int64_t i = 0; i < half; ++i)
          for (int64_t j = 0; j < 2; ++j) {
            const int64_t from = h * hd + 2 * i + j, to = h * hd + j * half + i;
            gguf_dequantize_row(t.type, t.data + size_t(from) * row_bytes, row, e.storage.data() + to * row);
          }
      break;
    }
    case Make::kv_b: {
      // attn_k_b [heads][kv_lora][nope] (k_b transposed per head) and
      // attn_v_b [heads][v][kv_lora] → kv_b_proj [heads*(nope+v)][kv_lora].
      const GgufTensor& vt = *e.src2;
      const int64_t nope = t.ne[0], kv_lora = t.ne[1], heads = t.ne[2], vd = vt.ne[1];
      std::vector<float> k(size_t(t.numel())), vv(size_t(vt.numel()));
      gguf_dequantize_row(t.type, t.data, t.numel(), k.data());
      gguf_dequantize_row(vt.type, vt.data, vt.numel(), vv.data());
      e.storage.assign(size_t(heads * (nope + vd) * kv_lora), 0.0f);
      for (int64_t h = 0; h < heads; ++h) {
        float* out = e.storage.data() + h * (nope + vd) * kv_lora;
        for (int64_t c = 0; c < kv_lora; ++c)
          for (int64_t n = 0; n < nope; ++n) out[n * kv_lora + c] = k[size_t((h * kv_lora + c) * nope + n)];
        std::copy_n(vv.data() + h * vd * kv_lora, vd * kv_lora, out + nope * kv_lora);
      }
      break;
    }
  }
  if (e.make != Make::view) {
    v.dtype = DType::f32;
    v.data = reinterpret_cast<const uint8_t*>(e.storage.data());
    v.nbytes = e.storage.size() * 4;
  }
  e.ready = true;
  return Status::ok_status();
}

const TensorView* GgufTensorSource::find(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = views_.find(name);
  bool listed = it != views_.end();
  if (!listed) {
    it = expert_views_.find(name);
    if (it == expert_views_.end()) return nullptr;
  }
  Entry& e = listed ? entries_.at(name) : expert_entries_.at(name);
  if (!e.ready) {
    Status s = Status::ok_status();
    try {
      s = make(e, it->second);
    } catch (const std::exception& ex) {  // std::bad_alloc: no room for the f32 copy
      s = make_error(file_->path() + ": tensor '" + name + "': " + ex.what());
      e.storage = {};
    }
    if (!s) {
      std::fprintf(stderr, "gguf: %s\n", s.error().c_str());
      return nullptr;
    }
  }
  return &it->second;
}

const std::map<std::string, TensorView>& GgufTensorSource::tensors() const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (all_made_) return views_;
  }
  bool all = true;
  for (const auto& kv : entries_) all = find(kv.first) != nullptr && all;
  std::lock_guard<std::mutex> lock(mu_);
  // A tensor that could not be made (said on stderr) is tried again by the
  // next call; its view stays empty (data null, 0 bytes) meanwhile.
  all_made_ = all;
  return views_;
}

void GgufTensorSource::make_experts() const {
  const ModelDesc& d = desc_;
  const size_t n_experts = size_t(d.moe.n_experts);
  blobs_.assign(size_t(d.n_layers) * n_experts, nullptr);
  size_t moe_layers = 0, quantised_bytes = 0;
  for (const LayerExperts& le : experts_)
    if (le.gate) {
      ++moe_layers;
      quantised_bytes += le.gate->nbytes + le.up->nbytes + le.down->nbytes;
    }
  blob_storage_.resize(moe_layers * n_experts * layout_.blob_bytes + kQ4Align);
  uint8_t* base = blob_storage_.data();
  base += (kQ4Align - reinterpret_cast<uintptr_t>(base) % kQ4Align) % kQ4Align;

  struct Job {
    const LayerExperts* le;
    size_t expert;
    uint8_t* blob;
  };
  std::vector<Job> jobs;
  size_t slot = 0;
  for (int l = 0; l < d.n_layers; ++l) {
    const LayerExperts& le = experts_[size_t(l)];
    if (!le.gate) continue;
    for (size_t e = 0; e < n_experts; ++e, ++slot) {
      uint8_t* blob = base + slot * layout_.blob_bytes;
      blobs_[size_t(l) * n_experts + e] = blob;
      jobs.push_back({&le, e, blob});
    }
  }
  const bool loud = quantised_bytes > (size_t(256) << 20);
  const auto t0 = std::chrono::steady_clock::now();
  int threads = threads_ > 0 ? threads_ : int(host_threads());
  threads = std::min<int>(threads, int(std::max<size_t>(1, jobs.size())));
  if (loud)
    std::fprintf(stderr, "gguf: %s: moving %.1f GB of experts into INT4 blobs (%d threads)\n", file_->path().c_str(),
                 double(quantised_bytes) / 1e9, threads);
  parallel_for(jobs.size(), size_t(threads), [&](size_t i) {
    const Job& j = jobs[i];
    const std::pair<const GgufTensor*, const Q4MatrixLayout*> mats[] = {
        {j.le->gate, &layout_.gate}, {j.le->up, &layout_.up}, {j.le->down, &layout_.down}};
    for (const auto& [t, m] : mats) {
      gguf_to_q4_rows(t->type, expert_slice(*t, int64_t(j.expert)), *m, 0, m->rows, j.blob);
    }
  });
  if (loud)
    std::fprintf(stderr, "gguf: experts ready in %.1f s\n",
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

const uint8_t* GgufTensorSource::expert_q4(int layer, int expert) const {
  if (!experts_q4_ || layer < 0 || layer >= desc_.n_layers || expert < 0 || expert >= desc_.moe.n_experts)
    return nullptr;
  std::call_once(experts_once_, [this] {
    try {
      make_experts();
    } catch (const std::exception& e) {  // std::bad_alloc: the host has no room for the blobs
      std::fprintf(stderr, "gguf: %s: the INT4 experts could not be made: %s\n", file_->path().c_str(), e.what());
      blobs_.clear();
    }
  });
  if (blobs_.empty()) return nullptr;  // the engine reports the missing expert
  return blobs_[size_t(layer) * size_t(desc_.moe.n_experts) + size_t(expert)];
}

// ---------------------------------------------------------------------------
// GgufModelReader

Status GgufModelReader::read(const std::string& path, const GgufOpenOptions& opts, ModelFiles* out) {
  auto opened = GgufFile::open(path);
  if (!opened) return make_error(opened.error());
  auto src = std::make_shared<GgufTensorSource>();
  src->file_ = std::move(*opened);
  src->threads_ = opts.threads;
  const GgufFile& g = *src->file_;

  std::string arch;
  if (auto got = g.get_string("general.architecture", &arch); !got || !*got)
    return make_error(got ? path + ": missing metadata 'general.architecture'" : got.error());
  std::string model_type;
  for (const ArchNames& a : kArchs)
    if (arch == a.gguf) model_type = a.model_type;
  if (model_type.empty()) {
    std::string known;
    for (const ArchNames& a : kArchs) known += std::string(known.empty() ? "" : ", ") + a.gguf;
    return make_error(path + ": architecture '" + arch + "' is not served (GGUF architectures read: " + known + ")");
  }

  auto tok = gguf_tokenizer_files(g);
  if (!tok) return make_error(tok.error());
  auto config = make_config(g, arch, model_type, tok->eos_ids, tok->bos_id);
  if (!config) return make_error(config.error());
  auto desc = parse_model_desc(*config);
  if (!desc) return make_error(path + ": " + desc.error());
  src->desc_ = *desc;
  const ModelDesc& d = src->desc_;

  // Tensors by Hugging Face name.
  std::vector<std::string> unused;
  src->experts_.assign(size_t(d.n_layers), {});
  bool any_quantised_expert = false;
  // `listed`: in tensors(); the experts' float tensors are not while they
  // are served as INT4 blobs (find() still makes one when asked).
  auto add = [&](const std::string& name, GgufTensorSource::Entry e, std::vector<int64_t> shape, bool listed = true) {
    TensorView v;
    v.name = name;
    v.shape = std::move(shape);
    if (e.make == GgufTensorSource::Make::view) {
      v.dtype = float_dtype(e.src->type);
      v.data = e.expert >= 0 ? expert_slice(*e.src, e.expert) : e.src->data;
      v.nbytes = e.expert >= 0 ? expert_slice_bytes(*e.src) : e.src->nbytes;
      e.ready = true;
    }
    (listed ? src->views_ : src->expert_views_).emplace(name, std::move(v));
    (listed ? src->entries_ : src->expert_entries_).emplace(name, std::move(e));
  };
  auto plain = [](const GgufTensor* t) {
    GgufTensorSource::Entry e;
    e.src = t;
    e.make = is_float_type(t->type) ? GgufTensorSource::Make::view : GgufTensorSource::Make::dequantize;
    return e;
  };

  for (const GgufTensor& t : g.tensors()) {
    int layer = -1;
    std::string base, kind;
    if (t.name == "token_embd.weight") {
      add("model.embed_tokens.weight", plain(&t), t.shape());
      continue;
    }
    if (t.name == "output_norm.weight") {
      add("model.norm.weight", plain(&t), t.shape());
      continue;
    }
    if (t.name == "output.weight") {
      add("lm_head.weight", plain(&t), t.shape());
      continue;
    }
    if (!split_layer_name(t.name, &layer, &base, &kind) || layer >= d.n_layers) {
      unused.push_back(t.name);
      continue;
    }
    if (base == "ffn_gate_exps" || base == "ffn_up_exps" || base == "ffn_down_exps") {
      if (t.ne.size() != 3 || t.ne[2] != d.moe.n_experts)
        return make_error(path + ": '" + t.name + "' is not [*, *, " + std::to_string(d.moe.n_experts) + "]");
      if (!d.layer_is_moe[size_t(layer)])
        return make_error(path + ": '" + t.name + "' on layer " + std::to_string(layer) + ", which the metadata makes dense");
      auto& le = src->experts_[size_t(layer)];
      (base == "ffn_gate_exps" ? le.gate : base == "ffn_up_exps" ? le.up : le.down) = &t;
      if (!is_float_type(t.type)) any_quantised_expert = true;
      continue;
    }
    if (base == "attn_k_b") {
      const GgufTensor* vb = g.find_tensor("blk." + std::to_string(layer) + ".attn_v_b.weight");
      if (!vb) return make_error(path + ": '" + t.name + "' without its attn_v_b");
      if (g.find_tensor("blk." + std::to_string(layer) + ".attn_kv_b.weight")) continue;  // kv_b itself is there
      if (t.ne.size() != 3 || vb->ne.size() != 3 || vb->ne[0] != t.ne[1] || vb->ne[2] != t.ne[2])
        return make_error(path + ": '" + t.name + "' and '" + vb->name +
                          "' are not [nope, kv_lora, heads] and [kv_lora, v, heads]");
      GgufTensorSource::Entry e;
      e.make = GgufTensorSource::Make::kv_b;
      e.src = &t;
      e.src2 = vb;
      add("model.layers." + std::to_string(layer) + ".self_attn.kv_b_proj.weight", std::move(e),
          {t.ne[2] * (t.ne[0] + vb->ne[1]), t.ne[1]});
      continue;
    }
    if (base == "attn_v_b") continue;  // with attn_k_b
    const std::string hf = hf_layer_name(d.arch, layer, base, kind);
    if (hf.empty()) {
      unused.push_back(t.name);
      continue;
    }
    std::vector<int64_t> shape = t.shape();
    if (base == "ffn_gate_inp_shexp" && shape.size() == 1) shape = {1, shape[0]};
    GgufTensorSource::Entry e = plain(&t);
    if (d.arch == Arch::mixtral && (base == "attn_q" || base == "attn_k")) {
      // The converter permuted the rows of the weight and of a bias alike.
      e.make = GgufTensorSource::Make::unpermute_qk;
      e.heads = base == "attn_q" ? d.n_heads : d.n_kv_heads;
      const bool matrix = kind == "weight" && t.ne.size() == 2;
      const bool vector = kind == "bias" && t.ne.size() == 1 && t.type == kGgmlF32;
      const int64_t rows = matrix ? t.ne[1] : t.ne[0];
      if ((!matrix && !vector) || e.heads <= 0 || rows % e.heads != 0 || (rows / e.heads) % 2 != 0)
        return make_error(path + ": '" + t.name + "' does not split into " + std::to_string(e.heads) +
                          " heads of even width");
    }
    add(hf, std::move(e), std::move(shape));
  }

  // Routed experts: INT4 blobs when any is quantised (and int4 is asked),
  // and one tensor per expert by its Hugging Face name (made when asked for:
  // `moe perplexity --experts bf16` compares the two).
  for (int l = 0; l < d.n_layers; ++l) {
    const auto& le = src->experts_[size_t(l)];
    const bool moe_layer = d.layer_is_moe[size_t(l)];
    if (moe_layer && (!le.gate || !le.up || !le.down))
      return make_error(path + ": layer " + std::to_string(l) + " lacks one of ffn_gate_exps, ffn_up_exps, ffn_down_exps");
    if (!moe_layer) continue;
    const int64_t H = d.hidden_size, I = d.moe.expert_intermediate;
    if (le.gate->ne[0] != H || le.gate->ne[1] != I || le.up->ne[0] != H || le.up->ne[1] != I ||
        le.down->ne[0] != I || le.down->ne[1] != H)
      return make_error(path + ": layer " + std::to_string(l) + "'s expert tensors are not [" + std::to_string(H) +
                        ", " + std::to_string(I) + "] / [" + std::to_string(I) + ", " + std::to_string(H) + "]");
  }
  // Every tensor that will be made is of a type we read: checked now, so that
  // a Q2_K expert is refused at open rather than found missing (or zero) later.
  auto readable = [&](const GgufTensor* t) -> Status {
    const GgmlTypeInfo* info = t ? ggml_type_info(t->type) : nullptr;
    if (t && !info->dequantizable)
      return make_error(path + ": tensor '" + t->name + "' is " + info->name + "; the types read are " +
                        gguf_readable_types());
    return Status::ok_status();
  };
  for (const auto& [name, e] : src->entries_) {
    MOE_TRY(readable(e.src));
    MOE_TRY(readable(e.src2));
  }
  for (const auto& le : src->experts_) {
    MOE_TRY(readable(le.gate));
    MOE_TRY(readable(le.up));
    MOE_TRY(readable(le.down));
  }
  src->experts_q4_ = any_quantised_expert && opts.experts == GgufExperts::int4;
  if (src->experts_q4_) src->layout_ = expert_layout(d.hidden_size, d.moe.expert_intermediate, 32);
  {
    for (int l = 0; l < d.n_layers; ++l) {
      const auto& le = src->experts_[size_t(l)];
      if (!le.gate) continue;
      for (int x = 0; x < d.moe.n_experts; ++x) {
        const ExpertWeightNames names = expert_weight_names(d, l, x);
        const std::pair<const GgufTensor*, const std::string*> mats[] = {
            {le.gate, &names.gate}, {le.up, &names.up}, {le.down, &names.down}};
        for (const auto& [t, name] : mats) {
          GgufTensorSource::Entry e = plain(t);
          e.expert = x;
          add(*name, std::move(e), {t->ne[1], t->ne[0]}, !src->experts_q4_);
        }
      }
    }
  }
  if (!unused.empty()) {
    std::string list;
    for (size_t i = 0; i < unused.size() && i < 4; ++i) list += (i ? ", " : "") + unused[i];
    std::fprintf(stderr, "gguf: %s: %zu tensor(s) not used (%s%s)\n", path.c_str(), unused.size(), list.c_str(),
                 unused.size() > 4 ? ", ..." : "");
  }

  out->path_ = path;
  out->packed_ = true;
  out->desc_ = d;
  out->experts_q4_ = src->experts_q4_;
  out->q4_group_ = src->experts_q4_ ? 32 : 0;
  out->layout_ = src->layout_;
  out->text_files_["config.json"] = *config;
  out->text_files_["tokenizer.json"] = tok->tokenizer_json;
  out->text_files_["tokenizer_config.json"] = tok->tokenizer_config_json;
  out->gguf_ = std::move(src);
  return Status::ok_status();
}

Result<std::shared_ptr<ModelFiles>> open_gguf_model(const std::string& path, const GgufOpenOptions& opts) {
  auto files = std::make_shared<ModelFiles>();
  try {
    if (Status s = GgufModelReader::read(path, opts, files.get()); !s) return make_error(s.error());
  } catch (const std::exception& e) {  // a backstop: every check above returns an error first
    return make_error(path + ": " + e.what());
  }
  return files;
}

}  // namespace moe
