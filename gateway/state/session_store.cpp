#include "gateway/state/session_store.h"

#include <hiredis/hiredis.h>
#include <sys/random.h>

#include <cerrno>
#include <cstdio>
#include <random>
#include <nlohmann/json.hpp>

#include "gateway/json_body.h"
#include "gateway/state/sha256.h"

namespace moe::gw {

using json = nlohmann::json;

namespace {

size_t text_bytes(const ChatMessage& m) {
  return m.role.size() + m.content.size() + m.tool_calls.size() + m.tool_call_id.size();
}

// What one turn takes in the mirror's memory: the object and every string
// it holds (their heap parts; short ones live inside the object).
size_t held_bytes(const ChatMessage& m) {
  size_t b = sizeof(ChatMessage) + 48;  // the vector's slot and the allocator's share
  for (const std::string* f : {&m.role, &m.content, &m.tool_calls, &m.tool_call_id, &m.request_key,
                               &m.request_digest, &m.finish_reason, &m.response_id, &m.usage})
    if (f->capacity() > 15) b += f->capacity() + 1;
  return b;
}

bool known_role(const std::string& r) { return r == "system" || r == "user" || r == "assistant" || r == "tool"; }

}  // namespace

SessionStore::SessionStore(RedisClient* redis, SessionStoreOptions opts) : redis_(redis), opts_(std::move(opts)) {}

bool SessionStore::valid_id(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                    c == '-' || c == '.' || c == ':';
    if (!ok) return false;
  }
  return true;
}

std::string SessionStore::issue_id() {
  uint8_t bytes[16];
  size_t have = 0;
  while (have < sizeof(bytes)) {
    const ssize_t n = ::getrandom(bytes + have, sizeof(bytes) - have, 0);
    if (n > 0) {
      have += size_t(n);
    } else if (errno != EINTR) {
      // No getrandom (an old kernel): the C++ library's own source.
      std::random_device rd;
      for (; have < sizeof(bytes); ++have) bytes[have] = uint8_t(rd());
    }
  }
  static const char* hex = "0123456789abcdef";
  std::string id = "s-";
  for (uint8_t b : bytes) {
    id += hex[b >> 4];
    id += hex[b & 15];
  }
  return id;
}

bool SessionStore::issued_shape(const std::string& id) {
  if (id.size() != 34 || id.compare(0, 2, "s-") != 0) return false;
  for (size_t i = 2; i < id.size(); ++i)
    if (!((id[i] >= '0' && id[i] <= '9') || (id[i] >= 'a' && id[i] <= 'f'))) return false;
  return true;
}

std::string SessionStore::owner_of_key(const std::string& api_key) {
  return protocol::session_owner_of_key(sha256_hex(api_key).substr(0, 32));
}

ChatMessages SessionStore::capped(ChatMessages messages, size_t max_messages, size_t max_bytes) {
  if (messages.empty() || max_messages == 0) return {};
  // A leading system turn keeps its place while it fits beside the newest turn.
  const bool has_system = messages.front().role == "system" && messages.size() > 1;
  const bool keep_system = has_system && max_messages >= 2 &&
                           text_bytes(messages.front()) + text_bytes(messages.back()) <= max_bytes;
  size_t count = keep_system ? 1 : 0, bytes = keep_system ? text_bytes(messages.front()) : 0;
  // The newest turns, as many as fit, back to front.
  size_t first = messages.size();
  const size_t floor = has_system ? 1 : 0;
  while (first > floor && count < max_messages && bytes + text_bytes(messages[first - 1]) <= max_bytes) {
    --first;
    ++count;
    bytes += text_bytes(messages[first]);
  }
  ChatMessages out;
  out.reserve(count + 1);
  if (first == messages.size() && messages.back().role.size() < max_bytes) {
    // Not even the newest turn fits: its last bytes are kept (cut at a
    // character boundary), rather than losing the whole conversation.
    ChatMessage last = std::move(messages.back());
    const size_t room = max_bytes - last.role.size() - (keep_system ? text_bytes(messages.front()) : 0);
    size_t cut = last.content.size() > room ? last.content.size() - room : 0;
    while (cut < last.content.size() && (static_cast<unsigned char>(last.content[cut]) & 0xC0) == 0x80) ++cut;
    last.content.erase(0, cut);
    if (keep_system) out.push_back(std::move(messages.front()));
    out.push_back(std::move(last));
    return out;
  }
  if (keep_system) out.push_back(std::move(messages.front()));
  for (size_t i = first; i < messages.size(); ++i) out.push_back(std::move(messages[i]));
  return out;
}

void SessionStore::forget(std::list<Held>::iterator it) {
  memory_bytes_ -= it->bytes;
  if (auto c = caller_bytes_.find(it->caller); c != caller_bytes_.end() && (c->second -= it->bytes) == 0)
    caller_bytes_.erase(c);
  index_.erase(it->key);
  lru_.erase(it);
}

void SessionStore::remember(const std::string& key, const std::string& caller, const ChatMessages& messages,
                            bool unsynced) {
  if (auto it = index_.find(key); it != index_.end()) forget(it->second);
  Held h;
  h.key = key;
  h.caller = caller;
  h.messages = messages;
  h.unsynced = unsynced;
  h.version = ++saves_;
  h.bytes = sizeof(Held) + 2 * key.size() + 160;  // the list node, the key twice (here and the index), the index's node
  for (const ChatMessage& m : h.messages) h.bytes += held_bytes(m);
  h.expires = std::chrono::steady_clock::now() + std::chrono::seconds(opts_.ttl_s);
  if (h.bytes > opts_.memory_bytes) return;
  // The caller's share first: its own least recently used sessions go.
  if (opts_.caller_share_divisor > 0) {
    const size_t share = std::max(opts_.memory_bytes / opts_.caller_share_divisor, h.bytes);
    for (auto it = lru_.end(); it != lru_.begin() && memory_bytes(caller) + h.bytes > share;) {
      --it;
      if (it->caller != caller) continue;
      auto gone = it++;
      forget(gone);
    }
  }
  while (!lru_.empty() && memory_bytes_ + h.bytes > opts_.memory_bytes) forget(std::prev(lru_.end()));
  memory_bytes_ += h.bytes;
  caller_bytes_[caller] += h.bytes;
  lru_.push_front(std::move(h));
  index_[key] = lru_.begin();
}

ChatMessages SessionStore::from_memory(const std::string& key) {
  auto it = index_.find(key);
  if (it == index_.end()) return {};
  auto held = it->second;
  if (held->expires <= std::chrono::steady_clock::now()) {
    forget(held);
    return {};
  }
  lru_.splice(lru_.begin(), lru_, held);
  return held->messages;
}

std::optional<ChatMessages> SessionStore::from_redis(const std::string& key, std::string_view text) const {
  // Whatever Redis holds is checked like a request: it may be anyone's bytes.
  auto bad = [&](const char* why) -> std::optional<ChatMessages> {
    std::fprintf(stderr, "moe-gateway: session %s in Redis: %s; ignored\n", key.c_str(), why);
    return std::nullopt;
  };
  // JSON escaping grows text at most sixfold (\u0000 for a control byte);
  // save() keeps what it writes under the same bound.
  if (text.size() > max_stored_bytes()) return bad("larger than a session may be");
  ParsedJson parsed = parse_json_body(text, 6);  // turns, a turn, its tool calls, a call, its function
  if (std::holds_alternative<ApiError>(parsed)) return bad("not JSON");
  const json& j = std::get<json>(parsed);
  if (!j.is_array()) return bad("not a list of turns");
  ChatMessages out;
  for (const json& m : j) {
    if (!m.is_object()) return bad("a turn is not an object");
    auto r = m.find("role"), c = m.find("content");
    if (r == m.end() || c == m.end() || !r->is_string() || !c->is_string()) return bad("a turn lacks role or content");
    if (!known_role(r->get<std::string>())) return bad("a turn has an unknown role");
    ChatMessage turn{r->get<std::string>(), c->get<std::string>(), "", ""};
    if (auto t = m.find("tool_calls"); t != m.end()) {
      // Stored as the request validated it: a list of calls.
      if (!t->is_array() || t->size() > 64) return bad("a turn's tool_calls is not a list of calls");
      for (const json& call : *t)
        if (!call.is_object() || !call.contains("function") || !call["function"].is_object() ||
            !call["function"].contains("name") || !call["function"]["name"].is_string() ||
            !call["function"].contains("arguments") || !call["function"]["arguments"].is_string())
          return bad("a turn's tool call lacks a function name or arguments");
      turn.tool_calls = t->dump();
    }
    if (auto id = m.find("tool_call_id"); id != m.end()) {
      if (!id->is_string()) return bad("a turn's tool_call_id is not a string");
      turn.tool_call_id = id->get<std::string>();
    }
    for (auto [name, field] : {std::pair{"request_key", &turn.request_key},
                               std::pair{"request_digest", &turn.request_digest},
                               std::pair{"finish_reason", &turn.finish_reason},
                               std::pair{"response_id", &turn.response_id}}) {
      auto k = m.find(name);
      if (k == m.end()) continue;
      if (!k->is_string() || k->get_ref<const std::string&>().size() > 128) return bad("a turn's request fields are malformed");
      *field = k->get<std::string>();
    }
    if (auto k = m.find("created"); k != m.end()) {
      if (!k->is_number_integer() || k->get<int64_t>() < 0) return bad("a turn's created is not a number of seconds");
      turn.created = k->get<int64_t>();
    }
    if (auto k = m.find("usage"); k != m.end()) {
      // Counts, and objects of counts (prompt_tokens_details…), as the response had them.
      const auto counts = [](const json& o) {
        if (!o.is_object() || o.size() > 16) return false;
        for (const auto& [name, v] : o.items())
          if (name.size() > 64 || !v.is_number_integer() || v.get<int64_t>() < 0) return false;
        return true;
      };
      bool ok = k->is_object() && k->size() <= 16;
      if (ok)
        for (const auto& [name, v] : k->items())
          ok = ok && name.size() <= 64 && ((v.is_number_integer() && v.get<int64_t>() >= 0) || counts(v));
      if (!ok) return bad("a turn's usage is not a set of token counts");
      turn.usage = k->dump();
    }
    out.push_back(std::move(turn));
  }
  return capped(std::move(out), opts_.max_messages, opts_.max_bytes);
}

void SessionStore::load(const SessionKey& sk, std::function<void(ChatMessages, bool)> done) {
  const std::string key = redis_key(sk);
  const auto in_memory = [this, &key] { return index_.count(key) > 0; };
  if (!redis_ || !redis_->connected()) return done(from_memory(key), in_memory());
  // Turns this process answered while Redis did not take them are newer
  // than whatever Redis holds: they are the conversation.
  if (auto it = index_.find(key); it != index_.end() && it->second->unsynced) return done(from_memory(key), true);
  const std::string caller = memory_caller(sk);
  redis_->command({"GET", key}, [this, key, caller, done = std::move(done)](const redisReply* r) {
    const bool here = index_.count(key) > 0;
    if (!r || r->type != REDIS_REPLY_STRING) return done(from_memory(key), here);  // gone, nil, or not ours
    if (auto it = index_.find(key); it != index_.end() && it->second->unsynced)
      return done(from_memory(key), true);  // a save failed while the GET was on its way
    std::optional<ChatMessages> messages = from_redis(key, std::string_view(r->str, r->len));
    // A copy that failed its checks is not a conversation: what this process
    // holds (if anything) stays, rather than an empty one over it. The
    // session is known all the same.
    if (!messages) return done(from_memory(key), true);
    remember(key, caller, *messages, false);
    done(std::move(*messages), true);
  });
}

void SessionStore::save(const SessionKey& sk, ChatMessages messages, std::function<void()> saved) {
  messages = capped(std::move(messages), opts_.max_messages, opts_.max_bytes);
  const std::string key = redis_key(sk);
  remember(key, memory_caller(sk), messages, redis_ != nullptr);  // unsynced until Redis says it holds them
  const uint64_t version = saves_;
  if (!redis_ || !redis_->connected()) {
    if (saved) saved();
    return;
  }
  json list = json::array();
  for (const ChatMessage& m : messages) {
    json t = {{"role", m.role}, {"content", m.content}};
    if (!m.tool_calls.empty()) t["tool_calls"] = json::parse(m.tool_calls, nullptr, false);
    if (!m.tool_call_id.empty()) t["tool_call_id"] = m.tool_call_id;
    if (!m.request_key.empty()) {
      t["request_key"] = m.request_key;
      t["request_digest"] = m.request_digest;
      t["finish_reason"] = m.finish_reason;
      if (!m.response_id.empty()) t["response_id"] = m.response_id;
      if (m.created != 0) t["created"] = m.created;
      if (!m.usage.empty()) t["usage"] = json::parse(m.usage, nullptr, false);
    }
    list.push_back(std::move(t));
  }
  // What load() takes back: the caps count text, not the JSON around it
  // (escapes, a keyed turn's request fields), so the oldest turns (after a
  // leading system turn) go until the stored form is within its bound.
  std::string stored = json_text(list);
  while (stored.size() > max_stored_bytes() && list.size() > 1) {
    const bool system_first = list[0]["role"] == "system" && list.size() > 2;
    list.erase(list.begin() + (system_first ? 1 : 0));
    stored = json_text(list);
  }
  if (stored.size() > max_stored_bytes()) stored = "[]";
  // The caller's reply waits for this answer: Redis then holds the turn
  // before the client can send its next one to any host.
  redis_->command({"SET", key, stored, "EX", std::to_string(opts_.ttl_s)},
                  [this, key, version, saved = std::move(saved)](const redisReply* r) {
                    if (r && r->type != REDIS_REPLY_ERROR) {
                      if (auto it = index_.find(key); it != index_.end() && it->second->version == version)
                        it->second->unsynced = false;
                    } else {
                      // Kept here, newer than Redis' copy, until a save goes through.
                      ++save_failures_;
                      std::fprintf(stderr, "moe-gateway: a session's turns were not stored in Redis (%s); kept in "
                                           "memory and written again with its next turn\n",
                                   r ? std::string(r->str, r->len).c_str() : "connection lost");
                    }
                    if (saved) saved();
                  });
  if (!opts_.events_key.empty())
    redis_->command(
        protocol::stream_append_command(
            opts_.events_key, opts_.stream_max_len,
            protocol::session_event(sha256_hex(key).substr(0, 16), messages.size())),
        [](const redisReply*) {});
  // On its way now, not on the loop's next turn.
  redis_->flush();
}

}  // namespace moe::gw
