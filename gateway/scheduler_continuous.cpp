#include "gateway/scheduler_continuous.h"

#include <algorithm>
#include <cstdio>
#include <variant>

namespace moe::gw {

namespace pr = moe::protocol;

ContinuousScheduler::ContinuousScheduler(uv_loop_t* loop, std::vector<std::string> worker_sockets,
                                         ContinuousSchedulerOptions opts)
    : loop_(loop), opts_(std::move(opts)) {
  kick_timer_ = new uv_timer_t;
  uv_timer_init(loop_, kick_timer_);
  kick_timer_->data = this;
  for (size_t i = 0; i < worker_sockets.size(); ++i) {
    WorkerLinkOptions lo = opts_.link;
    lo.socket_path = worker_sockets[i];
    WorkerLink::Callbacks cb;
    cb.on_ready = [this, i](const pr::Hello& h) { on_ready(i, h); };
    cb.on_frame = [this, i](const pr::Frame& f) { on_frame(i, f); };
    cb.on_down = [this, i](const std::string&) { on_down(i); };
    links_.push_back(std::make_unique<WorkerLink>(loop_, lo, std::move(cb)));
  }
  for (auto& l : links_) l->start();
}

ContinuousScheduler::~ContinuousScheduler() {
  kick_timer_->data = nullptr;
  uv_close(reinterpret_cast<uv_handle_t*>(kick_timer_), [](uv_handle_t* h) { delete reinterpret_cast<uv_timer_t*>(h); });
  links_.clear();
  supervisor_.reset();
}

WorkerLink* ContinuousScheduler::active_link() const {
  return active_ >= 0 && links_[size_t(active_)]->ready() ? links_[size_t(active_)].get() : nullptr;
}

bool ContinuousScheduler::ready() const {
  for (const auto& l : links_)
    if (l->ready()) return true;
  return false;
}

int ContinuousScheduler::max_context() const {
  if (WorkerLink* l = active_link()) return int(l->worker_hello().max_context);
  for (const auto& l : links_)
    if (l->ready()) return int(l->worker_hello().max_context);
  return 0;
}

SchedulerStats ContinuousScheduler::stats() const {
  SchedulerStats s;
  s.waiting = policy_.waiting();
  s.running = policy_.running();
  s.kv_blocks_used = policy_.kv_blocks_used();
  s.kv_blocks_total = policy_.limits().kv_blocks_total;
  s.preemptions = policy_.preemptions();
  s.degraded = active_ > 0;
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
  return s;
}

uint64_t ContinuousScheduler::submit(SequenceRequest req, SequenceObserver* obs) {
  const uint64_t id = next_seq_id_++;
  observers_[id] = obs;
  SequenceHints hints;
  if (PromptExpertPredictor* p = opts_.predictor) {
    Predicted& pr = predicted_[id];
    pr.prediction = p->predict(req.prompt);
    hints.experts = pr.prediction.set;
    hints.route_tag = pr.prediction.tag;
  }
  policy_.add(id, std::move(req), std::move(hints));
  request_kick();
  return id;
}

void ContinuousScheduler::cancel(uint64_t id) {
  observers_.erase(id);
  prediction_done(id);
  if (policy_.cancel(id)) send_releases({id});
  request_kick();  // its blocks may let a waiting request in
}

void ContinuousScheduler::send_releases(std::vector<uint64_t> ids) {
  WorkerLink* l = active_link();
  if (!l || ids.empty()) return;
  pr::ReleaseSequences r;
  r.seq_ids = std::move(ids);
  (void)l->send(pr::Message(std::move(r)));
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
  // Rank by rank across layers (every layer's best first), so a worker that
  // can place only some of them places the likeliest of each layer.
  // Hints address experts by the model's layer index (docs/protocol.md);
  // the prediction's rows are MoE layers in the worker's moe_layers order.
  const std::vector<uint16_t>& moe_layers = link->worker_hello().experts.moe_layers;
  pr::WarmHints wh;
  wh.seq_id = seq_id;
  const size_t E = size_t(opts_.predictor->n_experts());
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

void ContinuousScheduler::request_kick() {
  if (!uv_is_active(reinterpret_cast<uv_handle_t*>(kick_timer_)))
    uv_timer_start(kick_timer_, [](uv_timer_t* t) {
      if (auto* self = static_cast<ContinuousScheduler*>(t->data)) self->kick();
    }, 0, 0);
}

void ContinuousScheduler::on_ready(size_t link, const pr::Hello& h) {
  std::fprintf(stderr, "moe-gateway: worker %s ready (%s, %s, %u KV blocks of %u tokens, context %u)\n",
               links_[link]->socket_path().c_str(), h.model_id.c_str(), h.backend.c_str(), h.kv_blocks_total,
               h.kv_block_tokens, h.max_context);
  request_kick();
}

void ContinuousScheduler::on_down(size_t link) {
  if (int(link) != active_) return;
  // The worker's KV is gone: the step in flight will never be answered and
  // every admitted sequence is recomputed wherever we serve next.
  in_flight_ = false;
  in_flight_plan_ = {};
  policy_.worker_lost();
  active_ = -1;
  request_kick();
}

void ContinuousScheduler::on_frame(size_t link, const pr::Frame& f) {
  if (int(link) != active_ || !in_flight_ || f.request_id != in_flight_request_) {
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
      for (const pr::StepResult& r : reply->results) {
        ChunkResult c;
        c.seq_id = r.seq_id;
        c.ok = r.error == pr::ErrorCode::none;
        c.error = r.error_message;
        c.sampled = r.sampled;
        c.token.token = r.token;
        c.token.logprob = r.logprob;
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
  finish_step(results);
}

void ContinuousScheduler::finish_step(const std::vector<ChunkResult>& results) {
  in_flight_ = false;
  std::vector<uint64_t> release;
  StepPlan plan = std::move(in_flight_plan_);
  in_flight_plan_ = {};
  auto updates = policy_.apply(plan, results, &release);
  for (const SequenceUpdate& u : updates)
    if (u.finished) prediction_done(u.seq_id);
  send_releases(std::move(release));
  kick();  // the next step goes out before observers run their (slower) text work
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

void ContinuousScheduler::kick() {
  if (in_flight_) return;
  // Failover hook: a more preferred worker said hello again while a later one
  // (the fallback) serves. What runs here is released and recomputed there,
  // the same way as after a lost worker, so new and running requests move back.
  for (int i = 0; i < active_; ++i) {
    if (!links_[size_t(i)]->ready()) continue;
    std::fprintf(stderr, "moe-gateway: worker %s is back; leaving %s\n", links_[size_t(i)]->socket_path().c_str(),
                 links_[size_t(active_)]->socket_path().c_str());
    send_releases(policy_.running_ids());
    policy_.worker_lost();
    active_ = -1;
    break;
  }
  WorkerLink* link = active_link();
  if (!link) {
    // Serve from the most preferred ready worker; its KV holds nothing of ours.
    for (size_t i = 0; i < links_.size(); ++i) {
      if (!links_[i]->ready()) continue;
      if (active_ >= 0) policy_.worker_lost();
      active_ = int(i);
      link = links_[i].get();
      const pr::Hello& h = link->worker_hello();
      PolicyLimits lim;
      lim.max_step_tokens = opts_.max_step_tokens;
      lim.kv_blocks_total = int(h.kv_blocks_total);
      lim.kv_block_tokens = int(h.kv_block_tokens);
      lim.max_context = int(h.max_context);
      lim.headroom_blocks = opts_.headroom_blocks;
      lim.grouped_batching = opts_.grouped_batching;
      lim.grouping_max_skips = opts_.grouping_max_skips;
      if (h.max_batch_sequences > 0) lim.max_batch_sequences = int(h.max_batch_sequences);
      if (h.max_step_tokens > 0 && int(h.max_step_tokens) < lim.max_step_tokens) lim.max_step_tokens = int(h.max_step_tokens);
      policy_.set_limits(lim);
      break;
    }
    if (!link) return;
  }
  std::vector<SequenceUpdate> rejected;
  StepPlan plan = policy_.plan(&rejected);
  send_releases(plan.release);
  for (const SequenceUpdate& u : rejected) prediction_done(u.seq_id);
  if (!plan.chunks.empty()) {
    // Warm hints go first, on the same socket, so the worker has them before
    // the step that prefills the sequence from its start.
    if (opts_.predictor && opts_.warm_hints)
      for (const PlannedChunk& c : plan.chunks)
        if (c.start_pos == 0) send_warm_hints(link, c.seq_id);
    pr::StepRequest req;
    req.report_expert_usage = opts_.report_expert_usage;
    for (const PlannedChunk& c : plan.chunks) {
      pr::StepSequence s;
      s.seq_id = c.seq_id;
      s.tokens = c.tokens;
      s.start_pos = uint32_t(c.start_pos);
      s.sample = c.sample;
      s.route_bucket = c.route_tag;
      // Sampling parameters travel with every chunk; the worker keeps none.
      s.sampling.temperature = c.sampling.temperature;
      s.sampling.top_p = c.sampling.top_p;
      s.sampling.top_k = uint32_t(std::max(c.sampling.top_k, 0));
      s.sampling.seed = c.sampling.seed;
      s.sampling.logprobs = c.sampling.logprobs;
      s.sampling.top_logprobs = uint8_t(std::clamp(c.sampling.top_logprobs, 0, int(pr::kMaxTopLogprobs)));
      req.sequences.push_back(std::move(s));
    }
    auto id = link->send(pr::Message(std::move(req)));
    if (id.ok()) {
      in_flight_ = true;
      in_flight_request_ = *id;
      in_flight_plan_ = std::move(plan);
      ++steps_sent_;
    } else {
      // The link failed under us; its on_down resets the policy.
      std::fprintf(stderr, "moe-gateway: cannot send a step: %s\n", id.error().c_str());
      policy_.worker_lost();
    }
  }
  dispatch(rejected);
}

}  // namespace moe::gw
