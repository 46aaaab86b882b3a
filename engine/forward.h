#pragma once
// The batched forward pass: tokens of several sequences, each at its own
// positions, through every layer of the model. Keys and values of the new
// tokens are written into the KV cache; attention reads each sequence's own
// blocks. A token's result does not depend on the rest of the batch.
//
// Not thread-safe: one pass runs at a time (its scratch buffers are reused).

#include <cstdint>
#include <atomic>
#include <vector>

#include "engine/kv_cache.h"
#include "engine/weights.h"
#include "kernels/cpu/router.h"
#include "kernels/cpu/thread_pool.h"
#include "model/model_config.h"

namespace moe {

// What a test may observe inside one pass (all rows of the batch).
struct ForwardTrace {
  std::vector<std::vector<float>>
      hidden;  // [n_layers + 1][tokens * hidden]: entering layer l; last: after the final norm
  std::vector<std::vector<float>> mid;  // [n_layers][tokens * hidden]: after layer l's attention, before its MLP's norm
  std::vector<std::vector<float>> router_logits;  // [n_moe_layers][tokens * n_experts]
};

struct BatchSegment {
  int begin = 0, count = 0;              // rows [begin, begin + count) of the batch
  const int32_t* block_table = nullptr;  // the sequence's KV blocks
};

struct Batch {
  std::vector<int32_t> tokens;     // [T]
  std::vector<int32_t> positions;  // [T]
  std::vector<BatchSegment> segments;
  std::vector<int> logit_rows;  // rows whose logits are wanted, in output order
};

// The model's RoPE inverse frequencies [rot_dim / 2] (default, linear or
// YaRN scaling); *attention_factor receives the cos/sin scale (1 but YaRN).
std::vector<float> rope_frequencies(const ModelDesc& d, float* attention_factor);
// The attention's softmax scale: 1 / sqrt(the q.k width), times YaRN's
// mscale(factor, mscale_all_dim) squared for MLA (DeepSeek-V2). One rule for
// both engines.
float attention_softmax_scale(const ModelDesc& d);

// The model's routing rule for cpu::router_topk: its top-k, weight
// renormalisation and scale, and group-limited selection where it asks.
cpu::RouterParams router_params(const MoeConfig& mc);

class ForwardPass {
 public:
  ForwardPass(const ModelDesc& desc, const ModelWeights& w, KvCache& kv, cpu::ThreadPool& pool);

  // The KV layout the pass needs: heads per token, key and value widths.
  static int kv_heads(const ModelDesc& d);
  static int kv_qk_dim(const ModelDesc& d);
  static int kv_v_dim(const ModelDesc& d);

  // Runs the batch. logits: [logit_rows, vocab]. expert_counts (optional):
  // [segments, n_moe_layers * n_experts], incremented per routed token.
  void run(const Batch& b, float* logits, uint16_t* expert_counts, ForwardTrace* trace);
  // Bumped after each attention, MLP/MoE block and routed expert (nullptr:
  // none); from the pool's threads too, hence atomic.
  void set_progress(std::atomic<uint64_t>* progress) { progress_ = progress; }

 private:
  void advanced() {
    if (progress_) progress_->fetch_add(1, std::memory_order_relaxed);
  }
  void attention_gqa(const LayerWeights& lw, int layer, const Batch& b);
  void attention_mla(const LayerWeights& lw, int layer, const Batch& b);
  void attend(int layer, const Batch& b, const float* q, int qk_dim, int v_dim, float scale);
  void mlp_dense(const Mlp& m, int tokens, const float* x, float* out);
  void moe(const LayerWeights& lw, int moe_layer, const Batch& b, uint16_t* expert_counts,
           ForwardTrace* trace);

  const ModelDesc& d_;
  const ModelWeights& w_;
  KvCache& kv_;
  cpu::ThreadPool& pool_;
  std::vector<float> inv_freq_;  // [rot_dim / 2]
  float rope_scale_ = 1.0f;      // cos/sin factor (YaRN)
  float softmax_scale_ = 1.0f;

  // Scratch, [T, ...] each.
  std::vector<float> x_, h_, q_, k_, v_, att_, tmp_, tmp2_, mlp_out_;
  std::vector<int32_t> topk_ids_;
  std::vector<float> topk_w_, router_logits_, slot_out_;
  std::vector<int> row_segment_;
  std::atomic<uint64_t>* progress_ = nullptr;
};

}  // namespace moe
