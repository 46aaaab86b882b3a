#include "gateway/gateway_options.h"

#include <charconv>
#include <limits>

namespace moe::gw {
namespace {

bool parse_u64(const std::string& s, uint64_t* out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size() && !s.empty();
}

bool takes_value(const std::string& name) {
  for (const char* known : {"--model", "--worker", "--host", "--port", "--api-key", "--max-body-bytes",
                            "--served-model-name", "--redis", "--fallback-worker", "--request-timeout-ms", "--keepalive-timeout-ms",
                            "--max-write-queue-bytes", "--max-step-tokens", "--predict", "--grouped-batching",
                            "--lsh-bits", "--lsh-seed", "--predict-half-life", "--predict-experts",
                            "--grouping-max-skips"}) {
    if (name == known) return true;
  }
  return false;
}

std::string base_name(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

}  // namespace

std::string gateway_usage() {
  return "usage: moe-gateway --model DIR|FILE --worker unix:PATH [options]\n"
         "\n"
         "The OpenAI-compatible HTTP front end: tokenises, applies the chat template,\n"
         "batches requests into steps of the worker(s) and streams the results.\n"
         "\n"
         "  --model DIR|FILE          the model: a checkpoint folder (config.json, tokenizer.json)\n"
         "                            or a packed model file (required)\n"
         "  --worker unix:PATH        a worker's Unix socket; repeat for several workers (one\n"
         "                            per GPU), served at once: each request goes to the one\n"
         "                            whose resident experts best match its prediction,\n"
         "                            weighed against its load\n"
         "  --fallback-worker unix:PATH  a worker (e.g. the CPU backend) that serves only while\n"
         "                            the others are down; running streams move to it and back\n"
         "  --host ADDR               address to listen on (default 127.0.0.1)\n"
         "  --port N                  TCP port (default 8080; 0 picks a free one)\n"
         "  --api-key KEY             require 'Authorization: Bearer KEY' on every endpoint\n"
         "                            but /health\n"
         "  --max-body-bytes N        largest request body accepted (default 1048576); more is 413\n"
         "  --served-model-name NAME  the model id clients send and /v1/models lists\n"
         "                            (default: the name of the model folder or file)\n"
         "  --redis URL               Redis for sessions and warm-expert state\n"
         "                            (redis://host:port; default: none, in-process state)\n"
         "  --request-timeout-ms N    a request whose headers and body are not all in after\n"
         "                            N ms gets 408 and is closed (default 30000)\n"
         "  --keepalive-timeout-ms N  idle keep-alive connections are closed after N ms\n"
         "                            (default 60000)\n"
         "  --max-write-queue-bytes N a streaming client this far behind is dropped and its\n"
         "                            generation cancelled (default 1048576)\n"
         "  --max-step-tokens N       tokens in one worker step, decode and prefill chunks\n"
         "                            together (default 256): larger favours throughput,\n"
         "                            smaller the latency of running streams\n"
         "  --predict on|off          expert prediction (default on): each prompt is hashed\n"
         "                            (mean input embedding, LSH) to a bucket whose experts are\n"
         "                            learned from the workers' routing summaries (from Redis\n"
         "                            with --redis, else from this gateway's own steps); the\n"
         "                            predicted experts are warm-hinted to the worker before the\n"
         "                            prompt's prefill. POST /debug/experts shows a prediction\n"
         "  --grouped-batching on|off when more sequences are ready than one step takes, pick\n"
         "                            those whose predicted experts overlap most (default on;\n"
         "                            without predictions it is first come first served)\n"
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
    } else {
      if (a.rfind("--", 0) != 0) return make_error("unexpected argument '" + a + "'");
      if (!takes_value(a)) return make_error("unknown option '" + a + "' (see --help)");
      if (i + 1 >= args.size()) return make_error("option " + a + " needs a value");
      value = args[++i];
    }
    uint64_t num = 0;
    auto number = [&](uint64_t max) -> Status {
      if (!parse_u64(value, &num) || num > max) {
        return make_error("option " + name + " needs a number (0.." + std::to_string(max) + "), got '" + value + "'");
      }
      return {};
    };
    Status st;
    if (name == "--model") {
      o.model_path = value;
    } else if (name == "--worker") {
      if (value.rfind("unix:", 0) != 0 || value.size() == 5) {
        return make_error("option --worker needs unix:PATH, got '" + value + "'");
      }
      o.workers.push_back(value);
    } else if (name == "--fallback-worker") {
      if (value.rfind("unix:", 0) != 0 || value.size() == 5) {
        return make_error("option --fallback-worker needs unix:PATH, got '" + value + "'");
      }
      o.fallback_worker = value;
    } else if (name == "--host") {
      o.host = value;
    } else if (name == "--port") {
      if ((st = number(65535))) o.port = static_cast<int>(num);
    } else if (name == "--api-key") {
      if (value.empty()) return make_error("option --api-key needs a non-empty key");
      o.api_key = value;
    } else if (name == "--max-body-bytes") {
      if ((st = number(std::numeric_limits<uint32_t>::max()))) o.max_body_bytes = num;
    } else if (name == "--served-model-name") {
      o.served_model_name = value;
    } else if (name == "--redis") {
      o.redis_url = value;
    } else if (name == "--request-timeout-ms") {
      if ((st = number(24ull * 3600 * 1000))) o.request_timeout_ms = num;
    } else if (name == "--keepalive-timeout-ms") {
      if ((st = number(24ull * 3600 * 1000))) o.keepalive_timeout_ms = num;
    } else if (name == "--max-write-queue-bytes") {
      if ((st = number(std::numeric_limits<uint32_t>::max()))) o.max_write_queue_bytes = num;
    } else if (name == "--predict" || name == "--grouped-batching") {
      if (value != "on" && value != "off") return make_error("option " + name + " needs on or off, got '" + value + "'");
      (name == "--predict" ? o.predict : o.grouped_batching) = value == "on";
    } else if (name == "--lsh-bits") {
      if ((st = number(32))) o.lsh_bits = static_cast<int>(num);
      if (st.ok() && o.lsh_bits < 1) return make_error("option --lsh-bits needs 1..32");
    } else if (name == "--lsh-seed") {
      if ((st = number(std::numeric_limits<uint64_t>::max()))) o.lsh_seed = num;
    } else if (name == "--predict-half-life") {
      if ((st = number(1'000'000'000))) o.predict_half_life = double(num);
      if (st.ok() && num < 1) return make_error("option --predict-half-life needs at least 1");
    } else if (name == "--predict-experts") {
      if ((st = number(4096))) o.predict_experts = static_cast<int>(num);
      if (st.ok() && num < 1) return make_error("option --predict-experts needs at least 1");
    } else if (name == "--grouping-max-skips") {
      if ((st = number(1'000'000))) o.grouping_max_skips = static_cast<int>(num);
    } else if (name == "--max-step-tokens") {
      if ((st = number(65535))) o.max_step_tokens = static_cast<int>(num);
      if (st.ok() && o.max_step_tokens < 1) return make_error("option --max-step-tokens needs at least 1");
    } else {
      return make_error("unknown option '" + name + "' (see --help)");
    }
    if (!st.ok()) return make_error(st.error());
  }
  if (!cl.help && !cl.version) {
    if (o.model_path.empty()) return make_error("--model DIR|FILE is required (see --help)");
    if (o.served_model_name.empty()) o.served_model_name = base_name(o.model_path);
  }
  return cl;
}

}  // namespace moe::gw
