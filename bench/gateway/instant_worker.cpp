// moe-bench-instant-worker: the real worker socket server (worker_server.cpp)
// in front of a backend that answers every step at once, so that a benchmark
// of the gateway measures the gateway alone. It describes itself as the model
// it is given (vocabulary, context, EOS ids) but computes nothing: each
// sampled token is the next id after the sequence's last token, skipping EOS
// ids so that requests run to max_tokens. Bench-only; never part of a server.

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <unordered_map>

#include <sys/eventfd.h>
#include <unistd.h>

#include "worker/backend.h"
#include "worker/model_hello.h"
#include "worker/worker_server.h"
#include "model/model_files.h"

namespace {

using namespace moe;

class InstantBackend final : public worker::Backend {
 public:
  explicit InstantBackend(const ModelDesc& d) : desc_(d) {}

  protocol::Hello describe() const override {
    protocol::Hello h = worker::model_hello(desc_);
    h.model_id = "instant";
    h.backend = "instant";
    h.instance = "moe-bench-instant-worker";
    h.kv_blocks_total = kBlocks;
    h.kv_block_tokens = kBlockTokens;
    h.max_context = uint32_t(std::min(desc_.max_position, int(kBlocks * kBlockTokens)));
    return h;
  }

  protocol::StepReply step(const protocol::StepRequest& req) override {
    protocol::StepReply reply;
    for (const protocol::StepSequence& s : req.sequences) {
      protocol::StepResult r;
      r.seq_id = s.seq_id;
      uint32_t& len = lengths_[s.seq_id];
      if (s.start_pos == 0) len = 0;
      len += uint32_t(s.tokens.size());
      r.kv_tokens = len;
      if (s.sample && !s.tokens.empty()) {
        r.sampled = true;
        r.token = next_token(s.tokens.back());
      }
      reply.results.push_back(std::move(r));
    }
    reply.kv_blocks_free = kv_blocks_free();
    reply.kv_blocks_used = kBlocks - reply.kv_blocks_free;
    return reply;
  }

  void release(uint64_t seq_id) override { lengths_.erase(seq_id); }
  int kv_blocks_total() const override { return kBlocks; }
  int kv_blocks_free() const override {
    uint32_t used = 0;
    for (const auto& [id, len] : lengths_) used += (len + kBlockTokens - 1) / kBlockTokens;
    return int(kBlocks) - int(std::min(used, kBlocks));
  }
  int sequences_active() const override { return int(lengths_.size()); }

 private:
  static constexpr uint32_t kBlocks = 1 << 16;
  static constexpr uint32_t kBlockTokens = 16;

  int32_t next_token(int32_t last) const {
    int32_t t = last;
    do t = (t + 1) % desc_.vocab_size;
    while (std::find(desc_.eos_token_ids.begin(), desc_.eos_token_ids.end(), t) !=
           desc_.eos_token_ids.end());
    return t;
  }

  ModelDesc desc_;
  std::unordered_map<uint64_t, uint32_t> lengths_;
};

int g_stop_fd = -1;
void on_signal(int) {
  const uint64_t one = 1;
  if (write(g_stop_fd, &one, sizeof one) < 0) {
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string model, socket;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--model")) model = argv[i + 1];
    else if (!std::strcmp(argv[i], "--socket")) socket = argv[i + 1];
  }
  if (model.empty() || socket.empty()) {
    std::fprintf(stderr,
                 "usage: moe-bench-instant-worker --model DIR|FILE --socket PATH\n"
                 "A worker that answers every step at once (for gateway benchmarks only).\n");
    return 2;
  }
  auto files = ModelFiles::open(model);
  if (!files) {
    std::fprintf(stderr, "moe-bench-instant-worker: %s\n", files.error().c_str());
    return 1;
  }
  InstantBackend backend((*files)->desc());
  worker::ServerOptions so;
  so.socket_path = socket;
  worker::WorkerServer server(&backend, so);
  if (Status st = server.listen(); !st) {
    std::fprintf(stderr, "moe-bench-instant-worker: %s\n", st.error().c_str());
    return 1;
  }
  g_stop_fd = eventfd(0, EFD_CLOEXEC);
  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);
  if (Status st = server.run(g_stop_fd); !st) {
    std::fprintf(stderr, "moe-bench-instant-worker: %s\n", st.error().c_str());
    return 1;
  }
  return 0;
}
