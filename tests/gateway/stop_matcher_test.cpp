// Stop strings over text that arrives in arbitrary pieces.
#include <catch2/catch.hpp>

#include "gateway/api/stop_matcher.h"

using moe::gw::StopMatcher;

TEST_CASE("stop: a stop string split over pieces is never shown", "[gateway][stop]") {
  StopMatcher m({"END"});
  std::string shown;
  auto s1 = m.push("abc E");
  shown += s1.text;
  CHECK(s1.text == "abc ");  // "E" could start "END": held back
  auto s2 = m.push("N");
  shown += s2.text;
  CHECK(s2.text.empty());
  auto s3 = m.push("Dxyz");
  shown += s3.text;
  CHECK(s3.stopped);
  CHECK(shown == "abc ");
  CHECK(m.push("more").text.empty());
  CHECK(m.finish().empty());
}

TEST_CASE("stop: a false start is released when the next piece rules it out", "[gateway][stop]") {
  StopMatcher m({"END"});
  CHECK(m.push("xE").text == "x");
  CHECK(m.push("Nd").text == "ENd");
  CHECK_FALSE(m.stopped());
}

TEST_CASE("stop: held text comes out at the end when nothing matched", "[gateway][stop]") {
  StopMatcher m({"</s>"});
  CHECK(m.push("a</").text == "a");
  CHECK(m.finish() == "</");
}

TEST_CASE("stop: the earliest of several stop strings wins", "[gateway][stop]") {
  StopMatcher m({"world", "lo w"});
  auto s = m.push("hello world");
  CHECK(s.stopped);
  CHECK(s.text == "hel");
}

TEST_CASE("stop: overlapping prefixes hold the longest possible start", "[gateway][stop]") {
  StopMatcher m({"aab"});
  CHECK(m.push("xa").text == "x");
  CHECK(m.push("a").text.empty());  // "aa" held
  auto s = m.push("ab");            // "aaab": "aab" at 1
  CHECK(s.stopped);
  CHECK(s.text == "a");
}

TEST_CASE("stop: without stop strings everything passes at once", "[gateway][stop]") {
  StopMatcher m({});
  CHECK(m.push("abc").text == "abc");
  CHECK(m.finish().empty());
}
