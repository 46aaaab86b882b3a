#include "gateway/sched/scheduler_continuous.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <variant>

#include "gateway/last_resort.h"

namespace moe::gw {

namespace pr = moe::protocol;

ContinuousScheduler::ContinuousScheduler(uv_loop_t* loop, std::vector<std::string> worker_sockets,
                                         ContinuousSchedulerOptions opts)
    : loop_(loop), opts_(std::move(opts)) {
  kick_timer_ = new uv_timer_t;
  uv_timer_init(loop_, kick_timer_);
  kick_timer_->data = this;
  workers_.resize(worker_sockets.size());  // never resized again: callbacks keep indices
  for (size_t i = 0; i < worker_sockets.size(); ++i) {
    WorkerLinkOptions lo = opts_.link;
    lo.socket_path = worker_sockets[i];
    WorkerLink::Callbacks cb;
    cb.on_ready = [this, i](const pr::Hello& h) { on_ready(i, h); };
    cb.on_frame = [this, i](const pr::Frame& f) { on_frame(i, f); };
    cb.on_down = [this, i](const std::string&, bool unresponsive) { on_down(i, unresponsive); };
    Worker& w = workers_[i];
    w.link = std::make_unique<WorkerLink>(loop_, lo, std::move(cb));
    w.name = std::filesystem::path(worker_sockets[i]).stem().string();
    w.fallback = opts_.last_is_fallback && worker_sockets.size() > 1 && i + 1 == worker_sockets.size();
  }
  for (auto& w : workers_) {
    w.thermal = ThermalGovernor(opts_.thermal);
    w.link->start();
  }
  wait_timer_ = new uv_timer_t;
  uv_timer_init(loop_, wait_timer_);
  wait_timer_->data = this;
  uv_update_time(loop_);  // the loop may not have run since the gateway loaded its model
  none_ready();           // none is yet: a worker never reached counts from the start
  if (opts_.stats_interval_ms > 0) {
    stats_timer_ = new uv_timer_t;
    uv_timer_init(loop_, stats_timer_);
    stats_timer_->data = this;
    uv_timer_start(stats_timer_, [](uv_timer_t* t) {
      if (auto* self = static_cast<ContinuousScheduler*>(t->data)) last_resort("asking for stats", [self] { self->poll_stats(); });
    }, opts_.stats_interval_ms, opts_.stats_interval_ms);
  }
}

ContinuousScheduler::~ContinuousScheduler() {
  kick_timer_->data = nullptr;
  uv_close(reinterpret_cast<uv_handle_t*>(kick_timer_), [](uv_handle_t* h) { delete reinterpret_cast<uv_timer_t*>(h); });
  if (stats_timer_) {
    stats_timer_->data = nullptr;
    uv_close(reinterpret_cast<uv_handle_t*>(stats_timer_), [](uv_handle_t* h) { delete reinterpret_cast<uv_timer_t*>(h); });
  }
  wait_timer_->data = nullptr;
  uv_close(reinterpret_cast<uv_handle_t*>(wait_timer_), [](uv_handle_t* h) { delete reinterpret_cast<uv_timer_t*>(h); });
  workers_.clear();
  supervisor_.reset();
}

void ContinuousScheduler::own_supervisor(std::unique_ptr<WorkerSupervisor> s) {
  supervisor_ = std::move(s);
  // The planner ends what waits for it, on the next loop turn (the worker's
  // connection may be seen to close after its exit).
  if (supervisor_) supervisor_->on_failing([this] { request_kick(); });
}

std::string ContinuousScheduler::failing() const {
  if (ready()) return "";
  if (supervisor_ && supervisor_->failing()) return supervisor_->failing_reason();
  return no_worker_reason();
}

void ContinuousScheduler::none_ready() {
  if (none_ready_since_ms_ != 0) return;
  none_ready_since_ms_ = std::max<uint64_t>(uv_now(loop_), 1);
  if (opts_.worker_wait_ms == 0) return;
  uv_timer_start(wait_timer_, [](uv_timer_t* t) {
    if (auto* self = static_cast<ContinuousScheduler*>(t->data))
      last_resort("a wait for a worker", [self] { self->none_ready_too_long(); });
  }, opts_.worker_wait_ms, 0);
}

void ContinuousScheduler::none_ready_too_long() {
  const std::string why = no_worker_reason();
  if (why.empty()) return;  // a worker is ready again
  std::fprintf(stderr, "moe-gateway: failing (what waits ends, new requests get 503): %s\n", why.c_str());
  // The planner ends what waits (failing() now says why), as for a worker of
  // its own that cannot start.
  request_kick();
}

std::string ContinuousScheduler::no_worker_reason() const {
  if (opts_.worker_wait_ms == 0 || none_ready_since_ms_ == 0) return "";
  const uint64_t waited_ms = uv_now(loop_) - none_ready_since_ms_;
  if (waited_ms < opts_.worker_wait_ms) return "";
  std::string each;
  for (const Worker& w : workers_) {
    const std::string& why = w.link->last_failure();
    each += (each.empty() ? "" : "; ") + std::string(w.fallback ? "fallback worker " : "worker ") +
            w.link->socket_path() + ": " + (why.empty() ? "no answer yet" : why);
  }
  return "No worker has been ready for " + std::to_string(waited_ms / 1000) + " s (" + each +
         "); the server keeps trying to reach the workers and serves again once one is ready.";
}

void ContinuousScheduler::end_waiting(const std::string& why) {
  std::vector<SequenceUpdate> ended;
  auto end = [&](const SequenceState& s) {
    ended.push_back({s.id, {}, true, FinishReason::error, why});
    moved_.erase(s.id);
    owner_.erase(s.id);
    prediction_done(s.id);
  };
  for (const SequenceState& s : queued_) end(s);
  queued_.clear();
  for (Worker& w : workers_)
    if (!w.link->ready())
      for (const SequenceState& s : w.policy.take_all()) end(s);
  if (ended.empty()) return;
  std::fprintf(stderr, "moe-gateway: %zu sequence(s) waiting for a worker ended: %s\n", ended.size(), why.c_str());
  dispatch(ended);
}

bool ContinuousScheduler::serving(size_t w) const {
  if (!workers_[w].link->ready()) return false;
  if (!workers_[w].fallback) return true;
  for (const Worker& o : workers_)
    if (!o.fallback && o.link->ready()) return false;
  return true;
}

bool ContinuousScheduler::stepping(size_t w) const {
  if (serving(w)) return true;
  const Worker& wk = workers_[w];
  return wk.fallback && wk.link->ready() && wk.policy.running() + wk.policy.waiting() > 0;
}

void ContinuousScheduler::poll_stats() {
  // The resident sets only while the experts page is watched.
  pr::StatsRequest req;
  req.include_resident = expert_view_.watched(uv_now(loop_));
  for (Worker& w : workers_)
    if (w.link->ready()) (void)w.link->send(pr::Message(req));
}

void ContinuousScheduler::on_stats(size_t w, const pr::StatsReply& r) {
  Worker& wk = workers_[w];
  wk.have_stats = true;
  wk.stats = r;
  expert_view_.on_stats(w, r, uv_now(loop_));
  if (!wk.thermal.observe(r.card)) return;
  const PolicyLimits before = wk.policy.limits();
  apply_limits(w);
  const PolicyLimits& now = wk.policy.limits();
  std::fprintf(stderr, "moe-gateway: worker %s is %s (%s): step budget %d -> %d tokens, batch %d -> %d\n",
               wk.name.c_str(), wk.thermal.hot() ? "hot" : "cool again", wk.thermal.why().c_str(),
               before.max_step_tokens, now.max_step_tokens, before.max_batch_sequences, now.max_batch_sequences);
  request_kick();
}

void ContinuousScheduler::apply_limits(size_t w) {
  Worker& wk = workers_[w];
  PolicyLimits lim = wk.base_limits;
  if (wk.thermal.hot()) {
    lim.max_step_tokens = std::min(lim.max_step_tokens, std::max(16, lim.max_step_tokens / 2));
    lim.max_batch_sequences = std::max(1, lim.max_batch_sequences / 2);
  }
  wk.policy.set_limits(lim);
}

bool ContinuousScheduler::ready() const {
  for (const auto& w : workers_)
    if (w.link->ready()) return true;
  return false;
}

int ContinuousScheduler::max_context() const {
  for (size_t i = 0; i < workers_.size(); ++i)
    if (serving(i)) return int(workers_[i].link->worker_hello().max_context);
  for (const auto& w : workers_)
    if (w.link->ready()) return int(w.link->worker_hello().max_context);
  return 0;
}

int ContinuousScheduler::kv_capacity() const {
  int most = 0;
  for (size_t i = 0; i < workers_.size(); ++i)
    if (serving(i)) {
      const PolicyLimits& l = workers_[i].policy.limits();
      most = std::max(most, l.kv_blocks_total * std::max(l.kv_block_tokens, 1));
    }
  return most;
}

bool ContinuousScheduler::may_fit_later(const SequenceState& s, const std::vector<size_t>& candidates,
                                        bool whole) const {
  // A main worker that takes nothing now (down, restarting, under KV
  // pressure) and holds it (whole: all it may generate) by the limits it
  // last said, or never said them.
  for (size_t i = 0; i < workers_.size(); ++i) {
    const Worker& w = workers_[i];
    if (w.fallback || std::find(candidates.begin(), candidates.end(), i) != candidates.end()) continue;
    if (w.base_limits.kv_blocks_total <= 0) return true;
    BatchPolicy probe(w.base_limits);
    if (whole ? probe.holds_all(s) : probe.fits(s)) return true;
  }
  return false;
}

std::string ContinuousScheduler::backend() const {
  for (size_t i = 0; i < workers_.size(); ++i)
    if (serving(i)) return workers_[i].link->worker_hello().backend;
  return "";
}

uint64_t ContinuousScheduler::steps_sent() const {
  uint64_t n = 0;
  for (const auto& w : workers_) n += w.steps_sent;
  return n;
}

SchedulerStats ContinuousScheduler::stats() const {
  SchedulerStats s;
  s.waiting = int(queued_.size());
  for (const SequenceState& q : queued_) s.on_fallback += q.req.on_fallback ? 1 : 0;
  const OverloadView all = overload(INT_MAX);
  s.main_waiting = all.waiting;
  s.main_oldest_wait_ms = all.oldest_wait_ms;
  for (size_t i = 0; i < workers_.size(); ++i) {
    const Worker& w = workers_[i];
    s.waiting += w.policy.waiting();
    s.running += w.policy.running();
    s.kv_blocks_used += w.policy.kv_blocks_used();
    s.preemptions += w.policy.preemptions();
    s.priority_preemptions += w.policy.priority_preemptions();
    s.fairness_preemptions += w.policy.fairness_preemptions();
    s.on_fallback += w.policy.on_fallback();
    if (serving(i)) {
      s.kv_blocks_total += w.policy.limits().kv_blocks_total;
      if (w.fallback) s.degraded = true;
    }
    WorkerStats ws{w.name, w.link->ready(), w.fallback, w.policy.running(), w.policy.waiting(), w.assigned,
                   w.steps_sent};
    ws.have_stats = w.have_stats;
    ws.stats = w.stats;
    ws.hot = w.thermal.hot();
    ws.step_token_budget = w.policy.limits().max_step_tokens;
    ws.batch_limit = w.policy.limits().max_batch_sequences;
    s.workers.push_back(std::move(ws));
  }

  if (PromptExpertPredictor* p = opts_.predictor) {
    const PredictionStats ps = p->stats();
    s.predicting = true;
    s.prediction_requests = ps.requests_scored;
    s.predicted_experts = ps.predicted;
    s.prediction_hits = ps.hits;
    s.prediction_buckets = ps.buckets;
    s.routing_summaries_learned = ps.summaries_learned;
    s.routing_summaries_foreign = ps.summaries_foreign;
    s.warm_hints_sent = warm_hints_sent_;
  }
  s.steps_with_usage = steps_with_usage_;
  s.step_experts = step_experts_;
  s.worker_expert_hits = worker_expert_hits_;
  for (int i = 0; i < 3; ++i) s.worker_pressure[i] = pressure_frames_[i];
  s.worker_expert_misses = worker_expert_misses_;
  return s;
}

OverloadView ContinuousScheduler::overload(int priority) const {
  OverloadView v;
  uint64_t oldest = 0;  // the earliest waiting_since_ms of those counted
  for (const SequenceState& q : queued_) {
    if (q.req.on_fallback || q.req.priority > priority) continue;
    ++v.waiting;
    if (q.req.waiting_since_ms != 0 && (oldest == 0 || q.req.waiting_since_ms < oldest)) oldest = q.req.waiting_since_ms;
  }
  for (const Worker& w : workers_) {
    if (w.fallback) {
      if (w.link->ready()) {
        v.fallback_ready = true;
        v.fallback_max_context = int(w.link->worker_hello().max_context);
      }
      continue;
    }
    w.policy.waiting_at_or_before(priority, &v.waiting, &oldest);
  }
  const uint64_t now = uv_now(loop_);
  if (oldest != 0 && now > oldest) v.oldest_wait_ms = now - oldest;
  return v;
}

uint64_t ContinuousScheduler::submit(SequenceRequest req, SequenceObserver* obs) {
  const uint64_t id = next_seq_id_++;
  observers_[id] = obs;
  SequenceState st;
  st.id = id;
  if (PromptExpertPredictor* p = opts_.predictor) {
    Predicted& pr = predicted_[id];
    pr.prediction = p->predict(req.prompt);
    st.hints.experts = pr.prediction.set;
    st.hints.route_tag = pr.prediction.tag;
  }
  st.req = std::move(req);
  st.req.submitted_ms = std::max<uint64_t>(uv_now(loop_), 1);
  st.req.waiting_since_ms = st.req.submitted_ms;
  queued_.push_back(std::move(st));
  request_kick();
  return id;
}

void ContinuousScheduler::cancel(uint64_t id) {
  observers_.erase(id);
  prediction_done(id);
  auto q = std::find_if(queued_.begin(), queued_.end(), [id](const SequenceState& s) { return s.id == id; });
  if (q != queued_.end()) queued_.erase(q);
  moved_.erase(id);
  if (auto it = owner_.find(id); it != owner_.end()) {
    const size_t w = it->second;
    owner_.erase(it);
    if (workers_[w].policy.cancel(id)) send_releases(w, {id});
  }
  request_kick();  // its blocks may let a waiting request in
}

void ContinuousScheduler::prediction_done(uint64_t id) {
  auto it = predicted_.find(id);
  if (it == predicted_.end()) return;
  Predicted& pr = it->second;
  const bool used = std::any_of(pr.usage.begin(), pr.usage.end(), [](float v) { return v > 0; });
  if (used) {
    opts_.predictor->score(pr.prediction, pr.usage);
    if (opts_.learn_from_replies) opts_.predictor->learn(pr.prediction.bucket, pr.usage);
  }
  predicted_.erase(it);
}

void ContinuousScheduler::send_warm_hints(WorkerLink* link, uint64_t seq_id) {
  auto it = predicted_.find(seq_id);
  if (it == predicted_.end() || !it->second.prediction.known()) return;
  const ExpertPrediction& pred = it->second.prediction;
  // Hints address experts by the model's layer index (docs/protocol.md);
  // the prediction's rows are MoE layers in the worker's moe_layers order.
  const std::vector<uint16_t>& moe_layers = link->worker_hello().experts.moe_layers;
  pr::WarmHints wh;
  wh.seq_id = seq_id;
  const size_t E = size_t(opts_.predictor->n_experts());
  // Rank by rank across layers (every layer's best first), so a worker that
  // can place only some of them places the likeliest of each layer.
  size_t ranks = 0;
  for (const auto& l : pred.experts) ranks = std::max(ranks, l.size());
  for (size_t r = 0; r < ranks; ++r)
    for (size_t l = 0; l < pred.experts.size(); ++l) {
      if (r >= pred.experts[l].size()) continue;
      const int e = pred.experts[l][r];
      const uint16_t layer = l < moe_layers.size() ? moe_layers[l] : uint16_t(l);
      wh.hints.push_back({layer, uint16_t(e), std::clamp(pred.p[l * E + size_t(e)], 0.0f, 1.0f)});
    }
  if (link->send(pr::Message(std::move(wh))).ok()) ++warm_hints_sent_;
}

void ContinuousScheduler::send_releases(size_t w, std::vector<uint64_t> ids) {
  WorkerLink* l = workers_[w].link.get();
  if (!l->ready() || ids.empty()) return;
  pr::ReleaseSequences r;
  r.seq_ids = std::move(ids);
  (void)l->send(pr::Message(std::move(r)));
}

void ContinuousScheduler::request_kick() {
  if (!uv_is_active(reinterpret_cast<uv_handle_t*>(kick_timer_)))
    uv_timer_start(kick_timer_, [](uv_timer_t* t) {
      if (auto* self = static_cast<ContinuousScheduler*>(t->data)) last_resort("planning a step", [self] { self->kick(); });
    }, 0, 0);
}

void ContinuousScheduler::requeue(std::vector<SequenceState> seqs) {
  const uint64_t now = std::max<uint64_t>(uv_now(loop_), 1);
  for (auto it = seqs.rbegin(); it != seqs.rend(); ++it) {
    it->req.waiting_since_ms = now;
    owner_.erase(it->id);
    moved_.insert(it->id);
    queued_.push_front(std::move(*it));
  }
}

void ContinuousScheduler::on_ready(size_t w, const pr::Hello& h) {
  Worker& wk = workers_[w];
  if (supervisor_ && supervisor_->socket_path() == wk.link->socket_path()) supervisor_->note_ready();
  none_ready_since_ms_ = 0;
  uv_timer_stop(wait_timer_);
  expert_view_.set_worker(w, wk.name, h.experts);
  std::fprintf(stderr, "moe-gateway: worker %s ready (%s, %s, %u KV blocks of %u tokens, context %u)%s\n",
               wk.link->socket_path().c_str(), h.model_id.c_str(), h.backend.c_str(), h.kv_blocks_total,
               h.kv_block_tokens, h.max_context, wk.fallback ? ", the fallback" : "");
  // Its KV holds nothing of ours (a fresh connection): plan from its limits.
  PolicyLimits lim;
  lim.max_step_tokens = opts_.max_step_tokens;
  lim.kv_blocks_total = int(h.kv_blocks_total);
  lim.kv_block_tokens = int(h.kv_block_tokens);
  lim.max_context = int(h.max_context);
  lim.headroom_blocks = opts_.headroom_blocks;
  lim.grouped_batching = opts_.grouped_batching;
  lim.grouping_max_skips = opts_.grouping_max_skips;
  lim.priority_max_wait_ms = opts_.priority_max_wait_ms;
  if (h.max_batch_sequences > 0) lim.max_batch_sequences = int(h.max_batch_sequences);
  if (h.max_step_tokens > 0 && int(h.max_step_tokens) < lim.max_step_tokens) lim.max_step_tokens = int(h.max_step_tokens);
  wk.base_limits = lim;
  apply_limits(w);
  request_kick();
}

void ContinuousScheduler::on_down(size_t w, bool unresponsive) {
  Worker& wk = workers_[w];
  expert_view_.drop_worker(w);  // its map goes with it; its next hello brings it back
  // Our own child gone silent (frozen, or stuck in a kernel) would never
  // come back by itself: it is killed, and the supervisor restarts it.
  if (unresponsive && supervisor_ && supervisor_->socket_path() == wk.link->socket_path())
    supervisor_->kill_child("it stopped answering");
  // The worker's KV is gone: the step in flight will never be answered and
  // every sequence it held is recomputed wherever it goes next.
  wk.in_flight = false;
  wk.in_flight_plan = {};
  wk.have_stats = false;
  std::vector<SequenceState> held = wk.policy.take_all();
  // What rode on a lost fallback by overload goes wherever it can now.
  if (wk.fallback)
    for (SequenceState& s : held) s.req.on_fallback = false;
  requeue(std::move(held));
  if (!ready()) none_ready();
  request_kick();
}

void ContinuousScheduler::on_frame(size_t w, const pr::Frame& f) {
  Worker& wk = workers_[w];
  if (pr::Command(f.command) == pr::Command::stats_reply) {
    if (auto r = pr::decode_stats_reply(f.payload); r.ok()) on_stats(w, *r);
    return;
  }
  if (pr::Command(f.command) == pr::Command::pressure) {
    auto p = pr::decode_pressure(f.payload);
    if (!p.ok()) return;
    const int level = int(p->level);
    if (level >= 0 && level < 3) ++pressure_frames_[level];
    std::fprintf(stderr, "moe-gateway: worker %s says %s: %s\n", wk.name.c_str(), pr::pressure_level_name(p->level),
                 p->detail.c_str());
    if (p->level == pr::PressureLevel::break_) {
      // It is about to exit: move its sequences now rather than at the hang-up.
      wk.link->drop("the worker said break: " + p->detail);
      return;
    }
    wk.pressure = std::max(wk.pressure, level + 1);
    return;
  }
  if (!wk.in_flight || f.request_id != wk.in_flight_request) {
    if (pr::Command(f.command) == pr::Command::error) {
      auto e = pr::decode_error(f.payload);
      std::fprintf(stderr, "moe-gateway: worker error: %s\n", e.ok() ? e->message.c_str() : e.error().c_str());
    }
    return;
  }
  std::vector<ChunkResult> results;
  if (pr::Command(f.command) == pr::Command::step_reply) {
    auto reply = pr::decode_step_reply(f.payload);
    if (reply.ok()) {
      // How many distinct experts the step used: what grouped batching lowers.
      std::vector<uint8_t> touched;
      for (const pr::StepResult& r : reply->results) {
        if (touched.size() < r.expert_usage.size()) touched.resize(r.expert_usage.size(), 0);
        for (size_t i = 0; i < r.expert_usage.size(); ++i) touched[i] |= r.expert_usage[i] != 0;
      }
      if (!touched.empty()) {
        ++steps_with_usage_;
        step_experts_ += uint64_t(std::count(touched.begin(), touched.end(), uint8_t(1)));
      }
      // The worker's own count of experts found resident or copied in.
      worker_expert_hits_ += reply->expert_hits;
      worker_expert_misses_ += reply->expert_misses;
      const double kv_total = double(reply->kv_blocks_free) + double(reply->kv_blocks_used);
      if (wk.pressure && kv_total > 0 && reply->kv_blocks_free >= 0.2 * kv_total) {
        wk.pressure = 0;
        request_kick();
      }
      for (const pr::StepResult& r : reply->results) {
        ChunkResult c;
        c.seq_id = r.seq_id;
        c.ok = r.error == pr::ErrorCode::none;
        c.error = r.error_message;
        c.sampled = r.sampled;
        c.token.token = r.token;
        c.token.logprob = r.logprob;
        c.cached_tokens = int(r.cached_tokens);
        if (!r.expert_usage.empty()) expert_view_.on_usage(w, r.expert_usage);
        if (!r.expert_usage.empty()) {
          if (auto it = predicted_.find(r.seq_id); it != predicted_.end()) {
            auto& u = it->second.usage;
            if (u.size() < r.expert_usage.size()) u.resize(r.expert_usage.size(), 0.0f);
            for (size_t i = 0; i < r.expert_usage.size(); ++i) u[i] += float(r.expert_usage[i]);
          }
        }
        for (const auto& t : r.top) c.token.top.emplace_back(t.token, t.logprob);
        results.push_back(std::move(c));
      }
    } else {
      std::fprintf(stderr, "moe-gateway: undecodable step reply: %s\n", reply.error().c_str());
    }
  } else if (pr::Command(f.command) == pr::Command::error) {
    auto e = pr::decode_error(f.payload);
    std::fprintf(stderr, "moe-gateway: the worker refused a step: %s\n", e.ok() ? e->message.c_str() : e.error().c_str());
  }
  // Sequences without a result finish with an error (apply() says so).
  finish_step(w, results);
}

void ContinuousScheduler::finish_step(size_t w, const std::vector<ChunkResult>& results) {
  Worker& wk = workers_[w];
  wk.in_flight = false;
  std::vector<uint64_t> release;
  StepPlan plan = std::move(wk.in_flight_plan);
  wk.in_flight_plan = {};
  auto updates = wk.policy.apply(plan, results, &release);
  for (const SequenceUpdate& u : updates)
    if (u.finished) {
      owner_.erase(u.seq_id);
      prediction_done(u.seq_id);
    }
  send_releases(w, std::move(release));
  kick();  // the next steps go out before observers run their (slower) text work
  dispatch(updates);
}

void ContinuousScheduler::dispatch(std::vector<SequenceUpdate>& updates) {
  for (SequenceUpdate& u : updates) {
    for (const TokenEvent& ev : u.tokens) {
      auto it = observers_.find(u.seq_id);
      if (it == observers_.end()) break;  // cancelled, possibly by the previous token's observer call
      it->second->on_token(ev);
    }
    if (!u.finished) continue;
    auto it = observers_.find(u.seq_id);
    if (it == observers_.end()) continue;
    SequenceObserver* obs = it->second;
    observers_.erase(it);
    obs->on_finished(u.reason, u.error);
  }
}

std::deque<SequenceState>::iterator ContinuousScheduler::give(size_t w, std::deque<SequenceState>::iterator it) {
  Worker& wk = workers_[w];
  owner_[it->id] = w;
  ++wk.assigned;
  const bool ran_before = moved_.erase(it->id) > 0;  // sequences that ran elsewhere go first
  wk.policy.add_resumed(std::move(*it), ran_before);
  return queued_.erase(it);
}

void ContinuousScheduler::assign_queued() {
  // Sequences sent to the fallback by overload go there while it is ready;
  // without it they are ordinary sequences again.
  int fallback = -1;
  for (size_t i = 0; i < workers_.size(); ++i)
    if (workers_[i].fallback && workers_[i].link->ready()) fallback = int(i);
  for (auto it = queued_.begin(); it != queued_.end();) {
    if (!it->req.on_fallback) {
      ++it;
      continue;
    }
    if (fallback < 0 || !workers_[size_t(fallback)].policy.fits(*it)) {
      it->req.on_fallback = false;
      ++it;
      continue;
    }
    it = give(size_t(fallback), it);
  }
  std::vector<size_t> candidates;
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (workers_[i].pressure && workers_[i].policy.demand_blocks() == 0) workers_[i].pressure = 0;
    if (serving(i) && !workers_[i].pressure) candidates.push_back(i);  // KV pressure: admit nothing new
  }
  if (candidates.empty() && !queued_.empty()) {
    // Every serving worker is under KV pressure: a sequence of an earlier
    // priority than some a worker holds still goes there, where it may
    // preempt them (docs/operations.md); the rest wait here.
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (!serving(i) || !workers_[i].pressure || workers_[i].policy.running() + workers_[i].policy.waiting() == 0)
        continue;
      const int worst = workers_[i].policy.latest_priority();
      for (auto it = queued_.begin(); it != queued_.end();) it = it->req.priority < worst ? give(i, it) : it + 1;
    }
    return;
  }
  if (candidates.empty() || queued_.empty()) return;

  // Each worker as the choice sees it: its resident experts (from Redis) and
  // its load, which grows with every sequence given to it in this round.
  const PromptExpertPredictor* p = opts_.predictor;
  std::map<std::string, std::string> resident;
  if (p && opts_.resident_sets && candidates.size() > 1) resident = opts_.resident_sets();
  std::vector<WorkerCandidate> view;
  std::vector<double> demand, total;
  for (size_t i : candidates) {
    const Worker& wk = workers_[i];
    WorkerCandidate c;
    c.name = wk.name;
    if (auto r = resident.find(wk.name); r != resident.end())
      c.resident = parse_resident_set(r->second, p->n_layers(), p->n_experts());
    view.push_back(std::move(c));
    demand.push_back(wk.policy.demand_blocks());
    total.push_back(std::max(wk.policy.limits().kv_blocks_total, 1));
  }
  const ExpertPrediction none;
  std::vector<std::vector<SequenceState>> moved(candidates.size()), fresh(candidates.size());
  std::deque<SequenceState> later;  // no serving worker holds them; one that may is down
  while (!queued_.empty()) {
    SequenceState s = std::move(queued_.front());
    queued_.pop_front();
    // The workers that hold all it may generate. Else a stream already
    // under way (moved off a lost worker) waits for a main worker that
    // would (one restarting while a smaller fallback serves: a pause, not
    // a cut); a fresh one takes the largest that holds its prompt (it ends
    // there with "length" when full). None at all: it waits for a worker
    // that may hold it (down, or under KV pressure); with none anywhere it
    // goes to the largest, whose policy ends it.
    std::vector<size_t> fit;
    for (size_t j = 0; j < candidates.size(); ++j)
      if (workers_[candidates[j]].policy.holds_all(s)) fit.push_back(j);
    if (fit.empty() && !s.generated.empty() && may_fit_later(s, candidates, true)) {
      later.push_back(std::move(s));
      continue;
    }
    if (fit.empty())
      for (size_t j = 0; j < candidates.size(); ++j)
        if (workers_[candidates[j]].policy.fits(s) && (fit.empty() || total[j] > total[fit[0]])) fit.assign(1, j);
    if (fit.empty()) {
      if (may_fit_later(s, candidates, false)) {
        later.push_back(std::move(s));
        continue;
      }
      size_t largest = 0;
      for (size_t j = 1; j < candidates.size(); ++j)
        if (total[j] > total[largest]) largest = j;
      fit.push_back(largest);
    }
    size_t k = fit[0];
    if (fit.size() > 1) {
      std::vector<WorkerCandidate> among;
      for (size_t j : fit) {
        among.push_back(view[j]);
        among.back().load = std::min(1.0, demand[j] / total[j]);
      }
      auto pi = predicted_.find(s.id);
      const int chosen = choose_worker(pi != predicted_.end() ? pi->second.prediction : none,
                                       p ? size_t(p->n_experts()) : 0, among, opts_.choice);
      k = fit[chosen < 0 ? 0 : size_t(chosen)];
    }
    const Worker& wk = workers_[candidates[k]];
    const int bt = std::max(wk.policy.limits().kv_block_tokens, 1);
    demand[k] += double(s.req.prompt.size() + s.generated.size() + size_t(bt) - 1) / bt;
    // Sequences that ran elsewhere go first, as a lost worker's would.
    (moved_.erase(s.id) ? moved : fresh)[k].push_back(std::move(s));
  }
  queued_ = std::move(later);
  for (size_t k = 0; k < candidates.size(); ++k) {
    Worker& wk = workers_[candidates[k]];
    for (auto it = moved[k].rbegin(); it != moved[k].rend(); ++it) {
      owner_[it->id] = candidates[k];
      ++wk.assigned;
      wk.policy.add_resumed(std::move(*it), true);
    }
    for (SequenceState& s : fresh[k]) {
      owner_[s.id] = candidates[k];
      ++wk.assigned;
      wk.policy.add_resumed(std::move(s), false);
    }
  }
}

void ContinuousScheduler::kick() {
  if (const std::string why = failing(); !why.empty()) return end_waiting(why);
  // A main worker is ready again while the fallback holds sequences: they are
  // released there and recomputed on the main workers, as after a lost worker.
  bool main_ready = false;
  for (const Worker& w : workers_) main_ready |= !w.fallback && w.link->ready();
  for (size_t i = 0; i < workers_.size() && main_ready; ++i) {
    Worker& fb = workers_[i];
    if (!fb.fallback || fb.in_flight || fb.policy.running() + fb.policy.waiting() == fb.policy.on_fallback()) continue;
    std::fprintf(stderr, "moe-gateway: a main worker is back; leaving %s\n", fb.link->socket_path().c_str());
    std::vector<uint64_t> released;
    std::vector<SequenceState> back =
        fb.policy.take_if([](const SequenceRequest& r) { return !r.on_fallback; }, &released);
    send_releases(i, std::move(released));
    requeue(std::move(back));
  }
  assign_queued();
  rebalance();
  for (size_t i = 0; i < workers_.size(); ++i)
    if (!workers_[i].in_flight && stepping(i)) step(i);
}

void ContinuousScheduler::rebalance() {
  for (size_t i = 0; i < workers_.size(); ++i) {
    Worker& idle = workers_[i];
    if (!serving(i) || idle.in_flight || idle.policy.running() + idle.policy.waiting() > 0) continue;
    size_t busiest = i;
    for (size_t j = 0; j < workers_.size(); ++j)
      if (j != i && serving(j) && workers_[j].policy.waiting() > (busiest == i ? 0 : workers_[busiest].policy.waiting()))
        busiest = j;
    if (busiest == i) continue;
    // The younger half: what would wait longest where it is. At least one.
    const size_t n = (size_t(workers_[busiest].policy.waiting()) + 1) / 2;
    // Only what it holds as well as the busy one would: never a sequence
    // it would cut short.
    const BatchPolicy& here = idle.policy;
    const BatchPolicy& there = workers_[busiest].policy;
    auto takes = [&](const SequenceState& q) {
      if (!here.fits(q)) return false;
      if (here.holds_all(q)) return true;
      return !there.holds_all(q) && here.limits().kv_blocks_total >= there.limits().kv_blocks_total;
    };
    for (SequenceState& s : workers_[busiest].policy.take_waiting(n, takes)) {
      owner_[s.id] = i;
      ++idle.taken_over;
      idle.policy.add_resumed(std::move(s), false);
    }
  }
}

void ContinuousScheduler::step(size_t w) {
  Worker& wk = workers_[w];
  WorkerLink* link = wk.link.get();
  std::vector<SequenceUpdate> rejected;
  StepPlan plan = wk.policy.plan(&rejected, uv_now(loop_));
  send_releases(w, plan.release);
  for (const SequenceUpdate& u : rejected) {
    owner_.erase(u.seq_id);
    prediction_done(u.seq_id);
  }
  if (!plan.chunks.empty()) {
    // Warm hints go first, on the same socket, so the worker has them before
    // the step that prefills the sequence from its start.
    if (opts_.predictor && opts_.warm_hints)
      for (const PlannedChunk& c : plan.chunks)
        if (c.start_pos == 0) send_warm_hints(link, c.seq_id);
    for (const PlannedChunk& c : plan.chunks)
      if (c.start_pos == 0)
        if (auto pi = predicted_.find(c.seq_id); pi != predicted_.end() && pi->second.prediction.known())
          expert_view_.on_prediction(w, pi->second.prediction.set);
    pr::StepRequest req;
    // Each expert's use per sequence: for prediction and Redis, or while the
    // experts page is watched.
    req.report_expert_usage = opts_.report_expert_usage || expert_view_.watched(uv_now(loop_));
    for (const PlannedChunk& c : plan.chunks) {
      pr::StepSequence s;
      s.seq_id = c.seq_id;
      s.tokens = c.tokens;
      s.start_pos = uint32_t(c.start_pos);
      s.sample = c.sample;
      s.route_bucket = c.route_tag;
      // Sampling parameters travel with every chunk; the worker keeps none.
      s.sampling = c.sampling;
      req.sequences.push_back(std::move(s));
    }
    auto id = link->send(pr::Message(std::move(req)));
    if (id.ok()) {
      wk.in_flight = true;
      wk.in_flight_request = *id;
      wk.in_flight_plan = std::move(plan);
      ++wk.steps_sent;
    } else {
      // The link failed under us; its on_down moves the sequences elsewhere.
      std::fprintf(stderr, "moe-gateway: cannot send a step: %s\n", id.error().c_str());
      wk.policy.worker_lost();
    }
  }
  dispatch(rejected);
}

}  // namespace moe::gw
