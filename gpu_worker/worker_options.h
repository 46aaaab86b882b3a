#pragma once
// moe-worker's command line.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "model/result.h"

namespace moe::worker {

struct WorkerOptions {
  std::string model_path;   // --model: checkpoint folder or packed file
  std::string socket_path;  // --socket: Unix socket to listen on
  std::string backend = "auto";  // --backend auto|cpu|cuda (auto: cuda where it can run, else cpu)
  int threads = 0;              // --threads (0: all cores)
  int kv_blocks = 0;            // --kv-blocks (0: the backend's default)
  size_t max_frame_bytes = 64u << 20;  // --max-frame-bytes
  uint64_t vram_budget_bytes = 0;      // --vram-budget (cuda only; 0: free memory less a margin)
  std::string redis_url;               // --redis
  std::string redis_password_file;     // --redis-password-file
  int parent_pid = 0;                  // --parent-pid: exit when that process (the parent) is gone
  int stall_exit_s = 30;               // --stall-exit-s: a step without progress this long ends the process
  int max_step_tokens = 512;           // --max-step-tokens (cuda: tokens per forward pass)
  std::string expert_policy = "ours";  // --expert-policy lru|lfu|ours (cuda)
  bool prefetch = true;                // --prefetch on|off (cuda, under a budget)
  std::string dense_weights = "auto";  // --dense-weights auto|bf16|int8|int4 (cuda)
  std::string host_experts = "auto";   // --host-experts auto|on|off (cuda, under a budget)
  std::string misses = "stream";       // --misses stream|copy (cuda, under a budget)
};

struct WorkerCommandLine {
  WorkerOptions options;
  bool help = false;
  bool version = false;
};

// Parses argv[1..]. --model and --socket are required unless --help/--version.
Result<WorkerCommandLine> parse_worker_args(const std::vector<std::string>& args);
// "24G", "512M", "1048576" -> bytes.
Result<uint64_t> parse_byte_size(const std::string& text);
std::string worker_usage();

}  // namespace moe::worker
