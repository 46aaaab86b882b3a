// moe-worker: the inference worker, on the CPU backend or (when built with
// the CUDA toolkit) the CUDA backend, behind the same Backend interface.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "worker/backend.h"
#include "worker/redis_state.h"
#include "worker/warm_profile.h"
#include "worker/worker_options.h"
#include "worker/worker_server.h"
#include "moe_version.h"

namespace {

// The write end of the self-pipe SIGTERM/SIGINT wake the server through; a
// signal handler can reach nothing else.
int g_stop_pipe_write = -1;

void on_stop_signal(int) {
  const char c = 1;
  [[maybe_unused]] ssize_t n = ::write(g_stop_pipe_write, &c, 1);
  // A worker stuck in a step never reads the pipe: SIGALRM's default action
  // ends it 15 s from now if the orderly way has not.
  ::alarm(15);
}

}  // namespace

int main(int argc, char** argv) {
  // Every kernel's module is loaded with the CUDA context, not at its first
  // launch, so that what the process holds on the device is measured whole
  // before the arena is sized (docs/cuda-worker.md). Set before any CUDA call.
  ::setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  auto cl = moe::worker::parse_worker_args(std::vector<std::string>(argv + 1, argv + argc));
  if (!cl.ok()) {
    std::fprintf(stderr, "moe-worker: %s\n", cl.error().c_str());
    return 2;
  }
  if (cl->help) {
    std::printf("moe-worker %s\n%s", MOE_VERSION, moe::worker::worker_usage().c_str());
    std::printf("cuda backend: %s\n", moe::worker::cuda_backend_built() ? "built" : "not built (no CUDA toolkit at build time)");
    return 0;
  }
  if (cl->version) {
    std::printf("moe-worker %s\n", MOE_VERSION);
    return 0;
  }
  const moe::worker::WorkerOptions& o = cl->options;
  if (o.parent_pid > 0) {
    // The kernel tells us when the parent goes (kill -9 included); if it
    // went before this line, getppid() says so.
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != o.parent_pid) {
      std::fprintf(stderr, "moe-worker: the parent process %d is already gone\n", o.parent_pid);
      return 1;
    }
  }
  if (o.redis_url.empty()) std::fprintf(stderr, "moe-worker: no --redis; expert state stays in this process\n");

  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    std::perror("moe-worker: pipe");
    return 1;
  }
  g_stop_pipe_write = pipe_fds[1];
  struct sigaction sa{};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  moe::BackendChoice backend_kind = o.backend;
  if (backend_kind == moe::BackendChoice::automatic) {
    std::string device;
    std::string why_not = moe::worker::cuda_unavailable_reason(o.cuda.device, &device);
    // A chosen device that cannot serve where devices exist (an index this
    // machine lacks) is an error, not a reason to serve on the CPU.
    if (o.device_given && !why_not.empty() && moe::worker::cuda_devices() > 0) {
      std::fprintf(stderr, "moe-worker: %s\n", why_not.c_str());
      return 2;
    }
    // A model the CUDA engine does not run with these options (DeepSeek-V2 236B's compressed
    // query, latent rows in int8) is served on the CPU.
    if (why_not.empty()) why_not = moe::worker::cuda_model_refusal(o.model_path, o.cuda);
    backend_kind = why_not.empty() ? moe::BackendChoice::cuda : moe::BackendChoice::cpu;
    if (why_not.empty())
      std::fprintf(stderr, "moe-worker: the CUDA backend, on %s\n", device.c_str());
    else
      std::fprintf(stderr, "moe-worker: the CPU backend: %s\n", why_not.c_str());
  }
  if (o.backend == moe::BackendChoice::cpu && o.device_given) {
    std::fprintf(stderr, "moe-worker: --device %d chooses a CUDA device; the CPU backend has none to choose\n",
                 o.cuda.device);
    return 2;
  }
  if (backend_kind == moe::BackendChoice::cpu && o.routing != "router") {
    std::fprintf(stderr, "moe-worker: --routing %s is a benchmark routing of the cuda backend; the CPU backend "
                 "routes with the model's router\n", o.routing.c_str());
    return 2;
  }
  moe::Result<std::unique_ptr<moe::worker::Backend>> backend = moe::make_error("no backend");
  backend = backend_kind == moe::BackendChoice::cuda ? moe::worker::make_cuda_backend(o.model_path, o.cuda)
                                                      : moe::worker::make_cpu_backend(o.model_path, o.cpu);
  if (!backend.ok()) {
    std::fprintf(stderr, "moe-worker: %s\n", backend.error().c_str());
    return 1;
  }
  moe::worker::ServerOptions so;
  so.socket_path = o.socket_path;
  so.max_frame_bytes = o.max_frame_bytes;
  so.vram_budget_bytes = o.cuda.vram_budget;
  so.parent_pid = o.parent_pid;
  so.stall_exit_s = o.stall_exit_s;
  // Redis state: re-warm the last resident set before saying hello, then
  // publish state and routing summaries, read the gateways' events.
  std::unique_ptr<moe::worker::WorkerRedisState> redis;
  if (!o.redis_url.empty()) {
    moe::worker::WorkerRedisOptions ro;
    ro.url = o.redis_url;
    ro.password_file = o.redis_password_file;
    ro.model_id = (*backend)->describe().model_id;
    ro.consumer = std::filesystem::path(o.socket_path).stem().string();
    // Tests make the streams' bound small enough to see the trimming.
    if (const char* m = std::getenv("MOE_REDIS_STREAM_MAX_LEN")) ro.stream_max_len = std::strtoull(m, nullptr, 10);
    redis = std::make_unique<moe::worker::WorkerRedisState>(ro, backend->get());
    const auto rw = redis->rewarm();
    std::fprintf(stderr, "moe-worker: re-warmed %zu of %zu experts from Redis in %.1f ms%s\n", rw.resident, rw.previous,
                 rw.ms, rw.redis_reachable ? "" : " (Redis unreachable)");
    redis->start();
    so.hooks.push_back(redis.get());
  }
  // A warm profile fills what the re-warm left free.
  // The same file as --save-profile (a supervised worker's own history)
  // may be absent, broken or another model's: the worker starts cold and
  // replaces it. Named alone, the profile must be good.
  const bool own_profile = !o.warm_profile.empty() && o.warm_profile == o.save_profile;
  if (!o.warm_profile.empty()) {
    auto w = moe::worker::warm_from_profile(**backend, o.warm_profile);
    if (!w.ok() && own_profile) {
      std::fprintf(stderr, "moe-worker: --warm-profile: %s; starting cold (--save-profile replaces it)\n",
                   w.error().c_str());
    } else if (!w.ok()) {
      std::fprintf(stderr, "moe-worker: --warm-profile: %s\n", w.error().c_str());
      return 2;
    } else if (w->islands == 0)
      std::fprintf(stderr, "moe-worker: warm profile %s: every expert is resident already; nothing to warm\n",
                   o.warm_profile.c_str());
    else if (w->asked == 0)
      std::fprintf(stderr, "moe-worker: warm profile %s: no island is free%s\n", o.warm_profile.c_str(),
                   redis ? " (the re-warm from Redis filled them)" : "");
    else
      std::fprintf(stderr,
                   "moe-worker: warmed %zu of %zu experts from profile %s in %.1f ms (%u islands, %zu of its "
                   "experts resident before; together they served %.1f %% of the profile's uses)\n",
                   w->resident, w->asked, o.warm_profile.c_str(), w->ms, w->islands, w->already,
                   100.0 * w->coverage);
  }
  std::unique_ptr<moe::worker::ProfileSaver> saver;
  if (!o.save_profile.empty()) {
    saver = std::make_unique<moe::worker::ProfileSaver>(
        o.save_profile, **backend,
        "moe-worker " + std::filesystem::path(o.socket_path).stem().string() + " (" + (*backend)->describe().backend +
            ", routing " + o.routing + ")",
        std::chrono::milliseconds(int64_t(o.save_profile_every_s) * 1000));
    if (saver->continued())
      std::fprintf(stderr, "moe-worker: adding this worker's expert use to the profile in %s\n", o.save_profile.c_str());
    so.hooks.push_back(saver.get());
  }
  // The card's health, sampled once a second for the gateway's /metrics.
  std::unique_ptr<moe::CardHealthMonitor> card;
  if (const std::string bus = (*backend)->card_pci_bus_id(); !bus.empty()) {
    card = std::make_unique<moe::CardHealthMonitor>(bus);
    so.card = card.get();
  }
  moe::worker::WorkerServer server(backend->get(), so);
  if (auto st = server.listen(); !st.ok()) {
    std::fprintf(stderr, "moe-worker: %s\n", st.error().c_str());
    return 1;
  }
  const auto hello = (*backend)->describe();
  std::fprintf(stderr, "moe-worker %s: %s on %s, %u KV blocks of %u tokens, listening on %s\n", MOE_VERSION,
               hello.model_id.c_str(), hello.backend.c_str(), hello.kv_blocks_total, hello.kv_block_tokens,
               o.socket_path.c_str());
  const moe::Status run = server.run(pipe_fds[0]);
  // One line that says what this worker did (operators, benchmarks).
  moe::protocol::StatsReply st;
  (*backend)->fill_expert_stats(st);
  std::fprintf(stderr,
               "moe-worker: served %llu steps, %llu tokens (%llu sampled); experts: %llu hits, %llu misses, "
               "%.1f MB copied, %.1f MB streamed, %u of %u islands in use\n",
               (unsigned long long)server.steps(), (unsigned long long)server.tokens(),
               (unsigned long long)server.sampled_tokens(), (unsigned long long)st.expert_hits,
               (unsigned long long)st.expert_misses, double(st.bytes_copied) / 1e6,
               double(st.bytes_streamed) / 1e6, st.islands_used, st.islands_total);
  if (const std::string dm = (*backend)->device_memory_summary(); !dm.empty())
    std::fprintf(stderr, "moe-worker: %s\n", dm.c_str());
  if (saver) {
    if (moe::Status s = saver->save(); s.ok())
      std::fprintf(stderr, "moe-worker: routing profile saved to %s (%llu tokens this run)\n", saver->path().c_str(),
                   (unsigned long long)(*backend)->expert_use_tokens());
    else
      std::fprintf(stderr, "moe-worker: routing profile not saved: %s\n", s.error().c_str());
  }
  if (!run.ok()) {
    std::fprintf(stderr, "moe-worker: %s\n", run.error().c_str());
    return 1;
  }
  return server.exit_code();
}
