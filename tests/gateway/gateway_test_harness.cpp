#include "gateway_test_harness.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <stdexcept>

namespace moe::gw::test {

// --- ByteCodec ---

std::vector<int32_t> byte_tokens(std::string_view text) {
  std::vector<int32_t> ids;
  for (unsigned char c : text) ids.push_back(c);
  return ids;
}

std::vector<int32_t> ByteCodec::encode(std::string_view text) const { return byte_tokens(text); }

Result<std::vector<int32_t>> ByteCodec::encode_chat(const nlohmann::json& messages) const {
  return encode_chat(messages, nlohmann::json::object());
}

Result<std::vector<int32_t>> ByteCodec::encode_chat(const nlohmann::json& messages,
                                                    const nlohmann::json& template_kwargs) const {
  std::string text;
  for (const auto& [k, v] : template_kwargs.items())
    if (k != "tools") return make_error("this template takes no '" + k + "'");
  if (template_kwargs.contains("tools")) text += "tools: " + template_kwargs["tools"].dump() + "\n";
  for (const auto& m : messages) {
    text += m["role"].get<std::string>() + ": " + m["content"].get<std::string>();
    if (m.contains("tool_calls")) text += " calls " + m["tool_calls"].dump();
    if (m.contains("tool_call_id")) text += " answers " + m["tool_call_id"].get<std::string>();
    text += "\n";
  }
  text += "assistant:";
  return byte_tokens(text);
}

namespace {
// Emits the longest prefix of the pending bytes that ends on a whole UTF-8 character.
class ByteStream final : public TokenTextStream {
 public:
  std::string push(int32_t id) override {
    if (id < 0 || id > 255) return "";
    pending_.push_back(static_cast<char>(id));
    size_t cut = pending_.size();
    // Step back over an unfinished trailing character.
    for (size_t back = 1; back <= 4 && back <= pending_.size(); ++back) {
      unsigned char c = static_cast<unsigned char>(pending_[pending_.size() - back]);
      if ((c & 0xC0) == 0x80) continue;  // continuation byte
      size_t need = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4;
      if (need > back) cut = pending_.size() - back;
      break;
    }
    std::string out = pending_.substr(0, cut);
    pending_.erase(0, cut);
    return out;
  }
  std::string flush() override {
    std::string out = pending_.empty() ? "" : "\xEF\xBF\xBD";
    pending_.clear();
    return out;
  }

 private:
  std::string pending_;
};
}  // namespace

std::unique_ptr<TokenTextStream> ByteCodec::stream_decoder() const { return std::make_unique<ByteStream>(); }

std::string ByteCodec::token_bytes(int32_t id) const {
  if (id == kEos) return "<eos>";
  return std::string(1, static_cast<char>(id));
}

// --- ScriptedScheduler ---

ScriptedScheduler::Script spell(std::string text) {
  return [text](const SequenceRequest&, int step) -> int32_t {
    if (step < static_cast<int>(text.size())) return static_cast<unsigned char>(text[step]);
    return ByteCodec::kEos;
  };
}

ScriptedScheduler::ScriptedScheduler(uv_loop_t* loop) : script_(spell("Hello world")) {
  uv_timer_init(loop, &timer_);
  timer_.data = this;
}

ScriptedScheduler::~ScriptedScheduler() = default;

void ScriptedScheduler::close() {
  uv_timer_stop(&timer_);
  uv_close(reinterpret_cast<uv_handle_t*>(&timer_), nullptr);
}

void ScriptedScheduler::set_script(Script s) {
  std::lock_guard<std::mutex> g(mu_);
  script_ = std::move(s);
}

uint64_t ScriptedScheduler::submit(SequenceRequest req, SequenceObserver* obs) {
  std::lock_guard<std::mutex> g(mu_);
  uint64_t id = next_id_++;
  submitted_.push_back(req);
  seqs_[id] = Seq{std::move(req), obs, 0};
  if (!uv_is_active(reinterpret_cast<uv_handle_t*>(&timer_))) {
    uint64_t ms = static_cast<uint64_t>(tick_ms_.load());
    uv_timer_start(&timer_, on_tick, ms, ms);
  }
  return id;
}

void ScriptedScheduler::cancel(uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  cancelled_.push_back(id);
  seqs_.erase(id);
}

SchedulerStats ScriptedScheduler::stats() const {
  std::lock_guard<std::mutex> g(mu_);
  SchedulerStats s;
  const int n = static_cast<int>(seqs_.size());
  s.running = std::min(n, capacity_.load());
  s.waiting = n - s.running;
  s.kv_blocks_used = s.running * 2;
  s.kv_blocks_total = 64;
  s.preemptions = 3;
  s.degraded = degraded_.load();
  return s;
}

std::vector<SequenceRequest> ScriptedScheduler::submitted() const {
  std::lock_guard<std::mutex> g(mu_);
  return submitted_;
}

std::vector<uint64_t> ScriptedScheduler::cancelled() const {
  std::lock_guard<std::mutex> g(mu_);
  return cancelled_;
}

size_t ScriptedScheduler::active() const {
  std::lock_guard<std::mutex> g(mu_);
  return seqs_.size();
}

void ScriptedScheduler::on_tick(uv_timer_t* t) { static_cast<ScriptedScheduler*>(t->data)->tick(); }

void ScriptedScheduler::tick() {
  // Observers may cancel sequences (stop strings), so work from a snapshot of
  // ids and re-check each before calling out; the lock is never held across
  // an observer call.
  std::vector<uint64_t> ids;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (const auto& [id, s] : seqs_) {
      if (int(ids.size()) >= capacity_.load()) break;  // the rest wait
      ids.push_back(id);
    }
    if (ids.empty()) uv_timer_stop(&timer_);
  }
  int per_tick = tokens_per_tick_.load();
  for (int k = 0; k < per_tick; ++k) {
  for (uint64_t id : ids) {
    SequenceObserver* obs = nullptr;
    int32_t tok = 0;
    bool last = false, is_stop = false;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = seqs_.find(id);
      if (it == seqs_.end()) continue;
      Seq& s = it->second;
      obs = s.obs;
      tok = script_(s.req, s.step);
      ++s.step;
      if (tok < 0) {
        seqs_.erase(it);
      } else {
        for (int32_t st : s.req.stop_ids) is_stop = is_stop || st == tok;
        last = is_stop || s.step >= s.req.max_new_tokens;
        if (last) seqs_.erase(it);
      }
    }
    if (tok < 0) {
      obs->on_finished(FinishReason::error, "worker failed");
      continue;
    }
    TokenEvent ev;
    ev.token = tok;
    // Capital letters are the unlikely ones (best_of ranks by this).
    ev.logprob = tok >= 'A' && tok <= 'Z' ? -2.0f : -0.5f;
    ev.top = {{tok, ev.logprob}, {'?', -1.5f}};
    obs->on_token(ev);
    if (last) {
      // Cancelled from inside on_token? Then no further call.
      bool was_cancelled = false;
      {
        std::lock_guard<std::mutex> g(mu_);
        for (uint64_t c : cancelled_) was_cancelled = was_cancelled || c == id;
      }
      if (!was_cancelled) obs->on_finished(is_stop ? FinishReason::stop : FinishReason::length, "");
    }
  }
  }
}

// --- TestGateway ---

TestGateway::TestGateway(HttpServerOptions http, ApiOptions api, const TextCodec* codec) {
  uv_loop_init(&loop_);
  scheduler_ = std::make_unique<ScriptedScheduler>(&loop_);
  api_ = std::make_unique<OpenAiApi>(api, scheduler_.get(), codec ? codec : &codec_, &metrics_);
  http.port = 0;
  http.host = "127.0.0.1";
  server_ = std::make_unique<HttpServer>(&loop_, http, api_.get());
  api_->watch_server(server_.get());
  Status st = server_->listen();
  if (!st.ok()) throw std::runtime_error(st.error());
  port_ = server_->port();
  stop_.data = this;
  uv_async_init(&loop_, &stop_, [](uv_async_t* a) {
    auto* self = static_cast<TestGateway*>(a->data);
    self->server_->close();
    self->api_->close();
    self->scheduler_->close();
    uv_close(reinterpret_cast<uv_handle_t*>(a), nullptr);
  });
  thread_ = std::thread([this] { uv_run(&loop_, UV_RUN_DEFAULT); });
}

TestGateway::~TestGateway() {
  uv_async_send(&stop_);
  thread_.join();
  server_.reset();
  api_.reset();
  scheduler_.reset();
  uv_loop_close(&loop_);
}

// --- TestClient ---

TestClient::TestClient(int port) {
  fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    throw std::runtime_error("connect failed");
  }
  int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

TestClient::~TestClient() { close(); }

void TestClient::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void TestClient::shrink_receive_buffer() {
  int small = 4096;
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
}

void TestClient::send(const std::string& bytes) {
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

bool TestClient::fill(int timeout_ms) {
  if (eof_) return false;
  pollfd p{fd_, POLLIN, 0};
  if (::poll(&p, 1, timeout_ms) <= 0) return false;
  char tmp[65536];
  ssize_t n = ::recv(fd_, tmp, sizeof(tmp), 0);
  if (n <= 0) {
    eof_ = true;
    return false;
  }
  buf_.append(tmp, static_cast<size_t>(n));
  return true;
}

std::string TestClient::read_until(const std::string& needle, int timeout_ms) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (buf_.find(needle) == std::string::npos) {
    int left = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
    if (left <= 0 || !fill(left)) break;
  }
  return buf_;
}

bool TestClient::wait_closed(int timeout_ms) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (!eof_) {
    int left = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
    if (left <= 0) return false;
    fill(left);
  }
  return true;
}

ClientResponse TestClient::read_response(int timeout_ms, bool head_only) {
  ClientResponse r;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  auto more = [&]() {
    int left = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
    return left > 0 && fill(left);
  };
  size_t head_end;
  while ((head_end = buf_.find("\r\n\r\n")) == std::string::npos) {
    if (!more()) return r;
  }
  std::string head = buf_.substr(0, head_end);
  buf_.erase(0, head_end + 4);
  size_t line_end = head.find("\r\n");
  std::string status_line = head.substr(0, line_end);
  r.status = std::stoi(status_line.substr(9, 3));
  size_t pos = line_end == std::string::npos ? head.size() : line_end + 2;
  while (pos < head.size()) {
    size_t e = head.find("\r\n", pos);
    if (e == std::string::npos) e = head.size();
    std::string line = head.substr(pos, e - pos);
    size_t colon = line.find(':');
    std::string name = line.substr(0, colon);
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    std::string value = line.substr(colon + 1);
    while (!value.empty() && value.front() == ' ') value.erase(0, 1);
    r.headers[name] = value;
    pos = e + 2;
  }
  if (r.status == 100) return r;
  if (head_only) {
    r.ok = true;
    return r;
  }
  if (r.headers.count("content-length")) {
    size_t len = std::stoul(r.headers["content-length"]);
    while (buf_.size() < len) {
      if (!more()) return r;
    }
    r.body = buf_.substr(0, len);
    buf_.erase(0, len);
  } else if (r.headers.count("transfer-encoding") && r.headers["transfer-encoding"] == "chunked") {
    for (;;) {
      size_t e;
      while ((e = buf_.find("\r\n")) == std::string::npos) {
        if (!more()) return r;
      }
      size_t len = std::stoul(buf_.substr(0, e), nullptr, 16);
      while (buf_.size() < e + 2 + len + 2) {
        if (!more()) return r;
      }
      r.body += buf_.substr(e + 2, len);
      buf_.erase(0, e + 2 + len + 2);
      if (len == 0) break;
    }
  } else {
    while (more()) {
    }
    r.body = buf_;
    buf_.clear();
  }
  r.ok = true;
  return r;
}

ClientResponse http(int port, const std::string& method, const std::string& path, const std::string& body,
                    const std::string& extra_headers) {
  TestClient c(port);
  std::string req = method + " " + path + " HTTP/1.1\r\nHost: localhost\r\n" + extra_headers;
  if (!body.empty() || method == "POST") {
    req += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  }
  req += "\r\n" + body;
  c.send(req);
  return c.read_response();
}

std::vector<std::string> sse_events(const std::string& body) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < body.size()) {
    size_t e = body.find("\n\n", pos);
    if (e == std::string::npos) break;
    std::string ev = body.substr(pos, e - pos);
    if (ev.rfind("data: ", 0) == 0) out.push_back(ev.substr(6));
    pos = e + 2;
  }
  return out;
}

bool eventually(const std::function<bool()>& cond, int timeout_ms) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return cond();
}

}  // namespace moe::gw::test
