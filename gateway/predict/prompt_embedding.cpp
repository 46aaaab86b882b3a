#include "gateway/predict/prompt_embedding.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

namespace moe::gw {

namespace {
constexpr const char* kEmbedName = "model.embed_tokens.weight";
}

Result<std::unique_ptr<PromptEmbedder>> PromptEmbedder::open(const std::string& model_path) {
  auto files = ModelFiles::open(model_path);
  if (!files.ok()) return make_error(files.error());
  const TensorView* t = files.value()->find(kEmbedName);
  if (!t) return make_error(model_path + ": no tensor " + kEmbedName + " to embed prompts with");
  if (t->shape.size() != 2 || t->shape[0] <= 0 || t->shape[1] <= 0)
    return make_error(std::string(kEmbedName) + " is not a [vocab, hidden] matrix");
  if (t->dtype != DType::f32 && t->dtype != DType::f16 && t->dtype != DType::bf16)
    return make_error(std::string(kEmbedName) + " has dtype " + dtype_name(t->dtype) +
                      ", not a float type");
  std::unique_ptr<PromptEmbedder> e(new PromptEmbedder());
  e->files_ = std::move(files.value());
  e->view_ = t;
  e->vocab_ = int(t->shape[0]);
  e->dim_ = int(t->shape[1]);
  e->compute_center();
  return e;
}

PromptEmbedder::PromptEmbedder(std::vector<float> table, int vocab, int dim)
    : owned_(std::move(table)), vocab_(vocab), dim_(dim) {
  owned_.resize(size_t(vocab_) * size_t(dim_));
  compute_center();
}

void PromptEmbedder::add_row(int64_t row, float* acc, uint16_t* scratch) const {
  const size_t D = size_t(dim_);
  if (!view_) {
    const float* r = owned_.data() + size_t(row) * D;
    for (size_t c = 0; c < D; ++c) acc[c] += r[c];
    return;
  }
  const uint8_t* src = view_->data + size_t(row) * D * dtype_size(view_->dtype);
  switch (view_->dtype) {
    case DType::bf16:
      // A bf16 value is the top half of the f32 with the same bits.
      std::memcpy(scratch, src, 2 * D);
      for (size_t c = 0; c < D; ++c) {
        const uint32_t u = uint32_t(scratch[c]) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        acc[c] += f;
      }
      return;
    case DType::f16:
      std::memcpy(scratch, src, 2 * D);
      for (size_t c = 0; c < D; ++c) acc[c] += f16_to_f32(scratch[c]);
      return;
    default:
      for (size_t c = 0; c < D; ++c) {
        float f;
        std::memcpy(&f, src + 4 * c, 4);
        acc[c] += f;
      }
      return;
  }
}

void PromptEmbedder::compute_center() {
  // Rows are summed in float in blocks of 256 and the blocks in double, so a
  // large vocabulary loses no precision and the pass stays fast.
  std::vector<double> sum(size_t(dim_), 0.0);
  std::vector<float> block(static_cast<size_t>(dim_));
  std::vector<uint16_t> half(view_ ? size_t(dim_) : 0);
  for (int64_t r0 = 0; r0 < vocab_; r0 += 256) {
    std::fill(block.begin(), block.end(), 0.0f);
    for (int64_t r = r0; r < std::min<int64_t>(vocab_, r0 + 256); ++r)
      add_row(r, block.data(), half.data());
    for (int c = 0; c < dim_; ++c) sum[size_t(c)] += block[size_t(c)];
  }
  center_.resize(size_t(dim_));
  for (int c = 0; c < dim_; ++c)
    center_[size_t(c)] = vocab_ > 0 ? float(sum[size_t(c)] / vocab_) : 0.0f;
}

std::vector<float> PromptEmbedder::embed(std::span<const int32_t> tokens) const {
  std::vector<float> out(size_t(dim_), 0.0f);
  int64_t n = 0;
  const size_t count = std::min(tokens.size(), kMaxTokens);
  std::vector<uint16_t> half(view_ ? size_t(dim_) : 0);
  for (size_t k = 0; k < count; ++k) {
    const int32_t t = tokens[count == tokens.size() ? k : k * tokens.size() / count];
    if (t < 0 || t >= vocab_) continue;
    add_row(t, out.data(), half.data());
    ++n;
  }
  if (n == 0) return out;
  for (int c = 0; c < dim_; ++c) out[size_t(c)] = out[size_t(c)] / float(n) - center_[size_t(c)];
  return out;
}

LshHasher::LshHasher(int dim, int bits, uint64_t seed) : dim_(dim), bits_(bits), seed_(seed) {
  if (bits_ < 1) bits_ = 1;
  if (bits_ > kMaxBits) bits_ = kMaxBits;
  // std::mt19937_64's output is fixed by the standard; the Box-Muller
  // transform below is ours, so the planes are the same on every platform.
  std::mt19937_64 rng(seed_);
  auto uniform = [&] { return (double(rng() >> 11) + 0.5) * (1.0 / 9007199254740992.0); };
  planes_.resize(size_t(bits_) * size_t(dim_));
  for (size_t i = 0; i < planes_.size(); ++i) {
    const double u1 = uniform(), u2 = uniform();
    planes_[i] = float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
}

uint32_t LshHasher::bucket(std::span<const float> v) const {
  uint32_t b = 0;
  const size_t n = std::min(v.size(), size_t(dim_));
  for (int i = 0; i < bits_; ++i) {
    const float* p = planes_.data() + size_t(i) * size_t(dim_);
    double dot = 0.0;
    for (size_t c = 0; c < n; ++c) dot += double(p[c]) * double(v[c]);
    if (dot > 0.0) b |= 1u << i;
  }
  return b;
}

}  // namespace moe::gw
