#pragma once
// hiredis replies, read one way by every synchronous client of the streams
// (the worker's state thread, `moe profile --redis`): owning a reply, its
// text, a stream entry's id and fields, one command from its words.

#include <hiredis/hiredis.h>

#include <memory>
#include <string>
#include <vector>

#include "protocol/redis_schema.h"

namespace moe::protocol {

struct RedisReplyDeleter {
  void operator()(redisReply* r) const {
    if (r) freeReplyObject(r);
  }
};
using RedisReply = std::unique_ptr<redisReply, RedisReplyDeleter>;

// The text of a string, status or error reply; "" for any other.
std::string reply_text(const redisReply* r);

// A stream entry [id, [field, value, ...]] as its id and flat fields; false
// when the shape is not that (a nil field list, an entry deleted meanwhile,
// is an entry without fields).
bool stream_entry(const redisReply* e, std::string* id, StreamFields* fields);

// One command from its words (binary-safe); null when no reply came (the
// context then holds the error).
RedisReply redis_command(redisContext* ctx, const std::vector<std::string>& args);

}  // namespace moe::protocol
