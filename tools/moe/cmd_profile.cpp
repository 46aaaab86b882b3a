// moe profile: makes a routing profile (residency/routing_profile.h), the
// file `moe-worker --warm-profile` fills its islands from, out of a text run
// through the model, a recorded routing trace, or the routing summaries the
// workers published to Redis; or shows one.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "engine/cpu_engine.h"
#include "model/model_files.h"
#include "protocol/redis_endpoint.h"
#include "protocol/redis_reply.h"
#include "protocol/redis_schema.h"
#include "replay/routing_trace.h"
#include "replay/trace_replay.h"
#include "residency/routing_profile.h"
#include "tools/moe/commands.h"
#include "tools/moe/load_tokenizer.h"

namespace moe::cli {

namespace {

void usage(FILE* out) {
  std::fprintf(
      out,
      "usage: moe profile --model DIR|FILE --out FILE (--text FILE | --trace FILE | --redis URL) [options]\n"
      "       moe profile --show FILE [--islands N]\n\n"
      "Makes a routing profile: the tokens each expert of each MoE layer served, which\n"
      "`moe-worker --warm-profile FILE` fills its expert islands from before serving.\n\n"
      "  --model DIR|FILE     the model the profile is for (its layers and experts; with --text,\n"
      "                       the model that routes the text, on the CPU engine)\n"
      "  --out FILE           where to write the profile (replaced whole)\n"
      "  --text FILE          route this text (a sample of the traffic to expect) through the model\n"
      "  --ctx N              --text: tokens per pass (default 512)\n"
      "  --threads N          --text: CPU threads (default: all cores)\n"
      "  --trace FILE         a recorded routing trace: JSON lines {\"token\",\"layer\",\"experts\"}\n"
      "                       or a .safetensors [MoE layers, tokens, top_k] tensor; its layers count\n"
      "                       MoE layers\n"
      "  --tensor NAME        the trace's tensor (default eval.routing_topk)\n"
      "  --first-token N      --trace: count from the trace's token N (default 0)\n"
      "  --tokens N           --trace: count only N tokens (default: to the end)\n"
      "  --redis URL          the routing summaries workers published for this model\n"
      "                       (moe:<model id>:routing, as long as the stream keeps them)\n"
      "  --redis-password-file F  --redis: the password (or USER:PASSWORD), first line of F\n"
      "  --model-id ID        --redis: the model's name in Redis (default: from --model, as the\n"
      "                       worker names it)\n"
      "  --show FILE          print a profile's summary: tokens, per layer the busiest experts,\n"
      "                       and the share of uses N islands filled from it would serve\n"
      "  --islands N          --show: that N (default: a quarter of all experts)\n");
}

Result<RoutingProfile> from_text(const std::string& model, const std::string& path, int ctx, int threads) {
  auto text_ids = text_file_ids(model, path);
  if (!text_ids) return make_error(text_ids.error());
  const std::vector<int32_t>& ids = text_ids.value();
  auto files = ModelFiles::open(model);
  if (!files) return make_error(files.error());
  if (ids.empty()) return make_error(path + " holds no tokens");
  EngineOptions opts;
  opts.threads = threads;
  auto engine = CpuEngine::create(files.value(), opts);
  if (!engine) return make_error(engine.error());
  CpuEngine& e = *engine.value();
  // A pass's expert uses are counted in 16 bits a sequence.
  ctx = std::min({ctx, e.max_context() - 1, 65535 / std::max(1, e.desc().moe.top_k)});
  RoutingProfile p = RoutingProfile::for_model(e.desc(), protocol::redis_model_name(model));
  std::vector<uint64_t> use(p.counts.size());
  for (size_t begin = 0; begin < ids.size(); begin += size_t(ctx)) {
    const size_t end = std::min(ids.size(), begin + size_t(ctx));
    SeqInput in_seq;
    in_seq.seq_id = 1;
    in_seq.tokens.assign(ids.begin() + long(begin), ids.begin() + long(end));
    in_seq.sample = false;
    auto out = e.step(std::span<const SeqInput>(&in_seq, 1));
    if (!out) return make_error(out.error());
    e.release(1);
    const auto& c = (*out)[0].expert_counts;
    std::fill(use.begin(), use.end(), 0);
    for (size_t i = 0; i < std::min(c.size(), use.size()); ++i) use[i] = c[i];
    p.add(use, end - begin);
    std::fprintf(stderr, "\r%zu/%zu tokens", end, ids.size());
  }
  std::fprintf(stderr, "\n");
  p.source = "moe profile --text " + path;
  return p;
}

Result<RoutingProfile> from_trace(const ModelDesc& desc, const std::string& model_id, const std::string& path,
                                  const std::string& tensor, long first, long count) {
  auto tr = read_routing_trace(path, tensor);
  if (!tr) return make_error(tr.error());
  if (first > 0 || count > 0) tr = trace_slice(*tr, first, count > 0 ? count : -1);
  if (tr->steps.empty()) return make_error(path + ": no steps in the tokens asked for");
  RoutingProfile p = RoutingProfile::for_model(desc, model_id);
  if (tr->n_layers > p.n_moe_layers())
    return make_error(path + " routes " + std::to_string(tr->n_layers) + " MoE layers; the model has " +
                      std::to_string(p.n_moe_layers()));
  if (tr->n_experts > p.n_experts)
    return make_error(path + " names expert " + std::to_string(tr->n_experts - 1) + "; the model has " +
                      std::to_string(p.n_experts) + " a layer");
  int64_t last = -1, tokens = 0;
  for (const RoutingStep& s : tr->steps) {
    for (int e : s.experts)
      if (e >= 0) ++p.counts[size_t(s.layer) * size_t(p.n_experts) + size_t(e)];
    if (s.layer == 0 && s.token != last) {
      last = s.token;
      ++tokens;
    }
  }
  p.tokens = uint64_t(tokens);
  p.source = "moe profile --trace " + path;
  return p;
}

Result<RoutingProfile> from_redis(const ModelDesc& desc, const std::string& model_id, const std::string& url,
                                  const std::string& password_file) {
  auto ep = protocol::parse_redis_url(url);
  if (!ep) return make_error(ep.error());
  if (!password_file.empty()) MOE_TRY(protocol::read_redis_password_file(password_file, &ep.value()));
  const timeval tv{2, 0};
  redisContext* c = redisConnectWithTimeout(ep->host.c_str(), ep->port, tv);
  struct Close {
    redisContext* c;
    ~Close() {
      if (c) redisFree(c);
    }
  } closer{c};
  if (!c || c->err) return make_error("Redis at " + ep->where() + ": " + (c ? c->errstr : "no memory"));
  // A reply, or the error that stands for it.
  auto command = [&](const std::vector<std::string>& args, const char* what) -> Result<protocol::RedisReply> {
    protocol::RedisReply r = protocol::redis_command(c, args);
    if (!r) return make_error(std::string("Redis: ") + what + ": " + c->errstr);
    if (r->type == REDIS_REPLY_ERROR) return make_error(std::string("Redis: ") + what + ": " + protocol::reply_text(r.get()));
    return r;
  };
  if (ep->auth()) {
    std::vector<std::string> a = {"AUTH"};
    if (!ep->user.empty()) a.push_back(ep->user);
    a.push_back(ep->password);
    MOE_TRY(command(a, "AUTH"));
  }
  if (ep->db != 0) MOE_TRY(command({"SELECT", std::to_string(ep->db)}, "SELECT"));
  RoutingProfile p = RoutingProfile::for_model(desc, model_id);
  const std::string key = protocol::routing_stream_key(model_id);
  std::string start = "-";
  size_t entries = 0, skipped = 0;
  std::vector<uint64_t> use(p.counts.size());
  for (;;) {
    auto r = command({"XRANGE", key, start, "+", "COUNT", "1000"}, "XRANGE");
    if (!r) return make_error(r.error());
    const redisReply* page = r->get();
    const size_t n = page->type == REDIS_REPLY_ARRAY ? page->elements : 0;
    const std::string page_start = start;
    std::string id;
    protocol::StreamFields fields;
    for (size_t i = 0; i < n; ++i) {
      if (!protocol::stream_entry(page->element[i], &id, &fields)) {
        ++skipped;
        continue;
      }
      start = "(" + id;
      const std::string* layers = protocol::find_field(fields, protocol::stream_field::kLayers);
      auto counts = layers ? protocol::parse_routing_layers(*layers, p.n_moe_layers(), p.n_experts)
                           : Result<std::vector<float>>(make_error("no layers field"));
      if (!counts) {
        ++skipped;
        continue;
      }
      std::fill(use.begin(), use.end(), 0);
      for (size_t j = 0; j < std::min(counts->size(), use.size()); ++j) use[j] = uint64_t((*counts)[j] + 0.5f);
      uint64_t first_layer = 0;
      for (int x = 0; x < p.n_experts && size_t(x) < use.size(); ++x) first_layer += use[size_t(x)];
      p.add(use, first_layer / uint64_t(std::max(p.top_k, 1)));
      ++entries;
    }
    if (n < 1000 || start == page_start) break;  // the last page, or one whose ids could not be read
  }
  if (entries == 0)
    return make_error("no routing summaries of model '" + model_id + "' in Redis at " + ep->where() + " (" + key +
                      (skipped ? ": " + std::to_string(skipped) + " unreadable" : ": empty") + ")");
  std::fprintf(stderr, "%zu routing summaries read from %s", entries, key.c_str());
  if (skipped) std::fprintf(stderr, ", %zu skipped (not this model's shape or unreadable)", skipped);
  std::fprintf(stderr, "\n");
  p.source = "moe profile --redis " + ep->where() + " " + key;
  return p;
}

int show(const std::string& path, long islands) {
  auto p = read_routing_profile(path);
  if (!p) {
    std::fprintf(stderr, "moe profile: %s\n", p.error().c_str());
    return 1;
  }
  const size_t all = size_t(p->n_moe_layers()) * size_t(p->n_experts);
  const size_t n = islands > 0 ? size_t(islands) : std::max<size_t>(1, all / 4);
  std::printf("profile %s: model %s (%s), %d MoE layers x %d experts, top-%d, %llu tokens\nsource: %s\n",
              path.c_str(), p->model.c_str(), p->architecture.c_str(), p->n_moe_layers(), p->n_experts, p->top_k,
              (unsigned long long)p->tokens, p->source.c_str());
  std::printf("%zu islands (%.1f %% of the experts) filled from it serve %.1f %% of its uses\n", n,
              100.0 * double(n) / double(std::max<size_t>(all, 1)), 100.0 * p->coverage(n));
  for (int ml = 0; ml < p->n_moe_layers(); ++ml) {
    std::vector<int> e(size_t(p->n_experts));
    for (int i = 0; i < p->n_experts; ++i) e[size_t(i)] = i;
    std::stable_sort(e.begin(), e.end(), [&](int a, int b) { return p->count(ml, a) > p->count(ml, b); });
    uint64_t sum = 0;
    for (int i = 0; i < p->n_experts; ++i) sum += p->count(ml, i);
    std::printf("layer %3d:", p->model_layers[size_t(ml)]);
    for (int i = 0; i < std::min(p->n_experts, 8); ++i)
      std::printf(" %d (%.1f%%)", e[size_t(i)], sum ? 100.0 * double(p->count(ml, e[size_t(i)])) / double(sum) : 0.0);
    std::printf("\n");
  }
  return 0;
}

}  // namespace

int cmd_profile(int argc, char** argv) {
  std::string model, out, text, trace, tensor = "eval.routing_topk", redis, password_file, model_id, show_path;
  int ctx = 512, threads = 0;
  long islands = 0, first_token = 0, n_tokens = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "moe profile: %s needs a value (see --help)\n", a.c_str());
      return 2;
    }
    const std::string v = argv[++i];
    auto number = [&](long lo, long* dst) {
      char* end = nullptr;
      const long x = std::strtol(v.c_str(), &end, 10);
      if (!end || *end || end == v.c_str() || x < lo) {
        std::fprintf(stderr, "moe profile: %s needs a whole number of at least %ld, got '%s'\n", a.c_str(), lo,
                     v.c_str());
        return false;
      }
      *dst = x;
      return true;
    };
    long n = 0;
    if (a == "--model") model = v;
    else if (a == "--out") out = v;
    else if (a == "--text") text = v;
    else if (a == "--trace") trace = v;
    else if (a == "--tensor") tensor = v;
    else if (a == "--redis") redis = v;
    else if (a == "--redis-password-file") password_file = v;
    else if (a == "--model-id") model_id = v;
    else if (a == "--show") show_path = v;
    else if (a == "--ctx") {
      if (!number(1, &n)) return 2;
      ctx = int(std::min(n, 1L << 20));
    } else if (a == "--threads") {
      if (!number(0, &n)) return 2;
      threads = int(std::min(n, 4096L));
    } else if (a == "--first-token") {
      if (!number(0, &first_token)) return 2;
    } else if (a == "--tokens") {
      if (!number(1, &n_tokens)) return 2;
    } else if (a == "--islands") {
      if (!number(1, &islands)) return 2;
    } else {
      std::fprintf(stderr, "moe profile: unknown option '%s' (see --help)\n", a.c_str());
      return 2;
    }
  }
  if (!show_path.empty()) return show(show_path, islands);
  const int sources = int(!text.empty()) + int(!trace.empty()) + int(!redis.empty());
  if (model.empty() || out.empty() || sources != 1) {
    std::fprintf(stderr, "moe profile: needs --model, --out and one of --text, --trace, --redis\n\n");
    usage(stderr);
    return 2;
  }
  Result<RoutingProfile> p = make_error("no source");
  if (!text.empty()) {
    p = from_text(model, text, ctx, threads);
  } else {
    auto files = ModelFiles::open(model);
    if (!files) {
      std::fprintf(stderr, "moe profile: %s\n", files.error().c_str());
      return 1;
    }
    const std::string id = model_id.empty() ? protocol::redis_model_name(model) : model_id;
    p = !trace.empty() ? from_trace((*files)->desc(), id, trace, tensor, first_token, n_tokens)
                       : from_redis((*files)->desc(), id, redis, password_file);
  }
  if (!p) {
    std::fprintf(stderr, "moe profile: %s\n", p.error().c_str());
    return 1;
  }
  if (Status s = write_routing_profile(out, *p); !s.ok()) {
    std::fprintf(stderr, "moe profile: %s\n", s.error().c_str());
    return 1;
  }
  const size_t all = p->counts.size();
  std::printf("wrote %s: %llu tokens over %d MoE layers x %d experts; a quarter of the experts filled from it "
              "serve %.1f %% of its uses\n",
              out.c_str(), (unsigned long long)p->tokens, p->n_moe_layers(), p->n_experts,
              100.0 * p->coverage(std::max<size_t>(1, all / 4)));
  return 0;
}

}  // namespace moe::cli
