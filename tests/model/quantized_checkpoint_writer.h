#pragma once
// GPTQ and AWQ checkpoints made from the reference fixtures, for the tests of
// the quantised-checkpoint reader: a round-to-nearest quantiser per group
// (the point is the file layout, not GPTQ's error feedback), packed the way
// AutoGPTQ and AutoAWQ write their files; and a dequantiser written
// straight from the published formulas, independent of model/, with the
// plain checkpoint folder it gives (the reference the loader is compared
// against).
//
// Published layouts, W [out, in] in the orientation of torch.nn.Linear:
//   GPTQ qweight I32 [in/8, out]: code of input i, output o in bits 4(i%8)..
//        of word [i/8][o].
//        qzeros I32 [groups, out/8]: zero of group g, output o in bits
//        4(o%8).. of word [g][o/8], stored as z - 1 (v1) or z (gptq_v2).
//        scales F16 [groups, out]; g_idx I32 [in], the group of each input.
//        w = s[g][o] * (q - z), g = g_idx[i]; groups = ceil(in / group).
//   AWQ  qweight I32 [in, out/8] and qzeros I32 [groups, out/8]: AutoAWQ
//        packs columns 8c + {0, 2, 4, 6, 1, 3, 5, 7} into nibbles 0..7 of
//        word c; scales F16 [groups, out]; w = s * (q - z), g = i / group.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/safetensors.h"
#include "tests/model/safetensors_writer.h"

namespace moe::test {

struct QuantRecipe {
  std::string method = "gptq";  // "gptq" or "awq"
  int group = 64;               // -1 (GPTQ): one group over the whole row
  bool sym = false;             // GPTQ: zero point fixed at 8
  bool desc_act = false;        // GPTQ: groups over a permutation of the inputs
  bool v2 = false;              // GPTQ: zeros stored as they are (checkpoint_format gptq_v2)
  // Linears whose prefix contains one of these stay in bf16 (as
  // modules_to_not_convert / a partial quantisation leaves them).
  std::vector<std::string> keep_plain;
};

// A tensor with its own bytes.
struct OwnedTensor {
  TensorView view;
  std::shared_ptr<std::string> bytes;
};

inline OwnedTensor owned_tensor(const std::string& name, DType dtype, std::vector<int64_t> shape,
                                std::string bytes) {
  OwnedTensor t;
  t.bytes = std::make_shared<std::string>(std::move(bytes));
  t.view.name = name;
  t.view.dtype = dtype;
  t.view.shape = std::move(shape);
  t.view.data = reinterpret_cast<const uint8_t*>(t.bytes->data());
  t.view.nbytes = t.bytes->size();
  return t;
}

template <typename T>
OwnedTensor owned_tensor(const std::string& name, DType dtype, std::vector<int64_t> shape,
                         const std::vector<T>& values) {
  return owned_tensor(name, dtype, std::move(shape),
                      std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T)));
}

inline OwnedTensor copy_tensor(const TensorView& v) {
  return owned_tensor(v.name, v.dtype, v.shape, std::string(reinterpret_cast<const char*>(v.data), v.nbytes));
}

// The Linears a GPTQ/AWQ run quantises: the 2-D weights inside the decoder
// layers, except the routers (and any with an output count not a multiple
// of 8, such as Qwen2-MoE's one-row shared-expert gate, which the packing
// cannot hold).
inline bool quantisable(const TensorView& t) {
  const std::string& n = t.name;
  if (t.shape.size() != 2 || n.rfind("model.layers.", 0) != 0) return false;
  if (n.size() < 7 || n.compare(n.size() - 7, 7, ".weight") != 0) return false;
  for (const char* router : {"mlp.gate.weight", "block_sparse_moe.gate.weight"})
    if (n.size() >= std::strlen(router) && n.compare(n.size() - std::strlen(router), std::strlen(router), router) == 0)
      return false;
  return t.shape[0] % 8 == 0 && t.shape[1] % 8 == 0;
}

// One quantised Linear: its codes, zero points (effective, not as stored)
// and f16 scales, as the recipe rounds them.
struct RtnLinear {
  int out = 0, in = 0, groups = 0;
  std::vector<int32_t> g_idx;   // [in]
  std::vector<uint8_t> q;       // [in * out]: q[i * out + o]
  std::vector<int> zero;        // [groups * out]
  std::vector<uint16_t> scale;  // [groups * out], f16 bits
};

inline RtnLinear rtn_quantize(const std::vector<float>& w, int out, int in, const QuantRecipe& r) {
  RtnLinear L;
  L.out = out;
  L.in = in;
  const int G = r.group > 0 ? r.group : in;
  L.groups = (in + G - 1) / G;
  L.g_idx.resize(size_t(in));
  if (r.desc_act) {
    // Act order: groups are consecutive runs of a permutation of the
    // inputs (GPTQ sorts them by activation size); g_idx stays in input
    // order, so it is not monotone.
    std::vector<int> perm(static_cast<size_t>(in));
    for (int i = 0; i < in; ++i) perm[size_t(i)] = i;
    std::mt19937 rng(uint32_t(out * 7919 + in));
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int j = 0; j < in; ++j) L.g_idx[size_t(perm[size_t(j)])] = j / G;
  } else {
    for (int i = 0; i < in; ++i) L.g_idx[size_t(i)] = i / G;
  }
  L.q.resize(size_t(in) * size_t(out));
  L.zero.resize(size_t(L.groups) * size_t(out));
  L.scale.resize(size_t(L.groups) * size_t(out));
  for (int g = 0; g < L.groups; ++g)
    for (int o = 0; o < out; ++o) {
      float lo = INFINITY, hi = -INFINITY;
      for (int i = 0; i < in; ++i)
        if (L.g_idx[size_t(i)] == g) {
          lo = std::min(lo, w[size_t(o) * size_t(in) + size_t(i)]);
          hi = std::max(hi, w[size_t(o) * size_t(in) + size_t(i)]);
        }
      float s;
      int z;
      if (r.method == "awq") {  // AutoAWQ: min/max of the group, zero clamped to the codes
        s = std::max(hi - lo, 1e-5f) / 15.0f;
        s = f16_to_f32(f32_to_f16(s));
        z = int(std::clamp(-std::round(lo / s), 0.0f, 15.0f));
      } else if (r.sym) {  // GPTQ symmetric: zero at the middle code
        float m = std::max(std::fabs(lo), std::fabs(hi));
        if (m == 0) m = 1;
        s = f16_to_f32(f32_to_f16(2 * m / 15.0f));
        z = 8;
      } else {  // GPTQ asymmetric: the range always holds 0
        lo = std::min(lo, 0.0f);
        hi = std::max(hi, 0.0f);
        if (lo == 0 && hi == 0) lo = -1, hi = 1;
        s = f16_to_f32(f32_to_f16((hi - lo) / 15.0f));
        z = int(std::round(-lo / s));
      }
      L.zero[size_t(g) * size_t(out) + size_t(o)] = z;
      L.scale[size_t(g) * size_t(out) + size_t(o)] = f32_to_f16(s);
      for (int i = 0; i < in; ++i)
        if (L.g_idx[size_t(i)] == g) {
          const float v = std::round(w[size_t(o) * size_t(in) + size_t(i)] / s) + float(z);
          L.q[size_t(i) * size_t(out) + size_t(o)] = uint8_t(std::clamp(v, 0.0f, 15.0f));
        }
    }
  return L;
}

// The tensors of one quantised Linear, packed as the recipe's tool writes them.
inline std::vector<OwnedTensor> pack_linear(const std::string& prefix, const RtnLinear& L, const QuantRecipe& r) {
  const int out = L.out, in = L.in, words = out / 8;
  std::vector<OwnedTensor> t;
  std::vector<uint32_t> qzeros(size_t(L.groups) * size_t(words), 0);
  if (r.method == "awq") {
    static constexpr int kPackOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};
    std::vector<uint32_t> qweight(size_t(in) * size_t(words), 0);
    for (int i = 0; i < in; ++i)
      for (int c = 0; c < words; ++c)
        for (int n = 0; n < 8; ++n)
          qweight[size_t(i) * size_t(words) + size_t(c)] |=
              uint32_t(L.q[size_t(i) * size_t(out) + size_t(8 * c + kPackOrder[n])]) << (4 * n);
    for (int g = 0; g < L.groups; ++g)
      for (int c = 0; c < words; ++c)
        for (int n = 0; n < 8; ++n)
          qzeros[size_t(g) * size_t(words) + size_t(c)] |=
              uint32_t(L.zero[size_t(g) * size_t(out) + size_t(8 * c + kPackOrder[n])]) << (4 * n);
    t.push_back(owned_tensor(prefix + ".qweight", DType::i32, {in, words}, qweight));
  } else {
    std::vector<uint32_t> qweight(size_t(in / 8) * size_t(out), 0);
    for (int i = 0; i < in; ++i)
      for (int o = 0; o < out; ++o)
        qweight[size_t(i / 8) * size_t(out) + size_t(o)] |= uint32_t(L.q[size_t(i) * size_t(out) + size_t(o)])
                                                            << (4 * (i % 8));
    for (int g = 0; g < L.groups; ++g)
      for (int o = 0; o < out; ++o) {
        const int z = L.zero[size_t(g) * size_t(out) + size_t(o)];
        const uint32_t stored = uint32_t(r.v2 ? z : z - 1) & 15u;  // v1: z - 1, its nibble
        qzeros[size_t(g) * size_t(words) + size_t(o / 8)] |= stored << (4 * (o % 8));
      }
    t.push_back(owned_tensor(prefix + ".qweight", DType::i32, {in / 8, out}, qweight));
    t.push_back(owned_tensor(prefix + ".g_idx", DType::i32, {in}, L.g_idx));
  }
  t.push_back(owned_tensor(prefix + ".qzeros", DType::i32, {L.groups, words}, qzeros));
  t.push_back(owned_tensor(prefix + ".scales", DType::f16, {L.groups, out}, L.scale));
  return t;
}

inline nlohmann::json quantization_config(const QuantRecipe& r, const std::vector<std::string>& not_converted) {
  if (r.method == "awq")
    return {{"quant_method", "awq"}, {"bits", 4},         {"group_size", r.group},
            {"zero_point", true},    {"version", "gemm"}, {"modules_to_not_convert", not_converted}};
  return {{"quant_method", "gptq"},
          {"bits", 4},
          {"group_size", r.group},
          {"desc_act", r.desc_act},
          {"sym", r.sym},
          {"damp_percent", 0.01},
          {"true_sequential", true},
          {"checkpoint_format", r.v2 ? "gptq_v2" : "gptq"}};
}

inline void copy_text_files(const std::string& src, const std::string& dst) {
  namespace fs = std::filesystem;
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"})
    if (fs::exists(fs::path(src) / f))
      fs::copy_file(fs::path(src) / f, fs::path(dst) / f, fs::copy_options::overwrite_existing);
}

inline void write_config(const std::string& dst, const nlohmann::json& config) {
  std::ofstream(std::filesystem::path(dst) / "config.json") << config.dump(2);
}

// Writes the fixture folder `src` quantised by `r` into the folder `dst`
// (created). `edit`, when given, may change the tensors and the config
// before they are written (the error cases).
inline void write_quantized_checkpoint(
    const std::string& src, const std::string& dst, const QuantRecipe& r,
    const std::function<void(std::vector<OwnedTensor>&, nlohmann::json&)>& edit = {}) {
  namespace fs = std::filesystem;
  fs::create_directories(dst);
  auto ck = Checkpoint::open_dir(src);
  if (!ck) throw std::runtime_error(ck.error());
  std::vector<OwnedTensor> tensors;
  std::vector<std::string> not_converted;
  for (const auto& [name, t] : ck->tensors()) {
    const std::string prefix = name.substr(0, name.size() - 7);
    const int out = t.shape.size() == 2 ? int(t.shape[0]) : 0, in = t.shape.size() == 2 ? int(t.shape[1]) : 0;
    bool plain = !quantisable(t);
    for (const std::string& k : r.keep_plain) plain = plain || name.find(k) != std::string::npos;
    // AutoAWQ needs whole groups; such a Linear stays in bf16.
    if (!plain && r.method == "awq" && in % r.group != 0) plain = true;
    if (plain) {
      if (quantisable(t)) not_converted.push_back(prefix);
      tensors.push_back(copy_tensor(t));
      continue;
    }
    for (auto& p : pack_linear(prefix, rtn_quantize(to_f32(t), out, in, r), r)) tensors.push_back(std::move(p));
  }
  nlohmann::json config = nlohmann::json::parse(std::ifstream(fs::path(src) / "config.json"));
  config["quantization_config"] = quantization_config(r, not_converted);
  if (edit) edit(tensors, config);
  std::vector<const TensorView*> views;
  for (const auto& t : tensors) views.push_back(&t.view);
  write_safetensors((fs::path(dst) / "model.safetensors").string(), views);
  write_config(dst, config);
  copy_text_files(src, dst);
}

// --- The reference dequantiser: the published formulas, one weight at a time.

inline uint32_t word_of(const TensorView& t, size_t k) {
  uint32_t w;
  std::memcpy(&w, t.data + 4 * k, 4);
  return w;
}

// W [out, in] of the quantised Linear `prefix` of checkpoint `ck`.
inline std::vector<float> reference_dequantize(const Checkpoint& ck, const std::string& prefix,
                                               const nlohmann::json& qc, int* out_rows, int* in_cols) {
  const bool awq = qc.at("quant_method") == "awq";
  const bool v2 = qc.value("checkpoint_format", "gptq") == "gptq_v2";
  const TensorView& qw = *ck.find(prefix + ".qweight");
  const TensorView& qz = *ck.find(prefix + ".qzeros");
  const TensorView& sc = *ck.find(prefix + ".scales");
  const TensorView* gi = ck.find(prefix + ".g_idx");
  const int out = awq ? int(qw.shape[1]) * 8 : int(qw.shape[1]);
  const int in = awq ? int(qw.shape[0]) : int(qw.shape[0]) * 8;
  const int G = qc.at("group_size").get<int>() > 0 ? qc.at("group_size").get<int>() : in;
  static constexpr int kNibbleOf[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // AutoAWQ's reverse order
  std::vector<float> w(size_t(out) * size_t(in));
  const std::vector<float> s = to_f32(sc);
  for (int o = 0; o < out; ++o)
    for (int i = 0; i < in; ++i) {
      int g = i / G;
      if (gi) std::memcpy(&g, gi->data + 4 * size_t(i), 4);
      int q, z;
      if (awq) {
        q = int(word_of(qw, size_t(i) * size_t(out / 8) + size_t(o / 8)) >> (4 * kNibbleOf[o % 8])) & 15;
        z = int(word_of(qz, size_t(g) * size_t(out / 8) + size_t(o / 8)) >> (4 * kNibbleOf[o % 8])) & 15;
      } else {
        q = int(word_of(qw, size_t(i / 8) * size_t(out) + size_t(o)) >> (4 * (i % 8))) & 15;
        z = (int(word_of(qz, size_t(g) * size_t(out / 8) + size_t(o / 8)) >> (4 * (o % 8))) & 15) + (v2 ? 0 : 1);
      }
      w[size_t(o) * size_t(in) + size_t(i)] = s[size_t(g) * size_t(out) + size_t(o)] * float(q - z);
    }
  *out_rows = out;
  *in_cols = in;
  return w;
}

// The plain checkpoint of the quantised folder `qdir`: every quantised
// Linear dequantised by reference_dequantize as F32 `<prefix>.weight`,
// everything else as stored, and config.json without quantization_config.
inline void write_dequantized_checkpoint(const std::string& qdir, const std::string& dst) {
  namespace fs = std::filesystem;
  fs::create_directories(dst);
  auto ck = Checkpoint::open_dir(qdir);
  if (!ck) throw std::runtime_error(ck.error());
  nlohmann::json config = nlohmann::json::parse(std::ifstream(fs::path(qdir) / "config.json"));
  const nlohmann::json qc = config.at("quantization_config");
  std::vector<OwnedTensor> tensors;
  for (const auto& [name, t] : ck->tensors()) {
    const auto dot = name.rfind('.');
    const std::string prefix = name.substr(0, dot), part = name.substr(dot);
    if (part == ".qweight") {
      int out = 0, in = 0;
      const std::vector<float> w = reference_dequantize(*ck, prefix, qc, &out, &in);
      tensors.push_back(owned_tensor(prefix + ".weight", DType::f32, {out, in}, w));
    } else if (!ck->find(prefix + ".qweight") || (part != ".qzeros" && part != ".scales" && part != ".g_idx")) {
      tensors.push_back(copy_tensor(t));
    }
  }
  config.erase("quantization_config");
  std::vector<const TensorView*> views;
  for (const auto& t : tensors) views.push_back(&t.view);
  write_safetensors((fs::path(dst) / "model.safetensors").string(), views);
  write_config(dst, config);
  copy_text_files(qdir, dst);
}

}  // namespace moe::test
