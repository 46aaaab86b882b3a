#pragma once
// The model-dependent fields of a worker's hello, shared by every backend:
// vocabulary, EOS ids, step limits and the expert layout. Backends add their
// own name and KV capacity.

#include "model/model_config.h"
#include "protocol/messages.h"

namespace moe::worker {

protocol::Hello model_hello(const ModelDesc& d);

}  // namespace moe::worker
