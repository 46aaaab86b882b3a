#include "gateway/api_keys.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

namespace moe::gw {
namespace {

bool parse_int(const std::string& s, long lo, long hi, long* out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(s.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) return false;
  *out = v;
  return true;
}

bool is_hex_digest(const std::string& s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
         });
}

}  // namespace

Result<std::vector<ApiKeyEntry>> parse_keys_file(const std::string& text, const std::string& source) {
  std::vector<ApiKeyEntry> out;
  std::set<std::string> names, digests;
  std::istringstream in(text);
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    const std::string where = source + ":" + std::to_string(n) + ": ";
    std::istringstream cols(line);
    std::vector<std::string> c;
    for (std::string w; cols >> w;) c.push_back(w);
    if (c.empty() || c[0][0] == '#') continue;
    if (c.size() != 4)
      return make_error(where + "expected 4 columns (name, sha256 of the key, priority, requests per minute), got " +
                        std::to_string(c.size()));
    ApiKeyEntry e;
    e.name = c[0];
    for (char ch : e.name)
      if (!(std::isalnum(static_cast<unsigned char>(ch)) || ch == '-' || ch == '_' || ch == '.'))
        return make_error(where + "the name '" + e.name + "' may hold only letters, digits, '-', '_' and '.'");
    if (!is_hex_digest(c[1]))
      return make_error(where + "the second column must be the key's SHA-256 in hex (64 characters; "
                        "printf %s KEY | sha256sum), not the key");
    e.sha256_hex = c[1];
    std::transform(e.sha256_hex.begin(), e.sha256_hex.end(), e.sha256_hex.begin(),
                   [](char ch) { return char(std::tolower(static_cast<unsigned char>(ch))); });
    long v = 0;
    if (!parse_int(c[2], kMinPriority, kMaxPriority, &v))
      return make_error(where + "the priority must be an integer from " + std::to_string(kMinPriority) + " to " +
                        std::to_string(kMaxPriority) + ", got '" + c[2] + "'");
    e.priority = int(v);
    if (c[3] == "-") {
      e.rate_per_minute = 0;
    } else if (parse_int(c[3], 0, 1'000'000, &v)) {
      e.rate_per_minute = int(v);
    } else {
      return make_error(where + "the rate must be requests per minute (an integer up to 1000000, or '-' for "
                        "unlimited), got '" + c[3] + "'");
    }
    if (!names.insert(e.name).second) return make_error(where + "the name '" + e.name + "' appears twice");
    if (!digests.insert(e.sha256_hex).second) return make_error(where + "this key's digest appears twice");
    out.push_back(std::move(e));
  }
  if (out.empty()) return make_error(source + ": no keys in the file");
  return out;
}

Result<std::vector<ApiKeyEntry>> load_keys_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return make_error("cannot read the keys file " + path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return parse_keys_file(ss.str(), path);
}

bool looks_like_ip_address(std::string_view text) {
  return !text.empty() && text.size() <= 45 && text.find_first_not_of("0123456789abcdefABCDEF:.") == std::string::npos;
}

std::string forwarded_client(const std::string& peer, const std::string* forwarded_for,
                             const std::vector<std::string>& trusted) {
  auto is_trusted = [&](const std::string& a) { return std::find(trusted.begin(), trusted.end(), a) != trusted.end(); };
  if (!is_trusted(peer) || !forwarded_for) return peer;
  // Right to left: each proxy appends the address it saw.
  const std::string& xff = *forwarded_for;
  size_t end = xff.size();
  while (end > 0) {
    const size_t comma = xff.rfind(',', end - 1);
    const size_t begin = comma == std::string::npos ? 0 : comma + 1;
    std::string a = xff.substr(begin, end - begin);
    const size_t b = a.find_first_not_of(' '), e = a.find_last_not_of(' ');
    a = b == std::string::npos ? std::string() : a.substr(b, e - b + 1);
    if (!looks_like_ip_address(a)) return peer;  // not an address: trust nothing of it
    if (!is_trusted(a)) return a;
    if (comma == std::string::npos) break;
    end = comma;
  }
  return peer;
}

bool KeyRateLimiter::allow(const std::string& key, int rate, uint64_t now_ms, uint64_t* retry_after_ms) {
  if (rate <= 0) return true;
  auto [it, fresh] = buckets_.try_emplace(key);
  Bucket& b = it->second;
  const double per_ms = double(rate) / 60'000.0;
  if (fresh) {
    b.tokens = rate;
  } else if (now_ms > b.at_ms) {
    b.tokens = std::min<double>(rate, b.tokens + double(now_ms - b.at_ms) * per_ms);
  }
  b.at_ms = std::max(b.at_ms, now_ms);
  if (b.tokens >= 1.0) {
    b.tokens -= 1.0;
    return true;
  }
  if (retry_after_ms) *retry_after_ms = uint64_t((1.0 - b.tokens) / per_ms) + 1;
  return false;
}

std::optional<std::string> basic_auth_password(std::string_view credential) {
  while (!credential.empty() && credential.front() == ' ') credential.remove_prefix(1);
  while (!credential.empty() && credential.back() == ' ') credential.remove_suffix(1);
  if (credential.empty() || credential.size() % 4 != 0 || credential.size() > 4096) return std::nullopt;
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  std::string out;
  for (size_t i = 0; i < credential.size(); i += 4) {
    int v[4];
    int pad = 0;
    for (int j = 0; j < 4; ++j) {
      const char c = credential[i + size_t(j)];
      // '=' only at the very end, one or two of them.
      if (c == '=' && i + 4 == credential.size() && j >= 2) {
        v[j] = 0;
        ++pad;
        continue;
      }
      if (pad > 0 || (v[j] = value(c)) < 0) return std::nullopt;
    }
    const uint32_t n = uint32_t(v[0]) << 18 | uint32_t(v[1]) << 12 | uint32_t(v[2]) << 6 | uint32_t(v[3]);
    out.push_back(char(n >> 16));
    if (pad < 2) out.push_back(char((n >> 8) & 0xff));
    if (pad < 1) out.push_back(char(n & 0xff));
  }
  const size_t colon = out.find(':');
  if (colon == std::string::npos) return std::nullopt;
  return out.substr(colon + 1);
}

}  // namespace moe::gw
