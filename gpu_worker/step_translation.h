#pragma once
// Protocol steps onto an engine's step (CpuEngine and CudaEngine take the
// same SeqInput / SeqOutput): the sequences an engine would refuse get their
// own error in the reply, the rest run together, and the engine's outputs
// become the reply's results. Shared by the CPU and CUDA backends.

#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "gpu_worker/model_hello.h"
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

// The hello of a backend over an engine (CpuEngine, CudaEngine): the
// model's fields, the backend's name, its KV capacity and context.
template <class Engine>
protocol::Hello engine_hello(const Engine& e, const std::string& model_id, const char* backend) {
  protocol::Hello h = model_hello(e.desc());
  h.model_id = model_id;
  h.backend = backend;
  h.instance = "moe-worker";
  h.kv_blocks_total = uint32_t(e.kv_blocks_total());
  h.kv_block_tokens = uint32_t(e.kv_block_tokens());
  h.max_context = uint32_t(e.max_context());
  return h;
}

// One protocol step through an engine: the checks, the engine's step, the
// results, timing and KV counts. `on_outputs` sees the engine's outputs (or
// its error) when there were inputs to run.
template <class Engine, class OnOutputs>
protocol::StepReply run_engine_step(Engine& e, const protocol::StepRequest& req, OnOutputs&& on_outputs) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  auto seq_length = [&e](uint64_t id) { return e.seq_length(id); };
  const EngineLimits lim{e.desc().vocab_size, e.max_context(), e.kv_block_tokens(), e.kv_blocks_free(), seq_length};
  TranslatedStep t = translate_step(req, lim);
  const auto t1 = Clock::now();
  if (!t.inputs.empty()) {
    auto out = e.step(std::span<const SeqInput>(t.inputs));
    on_outputs(out);
    fill_step_results(t, out, req.report_expert_usage, seq_length);
  } else {
    fill_step_results(t, std::vector<SeqOutput>{}, req.report_expert_usage, seq_length);
  }
  const auto t2 = Clock::now();
  protocol::StepReply& reply = t.reply;
  reply.timing.compute_us = uint32_t(std::chrono::duration_cast<std::chrono::microseconds>(t2 - t1).count());
  reply.timing.total_us = uint32_t(std::chrono::duration_cast<std::chrono::microseconds>(t2 - t0).count());
  reply.kv_blocks_free = uint32_t(e.kv_blocks_free());
  reply.kv_blocks_used = uint32_t(e.kv_blocks_total() - e.kv_blocks_free());
  return std::move(reply);
}

}  // namespace moe::worker
