#include "gateway/gateway_options.h"

#include <charconv>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>

#include <sys/stat.h>

#include "gateway/api_keys.h"

namespace moe::gw {
namespace {

bool parse_u64(const std::string& s, uint64_t* out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size() && !s.empty();
}

std::string base_name(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

constexpr uint64_t kDayMs = 24ull * 3600 * 1000;
constexpr uint64_t kU32 = std::numeric_limits<uint32_t>::max();

// A numeric option: its range and where it goes.
struct Numeric {
  const char* name;
  uint64_t min, max;
  std::function<void(GatewayOptions&, uint64_t)> set;
};

const std::vector<Numeric>& numeric_options() {
  static const std::vector<Numeric> table = {
      {"--port", 0, 65535, [](GatewayOptions& o, uint64_t v) { o.port = int(v); }},
      {"--worker-wait-s", 0, kDayMs / 1000, [](GatewayOptions& o, uint64_t v) { o.worker_wait_s = v; }},
      {"--max-body-bytes", 1, kU32, [](GatewayOptions& o, uint64_t v) { o.max_body_bytes = v; }},
      {"--request-timeout-ms", 1, kDayMs, [](GatewayOptions& o, uint64_t v) { o.request_timeout_ms = v; }},
      {"--keepalive-timeout-ms", 1, kDayMs, [](GatewayOptions& o, uint64_t v) { o.keepalive_timeout_ms = v; }},
      {"--write-timeout-ms", 1, kDayMs, [](GatewayOptions& o, uint64_t v) { o.write_timeout_ms = v; }},
      {"--stream-ping-ms", 0, kDayMs, [](GatewayOptions& o, uint64_t v) { o.stream_ping_ms = v; }},
      {"--max-write-queue-bytes", 1, kU32, [](GatewayOptions& o, uint64_t v) { o.max_write_queue_bytes = v; }},
      {"--max-connections", 1, 1'000'000, [](GatewayOptions& o, uint64_t v) { o.max_connections = v; }},
      {"--max-step-tokens", 1, 65535, [](GatewayOptions& o, uint64_t v) { o.max_step_tokens = int(v); }},
      {"--max-request-tokens", 1, uint64_t(1) << 40,
       [](GatewayOptions& o, uint64_t v) { o.max_request_tokens = int64_t(v); }},
      {"--max-logprob-entries", 1, uint64_t(1) << 40,
       [](GatewayOptions& o, uint64_t v) { o.max_logprob_entries = int64_t(v); }},
      {"--max-response-bytes", 1024, uint64_t(1) << 40, [](GatewayOptions& o, uint64_t v) { o.max_response_bytes = v; }},
      {"--max-held-response-bytes", 1024, uint64_t(1) << 40,
       [](GatewayOptions& o, uint64_t v) { o.max_held_response_bytes = v; }},
      {"--max-caller-sequences", 1, 1'000'000, [](GatewayOptions& o, uint64_t v) { o.max_caller_sequences = int(v); }},
      {"--max-waiting", 1, 1'000'000, [](GatewayOptions& o, uint64_t v) { o.max_waiting = int(v); }},
      {"--session-max-messages", 1, 100'000, [](GatewayOptions& o, uint64_t v) { o.session_max_messages = v; }},
      {"--session-max-bytes", 1024, kU32, [](GatewayOptions& o, uint64_t v) { o.session_max_bytes = v; }},
      {"--session-memory-bytes", 0, uint64_t(1) << 40, [](GatewayOptions& o, uint64_t v) { o.session_memory_bytes = v; }},
      {"--session-ttl-s", 1, 365ull * 24 * 3600, [](GatewayOptions& o, uint64_t v) { o.session_ttl_s = v; }},
      {"--lsh-bits", 1, 32, [](GatewayOptions& o, uint64_t v) { o.lsh_bits = int(v); }},
      {"--lsh-seed", 0, std::numeric_limits<uint64_t>::max(), [](GatewayOptions& o, uint64_t v) { o.lsh_seed = v; }},
      {"--predict-half-life", 1, 1'000'000'000, [](GatewayOptions& o, uint64_t v) { o.predict_half_life = double(v); }},
      {"--predict-experts", 1, 4096, [](GatewayOptions& o, uint64_t v) { o.predict_experts = int(v); }},
      {"--grouping-max-skips", 0, 1'000'000, [](GatewayOptions& o, uint64_t v) { o.grouping_max_skips = int(v); }},
      {"--priority-max-wait-ms", 0, kDayMs, [](GatewayOptions& o, uint64_t v) { o.priority_max_wait_ms = v; }},
      {"--overload-queue-depth", 0, 1'000'000, [](GatewayOptions& o, uint64_t v) { o.overload_queue_depth = int(v); }},
      {"--overload-wait-ms", 0, kDayMs, [](GatewayOptions& o, uint64_t v) { o.overload_wait_ms = v; }},
      {"--stats-interval-ms", 0, 3'600'000, [](GatewayOptions& o, uint64_t v) { o.stats_interval_ms = v; }},
      {"--thermal-hot-c", 30, 120, [](GatewayOptions& o, uint64_t v) { o.thermal_hot_c = int(v); }},
  };
  return table;
}

const char* const kTextOptions[] = {"--model",  "--worker",       "--fallback-worker", "--worker-arg", "--host",
                                    "--api-key", "--api-key-file", "--served-model-name", "--redis",
                                    "--redis-password-file", "--predict", "--grouped-batching", "--experts-page",
                                    "--keys-file", "--request-priority", "--trusted-proxy"};

bool takes_value(const std::string& name) {
  for (const char* t : kTextOptions)
    if (name == t) return true;
  for (const Numeric& n : numeric_options())
    if (name == n.name) return true;
  return false;
}

}  // namespace

std::string gateway_usage() {
  return "usage: moe-gateway --model DIR|FILE [--worker unix:PATH] [options]\n"
         "\n"
         "The OpenAI-compatible HTTP front end: tokenises, applies the chat template,\n"
         "batches requests into steps of the worker(s) and streams the results. Without\n"
         "--worker it starts and supervises its own moe-worker: on the GPU when one is\n"
         "visible and the worker has CUDA, else on the CPU.\n"
         "\n"
         "  --model DIR|FILE          the model: a checkpoint folder (config.json, tokenizer.json;\n"
         "                            bf16, GPTQ or AWQ), a GGUF file (its tokenizer and chat\n"
         "                            template are read from it) or a packed model file (required)\n"
         "  --worker unix:PATH        a worker's Unix socket; repeat for several workers (one\n"
         "                            per GPU), served at once: each request goes to the one\n"
         "                            whose resident experts best match its prediction,\n"
         "                            weighed against its load\n"
         "  --fallback-worker unix:PATH  a worker (e.g. the CPU backend) that serves only while\n"
         "                            the others are down; running streams move to it and back\n"
         "  --worker-arg ARG          an option for the gateway's own worker (without --worker),\n"
         "                            repeatable: --worker-arg --vram-budget --worker-arg 10GiB.\n"
         "                            Its backend is auto: the GPU when the worker was built with\n"
         "                            CUDA and one is visible, else the CPU (/health says which);\n"
         "                            it shares the gateway's --redis unless these name one\n"
         "  --worker-wait-s N         once no worker, the fallback included, has been ready for\n"
         "                            N s (all lost, or none reached since the start), what waits\n"
         "                            for one ends with an error saying why (a stream: an error\n"
         "                            event, then [DONE]), new requests get 503 engine_failing\n"
         "                            with Retry-After and /health says 'failing', until one is\n"
         "                            ready again (default 120: room for a large model's load,\n"
         "                            43 s for a 61 GB checkpoint; 0: wait for ever)\n"
         "  --host ADDR               address to listen on (default 127.0.0.1)\n"
         "  --port N                  TCP port (default 8080; 0 picks a free one)\n"
         "\n"
         "Who may use it:\n"
         "  --api-key KEY             require 'Authorization: Bearer KEY' on every endpoint but\n"
         "                            /health; repeatable. Visible in ps: prefer the two below\n"
         "  --api-key-file FILE       keys, one a line ('#' comments); repeatable\n"
         "                            (the environment variable MOE_API_KEY adds one more)\n"
         "  --trusted-proxy ADDR      a balancer in front (its address, repeatable): a request from\n"
         "                            it is the client its X-Forwarded-For names last, for the\n"
         "                            bounds per caller without keys (docs/scale-out.md)\n"
         "  --max-connections N       open connections at most; more are answered 503 (default:\n"
         "                            the descriptor limit less 64 kept for workers and Redis,\n"
         "                            at most 4096)\n"
         "  --max-caller-sequences N  sequences (choices) one caller may have running or waiting\n"
         "                            (a caller: its API key, else its address; default 256);\n"
         "                            more is 429 with Retry-After\n"
         "  --max-waiting N           sequences waiting for the worker, everyone together\n"
         "                            (default 1024); more is 429 with Retry-After\n"
         "  --keys-file FILE          API keys with a name, a priority and a rate limit, one a\n"
         "                            line: NAME SHA256-OF-KEY PRIORITY REQUESTS-PER-MINUTE|-\n"
         "                            (the digest: printf %s KEY | sha256sum); lower priorities\n"
         "                            run first, --api-key keys have priority 0, no limit\n"
         "  --request-priority on|off honour the body's 'priority' (default off: a non-zero one\n"
         "                            is 400); never earlier than the caller's key allows\n"
         "  --priority-max-wait-ms N  a sequence submitted N ms ago runs before any later one\n"
         "                            and is no longer preempted for priority (default 30000;\n"
         "                            0: no bound)\n"
         "\n"
         "Overload and the card (docs/operations.md):\n"
         "  --overload-queue-depth N  while N sequences or more wait for the main workers, new\n"
         "                            requests go to --fallback-worker (X-Moe-Degraded: 1), or\n"
         "                            are 429 with Retry-After without one (default 0: off)\n"
         "  --overload-wait-ms N      the same while the oldest has waited N ms (default 0: off)\n"
         "  --stats-interval-ms N     ask each worker for its stats and its card's health (NVML)\n"
         "                            every N ms, shown in /metrics (default 1000; 0: never)\n"
         "  --thermal-hot-c N         a card this hot (or throttling for heat) has its worker's\n"
         "                            step budget and batch halved until it is 5 degrees\n"
         "                            cooler for 10 samples (default 87)\n"
         "\n"
         "What one request may cost:\n"
         "  --max-body-bytes N        largest request body accepted (default 1048576); more is 413\n"
         "  --max-request-tokens N    choices x max_tokens of one request (default 1048576)\n"
         "  --max-logprob-entries N   choices x max_tokens x (1 + alternatives) of a whole (not\n"
         "                            streamed) response with logprobs (default 262144)\n"
         "  --max-response-bytes N    text and logprobs a whole response may hold (default 64 MiB);\n"
         "                            past it the request fails with 400 response_too_large\n"
         "  --max-held-response-bytes N  what every whole response holds together (default\n"
         "                            512 MiB); past it the response that grows fails with\n"
         "                            503 responses_memory_full (Retry-After: 1)\n"
         "  --request-timeout-ms N    a request whose headers and body are not all in after\n"
         "                            N ms gets 408 and is closed (default 30000; at least 1)\n"
         "  --keepalive-timeout-ms N  idle keep-alive connections are closed after N ms\n"
         "                            (default 60000; at least 1)\n"
         "  --write-timeout-ms N      a client that takes none of a response's bytes for N ms\n"
         "                            is closed and its work cancelled (default 30000)\n"
         "  --stream-ping-ms N        a stream silent for N ms gets an SSE comment line, which\n"
         "                            clients skip, so idle timeouts of proxies keep it while\n"
         "                            the work waits (default 15000; 0: none)\n"
         "  --max-write-queue-bytes N a streaming client this far behind is dropped and its\n"
         "                            generation cancelled (default 1048576)\n"
         "\n"
         "State:\n"
         "  --served-model-name NAME  the model id clients send and /v1/models lists\n"
         "                            (default: the name of the model folder or file)\n"
         "  --redis URL               Redis for sessions and warm-expert state\n"
         "                            (redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]; default: none,\n"
         "                            in-process state)\n"
         "  --redis-password-file F   the Redis password (or USER:PASSWORD) read from a file,\n"
         "                            instead of the URL\n"
         "  --session-max-messages N  turns a session keeps, the oldest dropped (default 64)\n"
         "  --session-max-bytes N     text a session keeps (default 262144)\n"
         "  --session-memory-bytes N  sessions held in this process together, least recently\n"
         "                            used dropped (default 64 MiB)\n"
         "  --session-ttl-s N         a session expires N s after its last turn (default 86400)\n"
         "\n"
         "Batching and experts:\n"
         "  --max-step-tokens N       tokens in one worker step, decode and prefill chunks\n"
         "                            together (default 256): larger favours throughput,\n"
         "                            smaller the latency of running streams\n"
         "  --experts-page on|off     GET /experts, a live page of the experts per worker and layer, and\n"
         "                            /experts.json (default on; behind the API key, which a browser may\n"
         "                            send as the Basic password; while watched, steps report each\n"
         "                            sequence's expert use, docs/experts-page.md)\n"
         "  --predict on|off          expert prediction (default off: measured, it did not pay,\n"
         "                            docs/expert-prediction.md): each prompt is hashed\n"
         "                            (mean input embedding, LSH) to a bucket whose experts are\n"
         "                            learned from the workers' routing summaries (from Redis\n"
         "                            with --redis, else from this gateway's own steps); the\n"
         "                            predicted experts are warm-hinted to the worker before the\n"
         "                            prompt's prefill, and with several workers a request goes\n"
         "                            to the one holding them. POST /debug/experts shows a prediction\n"
         "  --grouped-batching on|off when more sequences are ready than one step takes, pick\n"
         "                            those whose predicted experts overlap most (default off, as\n"
         "                            --predict; without predictions it is first come first served)\n"
         "  --grouping-max-skips N    a sequence passed over N times goes next (default 4)\n"
         "  --lsh-bits N              hyperplanes of the prompt hash, 1..32 (default 12); every\n"
         "                            gateway sharing a Redis must use the same bits and seed\n"
         "  --lsh-seed N              seed of the hyperplanes (default 1)\n"
         "  --predict-half-life N     routing summaries after which a learned one weighs half\n"
         "                            (default 500)\n"
         "  --predict-experts N       experts predicted (and hinted) per MoE layer (default 8)\n"
         "  --help                    this text\n"
         "  --version                 the version\n";
}

Result<GatewayCommandLine> parse_gateway_args(const std::vector<std::string>& args) {
  GatewayCommandLine cl;
  GatewayOptions& o = cl.options;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      cl.help = true;
      continue;
    }
    if (a == "--version") {
      cl.version = true;
      continue;
    }
    // Every other option takes a value: "--opt VALUE" or "--opt=VALUE".
    std::string name = a, value;
    size_t eq = a.find('=');
    if (a.rfind("--", 0) == 0 && eq != std::string::npos) {
      name = a.substr(0, eq);
      value = a.substr(eq + 1);
      if (!takes_value(name)) return make_error("unknown option '" + name + "' (see --help)");
    } else {
      if (a.rfind("--", 0) != 0) return make_error("unexpected argument '" + a + "'");
      if (!takes_value(a)) return make_error("unknown option '" + a + "' (see --help)");
      if (i + 1 >= args.size()) return make_error("option " + a + " needs a value");
      value = args[++i];
    }
    bool numeric = false;
    for (const Numeric& n : numeric_options()) {
      if (name != n.name) continue;
      numeric = true;
      uint64_t v = 0;
      if (!parse_u64(value, &v) || v < n.min || v > n.max)
        return make_error("option " + name + " needs a number (" + std::to_string(n.min) + ".." +
                          std::to_string(n.max) + "), got '" + value + "'");
      n.set(o, v);
    }
    if (numeric) continue;
    if (name == "--model") {
      o.model_path = value;
    } else if (name == "--worker" || name == "--fallback-worker") {
      if (value.rfind("unix:", 0) != 0 || value.size() == 5)
        return make_error("option " + name + " needs unix:PATH, got '" + value + "'");
      (name == "--worker" ? o.workers.emplace_back() : o.fallback_worker) = value;
    } else if (name == "--worker-arg") {
      for (const char* own : {"--model", "--socket", "--parent-pid"})
        if (value == own || value.rfind(std::string(own) + "=", 0) == 0)
          return make_error("option --worker-arg: the gateway sets " + std::string(own) + " of its worker itself");
      o.worker_args.push_back(value);
    } else if (name == "--host") {
      o.host = value;
    } else if (name == "--api-key") {
      if (value.empty()) return make_error("option --api-key needs a non-empty key");
      o.api_keys.push_back(value);
    } else if (name == "--api-key-file") {
      o.api_key_files.push_back(value);
    } else if (name == "--served-model-name") {
      o.served_model_name = value;
    } else if (name == "--redis") {
      o.redis_url = value;
    } else if (name == "--redis-password-file") {
      o.redis_password_file = value;
    } else if (name == "--predict" || name == "--grouped-batching" || name == "--request-priority" ||
               name == "--experts-page") {
      if (value != "on" && value != "off") return make_error("option " + name + " needs on or off, got '" + value + "'");
      (name == "--predict"            ? o.predict
       : name == "--grouped-batching" ? o.grouped_batching
       : name == "--experts-page"     ? o.experts_page
                                      : o.request_priority) = value == "on";
    } else if (name == "--keys-file") {
      o.keys_file = value;
    } else if (name == "--trusted-proxy") {
      if (!looks_like_ip_address(value))
        return make_error("option --trusted-proxy needs an IP address, got '" + value + "'");
      o.trusted_proxies.push_back(value);
    }
  }
  if (!cl.help && !cl.version) {
    if (o.model_path.empty()) return make_error("--model DIR|FILE is required (see --help)");
    if (!o.worker_args.empty() && !o.workers.empty())
      return make_error("--worker-arg is for the gateway's own worker; with --worker the workers are started elsewhere");
    if (o.served_model_name.empty()) o.served_model_name = base_name(o.model_path);
  }
  return cl;
}

Result<std::vector<std::string>> collect_api_keys(const GatewayOptions& o, const char* env_key) {
  std::vector<std::string> keys = o.api_keys;
  for (const std::string& path : o.api_key_files) {
    std::ifstream in(path);
    if (!in) return make_error("cannot read --api-key-file " + path);
    struct stat st{};
    if (::stat(path.c_str(), &st) == 0 && (st.st_mode & 077))
      std::fprintf(stderr, "moe-gateway: warning: %s is readable by others (chmod 600 it)\n", path.c_str());
    size_t before = keys.size();
    std::string line;
    while (std::getline(in, line)) {
      const size_t b = line.find_first_not_of(" \t\r");
      if (b == std::string::npos || line[b] == '#') continue;
      const size_t e = line.find_last_not_of(" \t\r");
      keys.push_back(line.substr(b, e - b + 1));
    }
    if (keys.size() == before) return make_error("--api-key-file " + path + " holds no key");
  }
  if (env_key && *env_key) keys.emplace_back(env_key);
  return keys;
}

}  // namespace moe::gw
