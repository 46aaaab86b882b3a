#pragma once
// Where the gateway and the worker find Redis, and how they log in: one
// parser of the URL both processes take, so that the two sides can never
// read the same --redis differently.
//
//   redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]     (the scheme may be left out)
//
// A password may also come from a file (--redis-password-file: the first
// line: "PASSWORD", "USER:PASSWORD", or ":PASSWORD" for a password that
// holds ':'), which keeps it out of `ps`. With a
// password, each connection's first command is AUTH [USER] PASSWORD (Redis 6
// ACL users, or the single requirepass password without a user).

#include <string>

#include "model/result.h"

namespace moe::protocol {

struct RedisEndpoint {
  std::string host = "127.0.0.1";
  int port = 6379;
  int db = 0;
  std::string user;      // "" → the default user
  std::string password;  // "" → no AUTH

  bool auth() const { return !password.empty(); }
  // host:port, never the credentials (for logs).
  std::string where() const { return host + ":" + std::to_string(port); }
};

Result<RedisEndpoint> parse_redis_url(const std::string& url);

// Takes the password (and user, when the line reads USER:PASSWORD) from the
// first line of `path` into `ep`. Unreadable or empty: an error.
Status read_redis_password_file(const std::string& path, RedisEndpoint* ep);

}  // namespace moe::protocol
