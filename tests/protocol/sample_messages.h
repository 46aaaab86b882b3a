#pragma once
// Messages of every command with every field set to something other than its
// default, drawn from a seeded generator so a failure replays exactly.

#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "protocol/messages.h"

namespace moe::protocol::testing {

class SampleMessages {
 public:
  explicit SampleMessages(uint32_t seed) : rng_(seed) {}

  // One of each of the 16 message types, in Message's variant order.
  std::vector<Message> one_of_each() {
    std::vector<Message> v;
    for (size_t i = 0; i < std::variant_size_v<Message>; ++i) v.push_back(make(i));
    return v;
  }

  Message any() { return make(pick(0, std::variant_size_v<Message> - 1)); }

  Message make(size_t index) {
    switch (index) {
      case 0: return hello();
      case 1: return LoadExpert{u16(), u16s(1, 8), coin()};
      case 2: return LoadExpertReply{u16(), u16s(0, 8), u16s(0, 3), u64(), u32(), text()};
      case 3: return UnloadExpert{u16(), u16s(1, 8)};
      case 4: return UnloadExpertReply{u16(), u16s(0, 8), u16s(0, 3), text()};
      case 5: return warm_hints();
      case 6: return step();
      case 7: return step_reply();
      case 8: return ReleaseSequences{u64s(1, 10)};
      case 9: return StatsRequest{true};
      case 10: return stats_reply();
      case 11: return Shutdown{coin() ? ShutdownMode::drain : ShutdownMode::immediate, text()};
      case 12: return Ping{u64()};
      case 13: return Pong{u64(), u64()};
      case 14: return Pressure{static_cast<PressureLevel>(pick(0, 2)), text(), u64(), u64()};
      default:
        return ErrorReport{static_cast<ErrorCode>(pick(1, 14)), uint8_t(pick(0, 255)), u64(),
                           text()};
    }
  }

  Hello hello() {
    Hello h;
    h.role = Role::worker;
    h.model_id = "demo-moe/" + text();
    h.backend = coin() ? "cuda" : "cpu";
    h.instance = text();
    h.kv_blocks_total = u32();
    h.kv_block_tokens = 16;
    h.max_context = u32();
    h.vram_budget_bytes = u64();
    h.islands_total = u32();
    h.max_batch_sequences = u32();
    h.max_step_tokens = u32();
    h.experts.n_layers = static_cast<uint32_t>(pick(4, 60));
    h.experts.n_experts = static_cast<uint32_t>(pick(2, 128));
    h.experts.top_k = static_cast<uint32_t>(pick(1, h.experts.n_experts));
    h.experts.expert_blob_bytes = u64();
    for (uint16_t l = 0; l < h.experts.n_layers; ++l)
      if (coin()) h.experts.moe_layers.push_back(l);
    h.experts.n_moe_layers = static_cast<uint32_t>(h.experts.moe_layers.size());
    h.vocab_size = u32();
    h.eos_ids = {static_cast<int32_t>(pick(0, 1 << 20)), static_cast<int32_t>(pick(0, 1 << 20))};
    return h;
  }

  WarmHints warm_hints() {
    WarmHints w;
    for (size_t i = 0, n = pick(1, 20); i < n; ++i)
      w.hints.push_back({u16(), u16(), static_cast<float>(pick(0, 1000)) / 1000.0f});
    w.seq_id = u64();
    w.replace = coin();
    return w;
  }

  StepRequest step() {
    StepRequest s;
    s.report_expert_usage = coin();
    for (size_t i = 0, n = pick(1, 6); i < n; ++i) {
      StepSequence q;
      q.seq_id = 1000 + i;  // distinct, non-zero
      for (size_t t = 0, nt = pick(1, 40); t < nt; ++t)
        q.tokens.push_back(static_cast<int32_t>(pick(0, 150000)));
      q.start_pos = static_cast<uint32_t>(pick(0, 30000));
      q.sample = coin();
      q.sampling.temperature = static_cast<float>(pick(0, 200)) / 100.0f;
      q.sampling.top_p = static_cast<float>(pick(1, 100)) / 100.0f;
      q.sampling.top_k = static_cast<uint32_t>(pick(0, 100));
      q.sampling.seed = u64();
      q.sampling.logprobs = coin();
      q.sampling.top_logprobs = static_cast<uint8_t>(pick(0, kMaxTopLogprobs));
      if (coin()) {
        q.sampling.repetition_penalty = static_cast<float>(pick(50, 200)) / 100.0f;
        q.sampling.presence_penalty = static_cast<float>(pick(0, 400)) / 100.0f - 2.0f;
        q.sampling.frequency_penalty = static_cast<float>(pick(0, 400)) / 100.0f - 2.0f;
        q.sampling.min_p = static_cast<float>(pick(0, 100)) / 100.0f;
        int32_t tok = 0;
        for (size_t a = 0, na = pick(0, 30); a < na; ++a) {
          tok += static_cast<int32_t>(pick(1, 5000));
          const float bias = coin() ? -std::numeric_limits<float>::infinity() : static_cast<float>(pick(0, 200)) - 100.0f;
          q.sampling.adjust.push_back({tok, bias, static_cast<uint16_t>(pick(0, 9)), static_cast<uint8_t>(coin())});
        }
      }
      if (coin()) {
        q.sampling.allowed.assign(pick(1, 40), 0u);
        for (uint32_t& w : q.sampling.allowed) w = static_cast<uint32_t>(u64());
        q.sampling.allowed[0] |= 1u;
      }
      q.route_bucket = coin() ? u64() : 0;
      s.sequences.push_back(std::move(q));
    }
    return s;
  }

  StepReply step_reply() {
    StepReply r;
    for (size_t i = 0, n = pick(1, 6); i < n; ++i) {
      StepResult s;
      s.seq_id = u64();
      if (pick(0, 4) == 0) {
        s.error = ErrorCode::out_of_kv_blocks;
        s.error_message = text();
      }
      s.sampled = coin();
      s.token = static_cast<int32_t>(pick(0, 150000));
      s.logprob = -static_cast<float>(pick(0, 10000)) / 100.0f;
      for (size_t t = 0, nt = pick(0, kMaxTopLogprobs); t < nt; ++t)
        s.top.push_back({static_cast<int32_t>(pick(0, 150000)), -static_cast<float>(t)});
      s.expert_usage.resize(pick(0, 3) * 8);
      for (uint16_t& c : s.expert_usage) c = static_cast<uint16_t>(pick(0, 40));
      s.kv_tokens = u32();
      s.cached_tokens = static_cast<uint32_t>(pick(0, 4096));
      r.results.push_back(std::move(s));
    }
    r.timing = {u32(), u32(), u32(), u32()};
    r.kv_blocks_used = u32();
    r.kv_blocks_free = u32();
    r.expert_hits = u32();
    r.expert_misses = u32();
    return r;
  }

  StatsReply stats_reply() {
    StatsReply s{u64(), u64(), u64(), u32(), u32(), u32(), u32(),
                 u64(), u64(), u64(), u32(), u64(), {}, u64()};
    for (size_t i = 0, n = pick(0, 30); i < n; ++i) s.resident.push_back({u16(), u16()});
    if (coin()) {
      CardHealth& c = s.card;
      c.available = coin();
      c.reason = c.available ? "" : "libnvidia-ml.so.1: cannot open shared object file";
      c.name = "NVIDIA H200";
      c.temperature_c = int32_t(pick(0, 120)) - 10;
      c.sm_clock_mhz = u32();
      c.sm_clock_max_mhz = u32();
      c.memory_clock_mhz = u32();
      c.power_mw = u32();
      c.power_limit_mw = u32();
      c.throttle_reasons = u64();
      c.process_memory_bytes = u64();
      c.memory_total_bytes = u64();
      c.pcie_tx_kbps = u32();
      c.pcie_rx_kbps = u32();
      c.sample_age_ms = u32();
      c.sample_seq = u64();
    }
    return s;
  }

  size_t pick(size_t lo, size_t hi) { return std::uniform_int_distribution<size_t>(lo, hi)(rng_); }
  std::mt19937& rng() { return rng_; }

 private:
  bool coin() { return pick(0, 1) == 1; }
  uint16_t u16() { return static_cast<uint16_t>(pick(0, 0xFFFF)); }
  uint32_t u32() { return static_cast<uint32_t>(pick(0, 0xFFFFFFFFu)); }
  uint64_t u64() { return std::uniform_int_distribution<uint64_t>()(rng_); }
  std::vector<uint16_t> u16s(size_t lo, size_t hi) {
    std::vector<uint16_t> v(pick(lo, hi));
    for (auto& x : v) x = u16();
    return v;
  }
  std::vector<uint64_t> u64s(size_t lo, size_t hi) {
    std::vector<uint64_t> v(pick(lo, hi));
    for (auto& x : v) x = u64();
    return v;
  }
  std::string text() {
    static const char* words[] = {"expert", "island", "evicted", "KV", "ünïcode", "layer 3", ""};
    std::string s;
    for (size_t i = 0, n = pick(1, 4); i < n; ++i) s += std::string(words[pick(0, 6)]) + " ";
    return s;
  }

  std::mt19937 rng_;
};

// The frame carrying `m`, encoded through the typed make_frame overloads.
inline std::vector<uint8_t> frame_for(uint64_t request_id, const Message& m) {
  return std::visit([&](const auto& x) { return make_frame(request_id, x).value(); }, m);
}

// The same through the overload that takes the variant.
inline std::vector<uint8_t> frame_for_variant(uint64_t request_id, const Message& m) {
  return make_frame(request_id, m).value();
}

}  // namespace moe::protocol::testing
