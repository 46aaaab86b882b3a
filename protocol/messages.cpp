#include "protocol/messages.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <unordered_set>

#include "protocol/moe_generated.h"

namespace moe::protocol {

namespace fb = moe::fb;
using flatbuffers::FlatBufferBuilder;
using flatbuffers::Offset;

// Scalar vectors are copied as bytes (see Reader::scalars).
static_assert(FLATBUFFERS_LITTLEENDIAN, "the wire format is little-endian");
static_assert(static_cast<uint16_t>(ErrorCode::frame_too_small) == fb::ErrorCode_MAX,
              "ErrorCode must mirror moe.fb.ErrorCode");
static_assert(static_cast<uint16_t>(ErrorCode::version_mismatch) == fb::ErrorCode_VersionMismatch);
static_assert(static_cast<uint8_t>(Role::worker) == fb::Role_Worker);
static_assert(static_cast<uint8_t>(PressureLevel::break_) == fb::PressureLevel_Break);
static_assert(static_cast<uint8_t>(ShutdownMode::immediate) == fb::ShutdownMode_Immediate);

const char* pressure_level_name(PressureLevel level) {
  switch (level) {
    case PressureLevel::warn: return "warn";
    case PressureLevel::evict: return "evict";
    case PressureLevel::break_: return "break";
  }
  return "unknown";
}

Status check_version(const Hello& peer) {
  if (peer.protocol_version == kProtocolVersion) return {};
  return make_error("protocol version mismatch: peer speaks " +
                    std::to_string(peer.protocol_version) + ", this side speaks " +
                    std::to_string(kProtocolVersion));
}

namespace {

// ----------------------------------------------------------------- encoding

std::vector<uint8_t> finish(FlatBufferBuilder& b) {
  const uint8_t* p = b.GetBufferPointer();
  return std::vector<uint8_t>(p, p + b.GetSize());
}

Offset<flatbuffers::String> str(FlatBufferBuilder& b, std::string_view s) {
  // Strings over the limit would be refused by the reader; cut them here.
  s = s.substr(0, kMaxStringBytes);
  return b.CreateString(s.data(), s.size());
}

template <typename T>
Offset<flatbuffers::Vector<T>> vec(FlatBufferBuilder& b, const std::vector<T>& v) {
  return b.CreateVector(v);
}

// ----------------------------------------------------------------- decoding

// Copies fields out of a verified table and records the first limit that a
// field breaks; `what` names the message in every error.
class Reader {
 public:
  explicit Reader(const char* what) : what_(what) {}

  std::string string(const flatbuffers::String* s, const char* field) {
    if (!s) return {};
    if (s->size() > kMaxStringBytes) {
      fail(std::string(field) + " is " + std::to_string(s->size()) + " bytes, limit " +
           std::to_string(kMaxStringBytes));
      return {};
    }
    return s->str();
  }

  template <typename T>
  std::vector<T> scalars(const flatbuffers::Vector<T>* v, size_t limit, const char* field) {
    if (!v) return {};
    if (!within(v->size(), limit, field)) return {};
    // The verifier checks a vector's length field for 4-byte alignment only,
    // so 8-byte elements may sit misaligned in a crafted buffer: copy bytes.
    std::vector<T> out(v->size());
    if (!out.empty()) std::memcpy(out.data(), v->Data(), out.size() * sizeof(T));
    return out;
  }

  bool within(size_t n, size_t limit, const char* field) {
    if (n <= limit) return true;
    fail(std::string(field) + " has " + std::to_string(n) + " entries, limit " +
         std::to_string(limit));
    return false;
  }

  void fail(const std::string& why) {
    if (err_.empty()) err_ = std::string(what_) + ": " + why;
  }
  bool ok() const { return err_.empty(); }

  template <typename T>
  Result<T> result(T value) {
    if (!ok()) return make_error(err_);
    return value;
  }

 private:
  const char* what_;
  std::string err_;
};

// Verifies `p` as a T and hands the root table to `convert`, which returns
// Result<Message>. Payloads that are not 8-byte aligned (a span into a larger
// buffer) are copied first, as the FlatBuffers reader loads scalars in place.
template <typename T, typename Convert>
auto verified(Payload p, const char* what, Convert&& convert)
    -> decltype(convert(std::declval<const T&>())) {
  if (p.size() < sizeof(flatbuffers::uoffset_t) || p.size() >= FLATBUFFERS_MAX_BUFFER_SIZE) {
    return make_error(std::string(what) + ": payload of " + std::to_string(p.size()) +
                      " bytes cannot hold a table");
  }
  std::vector<uint8_t> aligned;
  const uint8_t* data = p.data();
  if (reinterpret_cast<uintptr_t>(data) % alignof(uint64_t) != 0) {
    aligned.assign(p.begin(), p.end());
    data = aligned.data();
  }
  flatbuffers::Verifier::Options opts;
  opts.max_depth = kVerifierMaxDepth;
  opts.max_tables = kVerifierMaxTables;
  flatbuffers::Verifier verifier(data, p.size(), opts);
  if (!verifier.VerifyBuffer<T>(nullptr)) {
    return make_error(std::string(what) + ": payload of " + std::to_string(p.size()) +
                      " bytes failed FlatBuffers verification");
  }
  return convert(*flatbuffers::GetRoot<T>(data));
}

bool finite(float x) { return std::isfinite(x); }

}  // namespace

// ==================================================================== hello

std::vector<uint8_t> encode_hello(const Hello& m) {
  FlatBufferBuilder b(512);
  auto model_id = str(b, m.model_id);
  auto backend = str(b, m.backend);
  auto instance = str(b, m.instance);
  auto moe_layers = vec(b, m.experts.moe_layers);
  fb::ExpertLayoutBuilder lb(b);
  lb.add_n_layers(m.experts.n_layers);
  lb.add_n_moe_layers(m.experts.n_moe_layers);
  lb.add_n_experts(m.experts.n_experts);
  lb.add_top_k(m.experts.top_k);
  lb.add_expert_blob_bytes(m.experts.expert_blob_bytes);
  lb.add_moe_layers(moe_layers);
  auto layout = lb.Finish();
  auto eos = vec(b, m.eos_ids);
  fb::HelloBuilder hb(b);
  hb.add_protocol_version(m.protocol_version);
  hb.add_role(static_cast<fb::Role>(m.role));
  hb.add_model_id(model_id);
  hb.add_backend(backend);
  hb.add_instance(instance);
  hb.add_kv_blocks_total(m.kv_blocks_total);
  hb.add_kv_block_tokens(m.kv_block_tokens);
  hb.add_max_context(m.max_context);
  hb.add_vram_budget_bytes(m.vram_budget_bytes);
  hb.add_islands_total(m.islands_total);
  hb.add_max_batch_sequences(m.max_batch_sequences);
  hb.add_max_step_tokens(m.max_step_tokens);
  hb.add_experts(layout);
  hb.add_vocab_size(m.vocab_size);
  hb.add_eos_ids(eos);
  b.Finish(hb.Finish());
  return finish(b);
}

Result<Hello> decode_hello(Payload p) {
  return verified<fb::Hello>(p, "hello", [](const fb::Hello& t) -> Result<Hello> {
    Reader r("hello");
    Hello m;
    m.protocol_version = t.protocol_version();
    const auto role = static_cast<uint8_t>(t.role());
    if (role > static_cast<uint8_t>(Role::worker)) r.fail("unknown role " + std::to_string(role));
    m.role = static_cast<Role>(role);
    m.model_id = r.string(t.model_id(), "model_id");
    m.backend = r.string(t.backend(), "backend");
    m.instance = r.string(t.instance(), "instance");
    m.kv_blocks_total = t.kv_blocks_total();
    m.kv_block_tokens = t.kv_block_tokens();
    m.max_context = t.max_context();
    m.vram_budget_bytes = t.vram_budget_bytes();
    m.islands_total = t.islands_total();
    m.max_batch_sequences = t.max_batch_sequences();
    m.max_step_tokens = t.max_step_tokens();
    if (const fb::ExpertLayout* l = t.experts()) {
      m.experts.n_layers = l->n_layers();
      m.experts.n_moe_layers = l->n_moe_layers();
      m.experts.n_experts = l->n_experts();
      m.experts.top_k = l->top_k();
      m.experts.expert_blob_bytes = l->expert_blob_bytes();
      m.experts.moe_layers = r.scalars(l->moe_layers(), kMaxExpertsPerMessage, "moe_layers");
    }
    const ExpertLayout& e = m.experts;
    if (e.moe_layers.size() != e.n_moe_layers) {
      r.fail("moe_layers lists " + std::to_string(e.moe_layers.size()) +
             " layers, n_moe_layers is " + std::to_string(e.n_moe_layers));
    }
    for (uint16_t layer : e.moe_layers) {
      if (layer >= e.n_layers) {
        r.fail("moe layer " + std::to_string(layer) + " is not below n_layers " +
               std::to_string(e.n_layers));
        break;
      }
    }
    if (uint64_t{e.n_moe_layers} * e.n_experts > kMaxExpertUsageEntries)
      r.fail("n_moe_layers * n_experts exceeds " + std::to_string(kMaxExpertUsageEntries));
    if (e.top_k > e.n_experts) r.fail("top_k exceeds n_experts");
    m.vocab_size = t.vocab_size();
    m.eos_ids = r.scalars(t.eos_ids(), kMaxEosIds, "eos_ids");
    return r.result(std::move(m));
  });
}

// ================================================================== experts

std::vector<uint8_t> encode_load_expert(const LoadExpert& m) {
  FlatBufferBuilder b(64 + 2 * m.experts.size());
  auto experts = vec(b, m.experts);
  fb::LoadExpertBuilder tb(b);
  tb.add_layer(m.layer);
  tb.add_experts(experts);
  tb.add_pin(m.pin);
  b.Finish(tb.Finish());
  return finish(b);
}

Result<LoadExpert> decode_load_expert(Payload p) {
  return verified<fb::LoadExpert>(
      p, "load_expert", [](const fb::LoadExpert& t) -> Result<LoadExpert> {
        Reader r("load_expert");
        LoadExpert m;
        m.layer = t.layer();
        m.experts = r.scalars(t.experts(), kMaxExpertsPerMessage, "experts");
        m.pin = t.pin();
        return r.result(std::move(m));
      });
}

std::vector<uint8_t> encode_load_expert_reply(const LoadExpertReply& m) {
  FlatBufferBuilder b(128 + 2 * (m.resident.size() + m.failed.size()));
  auto resident = vec(b, m.resident);
  auto failed = vec(b, m.failed);
  auto message = str(b, m.message);
  fb::LoadExpertReplyBuilder tb(b);
  tb.add_layer(m.layer);
  tb.add_resident(resident);
  tb.add_failed(failed);
  tb.add_bytes_copied(m.bytes_copied);
  tb.add_elapsed_us(m.elapsed_us);
  tb.add_message(message);
  b.Finish(tb.Finish());
  return finish(b);
}

Result<LoadExpertReply> decode_load_expert_reply(Payload p) {
  return verified<fb::LoadExpertReply>(
      p, "load_expert_reply", [](const fb::LoadExpertReply& t) -> Result<LoadExpertReply> {
        Reader r("load_expert_reply");
        LoadExpertReply m;
        m.layer = t.layer();
        m.resident = r.scalars(t.resident(), kMaxExpertsPerMessage, "resident");
        m.failed = r.scalars(t.failed(), kMaxExpertsPerMessage, "failed");
        m.bytes_copied = t.bytes_copied();
        m.elapsed_us = t.elapsed_us();
        m.message = r.string(t.message(), "message");
        return r.result(std::move(m));
      });
}

std::vector<uint8_t> encode_unload_expert(const UnloadExpert& m) {
  FlatBufferBuilder b(64 + 2 * m.experts.size());
  auto experts = vec(b, m.experts);
  fb::UnloadExpertBuilder tb(b);
  tb.add_layer(m.layer);
  tb.add_experts(experts);
  b.Finish(tb.Finish());
  return finish(b);
}

Result<UnloadExpert> decode_unload_expert(Payload p) {
  return verified<fb::UnloadExpert>(
      p, "unload_expert", [](const fb::UnloadExpert& t) -> Result<UnloadExpert> {
        Reader r("unload_expert");
        UnloadExpert m;
        m.layer = t.layer();
        m.experts = r.scalars(t.experts(), kMaxExpertsPerMessage, "experts");
        return r.result(std::move(m));
      });
}

std::vector<uint8_t> encode_unload_expert_reply(const UnloadExpertReply& m) {
  FlatBufferBuilder b(128 + 2 * (m.unloaded.size() + m.failed.size()));
  auto unloaded = vec(b, m.unloaded);
  auto failed = vec(b, m.failed);
  auto message = str(b, m.message);
  fb::UnloadExpertReplyBuilder tb(b);
  tb.add_layer(m.layer);
  tb.add_unloaded(unloaded);
  tb.add_failed(failed);
  tb.add_message(message);
  b.Finish(tb.Finish());
  return finish(b);
}

Result<UnloadExpertReply> decode_unload_expert_reply(Payload p) {
  return verified<fb::UnloadExpertReply>(
      p, "unload_expert_reply", [](const fb::UnloadExpertReply& t) -> Result<UnloadExpertReply> {
        Reader r("unload_expert_reply");
        UnloadExpertReply m;
        m.layer = t.layer();
        m.unloaded = r.scalars(t.unloaded(), kMaxExpertsPerMessage, "unloaded");
        m.failed = r.scalars(t.failed(), kMaxExpertsPerMessage, "failed");
        m.message = r.string(t.message(), "message");
        return r.result(std::move(m));
      });
}

std::vector<uint8_t> encode_warm_hints(const WarmHints& m) {
  FlatBufferBuilder b(64 + 8 * m.hints.size());
  std::vector<fb::ExpertHint> hints;
  hints.reserve(m.hints.size());
  for (const ExpertHint& h : m.hints) hints.emplace_back(h.layer, h.expert, h.priority);
  auto hv = b.CreateVectorOfStructs(hints);
  fb::WarmHintsBuilder tb(b);
  tb.add_hints(hv);
  tb.add_seq_id(m.seq_id);
  tb.add_replace(m.replace);
  b.Finish(tb.Finish());
  return finish(b);
}

Result<WarmHints> decode_warm_hints(Payload p) {
  return verified<fb::WarmHints>(p, "warm_hints", [](const fb::WarmHints& t) -> Result<WarmHints> {
    Reader r("warm_hints");
    WarmHints m;
    if (const auto* hv = t.hints(); hv && r.within(hv->size(), kMaxExpertsPerMessage, "hints")) {
      m.hints.reserve(hv->size());
      for (const fb::ExpertHint* h : *hv) {
        if (!finite(h->priority())) {
          r.fail("hint priority is not finite");
          break;
        }
        m.hints.push_back({h->layer(), h->expert(), h->priority()});
      }
    }
    m.seq_id = t.seq_id();
    m.replace = t.replace();
    return r.result(std::move(m));
  });
}

// ===================================================================== step

std::vector<uint8_t> encode_step(const StepRequest& m) {
  size_t tokens = 0;
  for (const StepSequence& s : m.sequences)
    tokens += s.tokens.size() + 3 * s.sampling.adjust.size() + s.sampling.allowed.size();
  FlatBufferBuilder b(128 + 96 * m.sequences.size() + 4 * tokens);
  std::vector<Offset<fb::StepSequence>> seqs;
  seqs.reserve(m.sequences.size());
  std::vector<fb::TokenAdjust> adjust;
  for (const StepSequence& s : m.sequences) {
    auto tv = vec(b, s.tokens);
    Offset<flatbuffers::Vector<const fb::TokenAdjust*>> av;
    if (!s.sampling.adjust.empty()) {
      adjust.clear();
      for (const TokenAdjust& a : s.sampling.adjust) adjust.emplace_back(a.token, a.bias, a.output_count, a.in_prompt != 0);
      av = b.CreateVectorOfStructs(adjust);
    }
    auto allowed = s.sampling.allowed.empty() ? Offset<flatbuffers::Vector<uint32_t>>() : vec(b, s.sampling.allowed);
    fb::SamplingParamsBuilder sb(b);
    sb.add_temperature(s.sampling.temperature);
    sb.add_top_p(s.sampling.top_p);
    sb.add_top_k(s.sampling.top_k);
    sb.add_seed(s.sampling.seed);
    sb.add_logprobs(s.sampling.logprobs);
    sb.add_top_logprobs(s.sampling.top_logprobs);
    sb.add_repetition_penalty(s.sampling.repetition_penalty);
    sb.add_presence_penalty(s.sampling.presence_penalty);
    sb.add_frequency_penalty(s.sampling.frequency_penalty);
    sb.add_min_p(s.sampling.min_p);
    if (!s.sampling.adjust.empty()) sb.add_adjust(av);
    if (!s.sampling.allowed.empty()) sb.add_allowed(allowed);
    auto sampling = sb.Finish();
    fb::StepSequenceBuilder qb(b);
    qb.add_seq_id(s.seq_id);
    qb.add_tokens(tv);
    qb.add_start_pos(s.start_pos);
    qb.add_sample(s.sample);
    qb.add_sampling(sampling);
    qb.add_route_bucket(s.route_bucket);
    seqs.push_back(qb.Finish());
  }
  auto sv = b.CreateVector(seqs);
  fb::StepRequestBuilder tb(b);
  tb.add_sequences(sv);
  // Written even when equal to the schema default, so a reader never guesses.
  b.ForceDefaults(true);
  tb.add_report_expert_usage(m.report_expert_usage);
  b.Finish(tb.Finish());
  return finish(b);
}

std::string sampling_problem(const SamplingParams& o) {
  if (!finite(o.temperature) || o.temperature < 0.0f) return "temperature must be finite and >= 0";
  if (!finite(o.top_p) || o.top_p <= 0.0f || o.top_p > 1.0f) return "top_p must be in (0, 1]";
  if (o.top_logprobs > kMaxTopLogprobs) return "top_logprobs above " + std::to_string(kMaxTopLogprobs);
  if (!finite(o.repetition_penalty) || o.repetition_penalty <= 0.0f) return "repetition_penalty must be finite and > 0";
  if (!finite(o.presence_penalty) || !finite(o.frequency_penalty))
    return "presence_penalty and frequency_penalty must be finite";
  if (!finite(o.min_p) || o.min_p < 0.0f || o.min_p > 1.0f) return "min_p must be in [0, 1]";
  int64_t last = -1;
  for (const TokenAdjust& a : o.adjust) {
    if (a.token <= last) return "adjust must be sorted by token, distinct, none negative";
    last = a.token;
    // A bias is finite, or -inf (the token is banned).
    if (std::isnan(a.bias) || a.bias == std::numeric_limits<float>::infinity())
      return "adjust bias of token " + std::to_string(a.token) + " must be finite or -inf";
  }
  if (!o.allowed.empty() && std::all_of(o.allowed.begin(), o.allowed.end(), [](uint32_t w) { return w == 0; }))
    return kNoAllowedToken;
  return {};
}

Result<StepRequest> decode_step(Payload p) {
  return verified<fb::StepRequest>(p, "step", [](const fb::StepRequest& t) -> Result<StepRequest> {
    Reader r("step");
    StepRequest m;
    m.report_expert_usage = t.report_expert_usage();
    const auto* sv = t.sequences();
    if (!sv || sv->size() == 0) return make_error("step: no sequences");
    if (!r.within(sv->size(), kMaxStepSequences, "sequences")) return r.result(std::move(m));
    m.sequences.reserve(sv->size());
    std::unordered_set<uint64_t> seen;
    seen.reserve(sv->size());
    size_t total_tokens = 0;
    for (const fb::StepSequence* q : *sv) {
      StepSequence s;
      s.seq_id = q->seq_id();
      auto id = [&s] { return "sequence " + std::to_string(s.seq_id); };
      if (s.seq_id == 0) r.fail("sequence id 0 is reserved");
      if (!seen.insert(s.seq_id).second) r.fail(id() + " appears twice");
      const auto* tv = q->tokens();
      const size_t n = tv ? tv->size() : 0;
      if (n == 0) r.fail(id() + " has no tokens");
      total_tokens += n;
      if (total_tokens > kMaxStepTokens) {
        r.fail("more than " + std::to_string(kMaxStepTokens) + " tokens in one step");
        break;
      }
      s.tokens = r.scalars(tv, kMaxStepTokens, "tokens");
      for (int32_t tok : s.tokens) {
        if (tok < 0) {
          r.fail(id() + " has negative token id " + std::to_string(tok));
          break;
        }
      }
      s.start_pos = q->start_pos();
      if (uint64_t{s.start_pos} + n > std::numeric_limits<uint32_t>::max())
        r.fail(id() + " runs past position 2^32");
      s.sample = q->sample();
      s.route_bucket = q->route_bucket();
      if (const fb::SamplingParams* sp = q->sampling()) {
        SamplingParams& o = s.sampling;
        o.temperature = sp->temperature();
        o.top_p = sp->top_p();
        o.top_k = sp->top_k();
        o.seed = sp->seed();
        o.logprobs = sp->logprobs();
        o.top_logprobs = sp->top_logprobs();
        o.repetition_penalty = sp->repetition_penalty();
        o.presence_penalty = sp->presence_penalty();
        o.frequency_penalty = sp->frequency_penalty();
        o.min_p = sp->min_p();
        if (const auto* av = sp->adjust(); av && r.within(av->size(), kMaxTokenAdjust, "adjust")) {
          o.adjust.reserve(av->size());
          for (const fb::TokenAdjust* a : *av)
            o.adjust.push_back({a->token(), a->bias(), a->output_count(), uint8_t(a->in_prompt() ? 1 : 0)});
        }
        if (const auto* mv = sp->allowed()) o.allowed = r.scalars(mv, kMaxAllowedWords, "allowed");
        if (const std::string why = sampling_problem(o); !why.empty()) r.fail(id() + ": " + why);
      }
      if (!r.ok()) break;
      m.sequences.push_back(std::move(s));
    }
    return r.result(std::move(m));
  });
}

std::vector<uint8_t> encode_step_reply(const StepReply& m) {
  size_t usage = 0;
  for (const StepResult& s : m.results) usage += s.expert_usage.size() + 8 * s.top.size();
  FlatBufferBuilder b(256 + 96 * m.results.size() + 2 * usage);
  std::vector<Offset<fb::StepResult>> results;
  results.reserve(m.results.size());
  std::vector<fb::TokenLogprob> top;
  for (const StepResult& s : m.results) {
    auto msg = s.error_message.empty() ? Offset<flatbuffers::String>() : str(b, s.error_message);
    top.clear();
    for (const TokenLogprob& t : s.top) top.emplace_back(t.token, t.logprob);
    auto tv = b.CreateVectorOfStructs(top);
    auto uv = vec(b, s.expert_usage);
    fb::StepResultBuilder rb(b);
    rb.add_seq_id(s.seq_id);
    rb.add_error(static_cast<fb::ErrorCode>(s.error));
    if (!msg.IsNull()) rb.add_error_message(msg);
    rb.add_sampled(s.sampled);
    rb.add_token(s.token);
    rb.add_logprob(s.logprob);
    rb.add_top(tv);
    rb.add_expert_usage(uv);
    rb.add_kv_tokens(s.kv_tokens);
    rb.add_cached_tokens(s.cached_tokens);
    results.push_back(rb.Finish());
  }
  auto rv = b.CreateVector(results);
  fb::StepTimingBuilder timing(b);
  timing.add_total_us(m.timing.total_us);
  timing.add_queue_us(m.timing.queue_us);
  timing.add_compute_us(m.timing.compute_us);
  timing.add_expert_wait_us(m.timing.expert_wait_us);
  auto to = timing.Finish();
  fb::StepReplyBuilder tb(b);
  tb.add_results(rv);
  tb.add_timing(to);
  tb.add_kv_blocks_used(m.kv_blocks_used);
  tb.add_kv_blocks_free(m.kv_blocks_free);
  tb.add_expert_hits(m.expert_hits);
  tb.add_expert_misses(m.expert_misses);
  b.Finish(tb.Finish());
  return finish(b);
}

Result<StepReply> decode_step_reply(Payload p) {
  return verified<fb::StepReply>(p, "step_reply", [](const fb::StepReply& t) -> Result<StepReply> {
    Reader r("step_reply");
    StepReply m;
    if (const auto* rv = t.results(); rv && r.within(rv->size(), kMaxStepSequences, "results")) {
      m.results.reserve(rv->size());
      for (const fb::StepResult* q : *rv) {
        StepResult s;
        s.seq_id = q->seq_id();
        s.error = static_cast<ErrorCode>(q->error());
        s.error_message = r.string(q->error_message(), "error_message");
        s.sampled = q->sampled();
        s.token = q->token();
        s.logprob = q->logprob();
        if (const auto* tv = q->top(); tv && r.within(tv->size(), kMaxTopLogprobs, "top")) {
          s.top.reserve(tv->size());
          for (const fb::TokenLogprob* x : *tv) s.top.push_back({x->token(), x->logprob()});
        }
        s.expert_usage = r.scalars(q->expert_usage(), kMaxExpertUsageEntries, "expert_usage");
        s.kv_tokens = q->kv_tokens();
        s.cached_tokens = q->cached_tokens();
        if (!r.ok()) break;
        m.results.push_back(std::move(s));
      }
    }
    if (const fb::StepTiming* ti = t.timing()) {
      m.timing = {ti->total_us(), ti->queue_us(), ti->compute_us(), ti->expert_wait_us()};
    }
    m.kv_blocks_used = t.kv_blocks_used();
    m.kv_blocks_free = t.kv_blocks_free();
    m.expert_hits = t.expert_hits();
    m.expert_misses = t.expert_misses();
    return r.result(std::move(m));
  });
}

// ============================================================= housekeeping

std::vector<uint8_t> encode_release_sequences(const ReleaseSequences& m) {
  FlatBufferBuilder b(64 + 8 * m.seq_ids.size());
  auto ids = vec(b, m.seq_ids);
  fb::ReleaseSequencesBuilder tb(b);
  tb.add_seq_ids(ids);
  b.Finish(tb.Finish());
  return finish(b);
}

Result<ReleaseSequences> decode_release_sequences(Payload p) {
  return verified<fb::ReleaseSequences>(
      p, "release_sequences", [](const fb::ReleaseSequences& t) -> Result<ReleaseSequences> {
        Reader r("release_sequences");
        ReleaseSequences m;
        m.seq_ids = r.scalars(t.seq_ids(), kMaxReleaseSequences, "seq_ids");
        return r.result(std::move(m));
      });
}

std::vector<uint8_t> encode_stats_request(const StatsRequest& m) {
  FlatBufferBuilder b(32);
  fb::StatsRequestBuilder tb(b);
  tb.add_include_resident(m.include_resident);
  b.Finish(tb.Finish());
  return finish(b);
}

Result<StatsRequest> decode_stats_request(Payload p) {
  return verified<fb::StatsRequest>(p, "stats",
                                    [](const fb::StatsRequest& t) -> Result<StatsRequest> {
                                      return StatsRequest{t.include_resident()};
                                    });
}

std::vector<uint8_t> encode_stats_reply(const StatsReply& m) {
  FlatBufferBuilder b(256 + 4 * m.resident.size());
  std::vector<fb::ExpertRef> resident;
  resident.reserve(m.resident.size());
  for (const ExpertRef& e : m.resident) resident.emplace_back(e.layer, e.expert);
  auto rv = b.CreateVectorOfStructs(resident);
  const CardHealth& c = m.card;
  auto reason = str(b, c.reason);
  auto name = str(b, c.name);
  fb::CardHealthBuilder cb(b);
  cb.add_available(c.available);
  cb.add_reason(reason);
  cb.add_name(name);
  cb.add_temperature_c(c.temperature_c);
  cb.add_sm_clock_mhz(c.sm_clock_mhz);
  cb.add_sm_clock_max_mhz(c.sm_clock_max_mhz);
  cb.add_memory_clock_mhz(c.memory_clock_mhz);
  cb.add_power_mw(c.power_mw);
  cb.add_power_limit_mw(c.power_limit_mw);
  cb.add_throttle_reasons(c.throttle_reasons);
  cb.add_process_memory_bytes(c.process_memory_bytes);
  cb.add_memory_total_bytes(c.memory_total_bytes);
  cb.add_pcie_tx_kbps(c.pcie_tx_kbps);
  cb.add_pcie_rx_kbps(c.pcie_rx_kbps);
  cb.add_sample_age_ms(c.sample_age_ms);
  cb.add_sample_seq(c.sample_seq);
  auto card = cb.Finish();
  fb::StatsReplyBuilder tb(b);
  tb.add_expert_hits(m.expert_hits);
  tb.add_expert_misses(m.expert_misses);
  tb.add_bytes_copied(m.bytes_copied);
  tb.add_islands_used(m.islands_used);
  tb.add_islands_total(m.islands_total);
  tb.add_kv_blocks_used(m.kv_blocks_used);
  tb.add_kv_blocks_free(m.kv_blocks_free);
  tb.add_steps(m.steps);
  tb.add_tokens(m.tokens);
  tb.add_sampled_tokens(m.sampled_tokens);
  tb.add_sequences_active(m.sequences_active);
  tb.add_uptime_ms(m.uptime_ms);
  tb.add_resident(rv);
  tb.add_bytes_streamed(m.bytes_streamed);
  tb.add_card(card);
  b.Finish(tb.Finish());
  return finish(b);
}

Result<StatsReply> decode_stats_reply(Payload p) {
  return verified<fb::StatsReply>(
      p, "stats_reply", [](const fb::StatsReply& t) -> Result<StatsReply> {
        Reader r("stats_reply");
        StatsReply m;
        m.expert_hits = t.expert_hits();
        m.expert_misses = t.expert_misses();
        m.bytes_copied = t.bytes_copied();
        m.islands_used = t.islands_used();
        m.islands_total = t.islands_total();
        m.kv_blocks_used = t.kv_blocks_used();
        m.kv_blocks_free = t.kv_blocks_free();
        m.steps = t.steps();
        m.tokens = t.tokens();
        m.sampled_tokens = t.sampled_tokens();
        m.sequences_active = t.sequences_active();
        m.bytes_streamed = t.bytes_streamed();
        m.uptime_ms = t.uptime_ms();
        if (const auto* rv = t.resident();
            rv && r.within(rv->size(), kMaxExpertsPerMessage, "resident")) {
          m.resident.reserve(rv->size());
          for (const fb::ExpertRef* e : *rv) m.resident.push_back({e->layer(), e->expert()});
        }
        if (const fb::CardHealth* c = t.card()) {
          CardHealth& h = m.card;
          h.available = c->available();
          h.reason = r.string(c->reason(), "card.reason");
          h.name = r.string(c->name(), "card.name");
          h.temperature_c = c->temperature_c();
          h.sm_clock_mhz = c->sm_clock_mhz();
          h.sm_clock_max_mhz = c->sm_clock_max_mhz();
          h.memory_clock_mhz = c->memory_clock_mhz();
          h.power_mw = c->power_mw();
          h.power_limit_mw = c->power_limit_mw();
          h.throttle_reasons = c->throttle_reasons();
          h.process_memory_bytes = c->process_memory_bytes();
          h.memory_total_bytes = c->memory_total_bytes();
          h.pcie_tx_kbps = c->pcie_tx_kbps();
          h.pcie_rx_kbps = c->pcie_rx_kbps();
          h.sample_age_ms = c->sample_age_ms();
          h.sample_seq = c->sample_seq();
        }
        return r.result(std::move(m));
      });
}

std::vector<uint8_t> encode_shutdown(const Shutdown& m) {
  FlatBufferBuilder b(64 + m.reason.size());
  auto reason = str(b, m.reason);
  fb::ShutdownBuilder tb(b);
  tb.add_mode(static_cast<fb::ShutdownMode>(m.mode));
  tb.add_reason(reason);
  b.Finish(tb.Finish());
  return finish(b);
}

Result<Shutdown> decode_shutdown(Payload p) {
  return verified<fb::Shutdown>(p, "shutdown", [](const fb::Shutdown& t) -> Result<Shutdown> {
    Reader r("shutdown");
    Shutdown m;
    const auto mode = static_cast<uint8_t>(t.mode());
    if (mode > static_cast<uint8_t>(ShutdownMode::immediate))
      r.fail("unknown mode " + std::to_string(mode));
    m.mode = static_cast<ShutdownMode>(mode);
    m.reason = r.string(t.reason(), "reason");
    return r.result(std::move(m));
  });
}

std::vector<uint8_t> encode_ping(const Ping& m) {
  FlatBufferBuilder b(32);
  fb::PingBuilder tb(b);
  tb.add_sent_us(m.sent_us);
  b.Finish(tb.Finish());
  return finish(b);
}

Result<Ping> decode_ping(Payload p) {
  return verified<fb::Ping>(p, "ping",
                            [](const fb::Ping& t) -> Result<Ping> { return Ping{t.sent_us()}; });
}

std::vector<uint8_t> encode_pong(const Pong& m) {
  FlatBufferBuilder b(48);
  fb::PongBuilder tb(b);
  tb.add_ping_sent_us(m.ping_sent_us);
  tb.add_sent_us(m.sent_us);
  b.Finish(tb.Finish());
  return finish(b);
}

Result<Pong> decode_pong(Payload p) {
  return verified<fb::Pong>(p, "pong", [](const fb::Pong& t) -> Result<Pong> {
    return Pong{t.ping_sent_us(), t.sent_us()};
  });
}

std::vector<uint8_t> encode_pressure(const Pressure& m) {
  FlatBufferBuilder b(64 + m.detail.size());
  auto detail = str(b, m.detail);
  fb::PressureBuilder tb(b);
  tb.add_level(static_cast<fb::PressureLevel>(m.level));
  tb.add_detail(detail);
  tb.add_vram_free_bytes(m.vram_free_bytes);
  tb.add_host_free_bytes(m.host_free_bytes);
  b.Finish(tb.Finish());
  return finish(b);
}

Result<Pressure> decode_pressure(Payload p) {
  return verified<fb::Pressure>(p, "pressure", [](const fb::Pressure& t) -> Result<Pressure> {
    Reader r("pressure");
    Pressure m;
    const auto level = static_cast<uint8_t>(t.level());
    if (level > static_cast<uint8_t>(PressureLevel::break_))
      r.fail("unknown level " + std::to_string(level));
    m.level = static_cast<PressureLevel>(level);
    m.detail = r.string(t.detail(), "detail");
    m.vram_free_bytes = t.vram_free_bytes();
    m.host_free_bytes = t.host_free_bytes();
    return r.result(std::move(m));
  });
}

std::vector<uint8_t> encode_error(const ErrorReport& m) {
  FlatBufferBuilder b(64 + m.message.size());
  auto message = str(b, m.message);
  fb::ErrorReportBuilder tb(b);
  tb.add_code(static_cast<fb::ErrorCode>(m.code));
  tb.add_command(m.command);
  tb.add_request_id(m.request_id);
  tb.add_message(message);
  b.Finish(tb.Finish());
  return finish(b);
}

Result<ErrorReport> decode_error(Payload p) {
  return verified<fb::ErrorReport>(p, "error", [](const fb::ErrorReport& t) -> Result<ErrorReport> {
    ErrorReport m;
    m.code = static_cast<ErrorCode>(t.code());
    m.command = t.command();
    m.request_id = t.request_id();
    // Never refused for its length: an error is not answered with an error.
    if (const flatbuffers::String* s = t.message())
      m.message.assign(s->c_str(), std::min<size_t>(s->size(), kMaxStringBytes));
    return m;
  });
}

// ============================================================= whole frames

namespace {

template <typename M>
constexpr Command command_for();
template <>
constexpr Command command_for<Hello>() {
  return Command::hello;
}
template <>
constexpr Command command_for<LoadExpert>() {
  return Command::load_expert;
}
template <>
constexpr Command command_for<LoadExpertReply>() {
  return Command::load_expert_reply;
}
template <>
constexpr Command command_for<UnloadExpert>() {
  return Command::unload_expert;
}
template <>
constexpr Command command_for<UnloadExpertReply>() {
  return Command::unload_expert_reply;
}
template <>
constexpr Command command_for<WarmHints>() {
  return Command::warm_hints;
}
template <>
constexpr Command command_for<StepRequest>() {
  return Command::step;
}
template <>
constexpr Command command_for<StepReply>() {
  return Command::step_reply;
}
template <>
constexpr Command command_for<ReleaseSequences>() {
  return Command::release_sequences;
}
template <>
constexpr Command command_for<StatsRequest>() {
  return Command::stats;
}
template <>
constexpr Command command_for<StatsReply>() {
  return Command::stats_reply;
}
template <>
constexpr Command command_for<Shutdown>() {
  return Command::shutdown;
}
template <>
constexpr Command command_for<Ping>() {
  return Command::ping;
}
template <>
constexpr Command command_for<Pong>() {
  return Command::pong;
}
template <>
constexpr Command command_for<Pressure>() {
  return Command::pressure;
}
template <>
constexpr Command command_for<ErrorReport>() {
  return Command::error;
}

template <typename M>
Result<Message> as_message(Result<M> r) {
  if (!r) return make_error(r.error());
  return Message(std::move(r).value());
}

Result<std::vector<uint8_t>> framed(Command c, uint64_t request_id,
                                    const std::vector<uint8_t>& payload, size_t max_frame_bytes) {
  return encode_frame(c, request_id, payload, max_frame_bytes);
}

}  // namespace

Command command_of(const Message& m) {
  return std::visit([](const auto& x) { return command_for<std::decay_t<decltype(x)>>(); }, m);
}

Result<Message> decode_message(const Frame& f) {
  const Payload p(f.payload);
  switch (static_cast<Command>(f.command)) {
    case Command::hello: return as_message(decode_hello(p));
    case Command::load_expert: return as_message(decode_load_expert(p));
    case Command::load_expert_reply: return as_message(decode_load_expert_reply(p));
    case Command::unload_expert: return as_message(decode_unload_expert(p));
    case Command::unload_expert_reply: return as_message(decode_unload_expert_reply(p));
    case Command::warm_hints: return as_message(decode_warm_hints(p));
    case Command::step: return as_message(decode_step(p));
    case Command::step_reply: return as_message(decode_step_reply(p));
    case Command::release_sequences: return as_message(decode_release_sequences(p));
    case Command::stats: return as_message(decode_stats_request(p));
    case Command::stats_reply: return as_message(decode_stats_reply(p));
    case Command::shutdown: return as_message(decode_shutdown(p));
    case Command::ping: return as_message(decode_ping(p));
    case Command::pong: return as_message(decode_pong(p));
    case Command::pressure: return as_message(decode_pressure(p));
    case Command::error: return as_message(decode_error(p));
  }
  return make_error(std::string("unknown command ") + std::to_string(f.command));
}

#define MOE_PROTOCOL_MAKE_FRAME(Type, encoder)                                                    \
  Result<std::vector<uint8_t>> make_frame(uint64_t request_id, const Type& m, size_t max_bytes) { \
    return framed(command_for<Type>(), request_id, encoder(m), max_bytes);                        \
  }
MOE_PROTOCOL_MAKE_FRAME(Hello, encode_hello)
MOE_PROTOCOL_MAKE_FRAME(LoadExpert, encode_load_expert)
MOE_PROTOCOL_MAKE_FRAME(LoadExpertReply, encode_load_expert_reply)
MOE_PROTOCOL_MAKE_FRAME(UnloadExpert, encode_unload_expert)
MOE_PROTOCOL_MAKE_FRAME(UnloadExpertReply, encode_unload_expert_reply)
MOE_PROTOCOL_MAKE_FRAME(WarmHints, encode_warm_hints)
MOE_PROTOCOL_MAKE_FRAME(StepRequest, encode_step)
MOE_PROTOCOL_MAKE_FRAME(StepReply, encode_step_reply)
MOE_PROTOCOL_MAKE_FRAME(ReleaseSequences, encode_release_sequences)
MOE_PROTOCOL_MAKE_FRAME(StatsRequest, encode_stats_request)
MOE_PROTOCOL_MAKE_FRAME(StatsReply, encode_stats_reply)
MOE_PROTOCOL_MAKE_FRAME(Shutdown, encode_shutdown)
MOE_PROTOCOL_MAKE_FRAME(Ping, encode_ping)
MOE_PROTOCOL_MAKE_FRAME(Pong, encode_pong)
MOE_PROTOCOL_MAKE_FRAME(Pressure, encode_pressure)
MOE_PROTOCOL_MAKE_FRAME(ErrorReport, encode_error)
#undef MOE_PROTOCOL_MAKE_FRAME

Result<std::vector<uint8_t>> make_frame(uint64_t request_id, const Message& m,
                                        size_t max_frame_bytes) {
  return std::visit([&](const auto& x) { return make_frame(request_id, x, max_frame_bytes); }, m);
}

std::vector<uint8_t> make_error_frame(uint64_t request_id, uint8_t command, ErrorCode code,
                                      std::string_view message) {
  ErrorReport e{code, command, request_id, std::string(message.substr(0, kMaxStringBytes))};
  std::vector<uint8_t> out;
  // A report of at most kMaxStringBytes always fits the smallest useful limit.
  Status st = append_frame(out, Command::error, request_id, encode_error(e), kMaxFrameBytesCeiling);
  (void)st;
  return out;
}

std::vector<uint8_t> make_error_frame(const FrameError& err) {
  return make_error_frame(err.request_id, err.command, err.code, err.message);
}

}  // namespace moe::protocol
