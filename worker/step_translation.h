#pragma once
// Protocol steps onto an Engine's step (engine/engine.h): each sequence the
// engine's admission refuses gets its own error in the reply, the rest run
// together, and the engine's outputs become the reply's results. Only the
// conversion lives here; the checks are the engine's. Shared by the CPU and
// CUDA backends.

#include <functional>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "protocol/messages.h"

namespace moe::worker {

struct TranslatedStep {
  protocol::StepReply reply;       // results sized to the request; refused ones carry their error
  std::vector<SeqInput> inputs;    // the sequences to run
  std::vector<size_t> result_of;   // [inputs]: index into reply.results
};

TranslatedStep translate_step(const protocol::StepRequest& req, const Engine& engine);

// Writes the engine's outputs (or its error, for every input) into the
// reply; kv_tokens from the engine for every result.
void fill_step_results(TranslatedStep& t, const Result<std::vector<SeqOutput>>& out, bool report_expert_usage,
                       const Engine& engine);

// The hello of a backend over an engine: the model's fields, the backend's
// name, its KV capacity and context.
protocol::Hello engine_hello(const Engine& e, const std::string& model_id, const char* backend);

// One protocol step through an engine: the checks, the engine's step, the
// results, timing and KV counts. `on_outputs` sees the engine's outputs (or
// its error) when there were inputs to run.
protocol::StepReply run_engine_step(Engine& e, const protocol::StepRequest& req,
                                    const std::function<void(const Result<std::vector<SeqOutput>>&)>& on_outputs);

}  // namespace moe::worker
