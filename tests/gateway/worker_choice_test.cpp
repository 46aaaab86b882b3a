// The multi-worker seam: a request's prediction against each worker's
// resident experts, weighed against the worker's load.
#include <catch2/catch.hpp>

#include "gateway/sched/worker_choice.h"

using namespace moe::gw;

namespace {

// Predicts experts {0, 1} of every one of `layers` layers (of 8), 0 likelier.
ExpertPrediction prediction(int layers) {
  ExpertPrediction p;
  p.set = ExpertSet(size_t(layers) * 8);
  p.p.assign(size_t(layers) * 8, 0.0f);
  for (int l = 0; l < layers; ++l) {
    p.experts.push_back({0, 1});
    p.p[size_t(l) * 8] = 0.75f;
    p.p[size_t(l) * 8 + 1] = 0.25f;
    p.set.add(size_t(l) * 8);
    p.set.add(size_t(l) * 8 + 1);
  }
  return p;
}

WorkerCandidate worker(const std::string& name, const std::string& resident, double load,
                       bool ready = true) {
  return {name, ready, parse_resident_set(resident, 2, 8), load};
}

}  // namespace

TEST_CASE("the resident stream's text parses into a set, garbage skipped",
          "[prediction][workers]") {
  const ExpertSet s = parse_resident_set("0:0 0:1 1:7 x:1 1:8 2:0 1:", 2, 8);
  CHECK(s.count() == 3);
  CHECK(s.has(0));
  CHECK(s.has(1));
  CHECK(s.has(15));
}

TEST_CASE("match weighs resident experts by their predicted share", "[prediction][workers]") {
  const ExpertPrediction p = prediction(2);
  CHECK(prediction_match(p, parse_resident_set("0:0 0:1 1:0 1:1", 2, 8), 8) == Approx(1.0));
  CHECK(prediction_match(p, parse_resident_set("0:0 1:0", 2, 8), 8) == Approx(0.75));
  CHECK(prediction_match(p, parse_resident_set("0:1 1:1 1:5", 2, 8), 8) == Approx(0.25));
  CHECK(prediction_match(p, ExpertSet(16), 8) == Approx(0.0));
  CHECK(prediction_match(ExpertPrediction{}, ExpertSet(16), 8) ==
        1.0);  // nothing predicted: any worker fits
}

TEST_CASE("the worker holding the predicted experts wins unless its load outweighs the match",
          "[prediction][workers]") {
  const ExpertPrediction p = prediction(2);
  std::vector<WorkerScore> scores;
  // Equal load: the better match.
  CHECK(choose_worker(p, 8, {worker("a", "0:5", 0.2), worker("b", "0:0 1:0 0:1 1:1", 0.2)}, {},
                      &scores) == 1);
  CHECK(scores[0].match == Approx(0.0));
  CHECK(scores[1].score == Approx(0.8));
  // b holds everything but is busy: 1 - 0.9 < 0.75 - 0.1 on a.
  CHECK(choose_worker(p, 8, {worker("a", "0:0 1:0", 0.1), worker("b", "0:0 1:0 0:1 1:1", 0.9)}) ==
        0);
  // A lighter load weight lets the match decide.
  WorkerChoiceParams light;
  light.load_weight = 0.1;
  CHECK(choose_worker(p, 8, {worker("a", "0:0 1:0", 0.1), worker("b", "0:0 1:0 0:1 1:1", 0.9)},
                      light) == 1);
  // Ties go to the lighter worker, then the earlier one.
  CHECK(choose_worker(p, 8, {worker("a", "", 0.5), worker("b", "", 0.5)}) == 0);
  CHECK(choose_worker(ExpertPrediction{}, 8, {worker("a", "", 0.5), worker("b", "", 0.2)}) == 1);
  // Never a worker that is not ready; none ready: -1.
  CHECK(choose_worker(p, 8, {worker("a", "0:0 1:0 0:1 1:1", 0.0, false), worker("b", "", 0.9)}) ==
        1);
  CHECK(choose_worker(p, 8, {worker("a", "", 0.0, false)}) == -1);
  CHECK(worker_load(2, 8, 50, 100) == Approx(0.5));
  CHECK(worker_load(8, 8, 0, 100) == Approx(1.0));
  CHECK(worker_load(0, 0, 0, 0) == 0.0);
}
