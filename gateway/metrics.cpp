#include "gateway/metrics.h"

#include <cstdio>

namespace moe::gw {
namespace {

void append_number(std::string& out, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  out += buf;
}

void render_scalar(std::string& out, const char* name, const char* type, const char* help, double v) {
  out += "# HELP ";
  out += name;
  out += ' ';
  out += help;
  out += "\n# TYPE ";
  out += name;
  out += ' ';
  out += type;
  out += '\n';
  out += name;
  out += ' ';
  append_number(out, v);
  out += '\n';
}

}  // namespace

void LatencyHistogram::observe(double seconds) {
  ++count_;
  sum_ += seconds;
  for (size_t i = 0; i < kBounds.size(); ++i) {
    if (seconds <= kBounds[i]) {
      ++buckets_[i];
      return;
    }
  }
}

void LatencyHistogram::render(std::string& out, const char* name, const char* help) const {
  out += "# HELP ";
  out += name;
  out += ' ';
  out += help;
  out += "\n# TYPE ";
  out += name;
  out += " histogram\n";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < kBounds.size(); ++i) {
    cumulative += buckets_[i];
    out += name;
    out += "_bucket{le=\"";
    append_number(out, kBounds[i]);
    out += "\"} " + std::to_string(cumulative) + "\n";
  }
  out += name;
  out += "_bucket{le=\"+Inf\"} " + std::to_string(count_) + "\n";
  out += name;
  out += "_sum ";
  append_number(out, sum_);
  out += '\n';
  out += name;
  out += "_count " + std::to_string(count_) + "\n";
}

void GatewayMetrics::count_request(const std::string& endpoint, int status) {
  ++requests_[{endpoint, status}];
}

uint64_t GatewayMetrics::requests(const std::string& endpoint, int status) const {
  auto it = requests_.find({endpoint, status});
  return it == requests_.end() ? 0 : it->second;
}

std::string GatewayMetrics::render(const SchedulerStats& stats, bool ready, const GatewayGauges& g) const {
  std::string out;
  out += "# HELP moe_gateway_requests_total HTTP requests answered, by endpoint and status.\n";
  out += "# TYPE moe_gateway_requests_total counter\n";
  for (const auto& [key, n] : requests_) {
    // Endpoints are fixed route names chosen by the gateway, never raw
    // request paths, so they need no label escaping.
    out += "moe_gateway_requests_total{endpoint=\"" + key.first + "\",status=\"" +
           std::to_string(key.second) + "\"} " + std::to_string(n) + "\n";
  }
  render_scalar(out, "moe_gateway_prompt_tokens_total", "counter", "Prompt tokens submitted.",
                static_cast<double>(prompt_tokens_));
  render_scalar(out, "moe_gateway_prompt_cached_tokens_total", "counter",
                "Prompt tokens whose KV the worker found in its prefix cache (not computed again).",
                static_cast<double>(cached_prompt_tokens_));
  render_scalar(out, "moe_gateway_prompt_cached_ratio", "gauge",
                "Share of the prompt tokens submitted so far that the prefix cache served.",
                prompt_tokens_ ? static_cast<double>(cached_prompt_tokens_) / static_cast<double>(prompt_tokens_) : 0.0);
  render_scalar(out, "moe_gateway_completion_tokens_total", "counter", "Tokens generated.",
                static_cast<double>(completion_tokens_));
  ttft_.render(out, "moe_gateway_time_to_first_token_seconds",
               "Time from accepting a request to the first token of a choice.");
  itl_.render(out, "moe_gateway_inter_token_latency_seconds", "Time between consecutive tokens of a choice.");
  render_scalar(out, "moe_gateway_sequences_waiting", "gauge", "Sequences queued, not yet admitted.",
                stats.waiting);
  render_scalar(out, "moe_gateway_sequences_running", "gauge", "Sequences admitted (prefill or decode).",
                stats.running);
  render_scalar(out, "moe_gateway_kv_blocks_used", "gauge", "KV cache blocks in use.", stats.kv_blocks_used);
  render_scalar(out, "moe_gateway_kv_blocks_total", "gauge", "KV cache blocks the worker has.",
                stats.kv_blocks_total);
  render_scalar(out, "moe_gateway_preemptions_total", "counter", "Sequences preempted for KV space.",
                static_cast<double>(stats.preemptions));
  render_scalar(out, "moe_gateway_degraded", "gauge", "1 while serving from the fallback worker.",
                stats.degraded ? 1 : 0);
  render_scalar(out, "moe_gateway_main_waiting", "gauge",
                "Sequences waiting for a main (non-fallback) worker: what the overload rule counts.",
                double(stats.main_waiting));
  render_scalar(out, "moe_gateway_main_oldest_wait_seconds", "gauge",
                "How long the oldest sequence waiting for a main worker has waited.",
                double(stats.main_oldest_wait_ms) / 1000.0);
  render_scalar(out, "moe_gateway_sequences_on_fallback", "gauge",
                "Sequences the fallback worker serves because the main workers were overloaded.",
                double(stats.on_fallback));
  render_scalar(out, "moe_gateway_overload_fallback_total", "counter",
                "Requests sent to the fallback worker because the main workers were overloaded.",
                double(g.overload_fallback));
  render_scalar(out, "moe_gateway_overload_refused_total", "counter",
                "Requests refused (429) because the main workers were overloaded and no fallback was ready.",
                double(g.overload_refused));
  render_scalar(out, "moe_gateway_rate_limited_total", "counter",
                "Requests refused (429) by their key's rate limit.", double(g.rate_limited));
  render_scalar(out, "moe_gateway_reading_refused_total", "counter",
                "Requests refused (429) because their caller had its share of the requests being read at once.",
                double(g.reading_refused));
  render_scalar(out, "moe_gateway_replayed_turns_total", "counter",
                "Retried session turns (the same Idempotency-Key) answered from the store, not run again.",
                double(g.replayed));
  render_scalar(out, "moe_gateway_priority_preemptions_total", "counter",
                "Sequences preempted to make room for an earlier priority.",
                double(stats.priority_preemptions));
  render_scalar(out, "moe_gateway_fairness_preemptions_total", "counter",
                "Sequences preempted so that another caller's waiting sequence gets its share of the batch.",
                double(stats.fairness_preemptions));
  render_scalar(out, "moe_gateway_degraded_responses_total", "counter",
                "Responses served while degraded.", static_cast<double>(degraded_responses_));
  render_scalar(out, "moe_gateway_client_disconnects_total", "counter",
                "Requests whose client went away (or read too slowly) before the end.",
                static_cast<double>(client_disconnects_));
  render_scalar(out, "moe_gateway_ready", "gauge", "1 once a worker can take steps.", ready ? 1 : 0);
  render_scalar(out, "moe_gateway_connections", "gauge", "Open HTTP connections.", double(g.connections));
  render_scalar(out, "moe_gateway_connections_refused_total", "counter",
                "Connections answered 503 because --max-connections were open.", double(g.connections_refused));
  render_scalar(out, "moe_gateway_sequences_admitted", "gauge",
                "Sequences admitted and not yet finished, every caller together.", double(g.sequences_admitted));
  render_scalar(out, "moe_gateway_callers", "gauge", "Callers with sequences in flight.", double(g.callers));
  render_scalar(out, "moe_gateway_admission_refused_total", "counter",
                "Requests answered 429 (a caller's bound or the waiting bound).", double(g.admission_refused));
  render_scalar(out, "moe_gateway_generations", "gauge", "Requests being generated or answered.",
                double(g.generations));
  render_scalar(out, "moe_gateway_held_response_bytes", "gauge",
                "Text and logprobs that whole (not streamed) responses hold together.",
                double(g.held_response_bytes));
  render_scalar(out, "moe_gateway_held_responses_refused_total", "counter",
                "Whole responses failed (503 responses_memory_full) past --max-held-response-bytes.",
                double(g.held_responses_refused));
  render_scalar(out, "moe_gateway_sessions_in_memory", "gauge", "Sessions the gateway's mirror holds.",
                double(g.sessions_in_memory));
  render_scalar(out, "moe_gateway_session_memory_bytes", "gauge", "Bytes the session mirror holds.",
                double(g.session_memory_bytes));
  render_scalar(out, "moe_gateway_internal_errors_total", "counter",
                "Exceptions caught by the last-resort handlers (each answered 500 or logged).",
                double(g.internal_errors));
  if (stats.predicting) {
    render_scalar(out, "moe_gateway_prediction_requests_total", "counter",
                  "Finished requests whose expert prediction was checked against their use.",
                  static_cast<double>(stats.prediction_requests));
    render_scalar(out, "moe_gateway_predicted_experts_total", "counter",
                  "Experts predicted for those requests (per MoE layer, summed).",
                  static_cast<double>(stats.predicted_experts));
    render_scalar(out, "moe_gateway_prediction_hits_total", "counter",
                  "Predicted experts the request really used.", static_cast<double>(stats.prediction_hits));
    render_scalar(out, "moe_gateway_prediction_buckets", "gauge", "Prompt-hash buckets the expert table knows.",
                  static_cast<double>(stats.prediction_buckets));
    render_scalar(out, "moe_gateway_routing_summaries_learned_total", "counter",
                  "Routing summaries the expert table learned from.",
                  static_cast<double>(stats.routing_summaries_learned));
    render_scalar(out, "moe_gateway_routing_summaries_foreign_total", "counter",
                  "Routing summaries not learned: no bucket, or another gateway's LSH settings.",
                  static_cast<double>(stats.routing_summaries_foreign));
    render_scalar(out, "moe_gateway_warm_hints_sent_total", "counter",
                  "warm_hints frames sent to workers before prefills.", static_cast<double>(stats.warm_hints_sent));
  }
  if (!stats.workers.empty()) {
    // Worker names come from socket file names: escaped as label values.
    auto label = [](const std::string& v) {
      std::string o;
      for (char c : v) {
        if (c == '\\' || c == '"') o += '\\';
        if (c == '\n') {
          o += "\\n";
          continue;
        }
        o += c;
      }
      return o;
    };
    struct Series {
      const char* name;
      const char* type;
      const char* help;
      double (*get)(const WorkerStats&);
    };
    const Series series[] = {
        {"moe_gateway_worker_ready", "gauge", "1 while the worker is connected and said hello.",
         [](const WorkerStats& w) { return w.ready ? 1.0 : 0.0; }},
        {"moe_gateway_worker_sequences_running", "gauge", "Sequences admitted on the worker.",
         [](const WorkerStats& w) { return double(w.running); }},
        {"moe_gateway_worker_sequences_waiting", "gauge", "Sequences given to the worker, not yet admitted.",
         [](const WorkerStats& w) { return double(w.waiting); }},
        {"moe_gateway_worker_sequences_assigned_total", "counter", "Sequences given to the worker.",
         [](const WorkerStats& w) { return double(w.assigned); }},
        {"moe_gateway_worker_steps_total", "counter", "Steps sent to the worker.",
         [](const WorkerStats& w) { return double(w.steps); }},
        {"moe_gateway_worker_hot", "gauge", "1 while the worker's card runs hot (its step budget and batch halved).",
         [](const WorkerStats& w) { return w.hot ? 1.0 : 0.0; }},
        {"moe_gateway_worker_step_token_budget", "gauge", "Tokens one step of the worker may carry now.",
         [](const WorkerStats& w) { return double(w.step_token_budget); }},
        {"moe_gateway_worker_batch_limit", "gauge", "Sequences the worker may run at once now.",
         [](const WorkerStats& w) { return double(w.batch_limit); }},
    };
    auto labels = [&label](const WorkerStats& w, const std::string& more = "") {
      return std::string("{worker=\"") + label(w.name) + "\",fallback=\"" + (w.fallback ? "1" : "0") + "\"" + more +
             "}";
    };
    for (const Series& m : series) {
      out += std::string("# HELP ") + m.name + " " + m.help + "\n# TYPE " + m.name + " " + m.type + "\n";
      for (const WorkerStats& w : stats.workers) {
        out += m.name + labels(w) + " ";
        append_number(out, m.get(w));
        out += '\n';
      }
    }
    // What each worker's last stats reply said (docs/operations.md): its
    // residency, and the card it runs on when NVML reads it.
    struct StatSeries {
      const char* name;
      const char* type;
      const char* help;
      bool card;  // only for workers whose card is read
      double (*get)(const protocol::StatsReply&);
    };
    const StatSeries stat_series[] = {
        {"moe_worker_card_available", "gauge", "1 when the worker reads its card's health through NVML.", false,
         [](const protocol::StatsReply& r) { return r.card.available ? 1.0 : 0.0; }},
        {"moe_worker_card_temperature_celsius", "gauge", "The card's temperature.", true,
         [](const protocol::StatsReply& r) { return double(r.card.temperature_c); }},
        {"moe_worker_card_sm_clock_mhz", "gauge", "The card's SM clock now.", true,
         [](const protocol::StatsReply& r) { return double(r.card.sm_clock_mhz); }},
        {"moe_worker_card_sm_clock_max_mhz", "gauge", "The card's highest SM clock.", true,
         [](const protocol::StatsReply& r) { return double(r.card.sm_clock_max_mhz); }},
        {"moe_worker_card_memory_clock_mhz", "gauge", "The card's memory clock now.", true,
         [](const protocol::StatsReply& r) { return double(r.card.memory_clock_mhz); }},
        {"moe_worker_card_power_watts", "gauge", "The card's power draw.", true,
         [](const protocol::StatsReply& r) { return double(r.card.power_mw) / 1000.0; }},
        {"moe_worker_card_power_limit_watts", "gauge", "The card's enforced power limit.", true,
         [](const protocol::StatsReply& r) { return double(r.card.power_limit_mw) / 1000.0; }},
        {"moe_worker_card_process_memory_bytes", "gauge", "Device memory the worker process holds.", true,
         [](const protocol::StatsReply& r) { return double(r.card.process_memory_bytes); }},
        {"moe_worker_card_memory_total_bytes", "gauge", "The card's memory.", true,
         [](const protocol::StatsReply& r) { return double(r.card.memory_total_bytes); }},
        {"moe_worker_card_pcie_tx_bytes_per_second", "gauge", "PCIe bytes the card sends a second.", true,
         [](const protocol::StatsReply& r) { return double(r.card.pcie_tx_kbps) * 1024.0; }},
        {"moe_worker_card_pcie_rx_bytes_per_second", "gauge", "PCIe bytes the card receives a second.", true,
         [](const protocol::StatsReply& r) { return double(r.card.pcie_rx_kbps) * 1024.0; }},
        {"moe_worker_card_sample_age_seconds", "gauge", "Age of the health sample when the worker replied.", true,
         [](const protocol::StatsReply& r) { return double(r.card.sample_age_ms) / 1000.0; }},
        {"moe_worker_islands_used", "gauge", "Expert islands (slots) in use.", false,
         [](const protocol::StatsReply& r) { return double(r.islands_used); }},
        {"moe_worker_islands_total", "gauge", "Expert islands (slots) the worker has now (fewer while its KV cache holds some of their room).", false,
         [](const protocol::StatsReply& r) { return double(r.islands_total); }},
        {"moe_worker_expert_hits_total", "counter", "Expert uses found resident.", false,
         [](const protocol::StatsReply& r) { return double(r.expert_hits); }},
        {"moe_worker_expert_misses_total", "counter", "Expert uses not resident (copied in or streamed).", false,
         [](const protocol::StatsReply& r) { return double(r.expert_misses); }},
        {"moe_worker_expert_bytes_copied_total", "counter", "Expert bytes copied into islands.", false,
         [](const protocol::StatsReply& r) { return double(r.bytes_copied); }},
        {"moe_worker_expert_bytes_streamed_total", "counter",
         "Expert bytes the kernels read from host memory over the link.", false,
         [](const protocol::StatsReply& r) { return double(r.bytes_streamed); }},
        {"moe_worker_tokens_total", "counter", "Tokens run through the model.", false,
         [](const protocol::StatsReply& r) { return double(r.tokens); }},
        {"moe_worker_kv_blocks_used", "gauge", "KV blocks in use, as the worker counts them.", false,
         [](const protocol::StatsReply& r) { return double(r.kv_blocks_used); }},
        {"moe_worker_kv_blocks_free", "gauge", "KV blocks free, as the worker counts them.", false,
         [](const protocol::StatsReply& r) { return double(r.kv_blocks_free); }},
        {"moe_worker_uptime_seconds", "gauge", "Since the worker started (a drop: it restarted).", false,
         [](const protocol::StatsReply& r) { return double(r.uptime_ms) / 1000.0; }},
    };
    for (const StatSeries& m : stat_series) {
      bool any = false;
      for (const WorkerStats& w : stats.workers) any |= w.have_stats && (!m.card || w.stats.card.available);
      if (!any) continue;
      out += std::string("# HELP ") + m.name + " " + m.help + "\n# TYPE " + m.name + " " + m.type + "\n";
      for (const WorkerStats& w : stats.workers) {
        if (!w.have_stats || (m.card && !w.stats.card.available)) continue;
        out += m.name + labels(w) + " ";
        append_number(out, m.get(w.stats));
        out += '\n';
      }
    }
    bool any_card = false;
    for (const WorkerStats& w : stats.workers) any_card |= w.have_stats && w.stats.card.available;
    if (any_card) {
      out += "# HELP moe_worker_card_throttle 1 per clock-throttle reason the card reports now.\n"
             "# TYPE moe_worker_card_throttle gauge\n";
      for (const WorkerStats& w : stats.workers) {
        if (!w.have_stats || !w.stats.card.available) continue;
        for (const auto& r : protocol::throttle::kReasons)
          out += "moe_worker_card_throttle" + labels(w, std::string(",reason=\"") + r.name + "\"") + " " +
                 ((w.stats.card.throttle_reasons & r.bit) ? "1" : "0") + "\n";
      }
    }
  }
  out += "# HELP moe_gateway_worker_pressure_total Pressure frames the workers sent, by level.\n"
         "# TYPE moe_gateway_worker_pressure_total counter\n";
  static const char* const kLevels[3] = {"warn", "evict", "break"};
  for (int i = 0; i < 3; ++i)
    out += std::string("moe_gateway_worker_pressure_total{level=\"") + kLevels[i] + "\"} " +
           std::to_string(stats.worker_pressure[i]) + "\n";
  if (stats.worker_expert_hits + stats.worker_expert_misses > 0) {
    render_scalar(out, "moe_gateway_worker_expert_hits_total", "counter",
                  "Routed experts the worker found resident, as its step replies count them.",
                  static_cast<double>(stats.worker_expert_hits));
    render_scalar(out, "moe_gateway_worker_expert_misses_total", "counter",
                  "Routed experts the worker had to copy in first (misses of its islands).",
                  static_cast<double>(stats.worker_expert_misses));
  }
  if (stats.steps_with_usage > 0) {
    render_scalar(out, "moe_gateway_steps_with_usage_total", "counter", "Worker steps that reported expert usage.",
                  static_cast<double>(stats.steps_with_usage));
    render_scalar(out, "moe_gateway_step_experts_total", "counter",
                  "Distinct (layer, expert) pairs used per step, summed over those steps.",
                  static_cast<double>(stats.step_experts));
  }
  return out;
}

}  // namespace moe::gw
