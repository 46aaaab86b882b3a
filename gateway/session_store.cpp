#include "gateway/session_store.h"

#include <hiredis/hiredis.h>

#include <cstdio>

namespace moe::gw {

using json = nlohmann::json;

SessionStore::SessionStore(RedisClient* redis, SessionStoreOptions opts)
    : redis_(redis), opts_(std::move(opts)) {}

bool SessionStore::valid_id(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '-' || c == '.' || c == ':';
    if (!ok) return false;
  }
  return true;
}

void SessionStore::remember(const std::string& id, const json& messages) {
  const auto now = std::chrono::steady_clock::now();
  if (memory_.size() >= opts_.max_sessions_in_memory) {
    // Drop the expired ones; if that frees nothing, this one is not mirrored.
    for (auto it = memory_.begin(); it != memory_.end();)
      it = it->second.expires <= now ? memory_.erase(it) : ++it;
    if (memory_.size() >= opts_.max_sessions_in_memory && !memory_.count(id)) return;
  }
  memory_[id] = Held{messages, now + std::chrono::seconds(opts_.ttl_s)};
}

void SessionStore::load(const std::string& id, std::function<void(json)> done) {
  auto from_memory = [this, id]() -> json {
    auto it = memory_.find(id);
    if (it == memory_.end()) return json::array();
    if (it->second.expires <= std::chrono::steady_clock::now()) {
      memory_.erase(it);
      return json::array();
    }
    return it->second.messages;
  };
  if (!redis_ || !redis_->connected()) return done(from_memory());
  redis_->command(
      {"GET", key(id)}, [this, id, done = std::move(done), from_memory](const redisReply* r) {
        if (!r) return done(from_memory());  // Redis went away meanwhile
        if (r->type == REDIS_REPLY_NIL) return done(from_memory());
        if (r->type != REDIS_REPLY_STRING) return done(from_memory());
        json messages = json::parse(std::string(r->str, r->len), nullptr, false);
        if (messages.is_discarded() || !messages.is_array()) {
          std::fprintf(stderr, "moe-gateway: session %s holds no message list in Redis; ignored\n",
                       id.c_str());
          return done(from_memory());
        }
        remember(id, messages);
        done(std::move(messages));
      });
}

void SessionStore::save(const std::string& id, const json& messages) {
  remember(id, messages);
  if (!redis_ || !redis_->connected()) return;
  redis_->command({"SET", key(id), messages.dump(-1, ' ', false, json::error_handler_t::replace),
                   "EX", std::to_string(opts_.ttl_s)},
                  [](const redisReply*) {});
  if (!opts_.events_key.empty())
    redis_->command(
        {"XADD", opts_.events_key, "MAXLEN", "~", std::to_string(opts_.stream_max_len), "*", "type",
         "session", "session", id, "messages", std::to_string(messages.size())},
        [](const redisReply*) {});
  // The turn's reply goes out right after this: the save must not wait for
  // the loop's next turn (a gateway killed in between would lose it).
  redis_->flush();
}

}  // namespace moe::gw
