#pragma once
// The one internal description of a model, built from a checkpoint's
// config.json (hub spelling or transformers-5 spelling). Every engine (CPU,
// CUDA) and tool reads this, never config.json itself.

#include <cstdint>
#include <string>
#include <vector>

#include "model/result.h"

namespace moe {

enum class Arch { qwen2_moe, qwen3_moe, mixtral, olmoe, qwen2, deepseek_v2 };

// How queries and keys are normalised after their projection.
enum class QkNorm {
  none,
  per_head,  // RMSNorm over each head's head_dim (Qwen3-MoE): weight [head_dim]
  whole,     // RMSNorm over the whole projection (OLMoE): weight [n_heads*head_dim]
};

enum class AttentionKind {
  gqa,  // grouped-query attention (n_kv_heads divides n_heads)
  mla,  // DeepSeek-V2 multi-head latent attention
};

struct RopeConfig {
  float theta = 10000.0f;
  std::string type = "default";  // "default", "linear", "dynamic", "yarn"
  float factor = 1.0f;
  int original_max_position = 0;               // yarn / dynamic
  float beta_fast = 32.0f, beta_slow = 1.0f;   // yarn
  float mscale = 1.0f, mscale_all_dim = 0.0f;  // yarn (DeepSeek)
};

struct MlaConfig {
  int q_lora_rank = 0;  // 0: q_proj is one dense matrix (DeepSeek-V2-Lite)
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
};

struct MoeConfig {
  int n_experts = 0;                   // routed experts per MoE layer
  int top_k = 0;                       // experts each token is routed to
  bool norm_topk_prob = false;         // renormalise the top-k weights to sum to 1
  int expert_intermediate = 0;         // moe_intermediate_size
  int n_shared_experts = 0;            // DeepSeek: shared experts fused in one MLP of
                                       // n_shared_experts * expert_intermediate
  int shared_intermediate = 0;         // width of the shared MLP (0: none)
  bool shared_expert_gate = false;     // Qwen2-MoE: sigmoid(gate(x)) scales shared out
  float routed_scaling = 1.0f;         // DeepSeek routed_scaling_factor
  std::string topk_method = "greedy";  // DeepSeek: "greedy" | "group_limited_greedy"
  int n_group = 1, topk_group = 1;
};

struct ModelDesc {
  Arch arch = Arch::qwen3_moe;
  std::string model_type;  // as in config.json
  int vocab_size = 0;
  int hidden_size = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;           // per-head q/k/v width (GQA)
  int intermediate_size = 0;  // dense MLP width (dense layers, Qwen2)
  float rms_eps = 1e-6f;
  bool tie_embeddings = false;
  bool qkv_bias = false;  // q/k/v projections carry a bias (Qwen2, Qwen2-MoE)
  QkNorm qk_norm = QkNorm::none;
  AttentionKind attention = AttentionKind::gqa;
  MlaConfig mla;
  RopeConfig rope;
  MoeConfig moe;
  std::vector<bool> layer_is_moe;  // [n_layers]: false where the layer has a dense MLP
  int max_position = 0;
  std::vector<int32_t> eos_token_ids;  // from config.json / generation_config.json
  int32_t bos_token_id = -1;           // -1: none

  int n_moe_layers() const;
  // Index of layer `layer` among MoE layers only, or -1 for a dense layer.
  int moe_layer_index(int layer) const;
};

// Parses `<dir>/config.json` (and generation_config.json where present, for
// EOS ids). An unsupported model_type or a missing key is an error naming it.
[[nodiscard]] Result<ModelDesc> load_model_desc(const std::string& dir);
// The same from the text of a config.json (tests, packed files).
[[nodiscard]] Result<ModelDesc> parse_model_desc(const std::string& config_json_text);
// The same, adding the EOS ids (and a BOS id config.json lacks) of a
// generation_config.json text ("" when there is none).
[[nodiscard]] Result<ModelDesc> parse_model_desc(const std::string& config_json_text,
                                                 const std::string& generation_config_text);

const char* arch_name(Arch a);

}  // namespace moe
