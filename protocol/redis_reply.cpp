#include "protocol/redis_reply.h"

namespace moe::protocol {

std::string reply_text(const redisReply* r) {
  if (!r) return "";
  if (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS || r->type == REDIS_REPLY_ERROR)
    return std::string(r->str, r->len);
  return "";
}

bool stream_entry(const redisReply* e, std::string* id, StreamFields* fields) {
  if (!e || e->type != REDIS_REPLY_ARRAY || e->elements != 2) return false;
  if (e->element[0]->type != REDIS_REPLY_STRING) return false;
  *id = reply_text(e->element[0]);
  fields->clear();
  const redisReply* f = e->element[1];
  if (f->type != REDIS_REPLY_ARRAY) return f->type == REDIS_REPLY_NIL;  // deleted meanwhile: no fields
  for (size_t i = 0; i < f->elements; ++i) fields->push_back(reply_text(f->element[i]));
  return true;
}

RedisReply redis_command(redisContext* ctx, const std::vector<std::string>& args) {
  std::vector<const char*> argv;
  std::vector<size_t> lens;
  for (const auto& a : args) {
    argv.push_back(a.data());
    lens.push_back(a.size());
  }
  return RedisReply(static_cast<redisReply*>(redisCommandArgv(ctx, int(argv.size()), argv.data(), lens.data())));
}

}  // namespace moe::protocol
