#include "worker/warm_profile.h"

#include <cstdio>
#include <filesystem>
#include <set>
#include <utility>

#include "protocol/messages.h"

namespace moe::worker {

RoutingProfile empty_profile_of(const Backend& backend) {
  const protocol::Hello h = backend.describe();
  const std::vector<int> layers(h.experts.moe_layers.begin(), h.experts.moe_layers.end());
  RoutingProfile p = RoutingProfile::shaped(layers, int(h.experts.n_experts), int(h.experts.top_k));
  p.model = h.model_id;
  return p;
}

Result<ProfileWarm> warm_from_profile(Backend& backend, const std::string& path) {
  const auto t0 = std::chrono::steady_clock::now();
  auto prof = read_routing_profile(path);
  if (!prof.ok()) return make_error(prof.error());
  const RoutingProfile shape = empty_profile_of(backend);
  if (const std::string why = prof->mismatch(shape.model_layers, shape.n_experts); !why.empty())
    return make_error("routing profile " + path + " is not of this model's shape: " + why);
  // The policy's prior first: the first prompts then evict the profile's
  // cold experts before its hot ones.
  if (prof->tokens > 0)
    for (int ml = 0; ml < prof->n_moe_layers(); ++ml) backend.seed_residency(ml, prof->rates(ml));
  protocol::StatsReply st;
  backend.fill_expert_stats(st);
  ProfileWarm w;
  // Islands for every expert (a resident CUDA engine): nothing to warm.
  const uint64_t experts = uint64_t(shape.n_moe_layers()) * uint64_t(shape.n_experts);
  w.islands = uint64_t(st.islands_total) >= experts ? 0 : st.islands_total;
  const std::vector<ExpertKey> order = prof->warm_order();
  // Offer what the free islands hold (all of it when the backend keeps
  // every expert resident: it then reports no islands and warms nothing).
  const size_t room = w.islands == 0 ? 0 : size_t(st.islands_total - std::min(st.islands_used, st.islands_total));
  // Those already resident (the re-warm from Redis) take no free island.
  std::set<std::pair<int, int>> resident;
  for (const protocol::ExpertRef& r : backend.resident()) resident.insert({int(r.layer), int(r.expert)});
  std::vector<protocol::ExpertRef> refs;
  size_t held = 0;  // the profile's experts resident after the warm (those first in its order)
  for (const ExpertKey& k : order) {
    const int layer = prof->model_layers[size_t(k.layer)];
    if (resident.count({layer, k.expert})) {
      ++held;
      continue;
    }
    if (refs.size() >= room) break;
    refs.push_back({uint16_t(layer), uint16_t(k.expert)});
  }
  w.asked = refs.size();
  w.already = held;
  w.coverage = prof->coverage(refs.size() + held);
  w.resident = refs.empty() ? 0 : backend.warm(refs);
  backend.wait_for_copies();
  w.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return w;
}

ProfileSaver::ProfileSaver(std::string path, Backend& backend, std::string source,
                           std::chrono::milliseconds interval)
    : path_(std::move(path)), backend_(backend), base_(empty_profile_of(backend)), interval_(interval) {
  backend.count_expert_use(true);
  std::error_code ec;
  if (std::filesystem::exists(path_, ec)) {
    auto old = read_routing_profile(path_);
    if (old.ok() && old->mismatch(base_.model_layers, base_.n_experts).empty()) {
      base_.counts = old->counts;
      base_.tokens = old->tokens;
      continued_ = true;
    } else {
      std::fprintf(stderr, "moe-worker: --save-profile %s: the file there is %s; it will be replaced\n",
                   path_.c_str(), old.ok() ? "another model's profile" : old.error().c_str());
    }
  }
  base_.source = std::move(source);
  next_ = std::chrono::steady_clock::now() + interval_;
}

ProfileSaver::~ProfileSaver() { join_writer(); }

void ProfileSaver::join_writer() {
  if (!writer_.joinable()) return;
  writer_.join();
  if (failed_ && !failed_->empty() && !warned_) {
    std::fprintf(stderr, "moe-worker: saving the routing profile: %s (will try again)\n", failed_->c_str());
    warned_ = true;
  } else if (failed_ && failed_->empty()) {
    warned_ = false;
  }
  failed_.reset();
}

RoutingProfile ProfileSaver::snapshot() const {
  RoutingProfile p = base_;
  p.add(backend_.expert_use(), backend_.expert_use_tokens());
  return p;
}

void ProfileSaver::after_step(const protocol::StepRequest&, const protocol::StepReply&) {
  const auto now = std::chrono::steady_clock::now();
  if (now < next_) return;
  next_ = now + interval_;
  const uint64_t tokens = backend_.expert_use_tokens();
  if (tokens == saved_tokens_) return;  // nothing new since the last write
  join_writer();  // the last one finished long ago, an interval back
  saved_tokens_ = tokens;
  auto failed = std::make_shared<std::string>();
  failed_ = failed;
  writer_ = std::thread([p = snapshot(), path = path_, failed] {
    if (Status s = write_routing_profile(path, p); !s.ok()) *failed = s.error();
  });
}

Status ProfileSaver::save() {
  join_writer();
  const uint64_t tokens = backend_.expert_use_tokens();
  if (tokens == saved_tokens_ && !warned_) return {};  // nothing new since the last good write
  MOE_TRY(write_routing_profile(path_, snapshot()));
  saved_tokens_ = tokens;
  return {};
}

}  // namespace moe::worker
