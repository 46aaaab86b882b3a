#pragma once
// Protocol steps onto an engine's step (CpuEngine and CudaEngine take the
// same SeqInput / SeqOutput): the sequences an engine would refuse get their
// own error in the reply, the rest run together, and the engine's outputs
// become the reply's results. Shared by the CPU and CUDA backends.

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "engine/engine.h"
#include "protocol/messages.h"

namespace moe::worker {

// What the checks need to know of the engine.
struct EngineLimits {
  int vocab = 0;
  int max_context = 0;
  int kv_block_tokens = 0;
  int kv_blocks_free = 0;
  std::function<int(uint64_t)> seq_length;  // -1 when the engine holds no such sequence
};

struct TranslatedStep {
  protocol::StepReply reply;       // results sized to the request; refused ones carry their error
  std::vector<SeqInput> inputs;    // the sequences to run
  std::vector<size_t> result_of;   // [inputs]: index into reply.results
};

TranslatedStep translate_step(const protocol::StepRequest& req, const EngineLimits& limits);

// Writes the engine's outputs (or its error, for every input) into the
// reply; kv_tokens from seq_length for every result.
void fill_step_results(TranslatedStep& t, const Result<std::vector<SeqOutput>>& out, bool report_expert_usage,
                       const std::function<int(uint64_t)>& seq_length);

}  // namespace moe::worker
