#pragma once
// moe-worker's command line.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda_engine/engine_options.h"
#include "engine/cpu_engine.h"
#include "model/result.h"

namespace moe {
enum class BackendChoice { automatic, cpu, cuda };  // --backend (auto: cuda where it can run, else cpu)
template <>
struct ChoiceNames<BackendChoice> {
  static constexpr std::pair<const char*, BackendChoice> all[] = {
      {"auto", BackendChoice::automatic}, {"cpu", BackendChoice::cpu}, {"cuda", BackendChoice::cuda}};
};
}  // namespace moe

namespace moe::worker {

// The command line fills each layer's own options: the engines' as they
// take them, the server's here.
struct WorkerOptions {
  std::string model_path;   // --model: checkpoint folder or packed file
  std::string socket_path;  // --socket: Unix socket to listen on
  BackendChoice backend = BackendChoice::automatic;
  EngineOptions cpu;        // --threads, --kv-blocks
  // --vram-budget, --kv-blocks, --max-step-tokens, --expert-policy,
  // --prefetch, --dense-weights, --host-experts, --misses, --device; --threads as
  // the host's threads for missed experts.
  CudaEngineOptions cuda;
  size_t max_frame_bytes = 64u << 20;  // --max-frame-bytes
  std::string redis_url;               // --redis
  std::string redis_password_file;     // --redis-password-file
  int parent_pid = 0;                  // --parent-pid: exit when that process (the parent) is gone
  int stall_exit_s = 30;               // --stall-exit-s: a step without progress this long ends the process
  // --routing: "router" (the model's own), or a benchmark routing of the
  // cuda backend, "uniform" or "replay:FILE" (cuda.uniform_routing_seed /
  // cuda.routing_trace hold what it asks for).
  std::string routing = "router";
  std::string warm_profile;         // --warm-profile: fill the islands from this routing profile at start
  std::string save_profile;         // --save-profile: keep this worker's expert use in this file
  int save_profile_every_s = 60;    // --save-profile-every-s
  bool device_given = false;        // --device (cuda.device): refused with the cpu backend
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
