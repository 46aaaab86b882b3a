#include "worker/worker_options.h"

#include <cctype>
#include <charconv>
#include <type_traits>

#include "protocol/frame.h"

namespace moe::worker {

Result<uint64_t> parse_byte_size(const std::string& text) {
  uint64_t v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end == text.data()) return make_error("not a size: '" + text + "'");
  std::string unit(end, text.data() + text.size());
  for (char& c : unit) c = char(std::toupper(static_cast<unsigned char>(c)));
  if (!unit.empty() && unit.back() == 'B') unit.pop_back();
  if (!unit.empty() && unit.back() == 'I') unit.pop_back();
  int shift = 0;
  if (unit == "K") shift = 10;
  else if (unit == "M") shift = 20;
  else if (unit == "G") shift = 30;
  else if (unit == "T") shift = 40;
  else if (!unit.empty()) return make_error("unknown size unit in '" + text + "'");
  if (shift && v > (UINT64_MAX >> shift)) return make_error("size too large: '" + text + "'");
  return v << shift;
}

static Result<int> parse_count(const std::string& name, const std::string& value) {
  int v = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (ec != std::errc() || end != value.data() + value.size() || v < 0)
    return make_error("option " + name + " needs a non-negative integer, got '" + value + "'");
  return v;
}

Result<WorkerCommandLine> parse_worker_args(const std::vector<std::string>& args) {
  WorkerCommandLine cl;
  WorkerOptions& o = cl.options;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") { cl.help = true; continue; }
    if (a == "--version") { cl.version = true; continue; }
    std::string name = a, value;
    bool inline_value = false;
    if (auto eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos) {
      name = a.substr(0, eq);
      value = a.substr(eq + 1);
      inline_value = true;
    }
    static const char* const kValued[] = {"--model", "--socket", "--backend", "--threads", "--kv-blocks",
                                          "--max-frame-bytes", "--vram-budget", "--redis",
                                          "--redis-password-file", "--parent-pid", "--stall-exit-s",
                                          "--max-step-tokens", "--expert-policy", "--prefetch", "--dense-weights",
                                          "--host-experts", "--misses", "--routing", "--prefix-cache",
                                          "--warm-profile", "--save-profile", "--save-profile-every-s", "--kv-dtype",
                                          "--kv-trade", "--kv-give-back-s", "--prefetch-guess", "--device",
                                          "--fused-decode"};
    bool known = false;
    for (const char* k : kValued) known = known || name == k;
    if (!known) return make_error("unknown option '" + a + "' (see --help)");
    if (!inline_value) {
      if (i + 1 >= args.size()) return make_error("option " + name + " needs a value");
      value = args[++i];
    }
    // An enum option from its spelling, or the message that refuses it.
    std::string refusal;
    auto choose = [&](auto& field) {
      auto c = parse_option<std::remove_reference_t<decltype(field)>>(name, value);
      if (c) field = *c;
      else refusal = c.error();
      return c.ok();
    };
    if (name == "--model") o.model_path = value;
    else if (name == "--socket") o.socket_path = value;
    else if (name == "--backend") {
      if (!choose(o.backend)) return make_error(refusal);
    } else if (name == "--threads" || name == "--kv-blocks") {
      auto v = parse_count(name, value);
      if (!v.ok()) return make_error(v.error());
      if (name == "--threads") {
        o.cpu.threads = *v;
        o.cuda.host_threads = *v;
      } else {
        o.cpu.kv_blocks = *v;
        o.cuda.kv_blocks = *v;
      }
    } else if (name == "--max-frame-bytes" || name == "--vram-budget") {
      auto v = parse_byte_size(value);
      if (!v.ok()) return make_error("option " + name + ": " + v.error());
      if (name == "--vram-budget") o.cuda.vram_budget = size_t(*v);
      else {
        if (*v < protocol::kFrameHeaderBytes || *v > protocol::kMaxFrameBytesCeiling)
          return make_error("option --max-frame-bytes out of range: '" + value + "'");
        o.max_frame_bytes = size_t(*v);
      }
    } else if (name == "--redis") {
      o.redis_url = value;
    } else if (name == "--redis-password-file") {
      o.redis_password_file = value;
    } else if (name == "--warm-profile" || name == "--save-profile") {
      if (value.empty()) return make_error("option " + name + " needs a file name");
      (name == "--warm-profile" ? o.warm_profile : o.save_profile) = value;
    } else if (name == "--parent-pid" || name == "--stall-exit-s" || name == "--save-profile-every-s") {
      auto v = parse_count(name, value);
      if (!v.ok()) return make_error(v.error());
      if (*v < 1) return make_error("option " + name + " needs a positive number, got '" + value + "'");
      (name == "--parent-pid" ? o.parent_pid : name == "--stall-exit-s" ? o.stall_exit_s : o.save_profile_every_s) = *v;
    } else if (name == "--max-step-tokens") {
      auto v = parse_count(name, value);
      if (!v.ok()) return make_error(v.error());
      if (*v < 1 || *v > 8192) return make_error("option --max-step-tokens must be in [1, 8192], got '" + value + "'");
      o.cuda.max_step_tokens = *v;
    } else if (name == "--expert-policy") {
      if (!choose(o.cuda.policy)) return make_error(refusal);
    } else if (name == "--kv-dtype") {
      if (!choose(o.cuda.kv_dtype)) return make_error(refusal);
      o.cpu.kv_dtype = o.cuda.kv_dtype == KvDtypeChoice::int8  ? KvDtype::int8
                       : o.cuda.kv_dtype == KvDtypeChoice::fp8 ? KvDtype::fp8
                                                               : KvDtype::bf16;
    } else if (name == "--prefetch-guess") {
      if (!choose(o.cuda.prefetch_guess)) return make_error(refusal);
    } else if (name == "--kv-trade") {
      if (value != "on" && value != "off") return make_error("option --kv-trade takes on or off, got '" + value + "'");
      o.cuda.kv_trade = value == "on";
    } else if (name == "--device") {
      auto v = parse_count(name, value);
      if (!v.ok()) return make_error(v.error());
      o.cuda.device = int(*v);
      o.device_given = true;
    } else if (name == "--kv-give-back-s") {
      auto v = parse_count(name, value);
      if (!v.ok()) return make_error(v.error());
      o.cuda.kv_give_back_s = *v;
    } else if (name == "--dense-weights") {
      if (!choose(o.cuda.dense_weights)) return make_error(refusal);
    } else if (name == "--prefetch") {
      if (value != "on" && value != "off") return make_error("option --prefetch takes on or off, got '" + value + "'");
      o.cuda.prefetch = value == "on";
    } else if (name == "--fused-decode") {
      if (value != "on" && value != "off")
        return make_error("option --fused-decode takes on or off, got '" + value + "'");
      o.cuda.fused_decode = value == "on";
    } else if (name == "--prefix-cache") {
      if (value != "on" && value != "off")
        return make_error("option --prefix-cache takes on or off, got '" + value + "'");
      o.cpu.prefix_cache = o.cuda.prefix_cache = value == "on";
    } else if (name == "--host-experts") {
      if (!choose(o.cuda.host_experts)) return make_error(refusal);
    } else if (name == "--misses") {
      if (!choose(o.cuda.misses)) return make_error(refusal);
    } else if (name == "--routing") {
      o.cuda.uniform_routing_seed = 0;
      o.cuda.routing_trace.clear();
      if (value == "uniform") {
        o.cuda.uniform_routing_seed = 0x5eed;
      } else if (value.rfind("replay:", 0) == 0 && value.size() > 7) {
        o.cuda.routing_trace = value.substr(7);
      } else if (value != "router") {
        return make_error("option --routing takes router, uniform or replay:FILE, got '" + value + "'");
      }
      o.routing = value;
    }
  }
  if (!cl.help && !cl.version) {
    if (o.model_path.empty()) return make_error("option --model is required");
    if (o.socket_path.empty()) return make_error("option --socket is required");
  }
  return cl;
}

std::string worker_usage() {
  return "usage: moe-worker --model DIR|FILE --socket PATH [options]\n"
         "Loads a model and serves steps to one gateway over a Unix socket.\n"
         "  --model DIR|FILE        checkpoint folder (bf16, GPTQ, AWQ), GGUF file or packed model file\n"
         "  --socket PATH           Unix socket to listen on (parent made 0700, socket 0600)\n"
         "  --backend auto|cpu|cuda compute backend (default auto: cuda when this build has it, a\n"
         "                          GPU is visible and the CUDA engine runs the model (not yet\n"
         "                          DeepSeek-V2), else cpu; the log says which and why)\n"
         "  --threads N             CPU threads (default: all cores); with cuda, the threads that\n"
         "                          compute missed experts on the host\n"
         "  --kv-blocks N           KV cache blocks at start (default: the backend's budget; under a\n"
         "                          budget with --kv-trade on, the least the pool keeps)\n"
         "  --kv-trade on|off       under a budget, KV blocks take expert islands when sequences need more\n"
         "                          than are free and give them back when idle; the hello announces the\n"
         "                          most KV the worker can reach (cuda, default on; docs/kv-islands-trade.md)\n"
         "  --kv-give-back-s S      seconds more than half the KV blocks must stay free before the grown\n"
         "                          part goes back to the islands (cuda, default 30; 0: at once)\n"
         "  --prefix-cache on|off   keep the KV of released sequences' whole blocks, found by the hash of\n"
         "                          their prefix, so that a prompt starting the same way (a session's next\n"
         "                          turn, a shared system prompt) computes only the rest (default on)\n"
         "  --kv-dtype D            the KV cache's rows: bf16, int8 or fp8 (one byte a value and a scale\n"
         "                          per token and head: half the bytes, docs/kv-cache.md), or auto\n"
         "                          (default): int8 under a budget with fewer islands than experts\n"
         "                          (cuda), else bf16; the cpu backend's bf16 rows are f32\n"
         "  --max-frame-bytes N     largest frame accepted (default 64M)\n"
         "  --device N              the CUDA device, an index among those this process sees (cuda, default 0;\n"
         "                          CUDA_VISIBLE_DEVICES chooses and orders them; deploy/supervise.sh starts a\n"
         "                          worker per visible GPU with its own --device, socket and name)\n"
         "  --vram-budget SIZE      device memory to use, e.g. 12GiB (cuda; default: free memory less 512 MiB);\n"
         "                          one allocation holds weights, KV, workspace and expert islands\n"
         "  --max-step-tokens N     tokens per forward pass; larger steps run as several (cuda, default 512)\n"
         "  --expert-policy P       expert eviction under a budget: lru, lfu or ours (cuda, default ours)\n"
         "  --prefetch on|off       copy the next layer's predicted experts ahead (cuda, default on)\n"
         "  --prefetch-guess G      what predicts them in decode: router (the next layer's router on this\n"
         "                          layer's state, default) or transition (a table learned from the layers'\n"
         "                          routing); copy mode (cuda)\n"
         "  --fused-decode on|off   with every expert resident, a decode pass of one token runs all layers\n"
         "                          in one launch where the model allows (cuda, default off: slower than\n"
         "                          the chain of kernels so far, docs/fused-decode.md)\n"
         "  --dense-weights W       non-expert matrices: bf16, int8 (per-row scales), int4 (groups of 64;\n"
         "                          matrices holding router rows, lm_head and widths int4 cannot take stay\n"
         "                          int8), or auto (default): bf16 when every expert stays resident within\n"
         "                          the budget, else int8 (cuda). Measured against bf16 on the demo model's\n"
         "                          held-out text: int8 +0.02 % perplexity, 99.4 % of top-k routing choices\n"
         "                          the same (worst layer 99.2 %); int4 +0.8 %, 96.4 % (95.7 %), for ~3 %\n"
         "                          more expert islands\n"
         "  --host-experts M        auto (default), on or off: under a budget, the host's cores compute part\n"
         "                          of a decode step's missed experts while the link brings the rest, split\n"
         "                          by speeds measured at start; auto: where those speeds give the host a\n"
         "                          share (streamed misses) or two threads (copied); the last bits of the\n"
         "                          outputs then follow this machine's timings (cuda)\n"
         "  --misses stream|copy    under a budget, a decode step's missed experts are read by the kernels\n"
         "                          from pinned host memory over the link (stream, default), or copied\n"
         "                          into islands first (copy, the mode --prefetch acts in)\n"
         "  --routing R             benchmarks only: router (default, the model's own choice of experts),\n"
         "                          uniform (each token's experts drawn uniformly, the router's weights\n"
         "                          kept), or replay:FILE (the choices of a recorded trace of this\n"
         "                          shape, bench/e2e/traces/, each sequence walking it from its own\n"
         "                          offset); the outputs are then not the model's (cuda)\n"
         "  --warm-profile FILE     before serving, seed the eviction policy with a routing profile's\n"
         "                          expert use and fill the free islands (after the re-warm from Redis,\n"
         "                          if any) with its most used experts: a profile --save-profile wrote,\n"
         "                          or `moe profile` made from a text, a routing trace or Redis;\n"
         "                          another model's profile is refused (but when FILE is also the\n"
         "                          --save-profile file: then a missing or unusable one is skipped)\n"
         "  --save-profile FILE     keep this worker's expert use (tokens each expert served) in FILE,\n"
         "                          written whole every --save-profile-every-s seconds (default 60)\n"
         "                          and at exit; a profile already there of this model is added to\n"
         "  --redis URL             Redis for warm-expert state and events\n"
         "                          (redis://[[USER]:PASSWORD@]HOST[:PORT][/DB])\n"
         "  --redis-password-file F the Redis password (or USER:PASSWORD), first line of F\n"
         "  --parent-pid PID        exit (SIGTERM first) when process PID, the one that started\n"
         "                          this worker, is gone (the gateway passes its own)\n"
         "  --stall-exit-s N        a step that makes no progress for N s ends the worker (exit 3)\n"
         "                          so that its supervisor restarts it (default 30); the gateway\n"
         "                          fails over within 3 s of the last sign of progress\n"
         "  --help, --version\n";
}

}  // namespace moe::worker
