#include "gateway/observe/expert_view.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "gateway/predict/expert_set.h"

namespace moe::gw {

ExpertView::Worker* ExpertView::worker(size_t w) {
  if (w >= workers_.size() || !workers_[w].present) return nullptr;
  return &workers_[w];
}

void ExpertView::set_worker(size_t w, const std::string& name, const protocol::ExpertLayout& layout) {
  if (w >= workers_.size()) workers_.resize(w + 1);
  Worker& k = workers_[w];
  k = Worker{};
  k.present = true;
  k.name = name;
  k.moe_layers = layout.moe_layers;
  k.n_experts = int(layout.n_experts);
  const size_t n = k.cells();
  k.resident.assign(n, 0);
  k.predicted.assign(n, 0);
  k.predicted_now.assign(n, 0);
  k.hot.assign(n, 0.f);
  k.used_now.assign(n, 0);
  k.missed_now.assign(n, 0);
  k.missed.assign(n, 0);
}

void ExpertView::drop_worker(size_t w) {
  if (w < workers_.size()) workers_[w] = Worker{};
}

void ExpertView::on_usage(size_t w, std::span<const uint16_t> usage) {
  Worker* k = worker(w);
  if (!k) return;
  const size_t n = std::min(usage.size(), k->cells());
  for (size_t i = 0; i < n; ++i) {
    if (usage[i] == 0) continue;
    k->used_now[i] += usage[i];
    if (k->resident_known && !k->resident[i]) ++k->missed_now[i];
  }
}

void ExpertView::on_prediction(size_t w, const ExpertSet& predicted) {
  Worker* k = worker(w);
  if (!k) return;
  for (size_t i = 0; i < k->cells(); ++i)
    if (predicted.has(i)) k->predicted_now[i] = 1;
}

void ExpertView::on_stats(size_t w, const protocol::StatsReply& r, uint64_t now_ms) {
  Worker* k = worker(w);
  if (!k) return;
  // The resident set, when the reply carries it (asked while watched): model
  // layer indices to MoE rows.
  // A reply without it (not asked: nobody watched) leaves the set unknown,
  // and nothing counts as missed until the next one.
  k->resident_known = !r.resident.empty() || r.islands_used == 0;
  if (k->resident_known) {
    std::fill(k->resident.begin(), k->resident.end(), uint8_t(0));
    for (const protocol::ExpertRef& e : r.resident) {
      auto row = std::find(k->moe_layers.begin(), k->moe_layers.end(), e.layer);
      if (row == k->moe_layers.end() || e.expert >= k->n_experts) continue;
      k->resident[size_t(row - k->moe_layers.begin()) * size_t(k->n_experts) + e.expert] = 1;
    }
  }
  // Close the second: heat as a moving average of tokens a second.
  const double dt = k->last_ms ? std::max(1.0, double(now_ms - k->last_ms)) / 1000.0 : 1.0;
  for (size_t i = 0; i < k->cells(); ++i) {
    k->hot[i] = float(0.5 * k->hot[i] + 0.5 * double(k->used_now[i]) / dt);
    if (k->hot[i] < 0.05f) k->hot[i] = 0.f;
  }
  std::fill(k->used_now.begin(), k->used_now.end(), 0u);
  k->missed.swap(k->missed_now);
  std::fill(k->missed_now.begin(), k->missed_now.end(), 0u);
  k->predicted.swap(k->predicted_now);
  std::fill(k->predicted_now.begin(), k->predicted_now.end(), uint8_t(0));
  if (k->have_counters && r.uptime_ms >= k->last.uptime_ms) {
    Sample s;
    s.t_ms = now_ms;
    // A counter's growth since the last reply (never negative).
    const auto since = [](uint64_t now, uint64_t then) { return double(now - std::min(now, then)); };
    const double hits = since(r.expert_hits, k->last.expert_hits);
    const double misses = since(r.expert_misses, k->last.expert_misses);
    const double tokens = since(r.tokens, k->last.tokens);
    const double bytes = since(r.bytes_copied + r.bytes_streamed, k->last.bytes_copied + k->last.bytes_streamed);
    s.hit_rate = hits + misses > 0 ? hits / (hits + misses) : -1;
    s.bytes_per_token = tokens > 0 ? bytes / tokens : 0;
    s.tokens_per_s = tokens / dt;
    k->series.push_back(s);
    while (k->series.size() > kSeriesLength) k->series.pop_front();
  }
  k->have_counters = true;
  k->last = r;
  k->last.resident.clear();
  k->last_ms = now_ms;
}

std::string ExpertView::json() const {
  using nlohmann::json;
  json out = {{"watch_ms", kWatchMs}, {"workers", json::array()}};
  for (const Worker& k : workers_) {
    if (!k.present) continue;
    std::string resident(k.cells(), '0'), predicted(k.cells(), '0');
    json hot = json::array(), missed = json::array();
    for (size_t i = 0; i < k.cells(); ++i) {
      if (k.resident[i]) resident[i] = '1';
      if (k.predicted[i]) predicted[i] = '1';
      if (k.hot[i] > 0)
        hot.push_back(std::round(double(k.hot[i]) * 10) / 10);
      else
        hot.push_back(0);
      missed.push_back(k.missed[i]);
    }
    json series = json::array();
    for (const Sample& s : k.series)
      series.push_back({{"t_ms", s.t_ms},
                        {"hit_rate", s.hit_rate < 0 ? json(nullptr) : json(std::round(s.hit_rate * 1e4) / 1e4)},
                        {"bytes_per_token", std::round(s.bytes_per_token)},
                        {"tokens_per_s", std::round(s.tokens_per_s * 10) / 10}});
    out["workers"].push_back({{"name", k.name},
                              {"moe_layers", k.moe_layers},
                              {"n_experts", k.n_experts},
                              {"islands_used", k.last.islands_used},
                              {"islands_total", k.last.islands_total},
                              {"resident", resident},
                              {"predicted", predicted},
                              {"hot", hot},
                              {"missed", missed},
                              {"series", series}});
  }
  return out.dump();
}

}  // namespace moe::gw
