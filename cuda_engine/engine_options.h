#pragma once
// The CUDA engine's options and the choices they take as enums, parsed once
// at a command line's edge (moe-worker, the benchmarks) with parse_choice
// and named back with choice_name; the engine itself never sees a string.
// Needs no CUDA headers.

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "model/result.h"

namespace moe {

enum class DenseWeights { automatic, bf16, int8, int4 };
enum class HostShareMode { automatic, on, off };
enum class MissMode { stream, copy };
enum class EvictionKind { lru, lfu, ours };
// --kv-dtype: auto resolves per engine (docs/kv-cache.md).
enum class KvDtypeChoice { automatic, bf16, int8, fp8 };
// Where copy mode's layer-ahead prefetch takes its guesses (docs/expert-prediction.md).
enum class PrefetchGuess { router, transition };

// The spelling of each choice on a command line.
template <class E>
struct ChoiceNames;
template <>
struct ChoiceNames<DenseWeights> {
  static constexpr std::pair<const char*, DenseWeights> all[] = {
      {"auto", DenseWeights::automatic}, {"bf16", DenseWeights::bf16}, {"int8", DenseWeights::int8},
      {"int4", DenseWeights::int4}};
};
template <>
struct ChoiceNames<HostShareMode> {
  static constexpr std::pair<const char*, HostShareMode> all[] = {
      {"auto", HostShareMode::automatic}, {"on", HostShareMode::on}, {"off", HostShareMode::off}};
};
template <>
struct ChoiceNames<MissMode> {
  static constexpr std::pair<const char*, MissMode> all[] = {{"stream", MissMode::stream}, {"copy", MissMode::copy}};
};
template <>
struct ChoiceNames<EvictionKind> {
  static constexpr std::pair<const char*, EvictionKind> all[] = {
      {"lru", EvictionKind::lru}, {"lfu", EvictionKind::lfu}, {"ours", EvictionKind::ours}};
};

template <>
struct ChoiceNames<KvDtypeChoice> {
  static constexpr std::pair<const char*, KvDtypeChoice> all[] = {
      {"auto", KvDtypeChoice::automatic}, {"bf16", KvDtypeChoice::bf16}, {"int8", KvDtypeChoice::int8},
      {"fp8", KvDtypeChoice::fp8}};
};

template <>
struct ChoiceNames<PrefetchGuess> {
  static constexpr std::pair<const char*, PrefetchGuess> all[] = {
      {"router", PrefetchGuess::router}, {"transition", PrefetchGuess::transition}};
};

template <class E>
std::optional<E> parse_choice(std::string_view text) {
  for (const auto& [name, value] : ChoiceNames<E>::all)
    if (text == name) return value;
  return std::nullopt;
}

template <class E>
const char* choice_name(E value) {
  for (const auto& [name, v] : ChoiceNames<E>::all)
    if (v == value) return name;
  return "?";
}

// "a, b or c": for the message that refuses anything else.
template <class E>
std::string choice_list() {
  std::string out;
  const size_t n = std::size(ChoiceNames<E>::all);
  for (size_t i = 0; i < n; ++i) {
    if (i) out += i + 1 == n ? " or " : ", ";
    out += ChoiceNames<E>::all[i].first;
  }
  return out;
}

// `value` given to command-line option `option` as a choice, or the
// message that refuses it ("option --misses takes stream or copy, got 'x'").
template <class E>
Result<E> parse_option(std::string_view option, std::string_view value) {
  if (auto c = parse_choice<E>(value)) return *c;
  return make_error("option " + std::string(option) + " takes " + choice_list<E>() + ", got '" + std::string(value) +
                    "'");
}

struct CudaEngineOptions {
  // The CUDA device, an index among those the process sees (CUDA_VISIBLE_DEVICES
  // chooses and orders them). The engine makes it current for the thread
  // that creates it, which must be the thread that calls it after.
  int device = 0;
  size_t vram_budget = 0;     // the whole process on the device; 0: free device memory less a margin
  bool prefix_cache = true;   // reuse cached KV blocks of shared prompt prefixes (docs/prefix-cache.md)
  // The arena alone instead (several engines in one process, as tests run
  // them side by side, cannot each own the whole process): when set,
  // vram_budget is ignored.
  size_t arena_budget = 0;
  // The router's rows in bf16 whatever the dense dtype (else INT8 at least).
  bool router_bf16 = false;
  int kv_blocks = 0;          // exactly this many; 0: what the experts leave (at least kv_blocks_min, up to 8 GiB)
  int kv_blocks_min = 64;     // with kv_blocks 0: the worker refuses to start with fewer
  // Under a budget, the KV pool grows into the expert islands nearest the
  // arena's top when sequences need more blocks than are free, and gives
  // them back once more than half its blocks have been free for
  // kv_give_back_s seconds (docs/kv-islands-trade.md). The start's blocks
  // and one layer's experts in islands always stay.
  bool kv_trade = true;
  int kv_give_back_s = 30;
  int max_step_tokens = 512;  // tokens per forward pass (larger steps run as several)
  int max_context = 0;        // 0: the model's max_position (capped at 32768)
  EvictionKind policy = EvictionKind::ours;  // which resident expert leaves its island
  bool prefetch = true;         // budget mode: hint the next layer's predicted experts
  // Copy mode's decode guesses for the next layer: its router on this
  // layer's state (router), or the learned layer-to-layer table (transition).
  PrefetchGuess prefetch_guess = PrefetchGuess::router;
  bool graphs = true;           // resident mode: replay decode steps as CUDA graphs
  // Resident mode: a decode pass of one token runs every layer in one
  // persistent launch (kernels/cuda/fused_decode.cuh, docs/fused-decode.md)
  // where the model's shapes allow (CudaExpertStats::fused_decode says why
  // not); off: the chain of a launch per kernel. Off by default: measured
  // slower than the chain so far (docs/fused-decode.md, "Measured").
  bool fused_decode = false;
  // Benchmarks: the fused pass stamps block 0's clock at each phase's
  // barrier (CudaExpertStats::fused_phase_us).
  bool bench_fused_stamps = false;
  int fuse_max_tokens = 4;      // up to this many tokens RMSNorm / SiLU are folded into the GEMVs (0..8)
  int q4_group = 64;            // quantising a checkpoint whose experts are not INT4 yet
  // Non-expert matrices: bf16, int8 (one scale per row), int4 (groups of 64
  // inputs, docs/int4-experts.md; the router's rows and lm_head stay int8,
  // a matrix narrower than 32-input runs too), or auto: bf16 when every
  // expert stays resident, else int8 (int4 only when int8 leaves no room;
  // its cost in quality in docs/cuda-worker.md). The embedding stays bf16.
  DenseWeights dense_weights = DenseWeights::automatic;
  // The KV cache's rows (docs/kv-cache.md). auto: int8 under a budget (fewer
  // islands than experts), bf16 when every expert is resident.
  KvDtypeChoice kv_dtype = KvDtypeChoice::automatic;
  // Under a budget (not every expert fits), keep the embedding in mapped
  // pinned host memory: a step reads one row per token over the link, and
  // its bytes become islands. Not done when a bf16 lm_head shares it.
  bool host_embedding = true;
  // Under a budget, the host's cores compute part of the misses from the
  // pinned blobs while the link brings the rest. Streamed batch-1 passes:
  // the first rows of every miss, by a table fixed at start from the two
  // measured rates (cuda_engine/host_share.h); copy mode: whole misses, per
  // layer on the host's running clock. host_threads 0: every hardware
  // thread but two (stream) or all (copy). "on", "off", or "auto": on where
  // the rates measured at start give the host any rows (in copy mode, where
  // the host has at least two threads). Which rows the host computes (f32,
  // the GPU half2) follows this machine's timings, and so may the last bits
  // of the logits; "off" keeps a budget run bit-identical to a resident one.
  HostShareMode host_experts = HostShareMode::automatic;
  // Under a budget, how decode passes (up to 8 tokens, not a prompt) meet a
  // miss: "stream", the expert kernels read it from pinned host memory over
  // the link (no host round trip inside the pass, so the pass is a CUDA
  // graph; experts the policy finds worth it are copied in after the pass,
  // at most stream_admit_per_pass a pass); or "copy", the host waits for
  // each layer's routes and copies the misses into islands first (with
  // prefetch of predicted experts, and the host split above).
  MissMode misses = MissMode::stream;
  int stream_admit_per_pass = 64;  // 8 converged slowly: docs/cuda-worker.md ("Admissions a pass")
  int host_threads = 0;
  double host_link_us = 0;    // one expert over the link, µs; 0: measured at start (tests force a split with it)
  double host_expert_us = 0;  // one expert on the host's cores (streamed passes), µs; 0: measured at start
  // Benchmarks: 0, the router picks the experts; else every token's experts
  // are drawn uniformly (distinct, the router's weights kept) from this seed,
  // the layer, the position and the sequence: the uniform routing that the
  // offload targets are stated for, which random router weights do not give.
  uint64_t uniform_routing_seed = 0;
  // Benchmarks: a recorded routing trace (replay/routing_trace.h: a
  // .safetensors tensor "routing_topk" [layers, tokens, top_k] or JSON
  // lines) of exactly this model's MoE layers, top-k and expert count, whose
  // choices replace the router's: each sequence walks the trace in order
  // from an offset of its own (kernels/cuda/router.cuh, ForcedRouting). Empty:
  // off. Takes precedence over uniform_routing_seed.
  std::string routing_trace;
  // Streamed decode passes of one token: the experts the next MoE layer's
  // router guesses on this layer's state after attention are copied from
  // the host into staging slots by a second stream of the graph while this
  // layer computes (docs/expert-prediction.md, "Streamed passes").
  // 2 x top_k expert blobs of the budget go to the slots. Off: measured 8-20 %
  // slower at 8 GiB, batch 1 (docs/expert-prediction.md, "Measured: it loses").
  bool stream_ahead = false;
  // Benchmarks with a replayed trace and stream_ahead: the guesses drawn
  // from the trace's next layer with this recall (cuda::force_guess)
  // instead of the seeded router's, which cannot know the replayed ids.
  // Below 0: the router's guesses.
  double bench_guess_recall = -1;
  // Decode attention: a query of at least 2 x this many keys is split over
  // several blocks, each taking a run of at least this many (a multiple of
  // 32; kernels/cuda/attention.cuh). 0: by the pass's size
  // (cuda::attention_split_keys_for: 128 where its (token, head) pairs leave
  // SMs idle, else 512). Outputs do not depend on it beyond float rounding
  // of the merge.
  int attention_split_keys = 0;
  // Benchmarks only, outputs meaningless: kernels left out of every pass, so
  // that a step's time without one tells that kernel's share of the step as
  // it runs among the others (moe-bench-engine --omit). Bits of OmitKernel.
  uint32_t bench_omit = 0;
};

enum OmitKernel : uint32_t {
  kOmitQkv = 1u << 0,        // the q|k|v projection (with its RMSNorm)
  kOmitAttention = 1u << 1,  // RoPE, the KV store and attention
  kOmitO = 1u << 2,          // the o projection
  kOmitPost = 1u << 3,       // the post-attention projection: the router's GEMV or the shared gate|up
  kOmitRouter = 1u << 4,     // softmax and top-k (uniform or replayed routing still draws the ids)
  kOmitGateUp = 1u << 5,     // the routed experts' gate|up
  kOmitDown = 1u << 6,       // the routed experts' down
  kOmitLmHead = 1u << 7,     // the final norm and lm_head
  kOmitSampling = 1u << 8,   // adjustments and sampling
};

// "qkv,attention,..." (OmitKernel's names, lower case) as bits; an unknown
// name is an error.
inline Result<uint32_t> parse_omit(std::string_view names) {
  static constexpr std::pair<std::string_view, uint32_t> kNames[] = {
      {"qkv", kOmitQkv},       {"attention", kOmitAttention}, {"o", kOmitO},
      {"post", kOmitPost},     {"router", kOmitRouter},       {"gate_up", kOmitGateUp},
      {"down", kOmitDown},     {"lm_head", kOmitLmHead},      {"sampling", kOmitSampling}};
  uint32_t bits = 0;
  while (!names.empty()) {
    const size_t comma = names.find(',');
    const std::string_view name = names.substr(0, comma);
    names = comma == std::string_view::npos ? std::string_view{} : names.substr(comma + 1);
    if (name.empty()) continue;
    bool known = false;
    for (const auto& [n, b] : kNames)
      if (n == name) bits |= b, known = true;
    if (!known)
      return make_error("unknown kernel '" + std::string(name) +
                        "' (qkv, attention, o, post, router, gate_up, down, lm_head, sampling)");
  }
  return bits;
}

}  // namespace moe
