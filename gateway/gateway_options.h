#pragma once
// moe-gateway's command line.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "model/result.h"

namespace moe::gw {

struct GatewayOptions {
  std::string model_path;             // --model: checkpoint folder or packed file
  std::vector<std::string> workers;   // --worker unix:PATH (repeatable): served at once
  std::string fallback_worker;        // --fallback-worker unix:PATH: served only while no --worker is up
  std::string host = "127.0.0.1";     // --host
  int port = 8080;                    // --port (0: ephemeral)
  std::string api_key;                // --api-key ("" → no authentication)
  size_t max_body_bytes = 1 << 20;    // --max-body-bytes
  std::string served_model_name;      // --served-model-name (default: the model's folder/file name)
  std::string redis_url;              // --redis (sessions, warm experts; "" → in-process)
  uint64_t request_timeout_ms = 30'000;    // --request-timeout-ms
  uint64_t keepalive_timeout_ms = 60'000;  // --keepalive-timeout-ms
  size_t max_write_queue_bytes = 1 << 20;  // --max-write-queue-bytes
  int max_step_tokens = 256;               // --max-step-tokens: tokens of one worker step
  // Expert prediction (docs/expert-prediction.md).
  bool predict = true;                     // --predict on|off
  bool grouped_batching = true;            // --grouped-batching on|off
  int lsh_bits = 12;                       // --lsh-bits
  uint64_t lsh_seed = 1;                   // --lsh-seed
  double predict_half_life = 500;          // --predict-half-life: in routing summaries
  int predict_experts = 8;                 // --predict-experts: per MoE layer
  int grouping_max_skips = 4;              // --grouping-max-skips
};

struct GatewayCommandLine {
  GatewayOptions options;
  bool help = false;
  bool version = false;
};

// Parses argv[1..]; an unknown option, a missing or malformed value is an
// error naming it. --model is required unless --help or --version is given.
Result<GatewayCommandLine> parse_gateway_args(const std::vector<std::string>& args);

// The --help text.
std::string gateway_usage();

}  // namespace moe::gw
