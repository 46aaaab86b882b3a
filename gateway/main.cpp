// moe-gateway: the OpenAI-compatible HTTP front end.
#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <map>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <sys/resource.h>
#include <uv.h>

#include "gateway/predict/expert_prediction.h"
#include "gateway/gateway_options.h"
#include "gateway/http/http_server.h"
#include "gateway/metrics.h"
#include "gateway/api/model_text_codec.h"
#include "gateway/api/openai_api.h"
#include "gateway/state/redis_client.h"
#include "gateway/state/redis_worker_streams.h"
#include "gateway/state/session_store.h"
#include "gateway/sched/scheduler_factory.h"
#include "model/model_files.h"
#include "moe_version.h"

namespace {

// Stops the server on SIGINT/SIGTERM; the loop ends once every handle closed.
struct Shutdown {
  moe::gw::HttpServer* server = nullptr;
  moe::gw::OpenAiApi* api = nullptr;
  uv_signal_t sigint{}, sigterm{};

  static void on_signal(uv_signal_t* s, int signum) {
    auto* self = static_cast<Shutdown*>(s->data);
    std::fprintf(stderr, "moe-gateway: signal %d, shutting down\n", signum);
    self->server->close();
    self->api->close();
    uv_close(reinterpret_cast<uv_handle_t*>(&self->sigint), nullptr);
    uv_close(reinterpret_cast<uv_handle_t*>(&self->sigterm), nullptr);
    uv_stop(s->loop);
  }
};

// Raises the soft descriptor limit to the hard one and returns the soft
// limit now in force.
uint64_t raise_descriptor_limit() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return 1024;
  if (rl.rlim_cur < rl.rlim_max) {
    rlimit want = rl;
    want.rlim_cur = rl.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &want) == 0) rl = want;
  }
  return uint64_t(rl.rlim_cur);
}

// Descriptors kept out of the connections' reach: the worker links and their
// restarts, Redis, the loop's own, the supervisor's pipes, a few refusals.
constexpr uint64_t kReservedDescriptors = 64;

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  auto cl = moe::gw::parse_gateway_args(args);
  if (!cl.ok()) {
    std::fprintf(stderr, "moe-gateway: %s\n", cl.error().c_str());
    return 2;
  }
  if (cl->help) {
    std::printf("moe-gateway %s\n%s", MOE_VERSION, moe::gw::gateway_usage().c_str());
    return 0;
  }
  if (cl->version) {
    std::printf("moe-gateway %s\n", MOE_VERSION);
    return 0;
  }
  const moe::gw::GatewayOptions& opts = cl->options;
  auto keys = moe::gw::collect_api_keys(opts, std::getenv("MOE_API_KEY"));
  if (!keys.ok()) {
    std::fprintf(stderr, "moe-gateway: %s\n", keys.error().c_str());
    return 2;
  }
  // Connections: what the descriptor limit allows after the reserve.
  const uint64_t nofile = raise_descriptor_limit();
  if (nofile < kReservedDescriptors + 8) {
    std::fprintf(stderr, "moe-gateway: the descriptor limit (%llu) is too low; it needs at least %llu\n",
                 (unsigned long long)nofile, (unsigned long long)(kReservedDescriptors + 8));
    return 2;
  }
  size_t max_connections = std::min<uint64_t>(4096, nofile - kReservedDescriptors);
  if (opts.max_connections > 0) {
    if (opts.max_connections > nofile - kReservedDescriptors) {
      std::fprintf(stderr, "moe-gateway: --max-connections %zu does not fit the descriptor limit %llu (at most %llu)\n",
                   opts.max_connections, (unsigned long long)nofile,
                   (unsigned long long)(nofile - kReservedDescriptors));
      return 2;
    }
    max_connections = opts.max_connections;
  }

  auto codec = moe::gw::load_model_text_codec(opts.model_path);
  if (!codec.ok()) {
    std::fprintf(stderr, "moe-gateway: %s\n", codec.error().c_str());
    return 1;
  }
  std::unique_ptr<moe::gw::TextCodec> text = std::move(codec.value());

  // Expert prediction: the model's embedding table, mapped (docs/expert-prediction.md).
  std::unique_ptr<moe::gw::PromptExpertPredictor> predictor;
  if (opts.predict) {
    moe::gw::PredictorOptions po;
    po.lsh_bits = opts.lsh_bits;
    po.lsh_seed = opts.lsh_seed;
    po.experts_per_layer = opts.predict_experts;
    po.table.half_life = opts.predict_half_life;
    auto p = moe::gw::PromptExpertPredictor::open(opts.model_path, po);
    if (p.ok()) {
      predictor = std::move(p.value());
      std::fprintf(stderr, "moe-gateway: expert prediction on (%d-bit LSH, %d MoE layers x %d experts, %d per layer)\n",
                   opts.lsh_bits, predictor->n_layers(), predictor->n_experts(), opts.predict_experts);
    } else {
      std::fprintf(stderr, "moe-gateway: expert prediction off: %s\n", p.error().c_str());
    }
  }

  uv_loop_t* loop = uv_default_loop();
  // Redis: sessions and the workers' streams; without it, in this process.
  std::unique_ptr<moe::gw::RedisClient> redis;
  std::unique_ptr<moe::gw::RedisWorkerStreams> worker_streams;
  if (opts.redis_url.empty()) {
    std::fprintf(stderr, "moe-gateway: no --redis; sessions and expert state stay in this process\n");
  } else {
    auto ep = moe::protocol::parse_redis_url(opts.redis_url);
    if (!ep.ok()) {
      std::fprintf(stderr, "moe-gateway: %s\n", ep.error().c_str());
      return 2;
    }
    if (!opts.redis_password_file.empty()) {
      if (auto st = moe::protocol::read_redis_password_file(opts.redis_password_file, &ep.value()); !st.ok()) {
        std::fprintf(stderr, "moe-gateway: %s\n", st.error().c_str());
        return 2;
      }
    }
    redis = std::make_unique<moe::gw::RedisClient>(loop, ep.value());
    moe::gw::RedisWorkerStreamsOptions wso;
    wso.model = moe::gw::redis_model_name(opts.model_path);
    worker_streams = std::make_unique<moe::gw::RedisWorkerStreams>(loop, redis.get(), wso);
    if (predictor) {
      worker_streams->on_routing([p = predictor.get()](uint64_t bucket, const std::string& layers) {
        p->learn_summary(bucket, layers);
      });
    }
    worker_streams->start();
    redis->start();
  }
  // The workers' resident sets (from Redis) let the scheduler choose among
  // several workers; read through the owning pointer, which outlives it.
  auto resident_sets = [&worker_streams]() -> std::map<std::string, std::string> {
    return worker_streams ? worker_streams->resident() : std::map<std::string, std::string>{};
  };
  // Every worker, the fallback included, must share this model's token ids
  // (what its hello says of its model's vocabulary), or it is refused.
  moe::gw::WorkerVocabulary vocabulary;
  if (auto files = moe::ModelFiles::open(opts.model_path); files.ok()) {
    vocabulary.model = moe::gw::redis_model_name(opts.model_path);
    vocabulary.vocab_size = uint32_t(files.value()->desc().vocab_size);
    vocabulary.eos_ids = files.value()->desc().eos_token_ids;
  }
  auto scheduler = moe::gw::make_scheduler(loop, opts, predictor.get(), resident_sets, std::move(vocabulary));
  if (!scheduler.ok()) {
    std::fprintf(stderr, "moe-gateway: %s\n", scheduler.error().c_str());
    return 1;
  }
  std::unique_ptr<moe::gw::Scheduler> engine = std::move(scheduler.value());

  moe::gw::SessionStoreOptions sso;
  if (worker_streams) sso.events_key = worker_streams->events_key();
  sso.ttl_s = opts.session_ttl_s;
  sso.max_messages = opts.session_max_messages;
  sso.max_bytes = opts.session_max_bytes;
  sso.memory_bytes = opts.session_memory_bytes;
  moe::gw::SessionStore sessions(redis.get(), sso);

  moe::gw::GatewayMetrics metrics;
  moe::gw::ApiOptions api_opts;
  api_opts.sessions = &sessions;
  api_opts.served_model_name = opts.served_model_name;
  api_opts.api_keys = keys.value();
  if (!opts.keys_file.empty()) {
    auto kf = moe::gw::load_keys_file(opts.keys_file);
    if (!kf.ok()) {
      std::fprintf(stderr, "moe-gateway: %s\n", kf.error().c_str());
      return 2;
    }
    api_opts.keys = std::move(kf.value());
  }
  api_opts.allow_request_priority = opts.request_priority;
  api_opts.experts_page = opts.experts_page;
  api_opts.trusted_proxies = opts.trusted_proxies;
  api_opts.overload_queue_depth = opts.overload_queue_depth;
  api_opts.overload_wait_ms = opts.overload_wait_ms;
  if ((opts.overload_queue_depth > 0 || opts.overload_wait_ms > 0) && opts.fallback_worker.empty())
    std::fprintf(stderr, "moe-gateway: overload bounds set without --fallback-worker: past them requests are 429\n");
  api_opts.max_request_tokens = opts.max_request_tokens;
  api_opts.max_logprob_entries = opts.max_logprob_entries;
  api_opts.max_response_bytes = opts.max_response_bytes;
  api_opts.max_held_response_bytes = opts.max_held_response_bytes;
  // A request may not ask for more choices than one caller may have in flight
  // (it could never run): n past that is a 400, not a 429 for ever.
  api_opts.max_choices = std::min({api_opts.max_choices, opts.max_caller_sequences, opts.max_waiting});
  api_opts.admission.max_caller_sequences = opts.max_caller_sequences;
  api_opts.admission.max_waiting = opts.max_waiting;
  api_opts.predictor = predictor.get();
  if (worker_streams) api_opts.resident_sets = [ws = worker_streams.get()] { return ws->resident(); };
  if (redis) api_opts.redis_connected = [r = redis.get()] { return r->connected(); };
  moe::gw::OpenAiApi api(api_opts, engine.get(), text.get(), &metrics);

  moe::gw::HttpServerOptions http;
  http.host = opts.host;
  http.port = opts.port;
  http.limits.max_body_bytes = opts.max_body_bytes;
  http.request_timeout_ms = opts.request_timeout_ms;
  http.keepalive_timeout_ms = opts.keepalive_timeout_ms;
  http.max_write_queue_bytes = opts.max_write_queue_bytes;
  http.write_timeout_ms = opts.write_timeout_ms;
  http.stream_ping_ms = opts.stream_ping_ms;
  http.max_connections = max_connections;
  moe::gw::HttpServer server(loop, http, &api);
  api.watch_server(&server);
  if (auto st = server.listen(); !st.ok()) {
    std::fprintf(stderr, "moe-gateway: %s\n", st.error().c_str());
    return 1;
  }
  std::fprintf(stderr, "moe-gateway %s: serving '%s' on http://%s:%d (%s, up to %zu connections)\n", MOE_VERSION,
               opts.served_model_name.c_str(), opts.host.c_str(), server.port(),
               api_opts.api_keys.empty() && api_opts.keys.empty()
                   ? "no API key"
                   : (std::to_string(api_opts.api_keys.size() + api_opts.keys.size()) + " API key(s)").c_str(),
               max_connections);

  std::signal(SIGPIPE, SIG_IGN);
  Shutdown shutdown;
  shutdown.server = &server;
  shutdown.api = &api;
  uv_signal_init(loop, &shutdown.sigint);
  uv_signal_init(loop, &shutdown.sigterm);
  shutdown.sigint.data = shutdown.sigterm.data = &shutdown;
  uv_signal_start(&shutdown.sigint, Shutdown::on_signal, SIGINT);
  uv_signal_start(&shutdown.sigterm, Shutdown::on_signal, SIGTERM);
  uv_run(loop, UV_RUN_DEFAULT);
  // Let the closing connections finish their close callbacks, and requests
  // still being tokenised on the thread pool come back (their clients are
  // gone: nothing more runs for them), so that no pool thread reads the
  // codec after it is freed.
  uv_run(loop, UV_RUN_NOWAIT);
  while (api.jobs_in_flight() > 0) uv_run(loop, UV_RUN_ONCE);
  // Redis first: its pending callbacks (called with nullptr) reach the store and streams.
  redis.reset();
  worker_streams.reset();
  uv_run(loop, UV_RUN_NOWAIT);
  return 0;
}
