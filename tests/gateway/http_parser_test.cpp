// The incremental request parser on its own: any split of the bytes, one
// request at a time, limits and malformed input.
#include <catch2/catch.hpp>

#include "gateway/http/http_parser.h"

using moe::gw::HttpLimits;
using moe::gw::HttpRequestParser;
using State = HttpRequestParser::State;

namespace {
const std::string kPost =
    "POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
    "Content-Length: 11\r\n\r\n{\"a\": true}";

// Feeds the whole input (ignoring headers_done pauses) until complete or error.
size_t feed_all(HttpRequestParser& p, std::string_view in) {
  size_t used = 0;
  while (used < in.size() && p.state() != State::complete && p.state() != State::error) {
    used += p.feed(in.substr(used));
  }
  return used;
}
}  // namespace

TEST_CASE("parser: a request delivered one byte at a time", "[gateway][parser]") {
  HttpRequestParser p(HttpLimits{});
  for (size_t i = 0; i < kPost.size(); ++i) {
    REQUIRE(p.state() != State::complete);
    REQUIRE(p.feed(std::string_view(kPost).substr(i, 1)) == 1);
    REQUIRE(p.state() != State::error);
  }
  REQUIRE(p.state() == State::complete);
  const auto& r = p.request();
  CHECK(r.method == "POST");
  CHECK(r.target == "/v1/completions?x=1");
  CHECK(r.path == "/v1/completions");
  CHECK(r.body == "{\"a\": true}");
  REQUIRE(r.header("content-type"));
  CHECK(*r.header("content-type") == "application/json");
  CHECK(r.keep_alive);
}

TEST_CASE("parser: pipelined requests are taken one at a time", "[gateway][parser]") {
  std::string two = kPost + "GET /health HTTP/1.1\r\nHost: a\r\n\r\n";
  HttpRequestParser p(HttpLimits{});
  size_t used = feed_all(p, two);
  REQUIRE(p.state() == State::complete);
  CHECK(used == kPost.size());  // the second request is left for later
  CHECK(p.request().body == "{\"a\": true}");
  p.reset();
  used += feed_all(p, std::string_view(two).substr(used));
  REQUIRE(p.state() == State::complete);
  CHECK(p.request().method == "GET");
  CHECK(p.request().path == "/health");
  CHECK(used == two.size());
}

TEST_CASE("parser: header block over the limit is 431", "[gateway][parser]") {
  HttpLimits lim;
  lim.max_header_bytes = 256;
  HttpRequestParser p(lim);
  std::string req = "GET / HTTP/1.1\r\nHost: a\r\nX-Big: " + std::string(300, 'a') + "\r\n\r\n";
  feed_all(p, req);
  REQUIRE(p.state() == State::error);
  CHECK(p.error_status() == 431);
}

TEST_CASE("parser: Content-Length over the body limit is 413 before any body byte", "[gateway][parser]") {
  HttpLimits lim;
  lim.max_body_bytes = 10;
  HttpRequestParser p(lim);
  feed_all(p, "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 11\r\n\r\n");
  REQUIRE(p.state() == State::error);
  CHECK(p.error_status() == 413);
}

TEST_CASE("parser: malformed requests are 400/411/501/505", "[gateway][parser]") {
  struct Case {
    const char* text;
    int status;
  };
  const Case cases[] = {
      {"GARBAGE\r\n\r\n", 400},
      {"GET  / HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"GET / HTTP/1.1 extra\r\n\r\n", 400},
      {"GET noslash HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"G(T / HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"GET / HTTP/2.0\r\n\r\n", 505},
      {"GET / FTP/1.0\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nHost: a\r\nNo colon here\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nHost: a\r\nBad Name: x\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nHost: a\r\nA: b\r\n folded\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1x\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n", 411},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n", 501},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 411},
      {"POST / HTTP/1.1\r\nHost: a\r\nExpect: something\r\n\r\n", 417},
      // HTTP/1.1 names its host exactly once.
      {"GET / HTTP/1.1\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400},
      {"GET / HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n", 400},
      // An absolute form needs a host, and is http or https.
      {"GET http:///x HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"GET ftp://a/x HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n", 400},
  };
  for (const auto& c : cases) {
    INFO(c.text);
    HttpRequestParser p(HttpLimits{});
    feed_all(p, c.text);
    REQUIRE(p.state() == State::error);
    CHECK(p.error_status() == c.status);
  }
}

TEST_CASE("parser: keep-alive follows the version and Connection header", "[gateway][parser]") {
  auto keep = [](const std::string& text) {
    HttpRequestParser p(HttpLimits{});
    feed_all(p, text);
    REQUIRE(p.state() == State::complete);
    return p.request().keep_alive;
  };
  CHECK(keep("GET / HTTP/1.1\r\nHost: a\r\n\r\n"));
  CHECK_FALSE(keep("GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"));
  CHECK_FALSE(keep("GET / HTTP/1.0\r\n\r\n"));
  CHECK(keep("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n"));
}

TEST_CASE("parser: bare LF line ends and leading empty lines are accepted", "[gateway][parser]") {
  HttpRequestParser p(HttpLimits{});
  feed_all(p, "\r\n\nPOST /x HTTP/1.1\nHost: a\nContent-Length: 2\n\nok");
  REQUIRE(p.state() == State::complete);
  CHECK(p.request().path == "/x");
  CHECK(p.request().body == "ok");
}

TEST_CASE("parser: Expect 100-continue pauses after the headers", "[gateway][parser]") {
  HttpRequestParser p(HttpLimits{});
  std::string head = "POST / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n";
  CHECK(p.feed(head + "ok") == head.size());
  REQUIRE(p.state() == State::headers_done);
  CHECK(p.request().expect_continue);
  CHECK(p.content_length() == 2);
  CHECK(p.feed("ok") == 2);
  CHECK(p.state() == State::complete);
}

TEST_CASE("parser: three pipelined requests under 500 random splits", "[gateway][parser]") {
  const std::string reqs[3] = {kPost, "GET /health HTTP/1.1\r\nHost: a\r\n\r\n",
                               "POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc"};
  const std::string all = reqs[0] + reqs[1] + reqs[2];
  uint32_t rng = 12345;
  for (int trial = 0; trial < 500; ++trial) {
    HttpRequestParser p(HttpLimits{});
    std::vector<std::string> bodies, paths;
    std::string pending;
    size_t pos = 0;
    while (pos < all.size()) {
      rng = rng * 1664525u + 1013904223u;
      size_t n = 1 + (rng >> 16) % 40;
      pending += all.substr(pos, n);
      pos += n;
      // Like a connection: feed what we have, take completed requests, keep the rest.
      for (;;) {
        size_t used = p.feed(pending);
        pending.erase(0, used);
        if (p.state() == State::complete) {
          paths.push_back(p.request().path);
          bodies.push_back(p.request().body);
          p.reset();
          continue;
        }
        REQUIRE(p.state() != State::error);
        if (p.state() == State::headers_done) continue;
        break;
      }
    }
    REQUIRE(paths == std::vector<std::string>{"/v1/completions", "/health", "/v1/chat/completions"});
    CHECK(bodies == std::vector<std::string>{"{\"a\": true}", "", "abc"});
  }
}

TEST_CASE("parser: an absolute-form target is served as its path", "[gateway][parser]") {
  auto target = [](const std::string& t) {
    HttpRequestParser p(HttpLimits{});
    feed_all(p, "GET " + t + " HTTP/1.1\r\nHost: a\r\n\r\n");
    REQUIRE(p.state() == State::complete);
    return std::pair{p.request().target, p.request().path};
  };
  CHECK(target("http://a.example:8000/v1/models?x=1") == std::pair<std::string, std::string>{"/v1/models?x=1", "/v1/models"});
  CHECK(target("HTTPS://a/health") == std::pair<std::string, std::string>{"/health", "/health"});
  CHECK(target("http://a") == std::pair<std::string, std::string>{"/", "/"});
  CHECK(target("http://a?q") == std::pair<std::string, std::string>{"/?q", "/"});
}

TEST_CASE("parser: HTTP/1.0 needs no Host, and its Expect is ignored", "[gateway][parser]") {
  HttpRequestParser p(HttpLimits{});
  // A 1.0 client knows no 100 Continue: none is asked of the server.
  const std::string req = "POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nok";
  feed_all(p, req);
  REQUIRE(p.state() == State::complete);
  CHECK_FALSE(p.request().expect_continue);
  CHECK(p.request().body == "ok");
  HttpRequestParser q(HttpLimits{});
  feed_all(q, "POST / HTTP/1.0\r\nExpect: something\r\nContent-Length: 0\r\n\r\n");
  CHECK(q.state() == State::complete);
}
