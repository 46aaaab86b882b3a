#include "protocol/redis_endpoint.h"

#include <cctype>
#include <charconv>
#include <fstream>

namespace moe::protocol {
namespace {

bool parse_int(std::string_view s, int* out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size() && !s.empty();
}

// %XX escapes in the credentials (a password may hold '@' or ':').
// Errors never quote the credentials.
Result<std::string> unescape(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out += s[i];
      continue;
    }
    int v = 0;
    if (i + 2 >= s.size() || !std::isxdigit(static_cast<unsigned char>(s[i + 1])) ||
        !std::isxdigit(static_cast<unsigned char>(s[i + 2])))
      return make_error("Redis URL: a bad %-escape in the credentials");
    std::from_chars(s.data() + i + 1, s.data() + i + 3, v, 16);
    out += char(v);
    i += 2;
  }
  return out;
}

}  // namespace

Result<RedisEndpoint> parse_redis_url(const std::string& url) {
  RedisEndpoint ep;
  std::string rest = url;
  if (rest.rfind("redis://", 0) == 0) rest = rest.substr(8);
  if (rest.empty()) return make_error("Redis URL names no host");
  // Credentials end at the last '@' (a password's own '@' should be %40).
  if (auto at = rest.rfind('@'); at != std::string::npos) {
    const std::string cred = rest.substr(0, at);
    rest = rest.substr(at + 1);
    const size_t colon = cred.find(':');
    auto user = unescape(colon == std::string::npos ? std::string_view() : std::string_view(cred).substr(0, colon));
    auto pass = unescape(colon == std::string::npos ? std::string_view(cred) : std::string_view(cred).substr(colon + 1));
    if (!user.ok()) return make_error(user.error());
    if (!pass.ok()) return make_error(pass.error());
    ep.user = user.value();
    ep.password = pass.value();
    if (ep.password.empty()) return make_error("Redis URL: credentials without a password");
  }
  // From here on the URL holds no secret, so errors may quote it.
  const std::string shown = "redis://" + rest;
  if (auto slash = rest.find('/'); slash != std::string::npos) {
    std::string db = rest.substr(slash + 1);
    rest = rest.substr(0, slash);
    if (!db.empty() && (!parse_int(db, &ep.db) || ep.db < 0))
      return make_error("Redis URL '" + shown + "': bad database number");
  }
  if (auto colon = rest.rfind(':'); colon != std::string::npos) {
    if (!parse_int(rest.substr(colon + 1), &ep.port) || ep.port <= 0 || ep.port > 65535)
      return make_error("Redis URL '" + shown + "': bad port");
    rest = rest.substr(0, colon);
  }
  if (!rest.empty()) ep.host = rest;
  return ep;
}

Status read_redis_password_file(const std::string& path, RedisEndpoint* ep) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return make_error("cannot read the Redis password file " + path);
  while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t')) line.pop_back();
  if (line.empty()) return make_error("the Redis password file " + path + " is empty");
  // "USER:PASSWORD" names an ACL user, ":PASSWORD" the default user (for a
  // password holding ':'); a line without ':' is the password alone.
  const size_t colon = line.find(':');
  if (colon == std::string::npos) {
    ep->password = line;
  } else {
    ep->user = line.substr(0, colon);
    ep->password = line.substr(colon + 1);
  }
  if (ep->password.empty()) return make_error("the Redis password file " + path + " holds no password");
  return {};
}

}  // namespace moe::protocol
