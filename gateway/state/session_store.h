#pragma once
// Conversations kept by id, so that a client can continue one through a
// restarted gateway or another gateway instance.
//
// Who may read a session: its owner. With API keys the owner is the caller's
// key (a digest of it names the session's namespace, so another key's
// caller cannot reach it whatever id it sends); without keys nobody is known,
// so ids are issued by the server (128 random bits) and knowing one is the
// only way in.
//
// What is kept: role and text of each turn, nothing else a client sent;
// at most `max_messages` turns and `max_bytes` of text per session (the
// oldest turns go first, a leading system turn last), with a TTL renewed on
// every write. The messages live in Redis (protocol::session_key(), a JSON
// array) and in this process' memory (least recently used dropped past
// `memory_bytes`) for when Redis is not configured or not reachable. What
// comes back from Redis is validated like a request. Every save also appends
// a "session" event to the workers' event stream (MAXLEN ~ bounded).
//
// Threading: loop thread only.

#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <optional>
#include <string>
#include <unordered_map>

#include "gateway/chat_message.h"
#include "gateway/state/redis_client.h"
#include "protocol/redis_schema.h"

namespace moe::gw {

struct SessionStoreOptions {
  uint64_t ttl_s = 24 * 3600;
  std::string events_key;  // "" → no events
  uint64_t stream_max_len = protocol::kStreamMaxLen;
  size_t max_messages = 64;             // turns per session
  size_t max_bytes = size_t(256) << 10;  // text per session
  size_t memory_bytes = size_t(64) << 20;  // the in-process mirror, every session together
  // One caller's sessions may hold this share of memory_bytes; past it its
  // own least recently used go first, so one client's new sessions cannot
  // push every other client's out (0: no share, the whole mirror).
  size_t caller_share_divisor = 8;
};

// A session as the store addresses it.
struct SessionKey {
  std::string owner;  // owner_of_key(), or open_owner() for server-issued ids
  std::string id;
  // Whose memory it counts against (the caller: its key or address; not
  // part of the key). "": the owner's.
  std::string caller = {};
};

class SessionStore {
 public:
  // `redis` may be null (in-process only); it must outlive the store.
  SessionStore(RedisClient* redis, SessionStoreOptions opts);

  // A session id is 1..128 characters of [A-Za-z0-9_.:-].
  static bool valid_id(const std::string& id);
  // A new id of the server's own shape: "s-" and 32 hex digits from the
  // system's random source.
  static std::string issue_id();
  static bool issued_shape(const std::string& id);
  // The owner of a key-holding caller's sessions.
  static std::string owner_of_key(const std::string& api_key);
  // The owner of the sessions of a gateway without keys (server-issued ids).
  static std::string open_owner() { return std::string(protocol::kSessionOwnerOpen); }

  // The stored turns (empty for an unknown or expired session), and whether
  // anything is stored under the key at all (a copy that failed its checks
  // counts: the session is known, its turns are not used). Asks Redis when
  // it is connected, else answers from memory at once.
  void load(const SessionKey& key, std::function<void(ChatMessages, bool)> done);
  // Replaces the session's turns (capped) and renews its TTL; `saved` (if
  // any) runs once Redis has stored them (or failed to: its reply or the
  // connection's loss), or at once without Redis.
  void save(const SessionKey& key, ChatMessages messages, std::function<void()> saved = {});

  // The newest turns that fit the caps, a leading system turn kept while it
  // fits beside the newest; when not even the newest turn fits, the end of
  // its text (the bytes that fit, cut at a character boundary).
  static ChatMessages capped(ChatMessages messages, size_t max_messages, size_t max_bytes);

  size_t in_memory() const { return lru_.size(); }
  size_t memory_bytes() const { return memory_bytes_; }
  size_t memory_bytes(const std::string& caller) const {
    auto it = caller_bytes_.find(caller);
    return it == caller_bytes_.end() ? 0 : it->second;
  }
  // Saves Redis did not take (an error reply such as a full memory, or the
  // connection lost first); the turns stay in this process' mirror,
  // marked as newer than Redis' copy (below).
  uint64_t save_failures() const { return save_failures_; }
  const SessionStoreOptions& options() const { return opts_; }

 private:
  struct Held {
    std::string key;
    std::string caller;  // SessionKey::caller (or owner)
    ChatMessages messages;
    size_t bytes = 0;
    std::chrono::steady_clock::time_point expires;
    // Saved here but not (yet) in Redis: saved while Redis was away, or
    // refused by it. load() then answers from here, the newer copy, and the
    // session's next save writes it to Redis whole.
    bool unsynced = false;
    uint64_t version = 0;  // the save that wrote it (a Redis reply names the save it answers)
  };
  void remember(const std::string& key, const std::string& caller, const ChatMessages& messages, bool unsynced);
  void forget(std::list<Held>::iterator it);
  ChatMessages from_memory(const std::string& key);
  // Redis' copy as turns; nullopt where it fails its checks (said in the log).
  std::optional<ChatMessages> from_redis(const std::string& key, std::string_view text) const;
  static std::string redis_key(const SessionKey& k) { return protocol::session_key(k.owner, k.id); }
  // Whose memory share a session counts against: its caller, else its owner.
  static const std::string& memory_caller(const SessionKey& k) { return k.caller.empty() ? k.owner : k.caller; }
  // The most bytes a session's stored JSON may take (what load() accepts).
  size_t max_stored_bytes() const { return 6 * opts_.max_bytes + 64 * opts_.max_messages + 4096; }

  RedisClient* redis_;
  SessionStoreOptions opts_;
  std::list<Held> lru_;  // most recently used first
  std::unordered_map<std::string, std::list<Held>::iterator> index_;
  size_t memory_bytes_ = 0;
  std::unordered_map<std::string, size_t> caller_bytes_;  // Held::bytes by Held::caller
  uint64_t saves_ = 0;
  uint64_t save_failures_ = 0;
};

}  // namespace moe::gw
