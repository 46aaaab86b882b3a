#pragma once
// The gateway's view of what workers publish in Redis (docs/state-and-failover.md;
// the keys, fields and text formats are protocol/redis_schema.h's):
// it tails moe:<model>:resident (each worker's resident experts) and
// moe:<model>:routing (per-request expert use, which the expert predictor
// learns from), and appends warm hints to moe:<model>:events, which the
// workers read in their consumer group. Entries that are not what they
// should be are skipped with a log line. Polls without blocking the loop.
// The routing stream is read whole from its start on the first connection
// (what other gateways' traffic taught is learned here too) and after that
// from this gateway's own last id, across reconnections; after every
// (re)connection the resident stream's last 1000 entries give each worker's
// newest set, and reading goes on after its newest entry.
//
// Threading: loop thread only.

#include <uv.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "gateway/state/redis_client.h"
#include "protocol/redis_schema.h"

namespace moe::gw {

// The model's name in the stream keys: the model folder's or file's name.
using protocol::redis_model_name;

struct RedisWorkerStreamsOptions {
  std::string model;  // redis_model_name()
  uint64_t poll_ms = 250;
  uint64_t stream_max_len = protocol::kStreamMaxLen;
};

class RedisWorkerStreams {
 public:
  RedisWorkerStreams(uv_loop_t* loop, RedisClient* redis, RedisWorkerStreamsOptions opts);
  ~RedisWorkerStreams();
  RedisWorkerStreams(const RedisWorkerStreams&) = delete;
  RedisWorkerStreams& operator=(const RedisWorkerStreams&) = delete;

  void start();
  // Called for every routing summary read (every worker's, from the start of
  // the stream on the first connection): its `bucket` field (0 when absent)
  // and its `layers` text.
  void on_routing(std::function<void(uint64_t bucket, const std::string& layers)> fn) {
    on_routing_ = std::move(fn);
  }
  // An expert list (protocol::format_expert_list), as a warm event the
  // workers read; appended with MAXLEN ~.
  void publish_warm_hints(const std::string& experts);

  // worker name -> its newest resident set, an expert list (checked with
  // protocol::parse_expert_list before it is kept).
  const std::map<std::string, std::string>& resident() const { return resident_; }
  uint64_t routing_summaries() const { return routing_; }
  uint64_t skipped() const { return skipped_; }

  std::string resident_key() const { return protocol::resident_stream_key(opts_.model); }
  std::string routing_key() const { return protocol::routing_stream_key(opts_.model); }
  std::string events_key() const { return protocol::events_stream_key(opts_.model); }

 private:
  void poll();
  void sync_positions();
  void take(const std::string& stream, const std::string& id, const protocol::StreamFields& fields);

  uv_loop_t* loop_;
  RedisClient* redis_;
  RedisWorkerStreamsOptions opts_;
  uv_timer_t* timer_ = nullptr;
  bool positioned_ = false;                     // last ids known for this connection
  bool busy_ = false;                           // a poll is in flight
  uint64_t connection_ = 0;                     // bumps on every (re)connection
  std::map<std::string, std::string> last_id_;  // stream -> last id read
  std::map<std::string, std::string> resident_;
  uint64_t routing_ = 0;
  uint64_t skipped_ = 0;
  bool routing_positioned_ = false;  // the routing stream's position survives reconnections
  std::function<void(uint64_t, const std::string&)> on_routing_;
};

}  // namespace moe::gw
