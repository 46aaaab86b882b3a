#pragma once
// The model-dependent fields of a worker's hello, shared by every backend:
// vocabulary, EOS ids, step limits and the expert layout. Backends add their
// own name and KV capacity.

#include <string>

#include "model/model_config.h"
#include "protocol/messages.h"

namespace moe::worker {

protocol::Hello model_hello(const ModelDesc& d);

// The model id a worker announces: the folder's or the packed file's name.
std::string model_id_from_path(const std::string& model_path);

}  // namespace moe::worker
