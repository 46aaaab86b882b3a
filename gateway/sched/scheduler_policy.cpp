#include "gateway/sched/scheduler_policy.h"

#include <algorithm>
#include <climits>
#include <unordered_map>
#include <unordered_set>

namespace moe::gw {

int BatchPolicy::blocks_for(int tokens) const {
  const int bt = std::max(limits_.kv_block_tokens, 1);
  return (tokens + bt - 1) / bt;
}

void BatchPolicy::count_group(uint64_t group, int delta) {
  auto [it, fresh] = groups_.try_emplace(group);
  // A new request takes its turn after those already waiting: it counts as
  // admitted "now", so a request partly admitted earlier goes before it.
  if (fresh) it->second.admitted = admit_counter_;
  it->second.sequences += delta;
  if (it->second.sequences <= 0) groups_.erase(it);
}

int64_t BatchPolicy::effective_priority(const Seq& s) const {
  const uint64_t bound = limits_.priority_max_wait_ms;
  if (bound > 0 && now_ms_ >= s.req.submitted_ms + bound) return INT64_MIN;
  return s.req.priority;
}

uint64_t BatchPolicy::victim(const std::function<bool(const Seq&)>& eligible, const CallerCounts& held) const {
  uint64_t id = 0;
  int64_t worst = INT64_MIN;
  int most = 0;
  for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
    const Seq& s = seqs_.at(*it);
    if (eligible && !eligible(s)) continue;
    const int h = held.at(s.req.caller);
    if (id == 0 || effective_priority(s) > worst || (effective_priority(s) == worst && h > most)) {
      worst = effective_priority(s);
      most = h;
      id = *it;
    }
  }
  return id;
}

BatchPolicy::CallerCounts BatchPolicy::running_by_caller() const {
  CallerCounts held;
  for (uint64_t id : running_) ++held[seqs_.at(id).req.caller];
  return held;
}

std::vector<size_t> BatchPolicy::admission_order(size_t limit) const {
  // Classes first: when the waiting sequences ask for more than one
  // priority, the order below is kept within each class.
  bool mixed = false;
  for (size_t i = 1; i < waiting_.size() && !mixed; ++i)
    mixed = seqs_.at(waiting_[i]).req.priority != seqs_.at(waiting_[0]).req.priority;
  if (!mixed) return admission_order_within(limit);
  std::vector<size_t> all = admission_order_within(waiting_.size());
  std::stable_sort(all.begin(), all.end(), [this](size_t a, size_t b) {
    return effective_priority(seqs_.at(waiting_[a])) < effective_priority(seqs_.at(waiting_[b]));
  });
  if (all.size() > limit) all.resize(limit);
  return all;
}

std::vector<size_t> BatchPolicy::admission_order_within(size_t limit) const {
  // Fair shares: the callers holding fewer running sequences first, the
  // order below kept among equals (all of them, when callers are unknown).
  const CallerCounts held = running_by_caller();
  auto share = [&](size_t pos) {
    auto it = held.find(seqs_.at(waiting_[pos]).req.caller);
    return it == held.end() ? 0 : it->second;
  };
  bool uneven = false;
  for (size_t i = 1; i < waiting_.size() && !uneven; ++i) uneven = share(i) != share(0);
  if (!uneven) return admission_order_fifo(limit);
  std::vector<size_t> all = admission_order_fifo(waiting_.size());
  std::stable_sort(all.begin(), all.end(), [&](size_t a, size_t b) { return share(a) < share(b); });
  if (all.size() > limit) all.resize(limit);
  return all;
}

std::vector<size_t> BatchPolicy::admission_order_fifo(size_t limit) const {
  std::vector<size_t> order;
  // Put back at the front: first, in queue order.
  for (size_t i = 0; i < waiting_.size() && order.size() < limit; ++i)
    if (seqs_.at(waiting_[i]).front) order.push_back(i);
  if (order.size() >= limit) return order;
  // The rest by group, each group's in queue order; groups by their last
  // admission, then by their first place in the queue.
  struct Pending {
    uint64_t group;
    uint64_t admitted;
    std::vector<size_t> positions;
  };
  std::vector<Pending> pending;
  std::unordered_map<uint64_t, size_t> slot;
  for (size_t i = 0; i < waiting_.size(); ++i) {
    const Seq& s = seqs_.at(waiting_[i]);
    if (s.front) continue;
    auto [it, fresh] = slot.try_emplace(s.req.group, pending.size());
    if (fresh) {
      auto g = groups_.find(s.req.group);
      pending.push_back({s.req.group, g == groups_.end() ? 0 : g->second.admitted, {}});
    }
    pending[it->second].positions.push_back(i);
  }
  std::stable_sort(pending.begin(), pending.end(),
                   [](const Pending& a, const Pending& b) { return a.admitted < b.admitted; });
  for (size_t round = 0; order.size() < limit; ++round) {
    bool any = false;
    for (const Pending& p : pending) {
      if (round >= p.positions.size()) continue;
      any = true;
      order.push_back(p.positions[round]);
      if (order.size() >= limit) break;
    }
    if (!any) break;
  }
  return order;
}

void BatchPolicy::add(uint64_t id, SequenceRequest req, SequenceHints hints) {
  Seq s;
  s.context = req.prompt;
  s.controls = TokenControls(req, {});
  count_group(req.group, +1);
  s.req = std::move(req);
  s.hints = std::move(hints);
  seqs_[id] = std::move(s);
  waiting_.push_back(id);
}

bool BatchPolicy::cancel(uint64_t id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return false;
  const bool admitted = it->second.admitted;
  count_group(it->second.req.group, -1);
  seqs_.erase(it);
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), id), waiting_.end());
  running_.erase(std::remove(running_.begin(), running_.end(), id), running_.end());
  return admitted;
}

int BatchPolicy::kv_blocks_used() const {
  int used = 0;
  for (uint64_t id : running_) used += blocks_for(seqs_.at(id).on_worker);
  return used;
}

int BatchPolicy::committed_blocks() const {
  int c = 0;
  for (uint64_t id : running_) {
    const Seq& s = seqs_.at(id);
    c += blocks_for(std::max<int>(s.on_worker + 1, int(s.context.size())));
  }
  return c;
}

std::vector<uint64_t> BatchPolicy::running_ids() const { return running_; }

int BatchPolicy::skips(uint64_t id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? 0 : it->second.skips;
}

size_t BatchPolicy::pick_grouped(const std::vector<uint64_t>& candidates, const ExpertSet& step) const {
  // Passed over often enough: the oldest such goes now, whatever it shares.
  for (size_t i = 0; i < candidates.size(); ++i)
    if (seqs_.at(candidates[i]).skips >= limits_.grouping_max_skips) return i;
  size_t best = 0;
  double best_score = -1;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const ExpertSet& e = seqs_.at(candidates[i]).hints.experts;
    const size_t n = e.count();
    const double score = n == 0 ? 0.0 : double(e.overlap(step)) / double(n);
    if (score > best_score) {  // ties: the older one
      best = i;
      best_score = score;
    }
  }
  return best;
}

const std::vector<int32_t>* BatchPolicy::generated(uint64_t id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : &it->second.generated;
}

bool BatchPolicy::can_ever_run(const Seq& s, std::string* why) const {
  if (s.req.prompt.empty()) {
    *why = "the prompt is empty";
    return false;
  }
  *why = context_problem(int(s.context.size()));
  return why->empty();
}

std::string BatchPolicy::context_problem(int len) const {
  if (limits_.max_context > 0 && len + 1 > limits_.max_context)
    return "the prompt of " + std::to_string(len) + " tokens leaves no room in the context of " +
           std::to_string(limits_.max_context);
  // Its whole context in the cache: it runs as one prefill and samples a
  // token (after which apply() ends it if the next one cannot fit).
  if (blocks_for(len) > limits_.kv_blocks_total)
    return "the prompt of " + std::to_string(len) + " tokens needs more KV blocks than the worker has (" +
           std::to_string(limits_.kv_blocks_total) + ")";
  return {};
}

bool BatchPolicy::fits(const SequenceState& st) const {
  return context_problem(int(st.req.prompt.size() + st.generated.size())).empty();
}

bool BatchPolicy::holds_all(const SequenceState& st) const {
  int64_t target = int64_t(st.req.prompt.size()) + std::max<int64_t>(st.req.max_new_tokens, int64_t(st.generated.size()));
  if (limits_.max_context > 0) target = std::min<int64_t>(target, limits_.max_context);
  return int64_t(blocks_for(int(std::min<int64_t>(target, INT_MAX / 2)))) <= limits_.kv_blocks_total;
}

void BatchPolicy::preempt_for_priority(StepPlan& plan) {
  if (waiting_.empty() || running_.empty()) return;
  const std::vector<size_t> first = admission_order(1);
  const Seq& want = seqs_.at(waiting_[first[0]]);
  const int64_t p = effective_priority(want);
  // Who may make room: running sequences of a later class now and of a
  // later priority as asked (an aged sequence goes first among those
  // waiting, but preempts no earlier or equal priority; equal priorities
  // never preempt each other).
  auto eligible = [&](const Seq& s, const CallerCounts&) {
    return effective_priority(s) > p && s.req.priority > want.req.priority;
  };
  priority_preemptions_ += uint64_t(make_room(want, 1, eligible, /*front=*/true, plan));
}

void BatchPolicy::preempt_for_fairness(StepPlan& plan) {
  if (waiting_.empty() || running_.empty()) return;
  const std::vector<size_t> first = admission_order(1);
  const Seq& want = seqs_.at(waiting_[first[0]]);
  // (The admission order puts the callers holding least first.)
  if (want.req.caller == 0) return;
  const int64_t p = effective_priority(want);
  // (`held` counts the running as if the victims chosen so far were gone;
  // the waiting caller's own are never among them.)
  auto eligible = [&](const Seq& s, const CallerCounts& held) {
    auto mine = held.find(want.req.caller);
    return s.req.caller != 0 && s.req.caller != want.req.caller && effective_priority(s) == p &&
           held.at(s.req.caller) > (mine == held.end() ? 0 : mine->second) + 1;
  };
  // Room for a first chunk worth starting, not one token a step.
  const int first_chunk = std::min<int>(int(want.context.size()), 32);
  fairness_preemptions_ += uint64_t(make_room(want, first_chunk, eligible, /*front=*/false, plan));
}

int BatchPolicy::make_room(const Seq& want, int first_chunk,
                           const std::function<bool(const Seq&, const CallerCounts&)>& eligible, bool front,
                           StepPlan& plan) {
  const int len = int(want.context.size());
  const int total = limits_.kv_blocks_total;
  auto blocks_held = [&](const Seq& s) { return blocks_for(std::max<int>(s.on_worker + 1, int(s.context.size()))); };
  // Room means all three: its KV (with headroom), a batch slot, and step
  // tokens left after the decodes for its first chunk.
  auto room = [&](int committed, int running, int decoding) {
    const int need = running == 0 ? blocks_for(len) : blocks_for(len) + limits_.headroom_blocks;
    return committed + need <= total && running < limits_.max_batch_sequences &&
           decoding + first_chunk <= limits_.max_step_tokens;
  };
  int committed = committed_blocks(), running = int(running_.size()), decodes = 0;
  for (uint64_t id : running_) decodes += decoding(seqs_.at(id));
  if (room(committed, running, decodes)) return 0;  // it fits as things are
  // The victims, in order, as if each were preempted; none unless they make
  // enough room together: never preempt in vain.
  std::vector<uint64_t> victims;
  std::unordered_set<const Seq*> taken;
  CallerCounts held = running_by_caller();  // as if the victims so far were gone
  auto open = [&](const Seq& s) { return !taken.count(&s) && eligible(s, held); };
  while (!room(committed, running, decodes)) {
    const uint64_t v = victim(open, held);
    if (v == 0) return 0;  // not enough: nobody goes
    const Seq& s = seqs_.at(v);
    taken.insert(&s);
    victims.push_back(v);
    committed -= blocks_held(s);
    --running;
    decodes -= decoding(s);
    --held[s.req.caller];
  }
  for (uint64_t v : victims) preempt(v, plan, front);
  return int(victims.size());
}

void BatchPolicy::preempt(uint64_t id, StepPlan& plan, bool front) {
  Seq& s = seqs_.at(id);
  s.req.waiting_since_ms = now_ms_;
  running_.erase(std::remove(running_.begin(), running_.end(), id), running_.end());
  s.admitted = false;
  s.front = front;
  s.on_worker = 0;
  // Not put first: at the back of the queue, behind whoever it made room for.
  if (front)
    waiting_.push_front(id);
  else
    waiting_.push_back(id);
  plan.release.push_back(id);
  ++preemptions_;
}

StepPlan BatchPolicy::plan(std::vector<SequenceUpdate>* rejected, uint64_t now_ms) {
  now_ms_ = now_ms;
  StepPlan plan;
  // Requests that can never run leave the queue with an error.
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    std::string why;
    if (can_ever_run(seqs_.at(*it), &why)) {
      ++it;
      continue;
    }
    // One that has generated tokens (resumed here from a worker with more
    // KV, say) ends as if it reached its length; a prompt that never fits is
    // an error.
    const bool grew = !seqs_.at(*it).generated.empty();
    if (rejected) rejected->push_back({*it, {}, true, grew ? FinishReason::length : FinishReason::error, grew ? "" : why});
    count_group(seqs_.at(*it).req.group, -1);
    seqs_.erase(*it);
    it = waiting_.erase(it);
  }

  // 1. Decode tokens (one per sequence whose prompt is on the worker); when
  //    the blocks they need are not free, preempt the youngest sequence.
  const int total = limits_.kv_blocks_total;
  auto decode_need = [&] {
    int need = 0;
    for (uint64_t id : running_) {
      const Seq& s = seqs_.at(id);
      if (decoding(s)) need += blocks_for(s.on_worker + 1) - blocks_for(s.on_worker);
    }
    return need;
  };
  preempt_for_priority(plan);
  preempt_for_fairness(plan);
  while (!running_.empty() && decode_need() > total - kv_blocks_used()) preempt(victim({}, running_by_caller()), plan);

  int budget = limits_.max_step_tokens;
  int free_blocks = total - kv_blocks_used();
  for (uint64_t id : running_) {
    Seq& s = seqs_.at(id);
    if (!decoding(s)) continue;
    free_blocks -= blocks_for(s.on_worker + 1) - blocks_for(s.on_worker);
    plan.chunks.push_back({id, {s.context.back()}, s.on_worker, true, s.req.sampling, s.hints.route_tag});
    plan.chunks.back().sampling.adjust = s.controls.next(s.req, int(s.generated.size()));
    plan.chunks.back().sampling.allowed = s.controls.allowed(s.req);
    --budget;
  }
  // The experts this step already touches (grouped batching adds to it).
  ExpertSet step_experts;
  for (const PlannedChunk& c : plan.chunks) step_experts.merge(seqs_.at(c.seq_id).hints.experts);

  // 2. Prefill chunks of admitted sequences, oldest first, within the budget
  //    and the free blocks. A chunk that does not end its prompt ends on a
  //    KV block boundary: the worker's prefix cache continues a prompt's
  //    chain of cached blocks only while its blocks so far are whole
  //    (docs/prefix-cache.md), so one chunk ending mid-block would cost
  //    every later chunk of that prompt its reuse (the n choices of one
  //    prompt, a shared history). A sequence whose aligned share of the
  //    budget is empty waits for the next step, unless no prefill has run
  //    in this step yet (the oldest always moves, even when decodes leave
  //    less than a block).
  bool prefilled = false;
  auto add_prefill = [&](uint64_t id) {
    Seq& s = seqs_.at(id);
    const int bt = std::max(limits_.kv_block_tokens, 1);
    const int remaining = int(s.context.size()) - s.on_worker;
    const int fit = (blocks_for(s.on_worker) + free_blocks) * bt - s.on_worker;
    int n = std::min({remaining, budget, fit});
    if (n <= 0) return;
    if (n < remaining) {
      const int aligned = (s.on_worker + n) / bt * bt - s.on_worker;
      if (aligned > 0) n = aligned;
      else if (prefilled) return;
    }
    prefilled = true;
    PlannedChunk c;
    c.seq_id = id;
    c.start_pos = s.on_worker;
    c.tokens.assign(s.context.begin() + s.on_worker, s.context.begin() + s.on_worker + n);
    c.sample = n == remaining;
    c.sampling = s.req.sampling;
    if (c.sample) {
      c.sampling.adjust = s.controls.next(s.req, int(s.generated.size()));
      c.sampling.allowed = s.controls.allowed(s.req);
    }
    c.route_tag = s.hints.route_tag;
    free_blocks -= blocks_for(s.on_worker + n) - blocks_for(s.on_worker);
    budget -= n;
    plan.chunks.push_back(std::move(c));
  };
  std::vector<uint64_t> prefilling;
  int prefill_tokens = 0;
  for (uint64_t id : running_) {
    const Seq& s = seqs_.at(id);
    const int remaining = int(s.context.size()) - s.on_worker;
    if (remaining <= 1) continue;
    prefilling.push_back(id);
    prefill_tokens += remaining;
  }
  if (!limits_.grouped_batching || prefill_tokens <= budget) {
    for (uint64_t id : prefilling) {
      if (budget <= 0) break;
      add_prefill(id);
      step_experts.merge(seqs_.at(id).hints.experts);
    }
  } else {
    // More prefill than the step takes: overlap with the step decides, and
    // every sequence left out this time counts one more skip.
    while (budget > 0 && !prefilling.empty()) {
      const size_t k = pick_grouped(prefilling, step_experts);
      const uint64_t id = prefilling[k];
      prefilling.erase(prefilling.begin() + long(k));
      Seq& s = seqs_.at(id);
      s.skips = 0;
      add_prefill(id);
      step_experts.merge(s.hints.experts);
    }
    for (uint64_t id : prefilling) ++seqs_.at(id).skips;
  }

  // 3. Admission, first come first served: the whole context must fit next to
  //    what the admitted sequences will hold, plus headroom.
  //    With grouped batching the pick among the first `grouping_window`
  //    waiting requests goes by overlap; the head, once passed over
  //    grouping_max_skips times, goes next. Whoever is picked must fit, else
  //    admission stops for this step (a small request never slips past a
  //    large one by size alone).
  // The round-robin order is computed once a step (ids, so admissions do
  // not shift it): the request admitted least recently first, one sequence
  // each, round after round, which is what recomputing after every
  // admission would give.
  const bool grouping = limits_.grouped_batching && waiting_.size() > 1;
  const size_t window = grouping ? size_t(std::max(limits_.grouping_window, 1)) : 1;
  std::vector<uint64_t> order;
  {
    const size_t want = std::min(waiting_.size(), window + size_t(std::max(budget, 0)));
    for (size_t pos : admission_order(want)) order.push_back(waiting_[pos]);
  }
  size_t next = 0;  // order[next..] are the candidates still waiting
  while (budget > 0 && next < order.size() && int(running_.size()) < limits_.max_batch_sequences) {
    size_t w = std::min(window, order.size() - next);
    // Grouping chooses within the head's class only.
    const int64_t head_class = effective_priority(seqs_.at(order[next]));
    for (size_t i = 1; i < w; ++i)
      if (effective_priority(seqs_.at(order[next + i])) != head_class) {
        w = i;
        break;
      }
    size_t pick = 0;
    if (grouping && w > 1 && seqs_.at(order[next]).skips < limits_.grouping_max_skips) {
      const std::vector<uint64_t> candidates(order.begin() + long(next), order.begin() + long(next + w));
      pick = pick_grouped(candidates, step_experts);
    }
    const uint64_t id = order[next + pick];
    Seq& s = seqs_.at(id);
    const int len = int(s.context.size());
    // Alone it needs only its context (the cache is all its own); beside
    // others, headroom to grow.
    const int need = running_.empty() ? blocks_for(len) : blocks_for(len) + limits_.headroom_blocks;
    if (committed_blocks() + need > total) break;
    for (size_t i = 0; i < pick; ++i) ++seqs_.at(order[next + i]).skips;  // overtaken
    order.erase(order.begin() + long(next + pick));
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), id));
    s.skips = 0;
    s.front = false;
    step_experts.merge(s.hints.experts);
    s.admitted = true;
    s.admitted_at = ++admit_counter_;
    if (auto g = groups_.find(s.req.group); g != groups_.end()) g->second.admitted = admit_counter_;
    s.on_worker = 0;
    running_.push_back(id);
    add_prefill(id);
  }
  drop_unsendable(plan, rejected);
  return plan;
}

void BatchPolicy::drop_unsendable(StepPlan& plan, std::vector<SequenceUpdate>* rejected) {
  // A sampled chunk the worker would refuse (the same rule it applies)
  // would fail the whole step, every other sequence in it too: its sequence
  // ends here, alone. A structured value that no token can continue is the
  // case met in practice (an empty mask of allowed tokens).
  for (auto it = plan.chunks.begin(); it != plan.chunks.end();) {
    const std::string why = it->sample ? protocol::sampling_problem(it->sampling) : std::string();
    if (why.empty()) {
      ++it;
      continue;
    }
    const uint64_t id = it->seq_id;
    it = plan.chunks.erase(it);
    Seq& s = seqs_.at(id);
    if (s.on_worker > 0) plan.release.push_back(id);  // its KV on the worker
    if (rejected)
      rejected->push_back({id, {}, true, FinishReason::error,
                           why == protocol::kNoAllowedToken ? "no token can continue the requested format here"
                                                          : "the worker would refuse the sampling: " + why});
    count_group(s.req.group, -1);
    running_.erase(std::remove(running_.begin(), running_.end(), id), running_.end());
    waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), id), waiting_.end());
    seqs_.erase(id);
  }
}

std::vector<SequenceUpdate> BatchPolicy::apply(const StepPlan& plan, const std::vector<ChunkResult>& results,
                                               std::vector<uint64_t>* release_after) {
  std::unordered_map<uint64_t, const ChunkResult*> by_id;
  for (const ChunkResult& r : results) by_id[r.seq_id] = &r;
  std::vector<SequenceUpdate> updates;
  for (const PlannedChunk& c : plan.chunks) {
    auto it = seqs_.find(c.seq_id);
    if (it == seqs_.end() || !it->second.admitted) continue;  // cancelled meanwhile
    Seq& s = it->second;
    SequenceUpdate u;
    u.seq_id = c.seq_id;
    auto rit = by_id.find(c.seq_id);
    if (rit == by_id.end() || !rit->second->ok) {
      u.finished = true;
      u.reason = FinishReason::error;
      u.error = rit == by_id.end() ? "the worker returned no result for the sequence" : rit->second->error;
    } else {
      s.on_worker = c.start_pos + int(c.tokens.size());
      // Every chunk of a prefill may find its blocks cached.
      s.cached_tokens = (c.start_pos == 0 ? 0 : s.cached_tokens) + rit->second->cached_tokens;
      if (c.sample && rit->second->sampled) {
        const TokenEvent& ev = rit->second->token;
        u.tokens.push_back(ev);
        if (s.generated.empty()) u.tokens.back().cached_prompt_tokens = s.cached_tokens;
        s.generated.push_back(ev.token);
        s.context.push_back(ev.token);
        s.controls.generated(ev.token);
        const auto& stop = s.req.stop_ids;
        if (std::find(stop.begin(), stop.end(), ev.token) != stop.end() || s.controls.closed()) {
          // A stop id, or a structured value that nothing can follow.
          u.finished = true;
          u.reason = FinishReason::stop;
        } else if (s.controls.broken()) {
          u.finished = true;
          u.reason = FinishReason::error;
          u.error = "the worker sampled a token the response format does not allow";
        } else if (int(s.generated.size()) >= s.req.max_new_tokens ||
                   (limits_.max_context > 0 && int(s.context.size()) >= limits_.max_context) ||
                   blocks_for(int(s.context.size())) > limits_.kv_blocks_total) {
          // The last: the next token's KV would not fit even in the whole
          // cache, so the sequence can never grow here (it would wait forever).
          u.finished = true;
          u.reason = FinishReason::length;
        }
      } else if (c.sample) {
        u.finished = true;
        u.reason = FinishReason::error;
        u.error = "the worker sampled no token";
      }
    }
    if (u.finished) {
      if (release_after) release_after->push_back(c.seq_id);
      running_.erase(std::remove(running_.begin(), running_.end(), c.seq_id), running_.end());
      count_group(s.req.group, -1);
      seqs_.erase(it);
    }
    if (u.finished || !u.tokens.empty()) updates.push_back(std::move(u));
  }
  return updates;
}

std::vector<SequenceState> BatchPolicy::take_all() {
  std::vector<SequenceState> out;
  auto take = [&](uint64_t id) {
    Seq& s = seqs_.at(id);
    out.push_back({id, std::move(s.req), std::move(s.generated), std::move(s.hints)});
  };
  for (uint64_t id : running_) take(id);
  for (uint64_t id : waiting_) take(id);
  seqs_.clear();
  running_.clear();
  waiting_.clear();
  groups_.clear();
  return out;
}

std::vector<SequenceState> BatchPolicy::take_if(const std::function<bool(const SequenceRequest&)>& which,
                                                std::vector<uint64_t>* released) {
  std::vector<SequenceState> out;
  auto take = [&](uint64_t id) {
    Seq& s = seqs_.at(id);
    count_group(s.req.group, -1);
    out.push_back({id, std::move(s.req), std::move(s.generated), std::move(s.hints)});
    seqs_.erase(id);
  };
  std::vector<uint64_t> keep_running, keep_waiting;
  for (uint64_t id : running_) {
    if (!which(seqs_.at(id).req)) {
      keep_running.push_back(id);
      continue;
    }
    if (released) released->push_back(id);
    take(id);
  }
  for (uint64_t id : waiting_) {
    if (!which(seqs_.at(id).req)) {
      keep_waiting.push_back(id);
      continue;
    }
    take(id);
  }
  running_ = std::move(keep_running);
  waiting_.assign(keep_waiting.begin(), keep_waiting.end());
  return out;
}

void BatchPolicy::waiting_at_or_before(int priority, int* count, uint64_t* oldest_since) const {
  for (uint64_t id : waiting_) {
    const SequenceRequest& r = seqs_.at(id).req;
    if (r.priority > priority) continue;
    ++*count;
    if (r.waiting_since_ms != 0 && (*oldest_since == 0 || r.waiting_since_ms < *oldest_since))
      *oldest_since = r.waiting_since_ms;
  }
}

int BatchPolicy::latest_priority() const {
  int p = INT_MIN;
  for (const auto& [id, s] : seqs_) p = std::max(p, s.req.priority);
  return p;
}

int BatchPolicy::on_fallback() const {
  int n = 0;
  for (const auto& [id, s] : seqs_) n += s.req.on_fallback ? 1 : 0;
  return n;
}

std::vector<SequenceState> BatchPolicy::take_waiting(size_t n, const std::function<bool(const SequenceState&)>& which) {
  std::vector<SequenceState> out;
  // The youngest first (from the back), those `which` takes.
  for (auto it = waiting_.end(); it != waiting_.begin() && out.size() < n;) {
    --it;
    Seq& s = seqs_.at(*it);
    SequenceState st{*it, s.req, s.generated, s.hints};
    if (which && !which(st)) continue;
    count_group(s.req.group, -1);
    seqs_.erase(*it);
    it = waiting_.erase(it);
    out.push_back(std::move(st));
  }
  std::reverse(out.begin(), out.end());
  return out;
}

void BatchPolicy::add_resumed(SequenceState st, bool front) {
  Seq s;
  s.context = st.req.prompt;
  s.context.insert(s.context.end(), st.generated.begin(), st.generated.end());
  s.generated = std::move(st.generated);
  s.controls = TokenControls(st.req, s.generated);
  count_group(st.req.group, +1);
  s.req = std::move(st.req);
  s.hints = std::move(st.hints);
  s.front = front;
  seqs_[st.id] = std::move(s);
  if (front)
    waiting_.push_front(st.id);
  else
    waiting_.push_back(st.id);
}

int BatchPolicy::demand_blocks() const {
  int d = committed_blocks();
  for (uint64_t id : waiting_) d += blocks_for(int(seqs_.at(id).context.size()));
  return d;
}

void BatchPolicy::worker_lost() {
  for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
    Seq& s = seqs_.at(*it);
    s.admitted = false;
    s.front = true;
    s.on_worker = 0;
    waiting_.push_front(*it);
  }
  running_.clear();
}

}  // namespace moe::gw
