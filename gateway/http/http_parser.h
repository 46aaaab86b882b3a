#pragma once
// An incremental HTTP/1.1 request parser. Bytes arrive in any split (one at a
// time, several requests in one read); feed() takes only the bytes of the
// current request and leaves the rest (a pipelined next request) to the
// caller, so one request is handled at a time per connection.
//
// Bodies: Content-Length only. A request with Transfer-Encoding is refused
// (411 for chunked, 501 for anything else): OpenAI clients always send a
// length, and refusing keeps request smuggling impossible.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace moe::gw {

struct HttpLimits {
  size_t max_header_bytes = 16 * 1024;  // request line + headers → 431 past it
  size_t max_body_bytes = 1024 * 1024;  // Content-Length past it → 413
};

struct HttpRequest {
  std::string method;  // "GET", "POST", … as sent (case-sensitive)
  std::string target;  // as sent: path and query
  std::string path;    // target up to '?'
  int version_minor = 1;  // HTTP/1.<minor>, 0 or 1
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased
  std::string body;
  bool keep_alive = true;
  bool expect_continue = false;  // "Expect: 100-continue"
  std::string peer;              // the client's address (set by the server, not the parser)

  // First header of that (lower-case) name, or nullptr.
  const std::string* header(std::string_view lower_name) const;
};

class HttpRequestParser {
 public:
  enum class State { incomplete, headers_done, complete, error };

  explicit HttpRequestParser(HttpLimits limits) : limits_(limits) {}

  // Takes bytes of the current request from `data`; returns how many it used.
  // After it returns, state() says whether more bytes are needed, the request
  // is complete, or it is malformed (error_status(), error_message()).
  // headers_done is reported once, when the header block ended and a body of
  // content_length() bytes follows (so the caller can answer Expect:
  // 100-continue); call feed() again to read the body.
  size_t feed(std::string_view data);

  State state() const { return state_; }
  // True once any byte of the current request arrived.
  bool started() const { return started_; }
  int error_status() const { return error_status_; }
  const std::string& error_message() const { return error_message_; }
  const HttpRequest& request() const { return req_; }
  HttpRequest take_request();
  size_t content_length() const { return content_length_; }

  // Forgets the current request; the next feed() starts a new one.
  void reset();

 private:
  void fail(int status, std::string message);
  void parse_head();  // head_ holds the whole header block

  HttpLimits limits_;
  State state_ = State::incomplete;
  bool started_ = false;
  bool in_body_ = false;
  std::string head_;      // request line + headers, line ends included
  size_t scan_from_ = 0;  // where to look for the end of the header block
  size_t content_length_ = 0;
  HttpRequest req_;
  int error_status_ = 0;
  std::string error_message_;
};

}  // namespace moe::gw
