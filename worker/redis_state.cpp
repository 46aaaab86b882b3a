#include "worker/redis_state.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>

#include "protocol/redis_reply.h"

namespace moe::worker {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kMaxRoutingQueued = 4096;  // summaries kept while Redis is away

using protocol::reply_text;
using Reply = protocol::RedisReply;

// A field's value, "" when the entry has none.
std::string field(const protocol::StreamFields& fields, std::string_view name) {
  const std::string* v = protocol::find_field(fields, name);
  return v ? *v : std::string();
}

}  // namespace

// ------------------------------------------------------------------ state

struct WorkerRedisState::Conn {
  redisContext* ctx = nullptr;
  bool down_logged = false;
  bool auth_logged = false;
  bool ever_up = false;
  Clock::time_point next_try{};
  int backoff_ms = 0;
  ~Conn() { close(); }
  void close() {
    if (ctx) redisFree(ctx);
    ctx = nullptr;
  }
  Reply cmd(const std::vector<std::string>& args) {
    if (!ctx) return nullptr;
    Reply r = protocol::redis_command(ctx, args);
    if (!r || ctx->err) {
      close();
      return nullptr;
    }
    return r;
  }
};

WorkerRedisState::WorkerRedisState(WorkerRedisOptions opts, Backend* backend)
    : opts_(std::move(opts)), backend_(backend) {
  auto ep = protocol::parse_redis_url(opts_.url);
  if (ep.ok() && !opts_.password_file.empty()) {
    if (auto st = protocol::read_redis_password_file(opts_.password_file, &ep.value()); !st.ok()) ep = make_error(st.error());
  }
  if (ep.ok()) {
    endpoint_ = ep.value();
    endpoint_ok_ = true;
  } else {
    std::fprintf(stderr, "moe-worker: %s; state stays in this process\n", ep.error().c_str());
  }
  n_experts_ = backend_->describe().experts.n_experts;
}

WorkerRedisState::~WorkerRedisState() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool WorkerRedisState::ensure_connected(Conn& c) {
  if (c.ctx) return true;
  if (!endpoint_ok_) return false;
  const auto now = Clock::now();
  if (now < c.next_try) return false;
  timeval tv{opts_.timeout_ms / 1000, (opts_.timeout_ms % 1000) * 1000};
  c.ctx = redisConnectWithTimeout(endpoint_.host.c_str(), endpoint_.port, tv);
  bool refused = false;
  if (c.ctx && !c.ctx->err) {
    redisSetTimeout(c.ctx, tv);
    if (endpoint_.auth()) {
      std::vector<std::string> auth = {"AUTH"};
      if (!endpoint_.user.empty()) auth.push_back(endpoint_.user);
      auth.push_back(endpoint_.password);
      Reply r = c.cmd(auth);
      if (!r || r->type != REDIS_REPLY_STATUS) {
        // No reply at all is a Redis that did not answer in time (frozen,
        // overloaded), not a refusal: said as such, once until it answers.
        if (!r && !c.down_logged)
          std::fprintf(stderr, "moe-worker: Redis at %s did not answer AUTH within %d ms (retrying)\n",
                       endpoint_.where().c_str(), opts_.timeout_ms);
        else if (r && !c.auth_logged)
          std::fprintf(stderr, "moe-worker: Redis at %s refused the credentials: %s (retrying)\n",
                       endpoint_.where().c_str(), reply_text(r.get()).c_str());
        if (r) c.auth_logged = true;
        c.down_logged = true;
        refused = true;
      }
    }
    if (!refused && endpoint_.db != 0) c.cmd({"SELECT", std::to_string(endpoint_.db)});
  }
  if (refused) {
    c.close();
    c.backoff_ms = std::clamp(c.backoff_ms * 2, 100, 5000);
    c.next_try = now + std::chrono::milliseconds(c.backoff_ms);
    return false;
  }
  if (!c.ctx || c.ctx->err) {
    if (!c.down_logged) {
      std::fprintf(
          stderr,
          "moe-worker: Redis at %s unreachable (%s); state stays in this process, retrying\n",
          endpoint_.where().c_str(), c.ctx ? c.ctx->errstr : "no memory");
      c.down_logged = true;
    }
    c.close();
    c.backoff_ms = std::clamp(c.backoff_ms * 2, 100, 5000);
    c.next_try = now + std::chrono::milliseconds(c.backoff_ms);
    return false;
  }
  if (c.down_logged || !c.ever_up)
    std::fprintf(stderr, "moe-worker: Redis at %s connected%s\n", endpoint_.where().c_str(),
                 endpoint_.auth() ? " and logged in" : "");
  c.down_logged = false;
  c.auth_logged = false;
  c.ever_up = true;
  c.backoff_ms = 0;
  group_ready_ = false;
  return true;
}

WorkerRedisState::Rewarm WorkerRedisState::rewarm() {
  Rewarm out;
  const auto t0 = Clock::now();
  Conn c;
  if (ensure_connected(c)) {
    out.redis_reachable = true;
    // This worker's own newest set: other workers of the model (the CPU
    // fallback that served while this one was down, above all) publish to
    // the same stream, and their sets fit their memory, not this one's.
    // Paged backwards from the newest entry until one of this worker's (the
    // stream is trimmed, so the walk is bounded).
    std::string from = "+";
    bool found = false;
    std::optional<std::vector<protocol::ExpertRef>> newest_any;  // a worker of a new name takes this
    for (size_t scanned = 0; !found && scanned < 20000;) {
      Reply r = c.cmd({"XREVRANGE", resident_key(), from, "-", "COUNT", "128"});
      if (!r || r->type != REDIS_REPLY_ARRAY || r->elements == 0) break;
      for (size_t i = 0; i < r->elements && !found; ++i, ++scanned) {
        std::string id;
        protocol::StreamFields fields;
        if (!protocol::stream_entry(r->element[i], &id, &fields)) continue;
        from = "(" + id;
        const bool own = field(fields, protocol::stream_field::kWorker) == opts_.consumer;
        if (!own && newest_any) continue;
        auto experts = protocol::parse_expert_list(field(fields, protocol::stream_field::kExperts));
        if (experts.ok() && !own) {
          newest_any = std::move(experts.value());
        } else if (experts.ok()) {
          out.previous = experts->size();
          out.resident = backend_->warm(experts.value());
          backend_->wait_for_copies();
          found = true;
        } else {
          std::fprintf(stderr, "moe-worker: skipping garbage resident-state entry %s: %s\n",
                       id.c_str(), experts.error().c_str());
        }
      }
      if (r->elements < 128) break;
    }
    if (!found && newest_any) {
      std::fprintf(stderr, "moe-worker: no resident set of '%s' in Redis: re-warming another worker's newest\n",
                   opts_.consumer.c_str());
      out.previous = newest_any->size();
      out.resident = backend_->warm(*newest_any);
      backend_->wait_for_copies();
    } else if (!found) {
      std::fprintf(stderr, "moe-worker: no resident set in Redis yet: starting cold\n");
    }
  }
  out.ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  return out;
}

void WorkerRedisState::start() {
  queue_resident(protocol::kResidentSnapshot);
  published_version_ = backend_->residency_version();
  if (!endpoint_ok_) return;
  thread_ = std::thread([this] { run(); });
}

void WorkerRedisState::queue_resident(std::string_view kind) {
  Entry e;
  e.key = resident_key();
  e.fields = protocol::resident_entry(opts_.consumer, kind,
                                      protocol::format_expert_list(backend_->resident()));
  std::lock_guard<std::mutex> lk(mu_);
  last_resident_ = e;
  resident_pending_ = std::move(e);
  cv_.notify_all();
}

void WorkerRedisState::apply_hints() {
  if (!hints_waiting_.exchange(false)) return;
  std::vector<protocol::ExpertRef> hints;
  {
    std::lock_guard<std::mutex> lk(mu_);
    hints.swap(hints_);
  }
  backend_->warm(hints);
}

void WorkerRedisState::after_step(const protocol::StepRequest& req,
                                  const protocol::StepReply& reply) {
  apply_hints();
  if (backend_->residency_version() != published_version_) {
    published_version_ = backend_->residency_version();
    queue_resident(protocol::kResidentChange);
  }
  // The gateway's routing class of each sequence, for its routing summary.
  for (const protocol::StepSequence& q : req.sequences)
    if (q.route_bucket != 0) buckets_[q.seq_id] = q.route_bucket;
  for (const protocol::StepResult& r : reply.results) {
    if (r.error != protocol::ErrorCode::none || r.expert_usage.empty()) continue;
    auto& u = usage_[r.seq_id];
    if (u.size() < r.expert_usage.size()) u.resize(r.expert_usage.size());
    for (size_t i = 0; i < r.expert_usage.size(); ++i) u[i] += r.expert_usage[i];
  }
}

void WorkerRedisState::released(uint64_t seq_id) {
  uint64_t bucket = 0;
  if (auto b = buckets_.find(seq_id); b != buckets_.end()) {
    bucket = b->second;
    buckets_.erase(b);
  }
  auto it = usage_.find(seq_id);
  if (it == usage_.end()) return;
  // Per MoE layer, the tokens each expert served.
  const std::string layers = protocol::format_routing_layers(it->second, n_experts_);
  usage_.erase(it);
  Entry e;
  e.key = routing_key();
  e.fields = protocol::routing_entry(opts_.consumer, seq_id, layers, bucket);
  std::lock_guard<std::mutex> lk(mu_);
  if (routing_pending_.size() >= kMaxRoutingQueued) routing_pending_.pop_front();
  routing_pending_.push_back(std::move(e));
  cv_.notify_all();
}

bool WorkerRedisState::publish(Conn& c, const Entry& e) {
  Reply r = c.cmd(protocol::stream_append_command(e.key, opts_.stream_max_len, e.fields));
  return r && r->type == REDIS_REPLY_STRING;
}

void WorkerRedisState::handle_event(const std::string& id, const protocol::StreamFields& fields) {
  const std::string type = field(fields, protocol::stream_field::kType);
  if (type == protocol::kEventWarm) {
    auto experts = protocol::parse_expert_list(field(fields, protocol::stream_field::kExperts));
    if (!experts.ok()) {
      std::fprintf(stderr, "moe-worker: skipping garbage event %s: %s\n", id.c_str(),
                   experts.error().c_str());
      return;
    }
    std::lock_guard<std::mutex> lk(mu_);
    hints_.insert(hints_.end(), experts->begin(), experts->end());
    hints_waiting_ = true;
  } else if (type == protocol::kEventSession) {
    // Sessions are the gateways' business; workers only acknowledge them.
  } else {
    std::fprintf(stderr, "moe-worker: skipping garbage event %s (type '%s')\n", id.c_str(),
                 type.substr(0, 40).c_str());
  }
}

// Reads one batch of events; false when the connection failed.
bool WorkerRedisState::read_events(Conn& c) {
  const std::string key = events_key();
  const std::string group(protocol::kEventsGroup);
  if (!group_ready_) {
    Reply r = c.cmd({"XGROUP", "CREATE", key, group, "$", "MKSTREAM"});
    if (!r) return false;
    if (r->type == REDIS_REPLY_ERROR &&
        reply_text(r.get()).find("BUSYGROUP") == std::string::npos) {
      std::fprintf(stderr, "moe-worker: XGROUP CREATE: %s\n", reply_text(r.get()).c_str());
      return false;
    }
    group_ready_ = true;
  }
  auto handle_entries = [&](const redisReply* list) -> bool {
    if (!list || list->type != REDIS_REPLY_ARRAY) return true;
    std::vector<std::string> acks = {"XACK", key, group};
    for (size_t i = 0; i < list->elements; ++i) {
      std::string id;
      protocol::StreamFields fields;
      if (!protocol::stream_entry(list->element[i], &id, &fields)) {
        std::fprintf(stderr, "moe-worker: skipping a malformed stream entry\n");
        continue;
      }
      handle_event(id, fields);
      acks.push_back(id);  // garbage too: it must not come back forever
    }
    if (acks.size() > 3 && !c.cmd(acks)) return false;
    return true;
  };
  if (!replayed_) {
    // What this worker (same consumer name) read but never acknowledged
    // before it died, then what other dead consumers left pending.
    Reply own = c.cmd(
        {"XREADGROUP", "GROUP", group, opts_.consumer, "COUNT", "1000", "STREAMS", key, "0"});
    if (!own) return false;
    if (own->type == REDIS_REPLY_ARRAY && own->elements == 1 && own->element[0]->elements == 2)
      if (!handle_entries(own->element[0]->element[1])) return false;
    Reply claimed = c.cmd({"XAUTOCLAIM", key, group, opts_.consumer,
                           std::to_string(opts_.claim_idle_ms), "0-0", "COUNT", "1000"});
    if (!claimed) return false;
    if (claimed->type == REDIS_REPLY_ARRAY && claimed->elements >= 2) {
      if (claimed->element[1]->elements)
        std::fprintf(stderr, "moe-worker: claimed %zu pending events of dead workers\n",
                     claimed->element[1]->elements);
      if (!handle_entries(claimed->element[1])) return false;
    }
    replayed_ = true;
  }
  Reply r = c.cmd({"XREADGROUP", "GROUP", group, opts_.consumer, "COUNT", "100", "BLOCK", "200",
                   "STREAMS", key, ">"});
  if (!r) return false;
  if (r->type == REDIS_REPLY_ARRAY && r->elements == 1 &&
      r->element[0]->type == REDIS_REPLY_ARRAY && r->element[0]->elements == 2)
    return handle_entries(r->element[0]->element[1]);
  return true;
}

void WorkerRedisState::run() {
  Conn c;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (stop_) return;
    }
    const bool was_down = c.ctx == nullptr;
    if (!ensure_connected(c)) {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait_for(lk, std::chrono::milliseconds(100), [&] { return stop_; });
      continue;
    }
    if (was_down) {
      // A restarted Redis may have lost the state: publish it again.
      std::lock_guard<std::mutex> lk(mu_);
      if (!resident_pending_ && last_resident_) resident_pending_ = last_resident_;
    }
    // Publish what is queued; on failure it is put back for the next connection.
    std::optional<Entry> resident;
    std::deque<Entry> routing;
    {
      std::lock_guard<std::mutex> lk(mu_);
      resident.swap(resident_pending_);
      routing.swap(routing_pending_);
    }
    bool ok = true;
    if (resident && !(ok = publish(c, *resident))) {
      std::lock_guard<std::mutex> lk(mu_);
      if (!resident_pending_) resident_pending_ = std::move(resident);
    }
    while (ok && !routing.empty()) {
      if (!(ok = publish(c, routing.front()))) break;
      routing.pop_front();
    }
    if (!routing.empty()) {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto it = routing.rbegin(); it != routing.rend(); ++it)
        routing_pending_.push_front(std::move(*it));
      while (routing_pending_.size() > kMaxRoutingQueued) routing_pending_.pop_front();
    }
    if (ok) ok = read_events(c);
    if (!ok) {
      c.close();
      replayed_ = false;
      if (!c.down_logged) {
        std::fprintf(stderr,
                     "moe-worker: lost Redis at %s; state stays in this process, reconnecting\n",
                     endpoint_.where().c_str());
        c.down_logged = true;
      }
      c.backoff_ms = 100;
      c.next_try = Clock::now() + std::chrono::milliseconds(c.backoff_ms);
    }
  }
}

}  // namespace moe::worker
