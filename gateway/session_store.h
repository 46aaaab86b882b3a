#pragma once
// Conversations kept by id, so that a client can continue one through a
// restarted gateway or another gateway instance: the messages live in Redis
// (key moe:session:<id>, a JSON array, with a TTL renewed on every write),
// mirrored in this process' memory (with the same TTL) for when Redis is not
// configured or not reachable. Every save also appends a "session" event to
// the workers' event stream (MAXLEN ~ bounded).
//
// Threading: loop thread only.

#include <chrono>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_map>

#include "gateway/redis_client.h"

namespace moe::gw {

struct SessionStoreOptions {
  uint64_t ttl_s = 24 * 3600;
  std::string events_key;  // "" → no events
  uint64_t stream_max_len = 10000;
  size_t max_sessions_in_memory = 100000;
};

class SessionStore {
 public:
  // `redis` may be null (in-process only); it must outlive the store.
  SessionStore(RedisClient* redis, SessionStoreOptions opts);

  // A session id is 1..128 characters of [A-Za-z0-9_.:-].
  static bool valid_id(const std::string& id);

  // The stored messages (an empty array for an unknown or expired session).
  // Asks Redis when it is connected, else answers from memory at once.
  void load(const std::string& id, std::function<void(nlohmann::json messages)> done);
  // Replaces the session's messages (and renews its TTL).
  void save(const std::string& id, const nlohmann::json& messages);

  size_t in_memory() const { return memory_.size(); }

 private:
  struct Held {
    nlohmann::json messages;
    std::chrono::steady_clock::time_point expires;
  };
  void remember(const std::string& id, const nlohmann::json& messages);
  std::string key(const std::string& id) const { return "moe:session:" + id; }

  RedisClient* redis_;
  SessionStoreOptions opts_;
  std::unordered_map<std::string, Held> memory_;
};

}  // namespace moe::gw
