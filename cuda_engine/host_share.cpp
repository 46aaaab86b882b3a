#include "cuda_engine/host_share.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <tuple>

#include "kernels/cpu/activation.h"
#include "model/safetensors.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MOE_SPIN_PAUSE() _mm_pause()
#else
#define MOE_SPIN_PAUSE() ((void)0)
#endif

namespace moe {

namespace {
// Spinning, then yielding the core: a thread the system has descheduled
// (more runnable threads than cores) gets to run instead of a phase waiting
// a whole time slice for it.
struct Backoff {
  int spins = 0;
  void wait() {
    if (++spins < 256) {
      MOE_SPIN_PAUSE();
    } else {
      std::this_thread::yield();
    }
  }
};
}  // namespace

std::vector<uint16_t> share_rows_table(int max_pairs, int inter, int step, double link_us, double host_us,
                                       double fixed_us) {
  std::vector<uint16_t> rows(size_t(max_pairs) + 1, 0);
  for (int m = 1; m <= max_pairs; ++m) {
    double best = m * link_us;
    for (int r = step; r <= inter; r = r + step > inter && r < inter ? inter : r + step) {
      const double f = double(r) / inter;
      const double t = std::max(m * (1 - f) * link_us, fixed_us + m * f * host_us);
      if (t < best) {
        best = t;
        rows[size_t(m)] = uint16_t(r);
      }
    }
  }
  return rows;
}

HostShare::HostShare(const ExpertLayout& layout, int layers, int n_experts, std::vector<const uint8_t*> blobs,
                     ShareMemory mem, int threads)
    : layout_(layout), layers_(layers), n_experts_(n_experts), blobs_(std::move(blobs)), mem_(mem) {
  const int n = std::max(1, threads);
  rows_.assign(size_t(n), std::vector<float>(size_t(layout_.hidden)));
  taken_.resize(size_t(layers));
  taken_rows_.assign(size_t(layers), 0);
  layer_us_.assign(size_t(layers), 0);
  for (int i = 1; i < n; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
  leader_ = std::thread([this] { leader_loop(); });
}

HostShare::~HostShare() {
  abandon_ = true;
  {
    std::lock_guard<std::mutex> lk(mu_);
    quit_ = true;
  }
  cv_.notify_all();
  leader_.join();
  for (std::thread& w : workers_) w.join();
}

void HostShare::begin(uint32_t pass) {
  abandon_ = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    awake_ = true;  // workers spin from now on
    want_ = pass;
  }
  cv_.notify_all();
}

void HostShare::end(bool ok) {
  if (!ok) abandon_ = true;
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return finished_ == want_; });
  awake_ = false;
  if (!ok) return;
  // The pass is over on both sides: the GPU's waits are written.
  for (int l = 0; l < layers_; ++l) {
    if (taken_[size_t(l)].empty()) continue;
    const double wait = double(std::atomic_ref<uint64_t>(mem_.slots[l].waited_ns).load()) / 1000.0;
    ++times_.layers;
    times_.host_us += layer_us_[size_t(l)];
    times_.gpu_wait_us += wait;
    times_.max_wait_us = std::max(times_.max_wait_us, wait);
    times_.stalls += wait > kShareStallUs;
  }
}

void HostShare::leader_loop() {
  for (;;) {
    uint32_t pass = 0;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return quit_ || want_ != finished_; });
      if (quit_) return;
      pass = want_;
    }
    serve(pass);
    {
      std::lock_guard<std::mutex> lk(mu_);
      finished_ = pass;
    }
    cv_.notify_all();
  }
}

void HostShare::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    Backoff b;
    while (epoch_.load(std::memory_order_acquire) == seen) {
      if (quit_) return;
      if (awake_.load(std::memory_order_relaxed)) {
        b.wait();
        continue;
      }
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return quit_ || awake_ || epoch_.load() != seen; });
    }
    seen = epoch_.load(std::memory_order_acquire);
    job_call_(job_, index, threads());
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

template <typename Fn>
void HostShare::on_all(Fn&& fn) {
  using F = std::remove_reference_t<Fn>;
  job_ = &fn;
  job_call_ = [](const void* f, int i, int n) { (*static_cast<const F*>(f))(i, n); };
  pending_.store(int(workers_.size()), std::memory_order_relaxed);
  epoch_.fetch_add(1, std::memory_order_release);
  if (!awake_.load()) {
    std::lock_guard<std::mutex> lk(mu_);  // a sleeping worker re-checks the epoch under the lock
  }
  cv_.notify_all();
  fn(0, threads());
  Backoff b;
  while (pending_.load(std::memory_order_acquire) != 0) b.wait();
}

void HostShare::serve(uint32_t pass) {
  const size_t H = size_t(layout_.hidden);
  for (auto& t : taken_) t.clear();
  std::fill(taken_rows_.begin(), taken_rows_.end(), 0);
  for (int l = 0; l < layers_; ++l) {
    ShareSlot& s = mem_.slots[l];
    std::atomic_ref<uint32_t> posted(s.posted);
    Backoff b;
    while (posted.load(std::memory_order_acquire) != pass) {
      if (abandon_.load(std::memory_order_relaxed)) return;
      b.wait();
    }
    const int count = int(std::min<uint32_t>(s.count, kShareMaxPairs));
    const int rows = int(std::min<uint32_t>(s.rows, uint32_t(layout_.inter)));
    const int tokens = int(std::clamp<uint32_t>(s.tokens, 1, kShareMaxTokens));
    if (count > 0 && rows > 0) {
      const auto t0 = std::chrono::steady_clock::now();
      const size_t at = size_t(l) * kShareMaxTokens * H;
      compute(l, s.expert, s.token, s.weight, count, rows, tokens, mem_.x + at, mem_.sum + at);
      layer_us_[size_t(l)] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      served_ += uint64_t(count);
      std::vector<int32_t>& taken = taken_[size_t(l)];
      for (int p = 0; p < count; ++p)
        if (std::find(taken.begin(), taken.end(), s.expert[p]) == taken.end()) taken.push_back(s.expert[p]);
      taken_rows_[size_t(l)] = rows;
    }
    std::atomic_ref<uint32_t>(s.done).store(pass, std::memory_order_release);
  }
}

void HostShare::compute(int layer, const int32_t* experts, const uint8_t* token_of, const float* weights, int count,
                        int rows, int tokens, const uint16_t* x_bf16, float* sum) {
  const int H = layout_.hidden, I = layout_.inter;
  xf_.resize(size_t(tokens) * H);
  for (size_t i = 0; i < size_t(tokens) * H; ++i) xf_[i] = bf16_to_f32(x_bf16[i]);
  h_.resize(size_t(count) * I);
  g_.resize(size_t(count) * I);
  // Each token's group sums, once for every chunk of the layer (gate and up
  // read the same x: one set of sums serves both when their groups agree).
  const int gate_groups = H / layout_.gate.group, up_groups = H / layout_.up.group;
  const int down_groups = I / layout_.down.group;
  const bool own_up = layout_.up.group != layout_.gate.group;
  sums_.resize(size_t(tokens) * (gate_groups + (own_up ? up_groups : 0)) + size_t(count) * down_groups);
  float* gate_sums = sums_.data();                                                 // [tokens, gate_groups]
  float* up_sums = own_up ? gate_sums + size_t(tokens) * gate_groups : gate_sums;  // [tokens, up_groups]
  float* down_sums = up_sums + size_t(tokens) * up_groups;                         // [count, down_groups]
  for (int t = 0; t < tokens; ++t) {
    q4_group_sums(layout_.gate, xf_.data() + size_t(t) * H, 0, gate_sums + size_t(t) * gate_groups);
    if (own_up) q4_group_sums(layout_.up, xf_.data() + size_t(t) * H, 0, up_sums + size_t(t) * up_groups);
  }
  auto blob = [&](int p) {
    const int e = std::clamp(int(experts[p]), 0, n_experts_ - 1);
    return blobs_[size_t(layer) * size_t(n_experts_) + size_t(e)];
  };
  auto token = [&](int p) { return std::min(int(token_of[p]), tokens - 1); };
  // Each phase is cut into chunks the threads claim as they go: a thread the
  // system holds up delays its phase by one chunk, not by a fixed slice
  // (on the GPU machine fixed slices left the GPU waiting 0.7-1.4 ms a
  // token and gave 114-121 tok/s where chunks give 129, Qwen3 at 12 GiB).
  constexpr int kUpChunk = 16, kDownChunk = 32;
  const auto claim = [&](int total, int chunk) -> std::pair<int, int> {
    const int a = std::min(total, next_chunk_.fetch_add(chunk, std::memory_order_relaxed));
    return {a, std::min(total, a + chunk)};
  };
  // gate and up rows [0, rows) of every pair, then h = silu(gate) * up.
  const auto up_rows = [&](int a, int b) {
    for (int r = a; r < b;) {
      const int p = r / rows, r0 = r % rows, r1 = std::min(rows, r0 + (b - r));
      const int t = token(p);
      const float* x = xf_.data() + size_t(t) * H;
      float* g = g_.data() + size_t(p) * I;
      float* h = h_.data() + size_t(p) * I;
      q4_matvec_rows_summed(blob(p), layout_.gate, x, gate_sums + size_t(t) * gate_groups, r0, r1, g);
      q4_matvec_rows_summed(blob(p), layout_.up, x, up_sums + size_t(t) * up_groups, r0, r1, h);
      cpu::silu_mul(g + r0, h + r0, h + r0, r1 - r0);
      r += r1 - r0;
    }
  };
  // down rows over inputs [0, rows): rows [a, b) of every token's sum, over
  // every pair.
  const auto down_rows = [&](int thread, int a, int b) {
    float* d = rows_[size_t(thread)].data();
    for (int t = 0; t < tokens; ++t)
      for (int r = a; r < b; ++r) sum[size_t(t) * H + r] = 0.f;
    for (int p = 0; p < count; ++p) {
      q4_matvec_rows_summed(blob(p), layout_.down, h_.data() + size_t(p) * I, down_sums + size_t(p) * down_groups, a,
                            b, d, rows);
      float* out = sum + size_t(token(p)) * H;
      for (int r = a; r < b; ++r) out[r] += weights[p] * d[r];
    }
  };
  next_chunk_.store(0, std::memory_order_relaxed);
  on_all([&](int, int) {
    for (auto [a, b] = claim(count * rows, kUpChunk); a < b; std::tie(a, b) = claim(count * rows, kUpChunk))
      up_rows(a, b);
  });
  for (int p = 0; p < count; ++p)
    q4_group_sums(layout_.down, h_.data() + size_t(p) * I, rows, down_sums + size_t(p) * down_groups);
  next_chunk_.store(0, std::memory_order_relaxed);
  on_all([&](int t, int) {
    for (auto [a, b] = claim(H, kDownChunk); a < b; std::tie(a, b) = claim(H, kDownChunk)) down_rows(t, a, b);
  });
}

double HostShare::measure_us(int reps) {
  const int H = layout_.hidden;
  std::vector<uint16_t> x(static_cast<size_t>(H));
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& v : x) v = f32_to_bf16(nd(rng));
  std::vector<float> sum(static_cast<size_t>(H));
  {
    std::lock_guard<std::mutex> lk(mu_);
    awake_ = true;
  }
  cv_.notify_all();
  std::vector<double> us;
  constexpr int kWarm = 3;
  for (int i = 0; i < reps + kWarm; ++i) {
    const int32_t e = int32_t((i * 13) % n_experts_);
    const float w = 1.f;
    const uint8_t token = 0;
    const auto t0 = std::chrono::steady_clock::now();
    compute((i * 7) % layers_, &e, &token, &w, 1, layout_.inter, 1, x.data(), sum.data());
    if (i >= kWarm) us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  awake_ = false;
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace moe
