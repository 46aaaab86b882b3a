#include "cuda_engine/host_experts.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>

#include "kernels/cpu/activation.h"
#include "model/safetensors.h"

namespace moe {

std::vector<int> plan_split(std::span<const MissCost> misses, double link_us, double host_us_per_token,
                            double host_fixed_us) {
  std::vector<MissCost> order(misses.begin(), misses.end());
  std::stable_sort(order.begin(), order.end(), [](const MissCost& a, const MissCost& b) { return a.tokens < b.tokens; });
  std::vector<int> host;
  double host_t = 0, link_t = 0;
  for (const MissCost& m : order) {
    const double h = (host.empty() ? host_fixed_us : host_t) + host_us_per_token * m.tokens;
    if (h < link_t + link_us) {
      host_t = h;
      host.push_back(m.expert);
    } else {
      link_t += link_us;
    }
  }
  return host;
}

HostExperts::HostExperts(const ExpertLayout& layout, int threads, bool int8_inputs)
    : layout_(layout), int8_(int8_inputs), pool_(threads) {}

namespace {
// Rows per task: about two tasks a thread, a multiple of 8.
int rows_per_task(int rows, int tasks_wanted) {
  const int r = (rows + tasks_wanted - 1) / std::max(tasks_wanted, 1);
  return std::max(8, (r + 7) / 8 * 8);
}
}  // namespace

void HostExperts::run(const uint16_t* x_bf16, int n_tokens, std::span<const HostPair> pairs, float* y) {
  const int H = layout_.hidden, I = layout_.inter;
  const int P = int(pairs.size());
  std::memset(y, 0, sizeof(float) * size_t(n_tokens) * H);
  if (P == 0) return;
  x_.resize(size_t(n_tokens) * H);
  for (size_t i = 0; i < x_.size(); ++i) x_[i] = bf16_to_f32(x_bf16[i]);
  if (int8_) {
    xq_.resize(size_t(n_tokens));
    std::vector<char> done(size_t(n_tokens), 0);
    for (const HostPair& hp : pairs)  // only the tokens some pair reads
      if (!done[size_t(hp.token)]) {
        done[size_t(hp.token)] = 1;
        q8_quantize(x_.data() + size_t(hp.token) * H, H, q8_block(layout_.gate), &xq_[size_t(hp.token)]);
      }
  }
  h_.resize(size_t(P) * I);
  g_.resize(size_t(P) * std::max(I, H));
  const int want = 2 * pool_.size();
  // gate and up rows of every pair, then h = silu(gate) * up on the slice.
  const int ri = rows_per_task(I, (want + P - 1) / P);
  const int chunks_i = (I + ri - 1) / ri;
  pool_.parallel_for(int64_t(P) * chunks_i, [&](int64_t task) {
    const int p = int(task / chunks_i), r0 = int(task % chunks_i) * ri, r1 = std::min(I, r0 + ri);
    const HostPair& hp = pairs[size_t(p)];
    const float* x = x_.data() + size_t(hp.token) * H;
    float* g = g_.data() + size_t(p) * I;
    float* h = h_.data() + size_t(p) * I;
    if (int8_) {
      q4_matvec_rows_q8(hp.blob, layout_.gate, xq_[size_t(hp.token)], r0, r1, g);
      q4_matvec_rows_q8(hp.blob, layout_.up, xq_[size_t(hp.token)], r0, r1, h);
    } else {
      q4_matvec_rows(hp.blob, layout_.gate, x, r0, r1, g);
      q4_matvec_rows(hp.blob, layout_.up, x, r0, r1, h);
    }
    cpu::silu_mul(g + r0, h + r0, h + r0, r1 - r0);
  });
  // down rows: each task owns rows [r0, r1) of every token's output, so the
  // weighted sum over that token's pairs needs no atomics.
  if (int8_) {
    hq_.resize(size_t(P));
    for (int p = 0; p < P; ++p) q8_quantize(h_.data() + size_t(p) * I, I, q8_block(layout_.down), &hq_[size_t(p)]);
  }
  const int rh = rows_per_task(H, want);
  const int chunks_h = (H + rh - 1) / rh;
  pool_.parallel_for(chunks_h, [&](int64_t task) {
    const int r0 = int(task) * rh, r1 = std::min(H, r0 + rh);
    for (int p = 0; p < P; ++p) {
      const HostPair& hp = pairs[size_t(p)];
      float* d = g_.data() + size_t(p) * std::max(I, H);  // the gate rows are spent: reuse
      if (int8_) q4_matvec_rows_q8(hp.blob, layout_.down, hq_[size_t(p)], r0, r1, d);
      else q4_matvec_rows(hp.blob, layout_.down, h_.data() + size_t(p) * I, r0, r1, d);
      float* out = y + size_t(hp.token) * H;
      for (int r = r0; r < r1; ++r) out[r] += hp.weight * d[r];
    }
  });
}

double HostExperts::measure_us(std::span<const uint8_t* const> blobs, int reps) {
  std::vector<uint16_t> x(size_t(layout_.hidden));
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& v : x) v = f32_to_bf16(nd(rng));
  std::vector<float> y(size_t(layout_.hidden));
  std::vector<double> us;
  constexpr int kWarm = 3;  // fresh threads, first touches of the blob
  for (int i = 0; i < reps + kWarm; ++i) {
    const HostPair pair{0, blobs[size_t(i) % blobs.size()], 1.f};
    const auto t0 = std::chrono::steady_clock::now();
    run(x.data(), 1, std::span<const HostPair>(&pair, 1), y.data());
    if (i >= kWarm) us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace moe
