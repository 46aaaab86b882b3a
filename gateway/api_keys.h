#pragma once
// Who may call, at which priority and how often (docs/operations.md,
// "Priorities"): the keys file, the per-key rate limit, and who a keyless
// caller is behind a trusted balancer.
//
// A keys file holds one key a line, as whitespace-separated columns
//
//   NAME  SHA256-HEX-OF-THE-KEY  PRIORITY  REQUESTS-PER-MINUTE
//
// (priority: an integer, lower runs first; rate: a positive integer, or `-`
// or 0 for unlimited); blank lines and lines starting with '#' are skipped.
// It holds digests only, never keys. Names are unique; so are digests.
//
// Threading: loop thread only.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "model/result.h"

namespace moe::gw {

struct ApiKeyEntry {
  std::string name;
  std::string sha256_hex;  // lower-case, 64 characters
  int priority = 0;        // lower runs first
  int rate_per_minute = 0; // 0: unlimited
};

// The priorities a keys file or a request may name.
constexpr int kMinPriority = -1000, kMaxPriority = 1000;

// Parses a keys file's text; an error names `source` and the line.
Result<std::vector<ApiKeyEntry>> parse_keys_file(const std::string& text, const std::string& source);
// Reads and parses the file at `path`.
Result<std::vector<ApiKeyEntry>> load_keys_file(const std::string& path);

// The password of an HTTP Basic credential (the base64 of "user:password"
// after "Basic "); nullopt when it is not valid base64 or has no ':'.
std::optional<std::string> basic_auth_password(std::string_view credential);

// True for the text of an IPv4 or IPv6 address as a peer or a proxy header
// writes it (digits, hex, ':' and '.'; at most 45 characters).
bool looks_like_ip_address(std::string_view text);

// Who sent a request without a key (docs/scale-out.md): its peer, or behind
// a `trusted` proxy the last address of `forwarded_for` (X-Forwarded-For,
// null: absent) that is not itself a trusted proxy; a header that is not a
// list of addresses is ignored.
std::string forwarded_client(const std::string& peer, const std::string* forwarded_for,
                             const std::vector<std::string>& trusted);

// A token bucket per key: `rate` requests a minute, at most `rate` at once.
class KeyRateLimiter {
 public:
  // True when the key may send a request at `now_ms` (and counts it); else
  // false with the milliseconds until it may in `retry_after_ms`.
  bool allow(const std::string& key, int rate_per_minute, uint64_t now_ms, uint64_t* retry_after_ms);
  size_t keys() const { return buckets_.size(); }

 private:
  struct Bucket {
    double tokens = 0;
    uint64_t at_ms = 0;
  };
  std::unordered_map<std::string, Bucket> buckets_;
};

}  // namespace moe::gw
