#include "worker/model_hello.h"

#include "protocol/redis_schema.h"

namespace moe::worker {

protocol::Hello model_hello(const ModelDesc& d) {
  protocol::Hello h;
  h.role = protocol::Role::worker;
  h.max_batch_sequences = uint32_t(protocol::kMaxStepSequences);
  h.max_step_tokens = uint32_t(protocol::kMaxStepTokens);
  h.vocab_size = uint32_t(d.vocab_size);
  h.eos_ids = d.eos_token_ids;
  h.experts.n_layers = uint32_t(d.n_layers);
  h.experts.n_moe_layers = uint32_t(d.n_moe_layers());
  h.experts.n_experts = uint32_t(d.moe.n_experts);
  h.experts.top_k = uint32_t(d.moe.top_k);
  for (int l = 0; l < d.n_layers; ++l)
    if (d.moe_layer_index(l) >= 0) h.experts.moe_layers.push_back(uint16_t(l));
  return h;
}

int moe_index_of_layer(const ModelDesc& d, int model_layer) {
  if (model_layer < 0 || model_layer >= d.n_layers) return -1;
  return d.moe_layer_index(model_layer);
}

int model_layer_of_moe_index(const ModelDesc& d, int moe_index) {
  for (int l = 0; l < d.n_layers; ++l)
    if (d.moe_layer_index(l) == moe_index) return l;
  return -1;
}

std::string model_id_from_path(const std::string& model_path) { return protocol::redis_model_name(model_path); }

}  // namespace moe::worker
