#include "kernels/cpu/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace moe::cpu {

static uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

double sample_uniform(uint64_t seed, int64_t position) {
  const uint64_t h = splitmix64(splitmix64(seed) ^ uint64_t(position) * 0xD6E8FEB86659FD93ull);
  return double(h >> 11) * (1.0 / 9007199254740992.0);  // 53 random bits
}

static int32_t argmax(const float* logits, int vocab) {
  int32_t best = 0;
  for (int i = 1; i < vocab; ++i)
    if (logits[i] > logits[best]) best = i;
  return best;
}

int32_t sample_token(const float* logits, int vocab, const SampleDraw& p, int64_t position) {
  const int32_t best = argmax(logits, vocab);
  const float mx = logits[best];
  // An infinite best (a penalty or bias that overflowed) leaves no finite
  // weights (inf - inf): the best token, as greedy. A masked row never
  // yields a masked token this way (those are -inf).
  if (p.temperature <= 0.0f || p.top_k == 1 || std::isinf(mx)) return best;
  const double inv_t = 1.0 / p.temperature;
  std::vector<double> prob(vocab);
  for (int i = 0; i < vocab; ++i) prob[i] = std::exp((double(logits[i]) - mx) * inv_t);
  // min_p: the best token's term is exp(0) = 1, so the cut is min_p itself.
  if (p.min_p > 0.0f)
    for (double& q : prob)
      if (q < double(p.min_p)) q = 0.0;
  const double u = sample_uniform(p.seed, position);

  const bool limit_k = p.top_k > 0 && p.top_k < vocab;
  const bool limit_p = p.top_p < 1.0f;
  if (!limit_k && !limit_p) {
    const double total = std::accumulate(prob.begin(), prob.end(), 0.0);
    double target = u * total, acc = 0.0;
    int last = 0;  // rounding may leave the target past the end: the last drawable token (the best has p = 1)
    for (int i = 0; i < vocab; ++i) {
      acc += prob[i];
      if (prob[i] > 0.0) last = i;
      if (acc > target) return i;
    }
    return last;
  }
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  auto better = [&](int32_t a, int32_t b) {
    return prob[a] != prob[b] ? prob[a] > prob[b] : a < b;
  };
  int keep = vocab;
  if (limit_k) {
    keep = p.top_k;
    std::partial_sort(order.begin(), order.begin() + keep, order.end(), better);
  } else {
    std::sort(order.begin(), order.end(), better);
  }
  if (limit_p) {
    double total = 0.0;
    for (int i = 0; i < keep; ++i) total += prob[order[i]];
    double acc = 0.0;
    int n = 0;
    while (n < keep) {
      acc += prob[order[n++]];
      if (acc >= p.top_p * total) break;
    }
    keep = n;
  }
  double total = 0.0;
  for (int i = 0; i < keep; ++i) total += prob[order[i]];
  double target = u * total, acc = 0.0;
  for (int i = 0; i < keep; ++i) {
    acc += prob[order[i]];
    if (acc > target) return order[i];
  }
  return order[0];  // rounding left the target past the kept mass: the best
}

void adjust_logits(float* logits, int vocab, std::span<const TokenAdjust> adjust, const Penalties& penalties) {
  for (const TokenAdjust& a : adjust)
    if (a.token >= 0 && a.token < vocab) logits[a.token] = adjusted_logit(logits[a.token], a, penalties);
}

void mask_logits(float* logits, int vocab, const uint32_t* allowed) {
  for (int i = 0; i < vocab; ++i)
    if (!(allowed[i / 32] >> (i % 32) & 1u)) logits[i] = -std::numeric_limits<float>::infinity();
}

static double log_sum_exp(const float* logits, int vocab) {
  const float mx = *std::max_element(logits, logits + vocab);
  double s = 0.0;
  for (int i = 0; i < vocab; ++i) s += std::exp(double(logits[i]) - mx);
  return mx + std::log(s);
}

float token_logprob(const float* logits, int vocab, int32_t token) {
  return float(double(logits[token]) - log_sum_exp(logits, vocab));
}

std::vector<std::pair<int32_t, float>> top_logprobs(const float* logits, int vocab, int n) {
  n = std::clamp(n, 0, vocab);
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + n, order.end(), [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  });
  const double lse = log_sum_exp(logits, vocab);
  std::vector<std::pair<int32_t, float>> out;
  out.reserve(n);
  for (int i = 0; i < n; ++i) out.emplace_back(order[i], float(double(logits[order[i]]) - lse));
  return out;
}

}  // namespace moe::cpu
