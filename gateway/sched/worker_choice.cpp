#include "gateway/sched/worker_choice.h"

#include <algorithm>
#include <charconv>

namespace moe::gw {

double worker_load(int running, int max_batch_sequences, int kv_blocks_used, int kv_blocks_total) {
  double a = max_batch_sequences > 0 ? double(running) / max_batch_sequences : 0.0;
  double b = kv_blocks_total > 0 ? double(kv_blocks_used) / kv_blocks_total : 0.0;
  return std::clamp(std::max(a, b), 0.0, 1.0);
}

double prediction_match(const ExpertPrediction& pred, const ExpertSet& resident, size_t n_experts) {
  double all = 0, held = 0;
  for (size_t l = 0; l < pred.experts.size(); ++l)
    for (int e : pred.experts[l]) {
      const size_t i = l * n_experts + size_t(e);
      // An expert with no estimated share still counts a little, so a
      // prediction of equal guesses is not all zeros.
      const double w = (i < pred.p.size() ? double(pred.p[i]) : 0.0) + 1e-6;
      all += w;
      if (resident.has(i)) held += w;
    }
  return all > 0 ? held / all : 1.0;
}

int choose_worker(const ExpertPrediction& pred, size_t n_experts,
                  const std::vector<WorkerCandidate>& workers, const WorkerChoiceParams& params,
                  std::vector<WorkerScore>* scores) {
  int best = -1;
  double best_score = 0, best_load = 0;
  if (scores) scores->assign(workers.size(), {});
  for (size_t i = 0; i < workers.size(); ++i) {
    const WorkerCandidate& w = workers[i];
    WorkerScore s;
    s.match = prediction_match(pred, w.resident, n_experts);
    s.score = s.match - params.load_weight * std::clamp(w.load, 0.0, 1.0);
    if (scores) (*scores)[i] = s;
    if (!w.ready) continue;
    const double eps = 1e-9;
    if (best < 0 || s.score > best_score + eps ||
        (s.score > best_score - eps && w.load < best_load)) {
      best = int(i);
      best_score = s.score;
      best_load = w.load;
    }
  }
  return best;
}

ExpertSet parse_resident_set(const std::string& text, int n_layers, int n_experts) {
  ExpertSet set(size_t(n_layers) * size_t(n_experts));
  size_t i = 0;
  while (i < text.size()) {
    size_t end = text.find(' ', i);
    if (end == std::string::npos) end = text.size();
    const std::string_view item(text.data() + i, end - i);
    const size_t colon = item.find(':');
    int l = -1, e = -1;
    if (colon != std::string_view::npos) {
      auto r1 = std::from_chars(item.data(), item.data() + colon, l);
      auto r2 = std::from_chars(item.data() + colon + 1, item.data() + item.size(), e);
      if (r1.ec == std::errc() && r2.ec == std::errc() && l >= 0 && l < n_layers && e >= 0 &&
          e < n_experts)
        set.add(size_t(l) * size_t(n_experts) + size_t(e));
    }
    i = end + 1;
  }
  return set;
}

}  // namespace moe::gw
