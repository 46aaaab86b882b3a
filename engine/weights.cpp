#include "engine/weights.h"

#include <cstring>

#include "kernels/cpu/matmul.h"

namespace moe {

void Linear::apply(const float* x, int64_t x_stride, float* y, int64_t y_stride, int tokens,
                   cpu::ThreadPool* pool) const {
  const float* b = bias.empty() ? nullptr : bias.data();
  if (f32)
    cpu::matmul_f32(x, x_stride, f32, b, y, y_stride, tokens, in, out, pool);
  else
    cpu::matmul_bf16(x, x_stride, bf16, b, y, y_stride, tokens, in, out, pool);
}

void Linear::row(int r, float* dst) const {
  if (f32) {
    std::memcpy(dst, f32 + int64_t(r) * in, sizeof(float) * in);
  } else {
    for (int i = 0; i < in; ++i) dst[i] = bf16_to_f32(bf16[int64_t(r) * in + i]);
  }
}

namespace {

class Loader {
 public:
  Loader(const ModelFiles& f, bool convert) : f_(f), convert_(convert) {}

  bool has(const std::string& name) const { return f_.find(name) != nullptr; }

  Status vec(const std::string& name, int n, std::vector<float>* out) const {
    const TensorView* t = f_.find(name);
    if (!t) return make_error("missing tensor '" + name + "'");
    if (t->numel() != n)
      return make_error("tensor '" + name + "' has " + std::to_string(t->numel()) +
                        " values, expected " + std::to_string(n));
    *out = to_f32(*t);
    return {};
  }

  // A matrix [out, in]; a bias `<prefix>.bias` is read when present.
  Status linear(const std::string& prefix, int out, int in, Linear* l) const {
    const std::string name = prefix + ".weight";
    const TensorView* t = f_.find(name);
    if (!t) return make_error("missing tensor '" + name + "'");
    if (t->shape.size() != 2 || t->shape[0] != out || t->shape[1] != in)
      return make_error("tensor '" + name + "' has shape " + shape_str(t->shape) + ", expected [" +
                        std::to_string(out) + ", " + std::to_string(in) + "]");
    l->out = out;
    l->in = in;
    if (t->dtype == DType::f32 && !convert_) {
      l->f32 = reinterpret_cast<const float*>(t->data);
    } else if (t->dtype == DType::bf16 && !convert_) {
      l->bf16 = reinterpret_cast<const uint16_t*>(t->data);
    } else if (t->dtype == DType::f32 || t->dtype == DType::bf16 || t->dtype == DType::f16) {
      l->owned = to_f32(*t);
      l->f32 = l->owned.data();
    } else {
      return make_error("tensor '" + name + "' has dtype " + dtype_name(t->dtype) +
                        ", expected a float type");
    }
    if (has(prefix + ".bias")) return vec(prefix + ".bias", out, &l->bias);
    return {};
  }

 private:
  static std::string shape_str(const std::vector<int64_t>& s) {
    std::string r = "[";
    for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
    return r + "]";
  }
  const ModelFiles& f_;
  bool convert_;
};

Status load_mlp(const Loader& L, const std::string& p, const char* gate, const char* up,
                const char* down, int hidden, int inter, Mlp* m) {
  MOE_TRY(L.linear(p + gate, inter, hidden, &m->gate));
  MOE_TRY(L.linear(p + up, inter, hidden, &m->up));
  MOE_TRY(L.linear(p + down, hidden, inter, &m->down));
  return {};
}

}  // namespace

size_t f32_weight_bytes(const ModelFiles& files) {
  const ModelDesc& d = files.desc();
  const size_t h = size_t(d.hidden_size);
  size_t n = size_t(d.vocab_size) * h * (d.tie_embeddings ? 1 : 2);
  for (int l = 0; l < d.n_layers; ++l) {
    if (d.attention == AttentionKind::mla) {
      const size_t qk = size_t(d.mla.qk_nope_head_dim + d.mla.qk_rope_head_dim);
      n += h * d.n_heads * qk + h * (d.mla.kv_lora_rank + d.mla.qk_rope_head_dim) +
           size_t(d.mla.kv_lora_rank) * d.n_heads * (d.mla.qk_nope_head_dim + d.mla.v_head_dim) +
           size_t(d.n_heads) * d.mla.v_head_dim * h;
    } else {
      n += h * d.head_dim * (2 * size_t(d.n_heads) + 2 * size_t(d.n_kv_heads));
    }
    if (d.layer_is_moe[size_t(l)])
      n += 3 * h *
               (size_t(d.moe.n_experts) * d.moe.expert_intermediate + d.moe.shared_intermediate) +
           h * d.moe.n_experts;
    else
      n += 3 * h * size_t(d.intermediate_size);
  }
  return n * sizeof(float);
}

Result<std::unique_ptr<ModelWeights>> load_weights(const ModelFiles& files, bool convert_f32,
                                                   bool use_q4) {
  const ModelDesc& d = files.desc();
  const Loader L(files, convert_f32);
  auto w = std::make_unique<ModelWeights>();
  const int H = d.hidden_size;
  w->experts_q4 = use_q4;
  if (use_q4) {
    if (!files.experts_q4()) return make_error("the model file has no INT4 experts");
    w->q4_layout = files.expert_layout();
    if (w->q4_layout.hidden != H || w->q4_layout.inter != d.moe.expert_intermediate)
      return make_error("INT4 expert layout does not match the model's hidden/expert sizes");
  }

  MOE_TRY(L.linear("model.embed_tokens", d.vocab_size, H, &w->embed));
  if (d.tie_embeddings || !L.has("lm_head.weight")) {
    MOE_TRY(L.linear("model.embed_tokens", d.vocab_size, H, &w->lm_head));
  } else {
    MOE_TRY(L.linear("lm_head", d.vocab_size, H, &w->lm_head));
  }
  MOE_TRY(L.vec("model.norm.weight", H, &w->final_norm));

  w->layers.resize(size_t(d.n_layers));
  for (int l = 0; l < d.n_layers; ++l) {
    LayerWeights& lw = w->layers[size_t(l)];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    MOE_TRY(L.vec(p + "input_layernorm.weight", H, &lw.attn_norm));
    MOE_TRY(L.vec(p + "post_attention_layernorm.weight", H, &lw.mlp_norm));

    const std::string a = p + "self_attn.";
    if (d.attention == AttentionKind::mla) {
      const MlaConfig& m = d.mla;
      const int qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
      if (m.q_lora_rank > 0) {
        MOE_TRY(L.linear(a + "q_a_proj", m.q_lora_rank, H, &lw.q_a));
        MOE_TRY(L.vec(a + "q_a_layernorm.weight", m.q_lora_rank, &lw.q_a_norm));
        MOE_TRY(L.linear(a + "q_b_proj", d.n_heads * qk, m.q_lora_rank, &lw.q_b));
      } else {
        MOE_TRY(L.linear(a + "q_proj", d.n_heads * qk, H, &lw.q));
      }
      MOE_TRY(
          L.linear(a + "kv_a_proj_with_mqa", m.kv_lora_rank + m.qk_rope_head_dim, H, &lw.kv_a));
      MOE_TRY(L.vec(a + "kv_a_layernorm.weight", m.kv_lora_rank, &lw.kv_a_norm));
      MOE_TRY(L.linear(a + "kv_b_proj", d.n_heads * (m.qk_nope_head_dim + m.v_head_dim),
                         m.kv_lora_rank, &lw.kv_b));
      MOE_TRY(L.linear(a + "o_proj", H, d.n_heads * m.v_head_dim, &lw.o));
    } else {
      const int hd = d.head_dim;
      MOE_TRY(L.linear(a + "q_proj", d.n_heads * hd, H, &lw.q));
      MOE_TRY(L.linear(a + "k_proj", d.n_kv_heads * hd, H, &lw.k));
      MOE_TRY(L.linear(a + "v_proj", d.n_kv_heads * hd, H, &lw.v));
      MOE_TRY(L.linear(a + "o_proj", H, d.n_heads * hd, &lw.o));
      if (d.qk_norm == QkNorm::per_head) {
        MOE_TRY(L.vec(a + "q_norm.weight", hd, &lw.q_norm));
        MOE_TRY(L.vec(a + "k_norm.weight", hd, &lw.k_norm));
      } else if (d.qk_norm == QkNorm::whole) {
        MOE_TRY(L.vec(a + "q_norm.weight", d.n_heads * hd, &lw.q_norm));
        MOE_TRY(L.vec(a + "k_norm.weight", d.n_kv_heads * hd, &lw.k_norm));
      }
    }

    lw.moe = d.layer_is_moe[size_t(l)];
    if (!lw.moe) {
      MOE_TRY(load_mlp(L, p + "mlp.", "gate_proj", "up_proj", "down_proj", H, d.intermediate_size,
                         &lw.dense));
      continue;
    }
    const MoeConfig& mc = d.moe;
    const bool mixtral = d.arch == Arch::mixtral;
    const std::string mp = p + (mixtral ? "block_sparse_moe." : "mlp.");
    MOE_TRY(L.linear(mp + "gate", mc.n_experts, H, &lw.router));
    lw.experts.resize(size_t(mc.n_experts));
    for (int e = 0; e < mc.n_experts; ++e) {
      Mlp& ex = lw.experts[size_t(e)];
      if (use_q4) {
        ex.q4 = files.expert_q4(l, e);
        if (!ex.q4)
          return make_error("missing INT4 expert " + std::to_string(e) + " of layer " +
                            std::to_string(l));
        continue;
      }
      const std::string ep = mp + "experts." + std::to_string(e) + ".";
      if (mixtral)
        MOE_TRY(load_mlp(L, ep, "w1", "w3", "w2", H, mc.expert_intermediate, &ex));
      else
        MOE_TRY(
            load_mlp(L, ep, "gate_proj", "up_proj", "down_proj", H, mc.expert_intermediate, &ex));
    }
    if (mc.shared_intermediate > 0) {
      const std::string sp =
          mp + (d.arch == Arch::deepseek_v2 ? "shared_experts." : "shared_expert.");
      MOE_TRY(load_mlp(L, sp, "gate_proj", "up_proj", "down_proj", H, mc.shared_intermediate,
                         &lw.shared));
      if (mc.shared_expert_gate)
        MOE_TRY(L.linear(mp + "shared_expert_gate", 1, H, &lw.shared_gate));
    }
  }
  return w;
}

}  // namespace moe
