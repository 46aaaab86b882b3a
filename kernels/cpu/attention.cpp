#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/matmul.h"

namespace moe::cpu {

static inline int64_t slot_index(const int32_t* block_table, int block_tokens, int pos) {
  return int64_t(block_table[pos / block_tokens]) * block_tokens + pos % block_tokens;
}

void kv_store(float* k_pool, float* v_pool, const int32_t* block_table, int block_tokens, int pos,
              const float* k, const float* v, int n_kv, int qk_dim, int v_dim) {
  const int64_t slot = slot_index(block_table, block_tokens, pos);
  std::memcpy(k_pool + slot * n_kv * qk_dim, k, sizeof(float) * n_kv * qk_dim);
  std::memcpy(v_pool + slot * n_kv * v_dim, v, sizeof(float) * n_kv * v_dim);
}

void kv_store(const KvRows& pool, const int32_t* block_table, int block_tokens, int pos, const float* k,
              const float* v, int n_kv, int qk_dim, int v_dim) {
  if (!kv_coded(pool.dtype)) {
    kv_store(pool.k, pool.v, block_table, block_tokens, pos, k, v, n_kv, qk_dim, v_dim);
    return;
  }
  const int64_t slot = slot_index(block_table, block_tokens, pos);
  for (int h = 0; h < n_kv; ++h) {
    const int64_t row = slot * n_kv + h;
    pool.k_scales[row] = kv_encode_row(pool.dtype, k + int64_t(h) * qk_dim, qk_dim, pool.k_codes + row * qk_dim);
    pool.v_scales[row] = kv_encode_row(pool.dtype, v + int64_t(h) * v_dim, v_dim, pool.v_codes + row * v_dim);
  }
}

// The causal softmax walk both row kinds share: key_score(row, q) gives a
// key's raw dot, add_value(row, w, out) adds w times its value row.
template <class KeyScore, class AddValue>
static void attend_rows(const float* q, int64_t q_stride, const PagedKv& kv, const int32_t* positions, float* out,
                        int64_t out_stride, int tokens, int n_heads, int n_kv, int qk_dim, int v_dim, float scale,
                        ThreadPool* pool, const KeyScore& key_score, const AddValue& add_value) {
  const int group = n_heads / n_kv;
  parallel_for(pool, int64_t(tokens) * n_heads, [&](int64_t task) {
    const int t = int(task / n_heads), h = int(task % n_heads), kvh = h / group;
    const int n_keys = positions[t] + 1;
    const float* qv = q + t * q_stride + int64_t(h) * qk_dim;
    std::vector<float> score(n_keys);
    float mx = -INFINITY;
    for (int j = 0; j < n_keys; ++j) {
      score[j] = key_score(slot_index(kv.block_table, kv.block_tokens, j) * n_kv + kvh, qv) * scale;
      mx = std::max(mx, score[j]);
    }
    float sum = 0.0f;
    for (int j = 0; j < n_keys; ++j) {
      score[j] = std::exp(score[j] - mx);
      sum += score[j];
    }
    const float inv = 1.0f / sum;
    float* o = out + t * out_stride + int64_t(h) * v_dim;
    std::fill(o, o + v_dim, 0.0f);
    for (int j = 0; j < n_keys; ++j)
      add_value(slot_index(kv.block_table, kv.block_tokens, j) * n_kv + kvh, score[j] * inv, o);
  });
}

void attention(const float* q, int64_t q_stride, const PagedKv& kv, const int32_t* positions,
               float* out, int64_t out_stride, int tokens, int n_heads, int n_kv, int qk_dim,
               int v_dim, float scale, ThreadPool* pool) {
  if (!kv_coded(kv.dtype)) {
    attend_rows(
        q, q_stride, kv, positions, out, out_stride, tokens, n_heads, n_kv, qk_dim, v_dim, scale, pool,
        [&](int64_t row, const float* qv) { return dot_f32(qv, kv.k + row * qk_dim, qk_dim); },
        [&](int64_t row, float w, float* o) { axpy_f32(w, kv.v + row * v_dim, o, v_dim); });
    return;
  }
  // Coded rows: a key's score is (q . codes) x its scale, a value's codes
  // are decoded into the sum with w x its scale; no row is decoded into a
  // copy. int8 codes convert in the loop (it vectorises), e4m3 ones through
  // their table.
  if (kv.dtype == KvDtype::int8) {
    attend_rows(
        q, q_stride, kv, positions, out, out_stride, tokens, n_heads, n_kv, qk_dim, v_dim, scale, pool,
        [&](int64_t row, const float* qv) {
          const int8_t* c = reinterpret_cast<const int8_t*>(kv.k_codes + row * qk_dim);
          float d = 0.0f;
          for (int i = 0; i < qk_dim; ++i) d += qv[i] * float(c[i]);
          return d * kv.k_scales[row];
        },
        [&](int64_t row, float w, float* o) {
          const int8_t* c = reinterpret_cast<const int8_t*>(kv.v_codes + row * v_dim);
          const float ws = w * kv.v_scales[row];
          for (int i = 0; i < v_dim; ++i) o[i] += ws * float(c[i]);
        });
    return;
  }
  const float* table = kv_code_table(kv.dtype).data();
  attend_rows(
      q, q_stride, kv, positions, out, out_stride, tokens, n_heads, n_kv, qk_dim, v_dim, scale, pool,
      [&](int64_t row, const float* qv) {
        const uint8_t* c = kv.k_codes + row * qk_dim;
        float d = 0.0f;
        for (int i = 0; i < qk_dim; ++i) d += qv[i] * table[c[i]];
        return d * kv.k_scales[row];
      },
      [&](int64_t row, float w, float* o) {
        const uint8_t* c = kv.v_codes + row * v_dim;
        const float ws = w * kv.v_scales[row];
        for (int i = 0; i < v_dim; ++i) o[i] += ws * table[c[i]];
      });
}

}  // namespace moe::cpu
