// The real moe-worker binary as a child process on a fixture model: hello,
// greedy decoding against the reference ids, bad frames, replacement of a
// connection, SIGTERM.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <cerrno>
#include <vector>

#include <csignal>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "model/safetensors.h"
#include "protocol/frame.h"
#include "protocol/messages.h"
#include "tests/reference_tensors.h"

namespace pr = moe::protocol;
namespace fs = std::filesystem;

namespace {

// MOE_TEST_DATA in the environment overrides the build's path (a build
// carried to the GPU machine); MOE_TEST_WORKER_BACKEND=cuda runs the same
// cases on the CUDA backend there.
std::string test_data() {
  const char* env = std::getenv("MOE_TEST_DATA");
  return env ? env : MOE_TEST_DATA;
}
std::string worker_bin() {
  const char* env = std::getenv("MOE_WORKER_BIN");
  return env ? env : MOE_WORKER_BIN;
}
std::string test_backend() {
  const char* env = std::getenv("MOE_TEST_WORKER_BACKEND");
  return env ? env : "cpu";
}
const std::string kFixture = test_data() + "/fixtures/qwen3_moe";

// One moe-worker child on a socket in a fresh private directory.
struct WorkerProcess {
  pid_t pid = -1;
  std::string dir, socket;
  // `backend_defaults`: on the CUDA backend, a 2 GB budget and 512 KV blocks
  // (cases that set their own leave them out).
  explicit WorkerProcess(std::vector<std::string> extra = {}, bool backend_defaults = true) {
    char tmpl[] = "/tmp/moe-worker-test-XXXXXX";
    REQUIRE(::mkdtemp(tmpl));
    dir = tmpl;
    socket = dir + "/sub/w.sock";  // the worker creates sub/ itself
    std::vector<std::string> args = {worker_bin(), "--model", kFixture, "--socket", socket,
                                     "--threads", "1", "--backend", test_backend()};
    if (test_backend() == "cuda" && backend_defaults) args.insert(args.end(), {"--vram-budget", "2G", "--kv-blocks", "512"});
    args.insert(args.end(), extra.begin(), extra.end());
    pid = ::fork();
    if (pid == 0) {
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      _exit(127);
    }
    for (int i = 0; i < 300 && !fs::exists(socket); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    REQUIRE(fs::exists(socket));
  }
  int wait_exit(int timeout_ms = 10000) {
    for (int i = 0; i < timeout_ms / 10; ++i) {
      int st = 0;
      if (::waitpid(pid, &st, WNOHANG) == pid) {
        pid = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }
  ~WorkerProcess() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

// A blocking client speaking the protocol.
struct Client {
  int fd = -1;
  pr::FrameDecoder dec;
  explicit Client(const std::string& path) {
    fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strcpy(a.sun_path, path.c_str());
    // The socket file appears at bind, a moment before listen: retry a refusal.
    int rc = -1;
    for (int i = 0; i < 200; ++i) {
      rc = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
      if (rc == 0 || errno != ECONNREFUSED) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    REQUIRE(rc == 0);
  }
  ~Client() {
    if (fd >= 0) ::close(fd);
  }
  void send_bytes(const std::vector<uint8_t>& b) {
    REQUIRE(::send(fd, b.data(), b.size(), MSG_NOSIGNAL) == ssize_t(b.size()));
  }
  template <typename M>
  void send(uint64_t id, const M& m) {
    send_bytes(pr::make_frame(id, m).value());
  }
  // The next frame; status error when the worker closed the connection.
  // The pongs a worker sends by itself during long steps (request id 0) are
  // counted in `beats` and skipped.
  int beats = 0;
  pr::DecodeEvent next(int timeout_ms = 20000) {
    for (;;) {
      pr::DecodeEvent ev = dec.next();
      if (ev.status == pr::DecodeStatus::frame && ev.frame.command == uint8_t(pr::Command::pong) &&
          ev.frame.request_id == 0) {
        ++beats;
        continue;
      }
      if (ev.status != pr::DecodeStatus::need_more) return ev;
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, timeout_ms) <= 0) return ev;
      uint8_t buf[65536];
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) {
        ev.status = pr::DecodeStatus::error;
        ev.error.message = "closed";
        return ev;
      }
      dec.feed(std::span<const uint8_t>(buf, size_t(n)));
    }
  }
  bool closed_by_peer(int timeout_ms = 5000) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) <= 0) return false;
    uint8_t b;
    return ::recv(fd, &b, 1, 0) == 0;
  }
  pr::Hello hello() {
    send(1, pr::Hello{});
    auto ev = next();
    REQUIRE(ev.status == pr::DecodeStatus::frame);
    REQUIRE(ev.frame.command == uint8_t(pr::Command::hello));
    REQUIRE(ev.frame.request_id == 1);
    return pr::decode_hello(ev.frame.payload).value();
  }
  pr::ErrorReport expect_error(uint64_t id) {
    auto ev = next();
    REQUIRE(ev.status == pr::DecodeStatus::frame);
    REQUIRE(ev.frame.command == uint8_t(pr::Command::error));
    CHECK(ev.frame.request_id == id);
    return pr::decode_error(ev.frame.payload).value();
  }
  pr::StepReply step(uint64_t id, const pr::StepRequest& r) {
    send(id, r);
    auto ev = next();
    REQUIRE(ev.status == pr::DecodeStatus::frame);
    REQUIRE(ev.frame.command == uint8_t(pr::Command::step_reply));
    REQUIRE(ev.frame.request_id == id);
    return pr::decode_step_reply(ev.frame.payload).value();
  }
  void ping_ok(uint64_t id) {
    send(id, pr::Ping{42});
    auto ev = next();
    REQUIRE(ev.status == pr::DecodeStatus::frame);
    CHECK(ev.frame.command == uint8_t(pr::Command::pong));
    CHECK(pr::decode_pong(ev.frame.payload).value().ping_sent_us == 42);
  }
};

std::vector<float> floats(const moe::TensorView& t) {
  std::vector<float> out(size_t(t.numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    if (t.dtype == moe::DType::f32) {
      std::memcpy(&out[i], t.data + 4 * i, 4);
    } else {
      double v;
      std::memcpy(&v, t.data + 8 * i, 8);
      out[i] = float(v);
    }
  }
  return out;
}

pr::StepSequence greedy(uint64_t id, std::vector<int32_t> tokens, uint32_t start) {
  pr::StepSequence s;
  s.seq_id = id;
  s.tokens = std::move(tokens);
  s.start_pos = start;
  s.sampling.temperature = 0;
  return s;
}

}  // namespace

TEST_CASE("moe-worker answers hello with its capabilities and decodes the reference greedy ids", "[worker]") {
  WorkerProcess w;
  struct stat st{};
  REQUIRE(::stat(w.socket.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  REQUIRE(::stat(fs::path(w.socket).parent_path().c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);

  Client c(w.socket);
  const pr::Hello h = c.hello();
  CHECK(h.role == pr::Role::worker);
  CHECK(h.backend == test_backend());
  CHECK(h.model_id == "qwen3_moe");
  CHECK(h.kv_blocks_total > 0);
  CHECK(h.kv_block_tokens == 16);
  CHECK(h.max_context > 0);
  CHECK(h.vocab_size == 1027);
  CHECK(h.experts.n_moe_layers == h.experts.moe_layers.size());
  CHECK(h.experts.n_experts > 0);

  auto ref = moe::Checkpoint::open_file(kFixture + "/reference.safetensors");
  REQUIRE(ref.ok());
  // Two prompts in the same steps: batching must not change either's tokens.
  std::vector<std::vector<int32_t>> prompts, want;
  std::vector<std::vector<float>> margins;
  for (int p = 0; p < 2; ++p) {
    const std::string pre = "p" + std::to_string(p) + ".";
    prompts.push_back(moe::test::ints(*ref->find(pre + "input_ids")));
    want.push_back(moe::test::ints(*ref->find(pre + "greedy_ids")));
    margins.push_back(floats(*ref->find(pre + "greedy_margin")));
  }
  pr::StepRequest req;
  for (int p = 0; p < 2; ++p) req.sequences.push_back(greedy(uint64_t(p + 1), prompts[size_t(p)], 0));
  std::vector<uint32_t> pos = {uint32_t(prompts[0].size()), uint32_t(prompts[1].size())};
  std::vector<bool> live = {true, true};
  int compared = 0;
  const size_t per_seq = size_t(h.experts.n_moe_layers) * h.experts.n_experts;
  for (size_t s = 0; s < std::min(want[0].size(), want[1].size()); ++s) {
    pr::StepReply r = c.step(100 + s, req);
    REQUIRE(r.results.size() == req.sequences.size());
    pr::StepRequest nextreq;
    for (size_t k = 0; k < r.results.size(); ++k) {
      const auto& res = r.results[k];
      const size_t p = size_t(res.seq_id - 1);
      REQUIRE(res.error == pr::ErrorCode::none);
      REQUIRE(res.sampled);
      CHECK(res.kv_tokens == pos[p]);
      // expert usage: top_k experts per token of each MoE layer.
      REQUIRE(res.expert_usage.size() == per_seq);
      uint32_t served = 0;
      for (uint16_t u : res.expert_usage) served += u;
      CHECK(served == h.experts.top_k * h.experts.n_moe_layers * req.sequences[k].tokens.size());
      // A near tie in the reference itself; the CUDA backend's INT4 experts
      // (quantised at load) move logits by more than the CPU's bf16 ones.
      if (margins[p][s] < (test_backend() == "cuda" ? 0.15f : 1e-3f)) live[p] = false;
      if (live[p]) {
        CHECK(res.token == want[p][s]);
        ++compared;
      }
      nextreq.sequences.push_back(greedy(res.seq_id, {res.token}, pos[p]));
      pos[p] += 1;
    }
    req = nextreq;
  }
  // On the CUDA backend this fixture's reference (random weights, flat
  // logits) is too close to ties for INT4 experts; its agreement with the
  // CPU engine is proven token by token in moe_cuda_engine_tests.
  if (test_backend() == "cpu") CHECK(compared >= 8);

  // Stats, release, and the KV coming back.
  c.send(900, pr::StatsRequest{});
  auto ev = c.next();
  REQUIRE(ev.frame.command == uint8_t(pr::Command::stats_reply));
  auto stats = pr::decode_stats_reply(ev.frame.payload).value();
  CHECK(stats.sequences_active == 2);
  CHECK(stats.kv_blocks_used > 0);
  c.send(901, pr::ReleaseSequences{{1, 2}});
  c.send(902, pr::StatsRequest{});
  ev = c.next();
  stats = pr::decode_stats_reply(ev.frame.payload).value();
  CHECK(stats.sequences_active == 0);
  CHECK(stats.kv_blocks_used == 0);
  CHECK(stats.kv_blocks_free == h.kv_blocks_total);
}

TEST_CASE("moe-worker says KV pressure: warn below 10 % free, evict below 3 %, again after relief", "[worker]") {
  WorkerProcess w({"--kv-blocks", "40", "--prefix-cache", "off"});  // identical prompts: no blocks shared
  Client c(w.socket);
  REQUIRE(c.hello().kv_blocks_total == 40);
  auto expect_pressure = [&](pr::PressureLevel level, const std::string& free_text) {
    auto ev = c.next();
    REQUIRE(ev.status == pr::DecodeStatus::frame);
    REQUIRE(ev.frame.command == uint8_t(pr::Command::pressure));
    CHECK(ev.frame.request_id == 0);  // unsolicited
    const pr::Pressure p = pr::decode_pressure(ev.frame.payload).value();
    CHECK(p.level == level);
    CHECK(p.detail.find(free_text) != std::string::npos);
  };
  auto fill = [&](uint64_t first_id, uint64_t request) {
    // 12 + 12 + 13 blocks of 16 tokens: 3 of 40 free (7.5 %).
    pr::StepRequest req;
    for (int i = 0; i < 3; ++i)
      req.sequences.push_back(greedy(first_id + uint64_t(i), std::vector<int32_t>(i == 2 ? 208 : 192, 5), 0));
    const pr::StepReply r = c.step(request, req);
    for (const auto& res : r.results) REQUIRE(res.error == pr::ErrorCode::none);
  };
  fill(1, 10);
  expect_pressure(pr::PressureLevel::warn, "3 of 40");
  // Two more blocks: 1 free (2.5 %).
  pr::StepRequest more;
  more.sequences.push_back(greedy(4, std::vector<int32_t>(32, 5), 0));
  REQUIRE(c.step(11, more).results.at(0).error == pr::ErrorCode::none);
  expect_pressure(pr::PressureLevel::evict, "1 of 40");
  // Released, the pool is roomy again; filling it again warns again (and
  // nothing was said in between: the next frame is that warning).
  c.send(12, pr::ReleaseSequences{{1, 2, 3, 4}});
  fill(5, 13);
  expect_pressure(pr::PressureLevel::warn, "3 of 40");
}

TEST_CASE("moe-worker answers bad frames with error frames and keeps serving", "[worker]") {
  WorkerProcess w({"--max-frame-bytes", "4096"});
  Client c(w.socket);
  // Before hello: not_ready.
  c.send(5, pr::StatsRequest{});
  CHECK(c.expect_error(5).code == pr::ErrorCode::not_ready);
  c.hello();
  // Unknown command byte: recoverable.
  std::vector<uint8_t> unknown;
  REQUIRE(pr::append_frame(unknown, uint8_t(0x55), 7, std::vector<uint8_t>{1, 2, 3}).ok());
  c.send_bytes(unknown);
  CHECK(c.expect_error(7).code == pr::ErrorCode::unknown_command);
  c.ping_ok(8);
  // Garbage payload for a step: malformed_payload.
  std::vector<uint8_t> garbage;
  REQUIRE(pr::append_frame(garbage, pr::Command::step, 9, std::vector<uint8_t>(40, 0xAB)).ok());
  c.send_bytes(garbage);
  CHECK(c.expect_error(9).code == pr::ErrorCode::malformed_payload);
  // Inconsistent sequences fail alone; the good one runs.
  pr::StepRequest req;
  req.sequences.push_back(greedy(1, {1, 2, 3}, 0));
  req.sequences.push_back(greedy(2, {5000000}, 0));  // token out of range
  req.sequences.push_back(greedy(3, {4}, 7));        // unknown sequence at start_pos 7
  pr::StepReply r = c.step(10, req);
  REQUIRE(r.results.size() == 3);
  CHECK(r.results[0].error == pr::ErrorCode::none);
  CHECK(r.results[1].error == pr::ErrorCode::invalid_argument);
  CHECK(r.results[2].error == pr::ErrorCode::unknown_sequence);
  // A reply command sent to the worker.
  c.send(11, pr::StepReply{});
  CHECK(c.expect_error(11).code == pr::ErrorCode::invalid_argument);
  c.ping_ok(12);
  // Oversized frame: fatal, an error frame with request id 0, then the connection closes.
  std::vector<uint8_t> big;
  REQUIRE(pr::append_frame(big, pr::Command::step, 13, std::vector<uint8_t>(8000, 0)).ok());
  c.send_bytes(big);
  auto err = c.expect_error(0);
  CHECK(err.code == pr::ErrorCode::frame_too_large);
  CHECK(c.closed_by_peer());
  // The worker still serves a new connection, and sequence 1 of the dropped one was released.
  Client c2(w.socket);
  const pr::Hello h = c2.hello();
  c2.send(2, pr::StatsRequest{});
  auto ev = c2.next();
  auto stats = pr::decode_stats_reply(ev.frame.payload).value();
  CHECK(stats.kv_blocks_free == h.kv_blocks_total);
  // While c2 is live, another connection is refused (busy) and closed; c2 goes on.
  Client intruder(w.socket);
  auto refused = intruder.expect_error(0);
  CHECK(refused.code == pr::ErrorCode::busy);
  CHECK(intruder.closed_by_peer());
  c2.ping_ok(4);
  // A wrong protocol version is refused and the connection closed.
  ::close(c2.fd);
  c2.fd = -1;
  Client c3(w.socket);
  pr::Hello old;
  old.protocol_version = pr::kProtocolVersion + 7;
  c3.send(1, old);
  CHECK(c3.expect_error(1).code == pr::ErrorCode::version_mismatch);
  CHECK(c3.closed_by_peer());
}

TEST_CASE("moe-worker exits 0 on SIGTERM after answering the step in flight", "[worker]") {
  WorkerProcess w;
  Client c(w.socket);
  c.hello();
  pr::StepRequest req;
  std::vector<int32_t> prompt;
  for (int i = 0; i < 200; ++i) prompt.push_back(1 + i % 1000);
  req.sequences.push_back(greedy(1, prompt, 0));
  c.send(3, req);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ::kill(w.pid, SIGTERM);
  auto ev = c.next();
  REQUIRE(ev.status == pr::DecodeStatus::frame);
  CHECK(ev.frame.command == uint8_t(pr::Command::step_reply));
  CHECK(w.wait_exit() == 0);
  CHECK_FALSE(fs::exists(w.socket));
}

// The device memory nvidia-smi shows for process `pid`, in MiB (-1: none shown).
int gpu_mib_of(pid_t pid) {
  FILE* f = ::popen("nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null", "r");
  if (!f) return -1;
  int found = -1;
  char line[256];
  while (std::fgets(line, sizeof(line), f)) {
    long p = 0, mib = 0;
    if (std::sscanf(line, "%ld, %ld", &p, &mib) == 2 && p == long(pid)) found = int(mib);
  }
  ::pclose(f);
  return found;
}

TEST_CASE("moe-worker's whole process stays within --vram-budget as nvidia-smi shows it", "[worker]") {
  if (test_backend() != "cuda") {
    WARN("skipped: the device budget is a CUDA backend matter (MOE_TEST_WORKER_BACKEND=cuda on a GPU machine)");
    return;
  }
  // The KV takes what the experts leave: the arena fills the budget, so the
  // context, the libraries and the graphs captured later must fit beside it.
  constexpr int kBudgetMiB = 1536;
  WorkerProcess w({"--vram-budget", std::to_string(kBudgetMiB) + "MiB"}, false);
  Client c(w.socket);
  const pr::Hello h = c.hello();
  REQUIRE(h.kv_blocks_total > 0);
  const int at_ready = gpu_mib_of(w.pid);
  REQUIRE(at_ready > 0);
  std::atomic<bool> done{false};
  std::atomic<int> peak{at_ready};
  std::thread sampler([&] {
    while (!done) {
      peak = std::max(peak.load(), gpu_mib_of(w.pid));
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  // Prefill of 8 prompts of 300 tokens (several passes of --max-step-tokens),
  // then decode at batch 8, then batch sizes 1..7 (each its own graph).
  pr::StepRequest req;
  std::vector<uint32_t> pos;
  for (int s = 0; s < 8; ++s) {
    std::vector<int32_t> prompt;
    for (int i = 0; i < 300; ++i) prompt.push_back(1 + (i * 7 + s * 131) % 1000);
    req.sequences.push_back(greedy(uint64_t(s + 1), prompt, 0));
    pos.push_back(300);
  }
  uint64_t id = 10;
  for (int step = 0; step < 60; ++step) {
    const pr::StepReply r = c.step(id++, req);
    REQUIRE(r.results.size() == req.sequences.size());
    pr::StepRequest next;
    const size_t keep = step < 30 ? 8 : size_t(8 - (step - 30) % 8);
    for (size_t k = 0; k < r.results.size() && k < keep; ++k) {
      REQUIRE(r.results[k].error == pr::ErrorCode::none);
      const size_t p = size_t(r.results[k].seq_id - 1);
      next.sequences.push_back(greedy(r.results[k].seq_id, {r.results[k].token}, pos[p]));
      pos[p] += 1;
    }
    req = next;
  }
  done = true;
  sampler.join();
  const int after = gpu_mib_of(w.pid);
  peak = std::max(peak.load(), after);
  INFO("budget " << kBudgetMiB << " MiB, at ready " << at_ready << " MiB, peak " << peak << " MiB, after " << after
                 << " MiB");
  CHECK(peak <= kBudgetMiB);
  // Nothing but the graphs of the batch sizes met (64 MiB kept for them) is
  // allocated after the worker said it was ready.
  CHECK(peak - at_ready <= 64);
  ::kill(w.pid, SIGTERM);
  CHECK(w.wait_exit() == 0);
}

TEST_CASE("moe-worker --kv-dtype int8: coded KV rows, more blocks in the same room, the reference's tokens",
          "[worker][kv]") {
  WorkerProcess plain, coded({"--kv-dtype", "int8"});
  Client cp(plain.socket), cc(coded.socket);
  const pr::Hello hp = cp.hello(), hc = cc.hello();
  // The CPU backend sizes its pool by bytes (256 MiB): f32 rows of 32 values
  // take 128 bytes a head, coded ones 36.
  if (test_backend() == "cpu") CHECK(hc.kv_blocks_total >= 3 * hp.kv_blocks_total);
  auto ref = moe::Checkpoint::open_file(kFixture + "/reference.safetensors");
  REQUIRE(ref.ok());
  const auto prompt = moe::test::ints(*ref->find("p0.input_ids"));
  const auto want = moe::test::ints(*ref->find("p0.greedy_ids"));
  const auto margin = floats(*ref->find("p0.greedy_margin"));
  pr::StepRequest req;
  req.sequences.push_back(greedy(1, prompt, 0));
  uint32_t pos = uint32_t(prompt.size());
  int compared = 0;
  for (size_t s = 0; s < want.size(); ++s) {
    const pr::StepReply r = cc.step(200 + s, req);
    REQUIRE(r.results.size() == 1);
    REQUIRE(r.results[0].error == pr::ErrorCode::none);
    // The reference's own token goes in next (teacher forcing); steps the
    // reference calls close are not compared (a coded row moves logits by a
    // few hundredths on these flat random-weight logits).
    if (margin[s] >= 0.05f) {
      CHECK(r.results[0].token == want[s]);
      ++compared;
    }
    req.sequences = {greedy(1, {want[s]}, pos++)};
  }
  INFO(compared << " tokens compared");
  CHECK(compared >= 3);
}

TEST_CASE("moe-worker refuses bad command lines clearly", "[worker]") {
  auto run = [](const std::string& args) {
    const int st = std::system((worker_bin() + " " + args + " >/dev/null 2>&1").c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  };
  CHECK(run("--version") == 0);
  CHECK(run("--help") == 0);
  CHECK(run("--socket /tmp/x.sock") == 2);
  CHECK(run("--model " + kFixture + " --socket /tmp/x.sock --bogus 1") == 2);
  CHECK(run("--model " + kFixture + " --socket /tmp/x.sock --backend gpu") == 2);
  CHECK(run("--model " + kFixture + " --socket /tmp/x.sock --vram-budget 8Q") == 2);
  CHECK(run("--model " + kFixture + " --socket /tmp/x.sock --expert-policy fifo") == 2);
  CHECK(run("--model " + kFixture + " --socket /tmp/x.sock --host-experts maybe") == 2);
  CHECK(run("--model " + kFixture + " --socket /tmp/x.sock --dense-weights int2") == 2);
  CHECK(run("--model " + kFixture + " --socket /tmp/x.sock --kv-dtype int4") == 2);
  CHECK(run("--model " + kFixture + " --socket /tmp/x.sock --kv-trade sometimes") == 2);
  CHECK(run("--model " + kFixture + " --socket /tmp/x.sock --fused-decode yes") == 2);
  CHECK(run("--model " + kFixture + " --socket /tmp/x.sock --kv-give-back-s -1") == 2);
  CHECK(run("--model " + kFixture + " --socket /tmp/x.sock --warm-profile") == 2);
  CHECK(run("--model " + kFixture + " --socket /tmp/x.sock --save-profile-every-s 0") == 2);
  CHECK(run("--model " + kFixture + " --socket /tmp/x.sock --routing sideways") == 2);
  CHECK(run("--model " + kFixture + " --socket /tmp/x.sock --routing replay:") == 2);
  // The benchmark routings belong to the cuda backend: the CPU backend refuses them before loading.
  CHECK(run("--model " + kFixture + " --socket /tmp/x.sock --backend cpu --routing uniform") == 2);
  CHECK(run("--model " + kFixture + " --socket /tmp/x.sock --backend cpu --routing replay:/tmp/t.safetensors") == 2);
  // The cuda backend without a model (or, in CI, without a device) fails to start, saying why.
  CHECK(run("--model /nonexistent --socket /tmp/moe-worker-test-nonexistent.sock --backend cuda") == 1);
  CHECK(run("--model /nonexistent --socket /tmp/moe-worker-test-nonexistent.sock") == 1);
}
