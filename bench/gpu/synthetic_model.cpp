#include "bench/gpu/synthetic_model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "model/int4.h"
#include "model/safetensors.h"

namespace moe::bench {

namespace {

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Runs fn(i) for i < n on every core.
template <typename F>
void parallel(size_t n, F&& fn) {
  const size_t threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (size_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (size_t i = t; i < n; i += threads) fn(i);
    });
  for (auto& th : pool) th.join();
}

// Uniform values in [offset - a, offset + a], as bf16 bits.
void fill_uniform(uint16_t* out, size_t n, uint64_t seed, float a, float offset) {
  const size_t chunk = size_t(1) << 20;
  parallel((n + chunk - 1) / chunk, [&](size_t c) {
    uint64_t s = mix(seed ^ (c * 0x632be59bd9b4e019ull));
    const size_t end = std::min(n, (c + 1) * chunk);
    for (size_t i = c * chunk; i < end; ++i) {
      s = mix(s);
      const float u = float(s >> 40) * (1.0f / float(1ull << 24)) * 2.f - 1.f;
      out[i] = f32_to_bf16(offset + a * u);
    }
  });
}

uint16_t f32_to_f16_bits(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

void fill_q4_matrix(uint8_t* blob, const Q4MatrixLayout& m, uint64_t seed) {
  uint64_t s = seed;
  uint8_t* codes = blob + m.codes_offset;
  for (size_t i = 0; i < m.codes_bytes(); i += 8) {
    s = mix(s);
    std::memcpy(codes + i, &s, std::min<size_t>(8, m.codes_bytes() - i));
  }
  const float scale = float(1.0 / (4.6 * std::sqrt(double(m.cols))));
  const uint16_t sc = f32_to_f16_bits(scale), bi = f32_to_f16_bits(-7.5f * scale);
  auto* params = reinterpret_cast<uint16_t*>(blob + m.params_offset);
  const size_t n = m.params_bytes() / 4;
  for (size_t i = 0; i < n; ++i) {
    params[2 * i] = sc;
    params[2 * i + 1] = bi;
  }
}

}  // namespace

SyntheticModel::~SyntheticModel() { std::free(experts); }

Result<std::unique_ptr<SyntheticModel>> make_synthetic_model(const ModelShape& s, uint64_t seed, int group) {
  auto m = std::make_unique<SyntheticModel>();
  const bool qwen2 = s.shared_inter > 0;
  nlohmann::json cfg = {
      {"model_type", qwen2 ? "qwen2_moe" : "qwen3_moe"},
      {"hidden_size", s.hidden},
      {"num_hidden_layers", s.layers},
      {"num_attention_heads", s.n_heads},
      {"num_key_value_heads", s.n_kv},
      {"head_dim", s.head_dim},
      {"moe_intermediate_size", s.inter},
      {"intermediate_size", qwen2 ? s.shared_inter : 6144},
      {"num_experts", s.n_experts},
      {"num_experts_per_tok", s.top_k},
      {"norm_topk_prob", s.norm_topk},
      {"vocab_size", s.vocab},
      {"rope_theta", s.rope_theta},
      {"rms_norm_eps", 1e-6},
      {"max_position_embeddings", 32768},
      {"tie_word_embeddings", false},
      {"decoder_sparse_step", 1},
      {"mlp_only_layers", nlohmann::json::array()},
      {"eos_token_id", 151645},
      {"torch_dtype", "bfloat16"},
  };
  if (qwen2) cfg["shared_expert_intermediate_size"] = s.shared_inter;
  if (s.mla()) {
    cfg = {
        {"model_type", "deepseek_v2"},
        {"hidden_size", s.hidden},
        {"num_hidden_layers", s.layers},
        {"num_attention_heads", s.n_heads},
        {"num_key_value_heads", s.n_heads},
        {"q_lora_rank", nullptr},
        {"kv_lora_rank", s.kv_lora_rank},
        {"qk_nope_head_dim", s.qk_nope},
        {"qk_rope_head_dim", s.qk_rope},
        {"v_head_dim", s.v_head},
        {"moe_intermediate_size", s.inter},
        {"intermediate_size", s.dense_inter},
        {"n_routed_experts", s.n_experts},
        {"n_shared_experts", s.shared_inter / s.inter},
        {"num_experts_per_tok", s.top_k},
        {"first_k_dense_replace", s.first_dense},
        {"moe_layer_freq", 1},
        {"topk_method", "greedy"},
        {"n_group", 1},
        {"topk_group", 1},
        {"scoring_func", "softmax"},
        {"routed_scaling_factor", 1.0},
        {"norm_topk_prob", false},
        {"vocab_size", s.vocab},
        {"rope_theta", s.rope_theta},
        {"rope_scaling",
         {{"type", "yarn"}, {"factor", s.yarn_factor}, {"original_max_position_embeddings", 4096},
          {"beta_fast", 32}, {"beta_slow", 1}, {"mscale", 0.707}, {"mscale_all_dim", 0.707}}},
        {"rms_norm_eps", 1e-6},
        {"max_position_embeddings", 163840},
        {"tie_word_embeddings", false},
        {"eos_token_id", 100001},
        {"torch_dtype", "bfloat16"},
    };
  }
  std::map<std::string, TensorView> tensors;
  uint64_t sd = seed;
  const int H = s.hidden, hd = s.head_dim;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, float a, float offset) {
    size_t n = 1;
    for (int64_t d : shape) n *= size_t(d);
    m->storage.emplace_back(n * 2);
    fill_uniform(reinterpret_cast<uint16_t*>(m->storage.back().data()), n, mix(++sd), a, offset);
    TensorView v;
    v.name = name;
    v.dtype = DType::bf16;
    v.shape = std::move(shape);
    v.data = m->storage.back().data();
    v.nbytes = n * 2;
    tensors[name] = v;
  };
  auto lin = [](int fan_in) { return float(std::sqrt(3.0 / fan_in)); };
  add("model.embed_tokens.weight", {s.vocab, H}, 1.f, 0.f);
  add("lm_head.weight", {s.vocab, H}, lin(H), 0.f);
  add("model.norm.weight", {H}, 0.1f, 1.f);
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {H}, 0.1f, 1.f);
    add(p + "post_attention_layernorm.weight", {H}, 0.1f, 1.f);
    if (s.mla()) {
      const int R = s.kv_lora_rank;
      add(p + "self_attn.q_proj.weight", {s.n_heads * (s.qk_nope + s.qk_rope), H}, lin(H), 0.f);
      add(p + "self_attn.kv_a_proj_with_mqa.weight", {R + s.qk_rope, H}, lin(H), 0.f);
      add(p + "self_attn.kv_a_layernorm.weight", {R}, 0.1f, 1.f);
      add(p + "self_attn.kv_b_proj.weight", {s.n_heads * (s.qk_nope + s.v_head), R}, lin(R), 0.f);
      add(p + "self_attn.o_proj.weight", {H, s.n_heads * s.v_head}, lin(s.n_heads * s.v_head), 0.f);
      if (l < s.first_dense) {
        add(p + "mlp.gate_proj.weight", {s.dense_inter, H}, lin(H), 0.f);
        add(p + "mlp.up_proj.weight", {s.dense_inter, H}, lin(H), 0.f);
        add(p + "mlp.down_proj.weight", {H, s.dense_inter}, lin(s.dense_inter), 0.f);
      } else {
        add(p + "mlp.gate.weight", {s.n_experts, H}, lin(H), 0.f);
        add(p + "mlp.shared_experts.gate_proj.weight", {s.shared_inter, H}, lin(H), 0.f);
        add(p + "mlp.shared_experts.up_proj.weight", {s.shared_inter, H}, lin(H), 0.f);
        add(p + "mlp.shared_experts.down_proj.weight", {H, s.shared_inter}, lin(s.shared_inter), 0.f);
      }
      continue;
    }
    add(p + "self_attn.q_proj.weight", {s.n_heads * hd, H}, lin(H), 0.f);
    add(p + "self_attn.k_proj.weight", {s.n_kv * hd, H}, lin(H), 0.f);
    add(p + "self_attn.v_proj.weight", {s.n_kv * hd, H}, lin(H), 0.f);
    add(p + "self_attn.o_proj.weight", {H, s.n_heads * hd}, lin(s.n_heads * hd), 0.f);
    if (s.qkv_bias) {
      add(p + "self_attn.q_proj.bias", {s.n_heads * hd}, 0.1f, 0.f);
      add(p + "self_attn.k_proj.bias", {s.n_kv * hd}, 0.1f, 0.f);
      add(p + "self_attn.v_proj.bias", {s.n_kv * hd}, 0.1f, 0.f);
    }
    if (s.qk_norm) {
      add(p + "self_attn.q_norm.weight", {hd}, 0.1f, 1.f);
      add(p + "self_attn.k_norm.weight", {hd}, 0.1f, 1.f);
    }
    add(p + "mlp.gate.weight", {s.n_experts, H}, lin(H), 0.f);
    if (qwen2) {
      add(p + "mlp.shared_expert.gate_proj.weight", {s.shared_inter, H}, lin(H), 0.f);
      add(p + "mlp.shared_expert.up_proj.weight", {s.shared_inter, H}, lin(H), 0.f);
      add(p + "mlp.shared_expert.down_proj.weight", {H, s.shared_inter}, lin(s.shared_inter), 0.f);
      add(p + "mlp.shared_expert_gate.weight", {1, H}, lin(H), 0.f);
    }
  }
  // Experts: one page-aligned block, every blob filled on all cores.
  const ExpertLayout L = expert_layout(H, s.inter, group);
  const size_t n_blobs = size_t(s.layers - s.first_dense) * s.n_experts;  // MoE layers' experts
  m->expert_bytes = n_blobs * L.blob_bytes;
  m->experts = static_cast<uint8_t*>(std::aligned_alloc(4096, (m->expert_bytes + 4095) / 4096 * 4096));
  if (!m->experts) return make_error("out of host memory for " + std::to_string(m->expert_bytes >> 20) + " MiB of experts");
  parallel(n_blobs, [&](size_t i) {
    uint8_t* blob = m->experts + i * L.blob_bytes;
    std::memset(blob, 0, L.blob_bytes);
    fill_q4_matrix(blob, L.gate, mix(seed ^ (3 * i + 1)));
    fill_q4_matrix(blob, L.up, mix(seed ^ (3 * i + 2)));
    fill_q4_matrix(blob, L.down, mix(seed ^ (3 * i + 3)));
  });
  // Indexed by model layer: none for the dense layers first.
  std::vector<const uint8_t*> blobs(size_t(s.layers) * s.n_experts, nullptr);
  for (size_t i = 0; i < n_blobs; ++i) blobs[size_t(s.first_dense) * s.n_experts + i] = m->experts + i * L.blob_bytes;
  auto files = ModelFiles::from_memory(cfg.dump(), std::move(tensors), group, std::move(blobs));
  if (!files) return make_error(files.error());
  m->files = *files;
  return Result<std::unique_ptr<SyntheticModel>>(std::move(m));
}

}  // namespace moe::bench
