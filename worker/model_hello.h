#pragma once
// The model-dependent fields of a worker's hello, shared by every backend:
// vocabulary, EOS ids, step limits and the expert layout. Backends add their
// own name and KV capacity.

#include <string>

#include "model/model_config.h"
#include "protocol/messages.h"

namespace moe::worker {

protocol::Hello model_hello(const ModelDesc& d);

// Expert references on the wire name the model's layer (docs/protocol.md);
// residency maps count MoE layers. -1 when the layer has no experts / the
// index is out of range.
int moe_index_of_layer(const ModelDesc& d, int model_layer);
int model_layer_of_moe_index(const ModelDesc& d, int moe_index);

// The model id a worker announces: the folder's or the packed file's name,
// as the Redis schema names the model (protocol::redis_model_name), so that
// the worker's hello and the gateway's keys agree by construction.
std::string model_id_from_path(const std::string& model_path);

}  // namespace moe::worker
