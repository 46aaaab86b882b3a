#pragma once
// Test parts for the gateway: a byte-level text codec, a scheduler double
// that emits scripted tokens on the loop, the real server on an ephemeral
// port on its own loop thread, and a small blocking HTTP client.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <uv.h>

#include "gateway/http/http_server.h"
#include "gateway/metrics.h"
#include "gateway/api/openai_api.h"
#include "gateway/sched/scheduler.h"
#include "gateway/api/text_codec.h"

namespace moe::gw::test {

// Token ids 0..255 are bytes; 256 is EOS. A chat renders as
// "<role>: <content>\n" per message, then "assistant:".
class ByteCodec final : public TextCodec {
 public:
  static constexpr int32_t kEos = 256;
  std::vector<int32_t> encode(std::string_view text) const override;
  Result<std::vector<int32_t>> encode_chat(const nlohmann::json& messages) const override;
  // A template of its own that takes tools (writes them, and each turn's
  // tool calls and call id, as JSON) and asks for Hermes-style calls.
  Result<std::vector<int32_t>> encode_chat(const nlohmann::json& messages,
                                           const nlohmann::json& template_kwargs) const override;
  ToolFormat tool_format() const override { return tool_format_; }
  // The markup its template would ask tools to be called in (hermes by default).
  ToolFormat tool_format_ = ToolFormat::hermes;
  std::unique_ptr<TokenTextStream> stream_decoder() const override;
  std::string token_bytes(int32_t id) const override;
  int vocab_size() const override { return 257; }
  std::vector<int32_t> stop_token_ids() const override { return {kEos}; }
};

std::vector<int32_t> byte_tokens(std::string_view text);

// The scheduler double. Every `tick_ms` each running sequence gets its next
// token from the script; a stop id finishes it with `stop`, max_new_tokens
// with `length`. Script tokens below 0 are faults: -1 finishes with an error.
class ScriptedScheduler final : public Scheduler {
 public:
  using Script = std::function<int32_t(const SequenceRequest& req, int step)>;

  explicit ScriptedScheduler(uv_loop_t* loop);
  ~ScriptedScheduler() override;
  void close();  // stops the timer (loop thread)

  uint64_t submit(SequenceRequest req, SequenceObserver* obs) override;
  void cancel(uint64_t id) override;
  bool ready() const override { return ready_.load(); }
  SchedulerStats stats() const override;
  int max_context() const override { return max_context_.load(); }
  int kv_capacity() const override { return kv_capacity_.load(); }

  // Test-thread side.
  std::atomic<bool> ready_{true};
  std::atomic<bool> degraded_{false};
  std::atomic<int> max_context_{4096};
  std::atomic<int> kv_capacity_{0};  // 0: not known
  std::atomic<int> tick_ms_{1};
  std::atomic<int> tokens_per_tick_{1};
  // Sequences that run at once; the rest wait (reported as stats().waiting).
  std::atomic<int> capacity_{1 << 30};
  void set_script(Script s);
  std::vector<SequenceRequest> submitted() const;
  std::vector<uint64_t> cancelled() const;
  size_t active() const;

 private:
  struct Seq {
    SequenceRequest req;
    SequenceObserver* obs;
    int step = 0;
  };
  static void on_tick(uv_timer_t* t);
  void tick();

  uv_timer_t timer_{};
  mutable std::mutex mu_;
  Script script_;
  std::map<uint64_t, Seq> seqs_;
  std::vector<SequenceRequest> submitted_;
  std::vector<uint64_t> cancelled_;
  uint64_t next_id_ = 1;
};

// A script that spells `text` byte by byte, then EOS.
ScriptedScheduler::Script spell(std::string text);

// The gateway (API + HTTP server) on its own loop thread.
class TestGateway {
 public:
  // `codec`: the text side to use (default: a ByteCodec); must outlive the gateway.
  explicit TestGateway(HttpServerOptions http = {}, ApiOptions api = {}, const TextCodec* codec = nullptr);
  ~TestGateway();
  int port() const { return port_; }
  ScriptedScheduler& scheduler() { return *scheduler_; }
  // Read on the test thread while the loop runs: only for counters.
  const HttpServer& server() const { return *server_; }
  const OpenAiApi& api() const { return *api_; }

 private:
  uv_loop_t loop_{};
  uv_async_t stop_{};
  std::unique_ptr<ScriptedScheduler> scheduler_;
  ByteCodec codec_;
  GatewayMetrics metrics_;
  std::unique_ptr<OpenAiApi> api_;
  std::unique_ptr<HttpServer> server_;
  std::thread thread_;
  int port_ = 0;
};

struct ClientResponse {
  int status = 0;
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;                            // de-chunked
  bool ok = false;                             // a whole response was read
};

// A blocking HTTP/1.1 client over one TCP connection.
class TestClient {
 public:
  explicit TestClient(int port);
  ~TestClient();
  void send(const std::string& bytes);
  // Reads one response (Content-Length, chunked or close-delimited).
  // `head_only`: the answer to a HEAD (its length says what a GET's body holds).
  ClientResponse read_response(int timeout_ms = 5000, bool head_only = false);
  // Reads raw bytes until `needle` appears (or timeout); returns all read so far.
  std::string read_until(const std::string& needle, int timeout_ms = 5000);
  // True once the server closed the connection (EOF or reset) within the time.
  bool wait_closed(int timeout_ms = 5000);
  void shrink_receive_buffer();
  void close();
  int fd() const { return fd_; }

 private:
  bool fill(int timeout_ms);  // reads more into buf_; false on timeout/EOF
  int fd_ = -1;
  bool eof_ = false;
  std::string buf_;
};

// One request on a fresh connection.
ClientResponse http(int port, const std::string& method, const std::string& path, const std::string& body = "",
                    const std::string& extra_headers = "");

// The "data: …" payloads of an SSE body, in order.
std::vector<std::string> sse_events(const std::string& body);

// Polls `cond` until true or the time is up.
bool eventually(const std::function<bool()>& cond, int timeout_ms = 3000);

}  // namespace moe::gw::test
