#include "engine/forward.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/activation.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/router.h"

namespace moe {

namespace {

template <typename T>
T* sized(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

double yarn_mscale(double scale, double m) {
  return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
}

}  // namespace

int ForwardPass::kv_heads(const ModelDesc& d) {
  return d.attention == AttentionKind::mla ? d.n_heads : d.n_kv_heads;
}
int ForwardPass::kv_qk_dim(const ModelDesc& d) {
  return d.attention == AttentionKind::mla ? d.mla.qk_nope_head_dim + d.mla.qk_rope_head_dim
                                           : d.head_dim;
}
int ForwardPass::kv_v_dim(const ModelDesc& d) {
  return d.attention == AttentionKind::mla ? d.mla.v_head_dim : d.head_dim;
}

cpu::RouterParams router_params(const MoeConfig& mc) {
  cpu::RouterParams rp;
  rp.n_experts = mc.n_experts;
  rp.top_k = mc.top_k;
  rp.renormalize = mc.norm_topk_prob;
  rp.scale = mc.routed_scaling;
  if (mc.topk_method == "group_limited_greedy") {
    rp.n_group = mc.n_group;
    rp.topk_group = mc.topk_group;
  }
  return rp;
}

std::vector<float> rope_frequencies(const ModelDesc& d, float* attention_factor) {
  const bool mla = d.attention == AttentionKind::mla;
  const int rot_dim = mla ? d.mla.qk_rope_head_dim : d.head_dim;
  const RopeConfig& r = d.rope;
  *attention_factor = 1.0f;
  if (r.type == "yarn") {
    const int orig = r.original_max_position > 0 ? r.original_max_position : d.max_position;
    return cpu::rope_inv_freq_yarn(r.theta, rot_dim, r.factor, orig, r.beta_fast, r.beta_slow, r.mscale,
                                   r.mscale_all_dim, attention_factor);
  }
  // "dynamic" equals the default table up to the original context, which
  // the engine never exceeds (max_context is max_position).
  std::vector<float> inv = cpu::rope_inv_freq_default(r.theta, rot_dim);
  if (r.type == "linear")
    for (float& f : inv) f /= r.factor;
  return inv;
}

float attention_softmax_scale(const ModelDesc& d) {
  float scale = 1.0f / std::sqrt(float(ForwardPass::kv_qk_dim(d)));
  const RopeConfig& r = d.rope;
  if (d.attention == AttentionKind::mla && r.type == "yarn" && r.mscale_all_dim != 0.0f) {
    const float m = float(yarn_mscale(r.factor, r.mscale_all_dim));
    scale *= m * m;
  }
  return scale;
}

ForwardPass::ForwardPass(const ModelDesc& desc, const ModelWeights& w, KvCache& kv,
                         cpu::ThreadPool& pool)
    : d_(desc), w_(w), kv_(kv), pool_(pool) {
  inv_freq_ = rope_frequencies(d_, &rope_scale_);
  softmax_scale_ = attention_softmax_scale(d_);
}

void ForwardPass::attend(int layer, const Batch& b, const float* q, int qk_dim, int v_dim,
                         float scale) {
  const int nh = d_.n_heads, nkv = kv_heads(d_), T = int(b.tokens.size());
  float* out = att_.data();
  const cpu::KvRows rows = kv_.rows(layer);
  pool_.parallel_for(T, [&](int64_t t) {
    const BatchSegment& s = b.segments[size_t(row_segment_[size_t(t)])];
    const cpu::PagedKv kv{rows.k,       rows.v,       s.block_table, kv_.block_tokens(), rows.dtype,
                          rows.k_codes, rows.v_codes, rows.k_scales, rows.v_scales};
    cpu::attention(q + t * nh * qk_dim, nh * qk_dim, kv, &b.positions[size_t(t)],
                   out + t * nh * v_dim, nh * v_dim, 1, nh, nkv, qk_dim, v_dim, scale, nullptr);
  });
}

void ForwardPass::attention_gqa(const LayerWeights& lw, int layer, const Batch& b) {
  const int T = int(b.tokens.size()), nh = d_.n_heads, nkv = d_.n_kv_heads, hd = d_.head_dim;
  float* q = sized(q_, size_t(T) * nh * hd);
  float* k = sized(k_, size_t(T) * nkv * hd);
  float* v = sized(v_, size_t(T) * nkv * hd);
  lw.q.apply(h_.data(), q, T, &pool_);
  lw.k.apply(h_.data(), k, T, &pool_);
  lw.v.apply(h_.data(), v, T, &pool_);
  if (d_.qk_norm == QkNorm::per_head) {
    cpu::rmsnorm_heads(q, nh * hd, lw.q_norm.data(), T, nh, hd, d_.rms_eps);
    cpu::rmsnorm_heads(k, nkv * hd, lw.k_norm.data(), T, nkv, hd, d_.rms_eps);
  } else if (d_.qk_norm == QkNorm::whole) {
    cpu::rmsnorm(q, lw.q_norm.data(), q, T, nh * hd, d_.rms_eps);
    cpu::rmsnorm(k, lw.k_norm.data(), k, T, nkv * hd, d_.rms_eps);
  }
  cpu::rope_neox(q, nh * hd, hd, b.positions.data(), T, nh, hd, inv_freq_.data(), rope_scale_);
  cpu::rope_neox(k, nkv * hd, hd, b.positions.data(), T, nkv, hd, inv_freq_.data(), rope_scale_);
  for (int t = 0; t < T; ++t) {
    const BatchSegment& s = b.segments[size_t(row_segment_[size_t(t)])];
    cpu::kv_store(kv_.rows(layer), s.block_table, kv_.block_tokens(),
                  b.positions[size_t(t)], k + size_t(t) * nkv * hd, v + size_t(t) * nkv * hd, nkv,
                  hd, hd);
  }
  sized(att_, size_t(T) * nh * hd);
  attend(layer, b, q, hd, hd, softmax_scale_);
}

void ForwardPass::attention_mla(const LayerWeights& lw, int layer, const Batch& b) {
  const MlaConfig& m = d_.mla;
  const int T = int(b.tokens.size()), nh = d_.n_heads;
  const int nope = m.qk_nope_head_dim, rope = m.qk_rope_head_dim, qk = nope + rope,
            vd = m.v_head_dim;
  const int rank = m.kv_lora_rank, kva_w = rank + rope, kvb_w = nope + vd;
  float* q = sized(q_, size_t(T) * nh * qk);
  if (lw.q.present()) {
    lw.q.apply(h_.data(), q, T, &pool_);
  } else {
    float* qa = sized(tmp_, size_t(T) * m.q_lora_rank);
    lw.q_a.apply(h_.data(), qa, T, &pool_);
    cpu::rmsnorm(qa, lw.q_a_norm.data(), qa, T, m.q_lora_rank, d_.rms_eps);
    lw.q_b.apply(qa, q, T, &pool_);
  }
  // Compressed KV [T, rank + rope]: the latent (normalised, expanded by
  // kv_b per head) and one rotary key shared by all heads.
  float* kva = sized(tmp2_, size_t(T) * kva_w);
  lw.kv_a.apply(h_.data(), kva, T, &pool_);
  float* latent = sized(mlp_out_, size_t(T) * rank);
  cpu::rmsnorm(kva, kva_w, lw.kv_a_norm.data(), latent, rank, T, rank, d_.rms_eps);
  float* kvb = sized(tmp_, size_t(T) * nh * kvb_w);
  lw.kv_b.apply(latent, kvb, T, &pool_);

  cpu::rope_interleaved(q + nope, nh * qk, qk, b.positions.data(), T, nh, rope, inv_freq_.data(),
                        rope_scale_);
  cpu::rope_interleaved(kva + rank, kva_w, 0, b.positions.data(), T, 1, rope, inv_freq_.data(),
                        rope_scale_);

  float* k = sized(k_, size_t(nh) * qk);
  float* v = sized(v_, size_t(nh) * vd);
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < nh; ++h) {
      const float* src = kvb + (size_t(t) * nh + h) * kvb_w;
      std::memcpy(k + size_t(h) * qk, src, sizeof(float) * nope);
      std::memcpy(k + size_t(h) * qk + nope, kva + size_t(t) * kva_w + rank, sizeof(float) * rope);
      std::memcpy(v + size_t(h) * vd, src + nope, sizeof(float) * vd);
    }
    const BatchSegment& s = b.segments[size_t(row_segment_[size_t(t)])];
    cpu::kv_store(kv_.rows(layer), s.block_table, kv_.block_tokens(),
                  b.positions[size_t(t)], k, v, nh, qk, vd);
  }
  sized(att_, size_t(T) * nh * vd);
  attend(layer, b, q, qk, vd, softmax_scale_);
}

void ForwardPass::mlp_dense(const Mlp& m, int T, const float* x, float* out) {
  const int I = m.gate.out;
  float* g = sized(tmp_, size_t(T) * I);
  float* u = sized(tmp2_, size_t(T) * I);
  m.gate.apply(x, g, T, &pool_);
  m.up.apply(x, u, T, &pool_);
  cpu::silu_mul(g, u, g, int64_t(T) * I);
  m.down.apply(g, out, T, &pool_);
}

void ForwardPass::moe(const LayerWeights& lw, int moe_layer, const Batch& b,
                      uint16_t* expert_counts, ForwardTrace* trace) {
  const MoeConfig& mc = d_.moe;
  const int T = int(b.tokens.size()), H = d_.hidden_size, E = mc.n_experts, K = mc.top_k;
  float* logits = sized(router_logits_, size_t(T) * E);
  lw.router.apply(h_.data(), logits, T, &pool_);
  if (trace) trace->router_logits.emplace_back(logits, logits + size_t(T) * E);

  const cpu::RouterParams rp = router_params(mc);
  int32_t* ids = sized(topk_ids_, size_t(T) * K);
  float* wts = sized(topk_w_, size_t(T) * K);
  cpu::router_topk(logits, T, rp, ids, wts);

  // Slots (token, j) grouped by expert, in token order.
  std::vector<std::vector<int>> slots(static_cast<size_t>(E));
  for (int i = 0; i < T * K; ++i) slots[size_t(ids[i])].push_back(i);
  if (expert_counts) {
    const size_t stride = size_t(d_.n_moe_layers()) * E;
    for (int i = 0; i < T * K; ++i)
      ++expert_counts[size_t(row_segment_[size_t(i / K)]) * stride + size_t(moe_layer) * E +
                      ids[i]];
  }
  std::vector<int> active;
  for (int e = 0; e < E; ++e)
    if (!slots[size_t(e)].empty()) active.push_back(e);
  // Busiest experts first, so that a long one does not start last.
  std::stable_sort(active.begin(), active.end(),
                   [&](int a, int c) { return slots[size_t(a)].size() > slots[size_t(c)].size(); });

  float* slot_out = sized(slot_out_, size_t(T) * K * H);
  const float* h = h_.data();
  pool_.parallel_for(int64_t(active.size()), [&](int64_t ai) {
    const int e = active[size_t(ai)];
    const Mlp& ex = lw.experts[size_t(e)];
    const std::vector<int>& rows = slots[size_t(e)];
    const int n = int(rows.size());
    if (ex.q4) {
      const ExpertLayout& L = w_.q4_layout;
      std::vector<float> g(size_t(L.inter)), u(size_t(L.inter));
      for (int r : rows) {
        const float* xin = h + size_t(r / K) * H;
        q4_matvec(ex.q4, L.gate, xin, g.data());
        q4_matvec(ex.q4, L.up, xin, u.data());
        cpu::silu_mul(g.data(), u.data(), g.data(), L.inter);
        q4_matvec(ex.q4, L.down, g.data(), slot_out + size_t(r) * H);
      }
      advanced();
      return;
    }
    const int I = ex.gate.out;
    std::vector<float> xin(size_t(n) * H), g(size_t(n) * I), u(size_t(n) * I), y(size_t(n) * H);
    for (int i = 0; i < n; ++i)
      std::memcpy(&xin[size_t(i) * H], h + size_t(rows[size_t(i)] / K) * H, sizeof(float) * H);
    ex.gate.apply(xin.data(), g.data(), n, nullptr);
    ex.up.apply(xin.data(), u.data(), n, nullptr);
    cpu::silu_mul(g.data(), u.data(), g.data(), int64_t(n) * I);
    ex.down.apply(g.data(), y.data(), n, nullptr);
    for (int i = 0; i < n; ++i)
      std::memcpy(slot_out + size_t(rows[size_t(i)]) * H, &y[size_t(i) * H], sizeof(float) * H);
    advanced();  // an expert done: a large model's layer is many of these
  });

  float* out = sized(mlp_out_, size_t(T) * H);
  for (int t = 0; t < T; ++t) {
    float* o = out + size_t(t) * H;
    std::fill(o, o + H, 0.0f);
    for (int j = 0; j < K; ++j) {
      const float wj = wts[t * K + j];
      const float* s = slot_out + (size_t(t) * K + j) * H;
      for (int i = 0; i < H; ++i) o[i] += wj * s[i];
    }
  }
  if (lw.shared.gate.present()) {
    std::vector<float> sh(size_t(T) * H);
    mlp_dense(lw.shared, T, h, sh.data());
    std::vector<float> gate(size_t(T), 1.0f);
    if (lw.shared_gate.present()) {
      lw.shared_gate.apply(h, gate.data(), T, nullptr);
      for (float& g : gate) g = cpu::sigmoid(g);
    }
    for (int t = 0; t < T; ++t)
      for (int i = 0; i < H; ++i) out[size_t(t) * H + i] += gate[size_t(t)] * sh[size_t(t) * H + i];
  }
}

void ForwardPass::run(const Batch& b, float* logits, uint16_t* expert_counts, ForwardTrace* trace) {
  const int T = int(b.tokens.size()), H = d_.hidden_size;
  row_segment_.assign(size_t(T), 0);
  for (size_t s = 0; s < b.segments.size(); ++s)
    for (int i = 0; i < b.segments[s].count; ++i)
      row_segment_[size_t(b.segments[s].begin + i)] = int(s);

  float* x = sized(x_, size_t(T) * H);
  for (int t = 0; t < T; ++t) w_.embed.row(b.tokens[size_t(t)], x + size_t(t) * H);
  if (trace) {
    trace->hidden.clear();
    trace->mid.clear();
    trace->router_logits.clear();
  }

  for (int l = 0; l < d_.n_layers; ++l) {
    const LayerWeights& lw = w_.layers[size_t(l)];
    if (trace) trace->hidden.emplace_back(x, x + size_t(T) * H);
    float* h = sized(h_, size_t(T) * H);
    cpu::rmsnorm(x, lw.attn_norm.data(), h, T, H, d_.rms_eps);
    if (d_.attention == AttentionKind::mla)
      attention_mla(lw, l, b);
    else
      attention_gqa(lw, l, b);
    const int att_w = d_.n_heads * kv_v_dim(d_);
    float* o = sized(mlp_out_, size_t(T) * H);
    lw.o.apply(att_.data(), att_w, o, H, T, &pool_);
    for (size_t i = 0; i < size_t(T) * H; ++i) x[i] += o[i];
    advanced();
    if (trace) trace->mid.emplace_back(x, x + size_t(T) * H);

    cpu::rmsnorm(x, lw.mlp_norm.data(), h, T, H, d_.rms_eps);
    if (lw.moe) {
      moe(lw, d_.moe_layer_index(l), b, expert_counts, trace);
    } else {
      float* out = sized(mlp_out_, size_t(T) * H);
      mlp_dense(lw.dense, T, h, out);
    }
    for (size_t i = 0; i < size_t(T) * H; ++i) x[i] += mlp_out_[i];
    advanced();
  }

  float* h = sized(h_, size_t(T) * H);
  if (trace) {
    cpu::rmsnorm(x, w_.final_norm.data(), h, T, H, d_.rms_eps);
    trace->hidden.emplace_back(h, h + size_t(T) * H);
  }
  const int R = int(b.logit_rows.size());
  if (R == 0 || !logits) return;
  for (int r = 0; r < R; ++r)
    cpu::rmsnorm(x + size_t(b.logit_rows[size_t(r)]) * H, w_.final_norm.data(), h + size_t(r) * H,
                 1, H, d_.rms_eps);
  w_.lm_head.apply(h, logits, R, &pool_);
}

}  // namespace moe
