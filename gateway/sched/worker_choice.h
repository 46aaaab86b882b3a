#pragma once
// Which worker should take a request, given its expert prediction
// (docs/expert-prediction.md, "Several workers"): the one whose resident
// experts cover most of the predicted token share, weighed against its load.
//
//   match(w) = Σ p(e) over predicted experts e resident on w
//              / Σ p(e) over predicted experts          (1 when nothing is predicted)
//   score(w) = match(w) − load_weight · load(w)
//
// `load` is in [0, 1]: ContinuousScheduler gives the KV blocks the worker's
// admitted and queued sequences need over its total; worker_load() is the
// same from a worker's reported figures. A worker that is not ready is never
// chosen. Ties go to the lighter load, then to the earlier worker. Pure
// functions: ContinuousScheduler calls choose_worker for each sequence it
// gives to a worker.

#include <cstddef>
#include <string>
#include <vector>

#include "gateway/predict/expert_prediction.h"
#include "gateway/predict/expert_set.h"

namespace moe::gw {

struct WorkerCandidate {
  std::string name;
  bool ready = true;
  ExpertSet resident;  // [layer * n_experts + expert]
  double load = 0.0;   // [0, 1]
};

struct WorkerChoiceParams {
  double load_weight = 1.0;  // a fully loaded worker loses as much as a perfect match gains
};

struct WorkerScore {
  double match = 0.0;
  double score = 0.0;
};

// Load in [0, 1] from what a worker reports (hello limits, its step replies).
double worker_load(int running, int max_batch_sequences, int kv_blocks_used, int kv_blocks_total);

double prediction_match(const ExpertPrediction& pred, const ExpertSet& resident, size_t n_experts);

// Index of the chosen worker, or -1 when none is ready; `scores` (optional)
// gets every worker's figures, in order.
int choose_worker(const ExpertPrediction& pred, size_t n_experts,
                  const std::vector<WorkerCandidate>& workers,
                  const WorkerChoiceParams& params = {},
                  std::vector<WorkerScore>* scores = nullptr);

// "3:17 3:20" (the resident stream's text) as a set; malformed pairs and
// pairs out of range are skipped.
ExpertSet parse_resident_set(const std::string& text, int n_layers, int n_experts);

}  // namespace moe::gw
