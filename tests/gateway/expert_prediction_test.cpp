// Expert prediction's parts: the prompt embedding and its LSH bucket (on the
// demo model's real embedding table and tokenizer), the decaying
// bucket → expert table, and the predictor's tags, learning and scoring.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gateway/predict/expert_frequency_table.h"
#include "gateway/predict/expert_prediction.h"
#include "gateway/api/model_text_codec.h"
#include "gateway/predict/prompt_embedding.h"

using namespace moe::gw;

namespace {

const std::string kDemo = std::string(MOE_TEST_DATA) + "/../../models/demo-moe";

// Windows of `len` tokens from the demo model's eval text, `step` apart.
std::vector<std::vector<int32_t>> eval_windows(const TextCodec& codec, int len, int step,
                                               int count) {
  std::ifstream f(kDemo + "/eval.txt");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::vector<int32_t> all = codec.encode(ss.str().substr(0, 200000));
  std::vector<std::vector<int32_t>> out;
  for (size_t at = 0; at + size_t(len) <= all.size() && int(out.size()) < count; at += size_t(step))
    out.emplace_back(all.begin() + long(at), all.begin() + long(at) + len);
  return out;
}

// Usage with `tokens` spread over `experts` in every layer.
std::vector<float> usage(int layers, int n_experts, const std::vector<int>& experts,
                         float tokens = 10) {
  std::vector<float> u(size_t(layers) * size_t(n_experts), 0.0f);
  for (int l = 0; l < layers; ++l)
    for (int e : experts) u[size_t(l) * size_t(n_experts) + size_t(e)] = tokens;
  return u;
}

std::vector<int> sorted(std::vector<int> v) {
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST_CASE("similar prompts share LSH buckets far more often than unrelated ones",
          "[prediction][lsh]") {
  auto codec = load_model_text_codec(kDemo);
  REQUIRE(codec.ok());
  auto emb = PromptEmbedder::open(kDemo);
  REQUIRE(emb.ok());
  CHECK(emb.value()->dim() == 256);
  const LshHasher lsh(emb.value()->dim(), 14, 1);

  // A prompt and the same text shifted by 4 of its 64 tokens (similar), and
  // prompts 40 windows apart (unrelated text of the same corpus).
  const auto w = eval_windows(*codec.value(), 68, 200, 120);
  REQUIRE(w.size() >= 100);
  int similar_same = 0, random_same = 0;
  double similar_d = 0, random_d = 0;
  const int n = 80;
  for (int i = 0; i < n; ++i) {
    const std::vector<int32_t> a(w[size_t(i)].begin(), w[size_t(i)].begin() + 64);
    const std::vector<int32_t> shifted(w[size_t(i)].begin() + 4, w[size_t(i)].end());
    const std::vector<int32_t> other(w[size_t(i + 40) % w.size()].begin(),
                                     w[size_t(i + 40) % w.size()].begin() + 64);
    const uint32_t ba = lsh.bucket(emb.value()->embed(a));
    const uint32_t bs = lsh.bucket(emb.value()->embed(shifted));
    const uint32_t bo = lsh.bucket(emb.value()->embed(other));
    similar_same += ba == bs;
    random_same += ba == bo;
    similar_d += hamming(ba, bs);
    random_d += hamming(ba, bo);
  }
  similar_d /= n;
  random_d /= n;
  INFO("same bucket: similar " << similar_same << "/" << n << ", unrelated " << random_same << "/"
                               << n << "; mean Hamming distance: similar " << similar_d
                               << ", unrelated " << random_d);
  CHECK(similar_same > 2 * random_same + 10);
  CHECK(similar_d * 3 < random_d);
  // Unrelated prompts spread over many buckets.
  std::set<uint32_t> distinct;
  for (const auto& x : w) distinct.insert(lsh.bucket(emb.value()->embed(x)));
  CHECK(distinct.size() > w.size() / 4);
}

TEST_CASE("the LSH is deterministic by seed and the embedding is centred", "[prediction][lsh]") {
  // A small table: rows differ in one direction each.
  const int vocab = 8, dim = 4;
  std::vector<float> table(size_t(vocab * dim), 1.0f);  // a common offset in every row
  for (int r = 0; r < vocab; ++r) table[size_t(r * dim + r % dim)] += r < 4 ? 1.0f : -1.0f;
  PromptEmbedder e(table, vocab, dim);
  const std::vector<int32_t> all = {0, 1, 2, 3, 4, 5, 6, 7};
  for (float v : e.embed(all)) CHECK(v == Approx(0.0f).margin(1e-6));  // the mean row is removed
  CHECK(e.embed(std::vector<int32_t>{}) == std::vector<float>(dim, 0.0f));
  CHECK(e.embed(std::vector<int32_t>{-1, 99}) ==
        std::vector<float>(dim, 0.0f));  // out of range: skipped
  // A prompt longer than kMaxTokens is sampled evenly across its length: a
  // first half of one token and a second half of another give their mean.
  std::vector<int32_t> longp;
  for (size_t i = 0; i < 10 * PromptEmbedder::kMaxTokens; ++i)
    longp.push_back(i < 5 * PromptEmbedder::kMaxTokens ? 0 : 1);
  const auto lm = e.embed(longp), pm = e.embed(std::vector<int32_t>{0, 1});
  for (int c = 0; c < dim; ++c) CHECK(lm[size_t(c)] == Approx(pm[size_t(c)]).margin(1e-5));

  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  const LshHasher a(64, 16, 42), b(64, 16, 42), c(64, 16, 43);
  int differ = 0;
  for (int i = 0; i < 50; ++i) {
    std::vector<float> v(64);
    for (float& x : v) x = nd(rng);
    CHECK(a.bucket(v) == b.bucket(v));
    differ += a.bucket(v) != c.bucket(v);
    CHECK(a.bucket(v) < (1u << 16));
    // Opposite vectors fall on opposite sides of every plane.
    std::vector<float> neg(v);
    for (float& x : neg) x = -x;
    CHECK((a.bucket(v) ^ a.bucket(neg)) == 0xffffu);
  }
  CHECK(differ > 40);
}

TEST_CASE("routing summaries parse into tokens per layer and expert", "[prediction][table]") {
  auto u = parse_routing_layers("0:3=5,7=2 1:0=1", 2, 8);
  REQUIRE(u.ok());
  CHECK(u.value()[3] == 5);
  CHECK(u.value()[7] == 2);
  CHECK(u.value()[8] == 1);
  CHECK(parse_routing_layers("", 2, 8).ok());
  CHECK_FALSE(parse_routing_layers("2:0=1", 2, 8).ok());  // layer out of range
  CHECK_FALSE(parse_routing_layers("0:8=1", 2, 8).ok());  // expert out of range
  CHECK_FALSE(parse_routing_layers("0:1", 2, 8).ok());
  CHECK_FALSE(parse_routing_layers("x:1=1", 2, 8).ok());
}

TEST_CASE("a bucket predicts its own experts; unseen buckets use the nearest, then the global row",
          "[prediction][table]") {
  FrequencyTableParams prm;
  prm.nearest_max_distance = 2;
  ExpertFrequencyTable t(3, 16, prm);
  CHECK(t.estimate(5).source == ExpertFrequencyTable::Source::none);
  for (int i = 0; i < 5; ++i) t.learn(0b0000, usage(3, 16, {0, 1}));
  for (int i = 0; i < 3; ++i) t.learn(0b1111, usage(3, 16, {9, 10}));
  CHECK(t.buckets() == 2);
  CHECK(t.learned() == 8);

  auto own = t.estimate(0b0000);
  CHECK(own.source == ExpertFrequencyTable::Source::bucket);
  for (const auto& layer : ExpertFrequencyTable::top_experts(own, 16, 2))
    CHECK(sorted(layer) == std::vector<int>{0, 1});
  auto other = t.estimate(0b1111);
  for (const auto& layer : ExpertFrequencyTable::top_experts(other, 16, 2))
    CHECK(sorted(layer) == std::vector<int>{9, 10});
  // Each layer's estimate sums to 1.
  double sum = 0;
  for (int e = 0; e < 16; ++e) sum += own.p[size_t(e)];
  CHECK(sum == Approx(1.0));

  auto near = t.estimate(0b0111);  // distance 1 from 1111, 3 from 0000
  CHECK(near.source == ExpertFrequencyTable::Source::nearest);
  CHECK(near.bucket == 0b1111);
  CHECK(near.distance == 1);
  for (const auto& layer : ExpertFrequencyTable::top_experts(near, 16, 2))
    CHECK(sorted(layer) == std::vector<int>{9, 10});

  auto far = t.estimate(0b1100000);  // distance 2 from 0000 (the limit), 6 from 1111
  CHECK(far.source == ExpertFrequencyTable::Source::nearest);
  CHECK(far.bucket == 0b0000);
  CHECK(far.distance == 2);
  auto none = t.estimate(0xff00);  // 8 bits from both: the global row, where {0,1} weigh most
  CHECK(none.source == ExpertFrequencyTable::Source::global);
  for (const auto& layer : ExpertFrequencyTable::top_experts(none, 16, 2))
    CHECK(sorted(layer) == std::vector<int>{0, 1});
}

TEST_CASE("the table decays: a learned summary weighs half after half_life more",
          "[prediction][table]") {
  FrequencyTableParams prm;
  prm.half_life = 10;
  ExpertFrequencyTable t(1, 8, prm);
  t.learn(1, usage(1, 8, {2}));
  for (int i = 0; i < 10; ++i) t.learn(2, usage(1, 8, {5}));
  CHECK(t.weight(1) == Approx(0.5));
  CHECK(t.weight(3) == 0.0);

  // Traffic that changes: the old pattern of a bucket gives way to the new one.
  for (int i = 0; i < 20; ++i) t.learn(7, usage(1, 8, {0}));
  CHECK(ExpertFrequencyTable::top_experts(t.estimate(7), 8, 1)[0] == std::vector<int>{0});
  for (int i = 0; i < 25; ++i) t.learn(7, usage(1, 8, {6}));
  CHECK(ExpertFrequencyTable::top_experts(t.estimate(7), 8, 1)[0] == std::vector<int>{6});
  // Bounded: the weight of an endlessly fed bucket tends to 1 / (1 - 2^(-1/10)) ≈ 14.9.
  for (int i = 0; i < 400; ++i) t.learn(7, usage(1, 8, {6}));
  CHECK(t.weight(7) == Approx(1.0 / (1.0 - std::exp2(-0.1))).epsilon(0.01));
  // Buckets that decayed to nothing are pruned (every 1024 summaries).
  for (int i = 0; i < 1100; ++i) t.learn(8, usage(1, 8, {1}));
  CHECK(t.weight(1) == 0.0);
  CHECK(t.buckets() <= 2);
}

TEST_CASE("the predictor tags buckets with its settings, learns from summaries and scores hits",
          "[prediction]") {
  auto emb = PromptEmbedder::open(kDemo);
  REQUIRE(emb.ok());
  PredictorOptions po;
  po.lsh_bits = 12;
  po.experts_per_layer = 2;
  PromptExpertPredictor p(std::move(emb.value()), 6, 32, po);
  const std::vector<int32_t> prompt = {10, 20, 30, 40, 50};
  const ExpertPrediction before = p.predict(prompt);
  CHECK_FALSE(before.known());
  CHECK(before.bucket < (1u << 12));
  uint32_t back = 0;
  REQUIRE(p.bucket_of_tag(before.tag, &back));
  CHECK(back == before.bucket);

  // Another gateway's settings (other seed) make a foreign tag.
  auto emb2 = PromptEmbedder::open(kDemo);
  REQUIRE(emb2.ok());
  PredictorOptions other = po;
  other.lsh_seed = 99;
  PromptExpertPredictor q(std::move(emb2.value()), 6, 32, other);
  CHECK_FALSE(p.bucket_of_tag(q.tag_of(before.bucket), &back));
  CHECK_FALSE(p.bucket_of_tag(before.bucket, &back));  // no tag bit

  p.learn_summary(before.tag, "0:4=3,5=3 1:4=2,5=2 2:4=1,5=1 3:4=1,5=1 4:4=1,5=1 5:4=1,5=9");
  p.learn_summary(q.tag_of(before.bucket), "0:1=1");
  p.learn_summary(0, "0:1=1");
  p.learn_summary(before.tag, "9:1=1");  // layer out of range
  PredictionStats st = p.stats();
  CHECK(st.summaries_learned == 1);
  CHECK(st.summaries_foreign == 2);
  CHECK(st.summaries_bad == 1);
  CHECK(st.buckets == 1);

  const ExpertPrediction after = p.predict(prompt);
  REQUIRE(after.known());
  CHECK(after.source == ExpertFrequencyTable::Source::bucket);
  for (const auto& layer : after.experts) CHECK(sorted(layer) == std::vector<int>{4, 5});
  CHECK(after.set.count() == 12);

  // The request used expert 4 everywhere and 5 nowhere: half the prediction hit.
  p.score(after, usage(6, 32, {4, 7}));
  st = p.stats();
  CHECK(st.requests_scored == 1);
  CHECK(st.predicted == 12);
  CHECK(st.hits == 6);
}
