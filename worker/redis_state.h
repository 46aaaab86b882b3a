#pragma once
// The worker's side of the Redis streams (docs/state-and-failover.md; the
// keys, fields and text formats are protocol/redis_schema.h's):
//   moe:<model>:resident  worker → gateways: the resident experts, a snapshot
//                         on start and one after every change
//   moe:<model>:routing   worker → gateways: per request, the experts each
//                         MoE layer used (from the steps' expert usage), and
//                         the gateway's route_bucket when the steps carried one
//   moe:<model>:events    gateways → workers: warm hints (and session
//                         events), read in the consumer group "workers";
//                         entries a dead worker left pending are claimed and
//                         replayed, garbage entries are logged and skipped
// Every XADD trims with MAXLEN ~ so the streams stay bounded.
//
// Threads: the step thread calls after_step()/released() (WorkerServer's
// hooks), which only queue; one background thread owns the blocking hiredis
// connection (short timeouts), publishes the queue, reads the events and
// reconnects with backoff. Without Redis everything keeps working in this
// process; the log says so once per outage.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "worker/backend.h"
#include "worker/worker_server.h"
#include "model/result.h"
#include "protocol/redis_endpoint.h"
#include "protocol/redis_schema.h"

namespace moe::worker {

using protocol::RedisEndpoint;

struct WorkerRedisOptions {
  std::string url;
  std::string password_file;  // "" → the URL's credentials, if any
  std::string model_id;
  std::string consumer;  // this worker's name in the consumer group (stable across restarts)
  uint64_t stream_max_len = protocol::kStreamMaxLen;
  uint64_t claim_idle_ms = 5000;  // pending this long: its consumer is presumed dead
  int timeout_ms = 500;           // connect and command timeout
};

class WorkerRedisState final : public StepHooks {
 public:
  WorkerRedisState(WorkerRedisOptions opts, Backend* backend);
  ~WorkerRedisState() override;
  WorkerRedisState(const WorkerRedisState&) = delete;
  WorkerRedisState& operator=(const WorkerRedisState&) = delete;

  struct Rewarm {
    bool redis_reachable = false;
    size_t previous = 0;  // experts in the last published resident set
    size_t resident = 0;  // of those, resident now
    double ms = 0;        // reading the state and warming
  };
  // Before the worker says hello: reads the last resident set this worker
  // (its name, `consumer`) published for this model, paging back from the
  // newest entry, and warms those experts (blocking, bounded by the
  // timeouts). Another worker's set (a CPU fallback's) is taken only by a
  // worker of a name that never published one.
  Rewarm rewarm();
  // Starts the background thread (publishes the snapshot first).
  void start();

  // StepHooks, on the step thread: queue only.
  void after_step(const protocol::StepRequest& req, const protocol::StepReply& reply) override;
  void released(uint64_t seq_id) override;

  // Keys (tests and docs).
  std::string resident_key() const { return protocol::resident_stream_key(opts_.model_id); }
  std::string routing_key() const { return protocol::routing_stream_key(opts_.model_id); }
  std::string events_key() const { return protocol::events_stream_key(opts_.model_id); }

 private:
  struct Conn;  // the hiredis context
  struct Entry {
    std::string key;
    protocol::StreamFields fields;
  };
  void run();
  bool ensure_connected(Conn& c);
  bool publish(Conn& c, const Entry& e);
  bool read_events(Conn& c);
  void handle_event(const std::string& id, const protocol::StreamFields& fields);
  void queue_resident(std::string_view kind);
  void apply_hints();

  WorkerRedisOptions opts_;
  RedisEndpoint endpoint_;
  bool endpoint_ok_ = false;
  Backend* backend_;
  uint64_t published_version_ = ~uint64_t(0);  // step thread only
  // step thread only: per sequence, tokens each (moe layer, expert) served
  std::unordered_map<uint64_t, std::vector<uint32_t>> usage_;
  // step thread only: per sequence, the gateway's route_bucket (non-zero ones)
  std::unordered_map<uint64_t, uint64_t> buckets_;
  uint32_t n_experts_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Entry> resident_pending_;   // only the newest state matters
  std::optional<Entry> last_resident_;      // published again after a reconnect
  std::deque<Entry> routing_pending_;       // bounded
  std::vector<protocol::ExpertRef> hints_;  // from events, applied on the step thread
  std::atomic<bool> hints_waiting_{false};
  bool stop_ = false;
  std::thread thread_;
  bool group_ready_ = false;  // thread only
  bool replayed_ = false;     // thread only: own and dead consumers' pending done
};

}  // namespace moe::worker
