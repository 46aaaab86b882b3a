#include "gateway/http/http_parser.h"

#include <algorithm>

namespace moe::gw {
namespace {

bool is_token_char(char c) {
  // RFC 9110 tchar.
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

std::string to_lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

std::string_view trim_ows(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// True when the comma-separated header value lists `token` (case-insensitive).
bool lists_token(std::string_view value, std::string_view token) {
  std::string lower = to_lower(value);
  std::string_view v = lower;
  while (!v.empty()) {
    size_t comma = v.find(',');
    std::string_view item = trim_ows(v.substr(0, comma));
    if (item == token) return true;
    if (comma == std::string_view::npos) break;
    v.remove_prefix(comma + 1);
  }
  return false;
}

}  // namespace

const std::string* HttpRequest::header(std::string_view lower_name) const {
  for (const auto& [name, value] : headers) {
    if (name == lower_name) return &value;
  }
  return nullptr;
}

void HttpRequestParser::reset() {
  state_ = State::incomplete;
  started_ = false;
  in_body_ = false;
  head_.clear();
  scan_from_ = 0;
  content_length_ = 0;
  req_ = HttpRequest{};
  error_status_ = 0;
  error_message_.clear();
}

HttpRequest HttpRequestParser::take_request() { return std::move(req_); }

void HttpRequestParser::fail(int status, std::string message) {
  state_ = State::error;
  error_status_ = status;
  error_message_ = std::move(message);
}

size_t HttpRequestParser::feed(std::string_view data) {
  if (state_ == State::error || state_ == State::complete) return 0;
  if (state_ == State::headers_done) state_ = State::incomplete;
  size_t used = 0;
  if (!in_body_) {
    while (used < data.size()) {
      char c = data[used++];
      // Empty lines before a request line are allowed (RFC 9112 §2.2).
      if (head_.empty() && (c == '\r' || c == '\n')) continue;
      started_ = true;
      head_.push_back(c);
      if (head_.size() > limits_.max_header_bytes) {
        fail(431, "request header fields too large");
        return used;
      }
      if (c != '\n') continue;
      // The block ends at an empty line: "\n\n" or "\n\r\n".
      size_t n = head_.size();
      bool ended = (n >= 2 && head_[n - 2] == '\n') ||
                   (n >= 3 && head_[n - 2] == '\r' && head_[n - 3] == '\n');
      if (!ended) continue;
      parse_head();
      if (state_ == State::error) return used;
      in_body_ = true;
      if (content_length_ == 0) {
        state_ = State::complete;
        return used;
      }
      state_ = State::headers_done;
      return used;
    }
    return used;
  }
  size_t want = content_length_ - req_.body.size();
  size_t take = std::min(want, data.size() - used);
  req_.body.append(data.data() + used, take);
  used += take;
  if (req_.body.size() == content_length_) state_ = State::complete;
  return used;
}

void HttpRequestParser::parse_head() {
  // Split into lines; each ends with "\n", optionally preceded by "\r".
  std::vector<std::string_view> lines;
  std::string_view rest = head_;
  while (!rest.empty()) {
    size_t nl = rest.find('\n');
    std::string_view line = rest.substr(0, nl);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    lines.push_back(line);
    rest.remove_prefix(nl + 1);
  }
  while (!lines.empty() && lines.back().empty()) lines.pop_back();
  if (lines.empty()) return fail(400, "empty request");

  // Request line: METHOD SP target SP HTTP/1.x
  std::string_view rl = lines[0];
  size_t sp1 = rl.find(' ');
  size_t sp2 = sp1 == std::string_view::npos ? sp1 : rl.find(' ', sp1 + 1);
  if (sp1 == std::string_view::npos || sp2 == std::string_view::npos ||
      rl.find(' ', sp2 + 1) != std::string_view::npos) {
    return fail(400, "malformed request line");
  }
  std::string_view method = rl.substr(0, sp1);
  std::string_view target = rl.substr(sp1 + 1, sp2 - sp1 - 1);
  std::string_view version = rl.substr(sp2 + 1);
  if (method.empty() || !std::all_of(method.begin(), method.end(), is_token_char)) {
    return fail(400, "malformed request method");
  }
  // The absolute form (http://host/path), which a server must accept, is
  // taken as its path and query; the asterisk form (OPTIONS *) is not served.
  std::string absolute_path;
  if (size_t scheme = target.find("://"); scheme != std::string_view::npos && scheme > 0 && target[0] != '/') {
    const std::string s = to_lower(target.substr(0, scheme));
    if (s != "http" && s != "https") return fail(400, "malformed request target");
    std::string_view rest = target.substr(scheme + 3);
    const size_t path_at = rest.find_first_of("/?");
    if (path_at == 0) return fail(400, "malformed request target");  // no host
    absolute_path = path_at == std::string_view::npos ? "/" : std::string(rest.substr(path_at));
    if (absolute_path[0] == '?') absolute_path.insert(0, "/");
    target = absolute_path;
  }
  if (target.empty() || target[0] != '/') return fail(400, "malformed request target");
  for (char c : target) {
    if (static_cast<unsigned char>(c) <= 0x20 || c == 0x7f) return fail(400, "malformed request target");
  }
  if (version.size() != 8 || version.substr(0, 7) != "HTTP/1.") {
    if (version.substr(0, 5) == "HTTP/") return fail(505, "HTTP version not supported");
    return fail(400, "malformed HTTP version");
  }
  if (version[7] != '0' && version[7] != '1') return fail(505, "HTTP version not supported");
  req_.method = method;
  req_.target = target;
  req_.path = target.substr(0, target.find('?'));
  req_.version_minor = version[7] - '0';

  bool have_length = false;
  int hosts = 0;
  bool have_transfer_encoding = false;
  bool chunked = false;
  for (size_t i = 1; i < lines.size(); ++i) {
    std::string_view line = lines[i];
    if (line.front() == ' ' || line.front() == '\t') {
      return fail(400, "obsolete header line folding");
    }
    size_t colon = line.find(':');
    if (colon == std::string_view::npos || colon == 0) return fail(400, "malformed header line");
    std::string_view name = line.substr(0, colon);
    if (!std::all_of(name.begin(), name.end(), is_token_char)) {
      return fail(400, "malformed header name");
    }
    std::string_view value = trim_ows(line.substr(colon + 1));
    for (char c : value) {
      if ((static_cast<unsigned char>(c) < 0x20 && c != '\t') || c == 0x7f) {
        return fail(400, "control character in header value");
      }
    }
    std::string lname = to_lower(name);
    if (lname == "content-length") {
      if (value.empty() || value.size() > 19 ||
          !std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; })) {
        return fail(400, "malformed Content-Length");
      }
      size_t len = std::stoull(std::string(value));
      if (have_length && len != content_length_) return fail(400, "conflicting Content-Length headers");
      have_length = true;
      content_length_ = len;
    } else if (lname == "transfer-encoding") {
      have_transfer_encoding = true;
      if (lists_token(value, "chunked")) chunked = true;
    } else if (lname == "host") {
      ++hosts;
    } else if (lname == "expect" && req_.version_minor >= 1) {
      // (an HTTP/1.0 client's expectation is ignored: it knows no 100 Continue)
      if (to_lower(value) != "100-continue") return fail(417, "unsupported Expect header");
      req_.expect_continue = true;
    }
    req_.headers.emplace_back(std::move(lname), std::string(value));
  }
  if (have_transfer_encoding) {
    if (chunked) return fail(411, "chunked request bodies are not supported; send Content-Length");
    return fail(501, "Transfer-Encoding is not supported");
  }
  // HTTP/1.1 names the host it asks, exactly once; no request names two.
  if (hosts > 1) return fail(400, "more than one Host header");
  if (req_.version_minor >= 1 && hosts == 0) return fail(400, "missing Host header");
  if (content_length_ > limits_.max_body_bytes) {
    return fail(413, "request body of " + std::to_string(content_length_) + " bytes exceeds the limit of " +
                         std::to_string(limits_.max_body_bytes) + " bytes");
  }
  const std::string* conn = req_.header("connection");
  if (req_.version_minor == 0) {
    req_.keep_alive = conn && lists_token(*conn, "keep-alive");
  } else {
    req_.keep_alive = !(conn && lists_token(*conn, "close"));
  }
  if (!req_.expect_continue || content_length_ == 0) req_.expect_continue = false;
}

}  // namespace moe::gw
