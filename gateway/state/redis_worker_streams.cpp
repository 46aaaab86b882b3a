#include "gateway/state/redis_worker_streams.h"

#include <hiredis/hiredis.h>

#include "gateway/last_resort.h"

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <set>
#include <utility>

namespace moe::gw {
namespace {

std::string text_of(const redisReply* r) {
  if (r && (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS))
    return std::string(r->str, r->len);
  return "";
}

// Stream ids come from Redis too: at most 40 printable characters reach the log.
std::string printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s.substr(0, 40)) out += (c >= 0x20 && c < 0x7f) ? char(c) : '?';
  return out;
}

bool all_digits(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

// A worker's name as Redis may hold it: anyone who can write the stream
// chooses these bytes, and they reach logs, metrics labels and JSON.
bool plausible_worker_name(const std::string& s) {
  if (s.empty() || s.size() > 128) return false;
  for (unsigned char c : s)
    if (c < 0x21 || c > 0x7e || c == '"' || c == '\\') return false;
  return true;
}

// Distinct workers whose resident sets are kept; more are skipped.
constexpr size_t kMaxWorkers = 256;

namespace field = protocol::stream_field;

}  // namespace

RedisWorkerStreams::RedisWorkerStreams(uv_loop_t* loop, RedisClient* redis,
                                       RedisWorkerStreamsOptions opts)
    : loop_(loop), redis_(redis), opts_(std::move(opts)) {
  timer_ = new uv_timer_t;
  uv_timer_init(loop_, timer_);
  timer_->data = this;
}

RedisWorkerStreams::~RedisWorkerStreams() {
  timer_->data = nullptr;
  uv_close(reinterpret_cast<uv_handle_t*>(timer_),
           [](uv_handle_t* h) { delete reinterpret_cast<uv_timer_t*>(h); });
}

void RedisWorkerStreams::start() {
  redis_->on_connected([this] {
    ++connection_;
    positioned_ = false;
  });
  uv_timer_start(
      timer_,
      [](uv_timer_t* t) {
        if (auto* self = static_cast<RedisWorkerStreams*>(t->data)) last_resort("polling Redis", [self] { self->poll(); });
      },
      opts_.poll_ms, opts_.poll_ms);
}

void RedisWorkerStreams::publish_warm_hints(const std::string& experts) {
  redis_->command(protocol::stream_append_command(events_key(), opts_.stream_max_len,
                                                  protocol::warm_event(experts)),
                  [](const redisReply*) {});
}

// After a (re)connection: the newest resident entry is read whole, and both
// streams continue after their newest id (a restarted Redis may have reset them).
void RedisWorkerStreams::sync_positions() {
  busy_ = true;
  const uint64_t conn = connection_;
  auto pending = std::make_shared<int>(2);
  for (const std::string& key : {resident_key(), routing_key()}) {
    // The resident stream: enough of its tail to find every recently active
    // worker's newest set; the routing stream only needs a position.
    const std::string count = key == resident_key() ? "1000" : "1";
    redis_->command({"XREVRANGE", key, "+", "-", "COUNT", count}, [this, key, conn,
                                                                 pending](const redisReply* r) {
      if (key == routing_key() && r && r->type == REDIS_REPLY_ARRAY) {
        // Learned from the start once; then onwards from our own position.
        if (!routing_positioned_) last_id_[key] = "0-0";
        routing_positioned_ = true;
      } else if (r && r->type == REDIS_REPLY_ARRAY && r->elements >= 1 &&
                 r->element[0]->type == REDIS_REPLY_ARRAY && r->element[0]->elements == 2) {
        last_id_[key] = text_of(r->element[0]->element[0]);
        // Newest first: each worker's newest resident set, oldest applied first.
        std::set<std::string> seen;
        std::vector<std::pair<std::string, std::vector<std::string>>> newest;
        for (size_t k = 0; k < r->elements; ++k) {
          const redisReply* e = r->element[k];
          if (e->type != REDIS_REPLY_ARRAY || e->elements != 2) continue;
          protocol::StreamFields fields;
          const redisReply* f = e->element[1];
          for (size_t i = 0; f->type == REDIS_REPLY_ARRAY && i < f->elements; ++i)
            fields.push_back(text_of(f->element[i]));
          const std::string* worker = protocol::find_field(fields, field::kWorker);
          if (k > 0 && (!worker || !seen.insert(*worker).second)) continue;
          seen.insert(worker ? *worker : std::string());
          newest.emplace_back(text_of(e->element[0]), std::move(fields));
        }
        for (auto it = newest.rbegin(); it != newest.rend(); ++it) take(key, it->first, it->second);
      } else if (r && r->type == REDIS_REPLY_ARRAY) {
        last_id_[key] = "0-0";
      }
      if (--*pending == 0) {
        busy_ = false;
        positioned_ = r != nullptr && conn == connection_;
      }
    });
  }
}

void RedisWorkerStreams::poll() {
  if (busy_ || !redis_->connected()) return;
  if (!positioned_) return sync_positions();
  busy_ = true;
  redis_->command({"XREAD", "COUNT", "1000", "STREAMS", resident_key(), routing_key(),
                   last_id_[resident_key()], last_id_[routing_key()]},
                  [this](const redisReply* r) {
                    busy_ = false;
                    if (!r || r->type != REDIS_REPLY_ARRAY) return;  // nil: nothing new
                    for (size_t s = 0; s < r->elements; ++s) {
                      const redisReply* st = r->element[s];
                      if (st->type != REDIS_REPLY_ARRAY || st->elements != 2) continue;
                      const std::string key = text_of(st->element[0]);
                      const redisReply* entries = st->element[1];
                      for (size_t i = 0;
                           entries->type == REDIS_REPLY_ARRAY && i < entries->elements; ++i) {
                        const redisReply* e = entries->element[i];
                        if (e->type != REDIS_REPLY_ARRAY || e->elements != 2) continue;
                        const std::string id = text_of(e->element[0]);
                        protocol::StreamFields fields;
                        const redisReply* f = e->element[1];
                        for (size_t k = 0; f->type == REDIS_REPLY_ARRAY && k < f->elements; ++k)
                          fields.push_back(text_of(f->element[k]));
                        if (!id.empty()) last_id_[key] = id;
                        take(key, id, fields);
                      }
                    }
                  });
}

void RedisWorkerStreams::take(const std::string& stream, const std::string& id,
                              const protocol::StreamFields& fields) {
  const std::string* worker = protocol::find_field(fields, field::kWorker);
  if (stream == resident_key()) {
    const std::string* experts = protocol::find_field(fields, field::kExperts);
    if (!worker || !plausible_worker_name(*worker) || !experts ||
        !protocol::parse_expert_list(*experts).ok() ||
        (resident_.size() >= kMaxWorkers && !resident_.count(*worker))) {
      ++skipped_;
      std::fprintf(stderr, "moe-gateway: skipping garbage entry %s in %s\n", printable(id).c_str(),
                   stream.c_str());
      return;
    }
    resident_[*worker] = *experts;
    return;
  }
  const std::string* seq = protocol::find_field(fields, field::kSeq);
  const std::string* layers = protocol::find_field(fields, field::kLayers);
  if (!worker || !plausible_worker_name(*worker) || !seq || !all_digits(*seq) || !layers) {
    ++skipped_;
    std::fprintf(stderr, "moe-gateway: skipping garbage entry %s in %s\n", printable(id).c_str(),
                 stream.c_str());
    return;
  }
  ++routing_;
  if (!on_routing_) return;
  const std::string* bucket = protocol::find_field(fields, field::kBucket);
  uint64_t tag = 0;
  if (bucket && all_digits(*bucket) && bucket->size() <= 20)
    tag = std::strtoull(bucket->c_str(), nullptr, 10);
  on_routing_(tag, *layers);
}

}  // namespace moe::gw
