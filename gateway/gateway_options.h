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
  std::vector<std::string> worker_args;  // --worker-arg ARG (repeatable): for the gateway's own worker
  // --worker-wait-s: how long no worker may be ready before what waits for
  // one ends with the reason and new requests get 503 (0: for ever).
  // 120: a 61 GB checkpoint folder took 43 s to load.
  uint64_t worker_wait_s = 120;
  std::string host = "127.0.0.1";     // --host
  int port = 8080;                    // --port (0: ephemeral)
  // Authentication: any of these keys opens every endpoint but /health.
  std::vector<std::string> api_keys;  // --api-key KEY (repeatable)
  std::vector<std::string> api_key_files;  // --api-key-file FILE (repeatable): one key a line
  // --trusted-proxy ADDR (repeatable): a balancer whose X-Forwarded-For names
  // the client (docs/scale-out.md); a keyless caller is then that address.
  std::vector<std::string> trusted_proxies;
  size_t max_body_bytes = 1 << 20;    // --max-body-bytes
  std::string served_model_name;      // --served-model-name (default: the model's folder/file name)
  std::string redis_url;              // --redis (sessions, warm experts; "" → in-process)
  std::string redis_password_file;    // --redis-password-file: the password (or user:password) for Redis AUTH
  uint64_t request_timeout_ms = 30'000;    // --request-timeout-ms
  uint64_t keepalive_timeout_ms = 60'000;  // --keepalive-timeout-ms
  uint64_t write_timeout_ms = 30'000;      // --write-timeout-ms
  uint64_t stream_ping_ms = 15'000;        // --stream-ping-ms (0: none)
  size_t max_write_queue_bytes = 1 << 20;  // --max-write-queue-bytes
  size_t max_connections = 0;              // --max-connections (0: from the descriptor limit)
  int max_step_tokens = 256;               // --max-step-tokens: tokens of one worker step
  // What one request may cost (docs/security.md).
  int64_t max_request_tokens = int64_t(1) << 20;   // --max-request-tokens: choices × max_tokens
  int64_t max_logprob_entries = int64_t(1) << 18;  // --max-logprob-entries: of a whole response
  size_t max_response_bytes = size_t(64) << 20;    // --max-response-bytes: of a whole response
  size_t max_held_response_bytes = size_t(512) << 20;  // --max-held-response-bytes: of all together
  // Admission (docs/security.md).
  int max_caller_sequences = 256;  // --max-caller-sequences: per caller, in flight
  int max_waiting = 1024;          // --max-waiting: sequences waiting, everyone together
  // Sessions.
  size_t session_max_messages = 64;               // --session-max-messages
  size_t session_max_bytes = size_t(256) << 10;   // --session-max-bytes
  size_t session_memory_bytes = size_t(64) << 20; // --session-memory-bytes
  uint64_t session_ttl_s = 24 * 3600;             // --session-ttl-s
  // Expert prediction (docs/expert-prediction.md).
  // Off unless asked: through the gateway at the real shapes neither paid
  // (docs/expert-prediction.md, "Switched off by default").
  bool predict = false;                    // --predict on|off
  bool experts_page = true;                // --experts-page on|off
  bool grouped_batching = false;           // --grouped-batching on|off
  int lsh_bits = 12;                       // --lsh-bits
  uint64_t lsh_seed = 1;                   // --lsh-seed
  double predict_half_life = 500;          // --predict-half-life: in routing summaries
  int predict_experts = 8;                 // --predict-experts: per MoE layer
  int grouping_max_skips = 4;              // --grouping-max-skips
  // Operations (docs/operations.md).
  std::string keys_file;                   // --keys-file: name, key digest, priority, rate per key
  bool request_priority = false;           // --request-priority on|off: the body's `priority` honoured
  uint64_t priority_max_wait_ms = 30'000;  // --priority-max-wait-ms: the starvation bound (0: none)
  int overload_queue_depth = 0;            // --overload-queue-depth (0: off)
  uint64_t overload_wait_ms = 0;           // --overload-wait-ms (0: off)
  uint64_t stats_interval_ms = 1000;       // --stats-interval-ms: workers' stats and card health (0: never)
  int thermal_hot_c = 87;                  // --thermal-hot-c
};

struct GatewayCommandLine {
  GatewayOptions options;
  bool help = false;
  bool version = false;
};

// Parses argv[1..]; an unknown option, a missing or malformed value is an
// error naming it. --model is required unless --help or --version is given.
Result<GatewayCommandLine> parse_gateway_args(const std::vector<std::string>& args);

// Every key the options name: --api-key values, then the keys of each
// --api-key-file (one a line; blank lines and lines starting with '#'
// skipped), then the MOE_API_KEY environment value if `env_key` is set. An
// unreadable or keyless file is an error.
Result<std::vector<std::string>> collect_api_keys(const GatewayOptions& o, const char* env_key);

// The --help text.
std::string gateway_usage();

}  // namespace moe::gw
