#pragma once
// Warm profiles in the worker (residency/routing_profile.h): --warm-profile
// fills the free islands with a profile's most used experts before the
// worker says hello; --save-profile writes the worker's own expert use to a
// profile file every interval and when the worker stops.

#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <string>
#include <vector>

#include "model/result.h"
#include "residency/routing_profile.h"
#include "worker/backend.h"
#include "worker/worker_server.h"

namespace moe::worker {

// The routing shape of the backend's model, as a profile counts it.
RoutingProfile empty_profile_of(const Backend& backend);

struct ProfileWarm {
  size_t asked = 0;        // experts offered (the free islands' worth, most used first)
  size_t resident = 0;     // of those, resident after warming
  size_t already = 0;      // the profile's experts resident before (the re-warm from Redis)
  uint32_t islands = 0;    // islands in all (0: every expert has one, nothing to warm)
  double coverage = 0;     // share of the profile's uses the experts offered and already resident served
  double ms = 0;
};
// Reads `path`, checks it against the backend's model and warms. An
// unreadable file or another model's profile is an error naming why.
Result<ProfileWarm> warm_from_profile(Backend& backend, const std::string& path);

// The periodic writes run on a thread of their own (with a copy of the
// counts), so the step thread never waits on the disk; the last one, at
// exit, on the caller's.
class ProfileSaver final : public StepHooks {
 public:
  // Counts start from `path`'s profile when it holds one of this model's
  // shape (a restart adds to the history instead of replacing it), else
  // from zero.
  // Turns the backend's expert-use counting on.
  ProfileSaver(std::string path, Backend& backend, std::string source,
               std::chrono::milliseconds interval);
  ~ProfileSaver() override;
  void after_step(const protocol::StepRequest& req, const protocol::StepReply& reply) override;
  void released(uint64_t) override {}
  // Writes now, after any write in flight (the step thread, or after it
  // has stopped).
  Status save();
  const std::string& path() const { return path_; }
  bool continued() const { return continued_; }

 private:
  std::string path_;
  const Backend& backend_;
  RoutingProfile base_;
  bool continued_ = false;
  std::chrono::milliseconds interval_;
  std::chrono::steady_clock::time_point next_;
  uint64_t saved_tokens_ = ~uint64_t(0);
  std::thread writer_;                  // the periodic write in flight, if any
  std::shared_ptr<std::string> failed_;  // its error ("" when it succeeded), read after joining
  bool warned_ = false;
  RoutingProfile snapshot() const;
  void join_writer();
};

}  // namespace moe::worker
