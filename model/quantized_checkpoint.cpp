#include "model/quantized_checkpoint.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "model/int4.h"
#include "model/parallel_for.h"
#include "model/model_files.h"
#include "model/packed_model.h"  // expert_weight_names
#include "model/safetensors.h"

namespace moe {

namespace {

using json = nlohmann::json;

// AWQ (GEMM) packs eight output columns into one int32 word in the order
// 0, 2, 4, 6, 1, 3, 5, 7: nibble n (bits 4n..4n+3) of word c holds column
// 8c + kAwqPackOrder[n]. Read the other way, column 8c + j sits in nibble
// kAwqNibbleOf[j] (what AutoAWQ calls the reverse order).
constexpr int kAwqNibbleOf[8] = {0, 4, 1, 5, 2, 6, 3, 7};

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// The shard file of each tensor, for messages that name file and tensor.
class Where {
 public:
  explicit Where(const std::string& dir) : dir_(dir) {
    namespace fs = std::filesystem;
    const fs::path index = fs::path(dir) / "model.safetensors.index.json";
    std::ifstream in(index, std::ios::binary);
    if (!in) return;
    std::ostringstream ss;
    ss << in.rdbuf();
    const json j = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) return;
    for (const auto& [name, shard] : j["weight_map"].items())
      if (shard.is_string()) shards_[name] = shard.get<std::string>();
  }
  std::string operator()(const std::string& tensor) const {
    auto it = shards_.find(tensor);
    const std::string file = it == shards_.end() ? "model.safetensors" : it->second;
    return (std::filesystem::path(dir_) / file).string() + ": tensor '" + tensor + "'";
  }

 private:
  std::string dir_;
  std::map<std::string, std::string> shards_;
};

uint32_t word_at(const TensorView& t, size_t index) {
  uint32_t w;
  std::memcpy(&w, t.data + 4 * index, 4);
  return w;
}

float float_at(const TensorView& t, size_t index) {
  switch (t.dtype) {
    case DType::f16: {
      uint16_t h;
      std::memcpy(&h, t.data + 2 * index, 2);
      return f16_to_f32(h);
    }
    case DType::bf16: {
      uint16_t h;
      std::memcpy(&h, t.data + 2 * index, 2);
      return bf16_to_f32(h);
    }
    default: {
      float f;
      std::memcpy(&f, t.data + 4 * index, 4);
      return f;
    }
  }
}

// One quantised Linear W [out, in] of the checkpoint, checked.
struct QLinear {
  std::string prefix;
  int in = 0, out = 0, groups = 0;
  const TensorView* qweight = nullptr;
  const TensorView* qzeros = nullptr;
  const TensorView* scales = nullptr;
  const TensorView* g_idx = nullptr;  // GPTQ only; may be absent
  std::vector<int32_t> group_of;      // [in]: the group of each input
};

// A quantised Linear unpacked: one code per byte, effective zero points and
// scales, each in the orientation of W (row = output).
struct Unpacked {
  std::vector<uint8_t> codes;   // [out * in]: q of W[o][i] at o*in + i
  std::vector<int16_t> zeros;   // [groups * out]: the zero point z, at g*out + o
  std::vector<float> scales;    // [groups * out]
};

// GPTQ: qweight int32 [in/8, out], code of input i, output o in bits
// 4(i%8).. of word [i/8][o]; qzeros int32 [groups, out/8], zero of group g,
// output o in bits 4(o%8).. of word [g][o/8], stored as z - 1 in the v1
// format. AWQ: qweight int32 [in, out/8] and qzeros int32 [groups, out/8],
// both with output o in nibble kAwqNibbleOf[o%8] of word [.][o/8], zeros as
// they are. Scales f16 [groups, out] in both.
Unpacked unpack(const QLinear& q, const QuantizedCheckpointConfig& cfg) {
  Unpacked u;
  const size_t in = size_t(q.in), out = size_t(q.out), words = out / 8;
  u.codes.resize(out * in);
  if (cfg.method == QuantMethod::gptq) {
    for (size_t r = 0; r < in / 8; ++r)
      for (size_t o = 0; o < out; ++o) {
        const uint32_t w = word_at(*q.qweight, r * out + o);
        uint8_t* dst = u.codes.data() + o * in + 8 * r;
        for (int n = 0; n < 8; ++n) dst[n] = uint8_t((w >> (4 * n)) & 15u);
      }
  } else {
    for (size_t i = 0; i < in; ++i)
      for (size_t c = 0; c < words; ++c) {
        const uint32_t w = word_at(*q.qweight, i * words + c);
        for (int j = 0; j < 8; ++j)
          u.codes[(8 * c + size_t(j)) * in + i] = uint8_t((w >> (4 * kAwqNibbleOf[j])) & 15u);
      }
  }
  const bool plus_one = cfg.method == QuantMethod::gptq && !cfg.gptq_v2;
  u.zeros.resize(size_t(q.groups) * out);
  u.scales.resize(size_t(q.groups) * out);
  for (size_t g = 0; g < size_t(q.groups); ++g)
    for (size_t c = 0; c < words; ++c) {
      const uint32_t w = word_at(*q.qzeros, g * words + c);
      for (int j = 0; j < 8; ++j) {
        const int nibble = cfg.method == QuantMethod::gptq ? j : kAwqNibbleOf[j];
        u.zeros[g * out + 8 * c + size_t(j)] = int16_t(((w >> (4 * nibble)) & 15u) + (plus_one ? 1 : 0));
      }
    }
  for (size_t k = 0; k < size_t(q.groups) * out; ++k) u.scales[k] = float_at(*q.scales, k);
  return u;
}

// W [out, in] as f32: w[o][i] = s[g][o] * (q[i][o] - z[g][o]), g the group
// of input i. Exact: (q - z) is an integer of at most 5 bits, s a half.
void dequantize(const QLinear& q, const Unpacked& u, float* w) {
  for (size_t o = 0; o < size_t(q.out); ++o)
    for (size_t i = 0; i < size_t(q.in); ++i) {
      const size_t gk = size_t(q.group_of[i]) * size_t(q.out) + o;
      w[o * size_t(q.in) + i] = u.scales[gk] * float(int(u.codes[o * size_t(q.in) + i]) - u.zeros[gk]);
    }
}

// Writes W into matrix `m` of `blob` as it stands, when that is exact up to
// the bias's half rounding: every group of m.group inputs lies inside one
// checkpoint group, the scales are halves, and -z*s is a finite half. Then
// scale = s, bias = half(-z*s), codes = q. Returns false (nothing written)
// otherwise.
bool write_exact(const QLinear& q, const Unpacked& u, const Q4MatrixLayout& m, uint8_t* blob) {
  if (q.scales->dtype != DType::f16) return false;
  const int ours = m.cols / m.group;
  for (int j = 0; j < ours; ++j)
    for (int i = j * m.group + 1; i < (j + 1) * m.group; ++i)
      if (q.group_of[size_t(i)] != q.group_of[size_t(j) * size_t(m.group)]) return false;
  for (size_t k = 0; k < u.scales.size(); ++k)
    if (!(std::fabs(float(u.zeros[k]) * u.scales[k]) <= 65504.0f)) return false;
  const uint16_t* scale_bits = reinterpret_cast<const uint16_t*>(q.scales->data);
  for (int o = 0; o < m.rows; ++o) {
    const uint8_t* codes = u.codes.data() + size_t(o) * size_t(m.cols);
    for (int j = 0; j < ours; ++j) {
      const size_t gk = size_t(q.group_of[size_t(j) * size_t(m.group)]) * size_t(q.out) + size_t(o);
      uint16_t s;
      std::memcpy(&s, scale_bits + gk, 2);  // the checkpoint's half, bit for bit
      const uint16_t bias = f32_to_f16(-float(u.zeros[gk]) * u.scales[gk]);
      q4_store_group(m, blob, o, j, codes + size_t(j) * size_t(m.group), s, bias);
    }
  }
  return true;
}

// Checks the tensors of the quantised Linear `prefix` against each other and
// the config; fills `q`.
Status describe(const Checkpoint& ck, const QuantizedCheckpointConfig& cfg, const Where& where,
                const std::string& prefix, QLinear* q) {
  q->prefix = prefix;
  q->qweight = ck.find(prefix + ".qweight");
  q->qzeros = ck.find(prefix + ".qzeros");
  q->scales = ck.find(prefix + ".scales");
  q->g_idx = ck.find(prefix + ".g_idx");
  const std::string what = cfg.method == QuantMethod::gptq ? "GPTQ" : "AWQ";
  auto bad = [&](const std::string& tensor, const std::string& why) {
    return make_error(where(tensor) + ": " + why);
  };
  const TensorView& qw = *q->qweight;
  if (qw.dtype != DType::i32 || qw.shape.size() != 2)
    return bad(qw.name, what + " qweight must be I32 of rank 2, found " + dtype_name(qw.dtype) + " " +
                            shape_str(qw.shape));
  if (cfg.method == QuantMethod::gptq) {
    q->in = int(qw.shape[0] * 8);  // eight 4-bit codes per word along the inputs
    q->out = int(qw.shape[1]);
  } else {
    q->in = int(qw.shape[0]);
    q->out = int(qw.shape[1] * 8);  // eight 4-bit codes per word along the outputs
  }
  if (q->in <= 0 || q->out <= 0) return bad(qw.name, "empty quantised matrix " + shape_str(qw.shape));
  const int group = cfg.group_size > 0 ? cfg.group_size : q->in;
  q->groups = (q->in + group - 1) / group;
  const std::string groups = std::to_string(q->groups);
  const std::string out8 = std::to_string(q->out / 8);
  // A missing part is named beside the qweight's file (a shard's index
  // does not list what is not there).
  if (!q->scales)
    return bad(qw.name, "the quantised Linear '" + prefix + "' has no scales: '" + prefix + ".scales' is missing");
  if (!q->qzeros)
    return bad(qw.name, "the quantised Linear '" + prefix + "' has no zero points: '" + prefix +
                            ".qzeros' is missing");
  if (q->scales->shape != std::vector<int64_t>{q->groups, q->out})
    return bad(q->scales->name, "has shape " + shape_str(q->scales->shape) + ", expected [" + groups +
                                    ", " + std::to_string(q->out) + "] for " + qw.name + " " +
                                    shape_str(qw.shape) + " with group size " +
                                    std::to_string(cfg.group_size));
  if (q->scales->dtype != DType::f16 && q->scales->dtype != DType::bf16 &&
      q->scales->dtype != DType::f32)
    return bad(q->scales->name, std::string("has dtype ") + dtype_name(q->scales->dtype) +
                                    ", expected F16");
  if (q->qzeros->dtype != DType::i32 || q->out % 8 != 0 ||
      q->qzeros->shape != std::vector<int64_t>{q->groups, q->out / 8})
    return bad(q->qzeros->name, std::string("is ") + dtype_name(q->qzeros->dtype) + " " +
                                    shape_str(q->qzeros->shape) + ", expected I32 [" + groups + ", " +
                                    out8 + "] for " + qw.name + " " + shape_str(qw.shape));
  q->group_of.resize(size_t(q->in));
  if (cfg.method == QuantMethod::gptq && q->g_idx) {
    const TensorView& gi = *q->g_idx;
    if ((gi.dtype != DType::i32 && gi.dtype != DType::i64) || gi.shape != std::vector<int64_t>{q->in})
      return bad(gi.name, std::string("is ") + dtype_name(gi.dtype) + " " + shape_str(gi.shape) +
                              ", expected I32 [" + std::to_string(q->in) + "]");
    for (int i = 0; i < q->in; ++i) {
      int64_t g;
      if (gi.dtype == DType::i32) {
        int32_t v;
        std::memcpy(&v, gi.data + 4 * size_t(i), 4);
        g = v;
      } else {
        std::memcpy(&g, gi.data + 8 * size_t(i), 8);
      }
      if (g < 0 || g >= q->groups)
        return bad(gi.name, "input " + std::to_string(i) + " is in group " + std::to_string(g) +
                                ", outside 0.." + std::to_string(q->groups - 1));
      q->group_of[size_t(i)] = int32_t(g);
    }
  } else {
    if (cfg.method == QuantMethod::gptq && cfg.desc_act)
      return bad(qw.name, "'" + prefix + ".g_idx' is missing, and desc_act is true: the groups of the inputs are unknown");
    for (int i = 0; i < q->in; ++i) q->group_of[size_t(i)] = i / group;
  }
  return {};
}

// The blob group for a checkpoint group: ours (32, 64, 128) nests inside
// theirs whenever theirs is a multiple of it.
int blob_group_for(int group_size) {
  if (group_size <= 0 || group_size >= 128) return 128;
  if (group_size >= 64) return 64;
  return 32;
}

// Runs every job on the host's cores; the first failure is returned.
Status run_jobs(const std::vector<std::function<Status()>>& jobs) {
  std::mutex mu;
  Status first;
  parallel_for(jobs.size(), host_threads(), [&](size_t k) {
    Status s = jobs[k]();
    if (!s) {
      std::lock_guard<std::mutex> lock(mu);
      if (first.ok()) first = std::move(s);
    }
  });
  return first;
}

Result<int> int_key(const json& q, std::initializer_list<const char*> keys, const std::string& what) {
  for (const char* k : keys)
    if (q.contains(k) && !q[k].is_null()) {
      if (!q[k].is_number_integer())
        return make_error("config.json: quantization_config." + std::string(k) + " is not an integer");
      return q[k].get<int>();
    }
  return make_error("config.json: quantization_config has no '" + std::string(*keys.begin()) + "' (" +
                    what + ")");
}

}  // namespace

Result<std::optional<QuantizedCheckpointConfig>> read_quantization_config(const std::string& text) {
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return make_error("config.json: does not parse as a JSON object");
  if (!j.contains("quantization_config") || j["quantization_config"].is_null())
    return std::optional<QuantizedCheckpointConfig>();
  const json& q = j["quantization_config"];
  if (!q.is_object()) return make_error("config.json: quantization_config is not an object");
  if (!q.contains("quant_method") || !q["quant_method"].is_string())
    return make_error("config.json: quantization_config has no quant_method");
  QuantizedCheckpointConfig c;
  const std::string method = lower(q["quant_method"].get<std::string>());
  if (method == "gptq") {
    c.method = QuantMethod::gptq;
  } else if (method == "awq") {
    c.method = QuantMethod::awq;
  } else {
    return make_error("config.json: quantization_config.quant_method '" + method +
                      "' is not supported; this build serves INT4 GPTQ and AWQ checkpoints "
                      "(quant_method \"gptq\" or \"awq\")");
  }
  auto bits = int_key(q, {"bits", "w_bit"}, "the bit width");
  if (!bits) return make_error(bits.error());
  c.bits = *bits;
  if (c.bits != 4)
    return make_error("config.json: quantization_config.bits is " + std::to_string(c.bits) + ": only 4-bit " +
                      (c.method == QuantMethod::gptq ? "GPTQ" : "AWQ") + " checkpoints are supported");
  auto group = int_key(q, {"group_size", "q_group_size"}, "the group size");
  if (!group) return make_error(group.error());
  c.group_size = *group;
  if (c.group_size == 0 || c.group_size < -1 || (c.group_size == -1 && c.method == QuantMethod::awq))
    return make_error("config.json: quantization_config.group_size " + std::to_string(c.group_size) +
                      " is not a group size");
  if (c.method == QuantMethod::gptq) {
    if (q.contains("desc_act") && !q["desc_act"].is_null()) {
      if (!q["desc_act"].is_boolean())
        return make_error("config.json: quantization_config.desc_act is not true or false");
      c.desc_act = q["desc_act"].get<bool>();
    }
    std::string format = "gptq";
    for (const char* k : {"checkpoint_format", "format"})
      if (q.contains(k) && q[k].is_string()) {
        format = lower(q[k].get<std::string>());
        break;
      }
    if (format == "gptq_v2") {
      c.gptq_v2 = true;
    } else if (format != "gptq") {
      return make_error("config.json: quantization_config.checkpoint_format '" + format +
                        "' is not supported (\"gptq\" or \"gptq_v2\": the AutoGPTQ layout of qweight, "
                        "qzeros, scales, g_idx)");
    }
  } else {
    if (q.contains("version") && q["version"].is_string() && lower(q["version"].get<std::string>()) != "gemm")
      return make_error("config.json: quantization_config.version '" + q["version"].get<std::string>() +
                        "' is not supported; this build reads the AWQ GEMM layout (version \"gemm\")");
    if (q.contains("zero_point") && q["zero_point"].is_boolean() && !q["zero_point"].get<bool>())
      return make_error("config.json: quantization_config.zero_point is false; this build reads AWQ "
                        "checkpoints with zero points only");
    if (q.contains("modules_to_not_convert") && q["modules_to_not_convert"].is_array())
      for (const json& m : q["modules_to_not_convert"])
        if (m.is_string()) c.modules_to_not_convert.push_back(m.get<std::string>());
  }
  return std::optional<QuantizedCheckpointConfig>(std::move(c));
}

Status QuantizedCheckpointReader::read(const QuantizedCheckpointConfig& cfg, ModelFiles* out) {
  const ModelDesc& d = out->desc_;
  const Checkpoint& ck = out->ckpt_;
  const Where where(out->path_);

  // Every quantised Linear, by prefix.
  std::map<std::string, QLinear> qlinears;
  std::set<std::string> consumed;  // checkpoint tensors that are not exposed as they are
  for (const auto& [name, t] : ck.tensors()) {
    if (!name.ends_with(".qweight")) continue;
    const std::string prefix = name.substr(0, name.size() - std::string(".qweight").size());
    if (ck.find(prefix + ".weight"))
      return make_error(where(prefix + ".weight") + ": the Linear '" + prefix +
                        "' is stored both quantised (.qweight) and as a plain weight");
    QLinear q;
    MOE_TRY(describe(ck, cfg, where, prefix, &q));
    for (const char* part : {".qweight", ".qzeros", ".scales", ".g_idx"}) consumed.insert(prefix + part);
    qlinears.emplace(prefix, std::move(q));
  }

  std::vector<std::function<Status()>> jobs;
  std::atomic<int> requantised{0};
  int quantised_experts = 0;

  // Routed experts: one INT4 blob each, all in one page-aligned buffer.
  const int H = d.hidden_size, I = d.moe.expert_intermediate, E = d.moe.n_experts;
  if (d.n_moe_layers() > 0) {
    if (H % 2 != 0 || I % 2 != 0)
      return make_error(out->path_ + ": INT4 experts need even hidden and expert intermediate sizes");
    out->experts_q4_ = true;
    out->q4_group_ = blob_group_for(cfg.group_size);
    out->layout_ = expert_layout(H, I, out->q4_group_);
    const size_t stride = (out->layout_.blob_bytes + kPackedAlign - 1) / kPackedAlign * kPackedAlign;
    const size_t total = size_t(d.n_moe_layers()) * size_t(E) * stride;
    uint8_t* base = static_cast<uint8_t*>(std::aligned_alloc(kPackedAlign, total));
    if (!base) return make_error(out->path_ + ": cannot allocate " + std::to_string(total) + " bytes of INT4 experts");
    out->owned_.push_back(std::shared_ptr<const void>(base, [](const void* p) { std::free(const_cast<void*>(p)); }));
    out->expert_blobs_.assign(size_t(d.n_layers) * size_t(E), nullptr);

    // One matrix of one expert: a quantised Linear, or float weights.
    struct Part {
      const QLinear* q = nullptr;
      const TensorView* w = nullptr;
      const Q4MatrixLayout* m = nullptr;
    };
    size_t slot = 0;
    for (int l = 0; l < d.n_layers; ++l) {
      if (!d.layer_is_moe[size_t(l)]) continue;
      for (int e = 0; e < E; ++e, ++slot) {
        const ExpertWeightNames names = expert_weight_names(d, l, e);
        const ExpertLayout& L = out->layout_;
        std::vector<Part> parts;
        for (const auto& [name, m] : {std::pair{&names.gate, &L.gate}, std::pair{&names.up, &L.up},
                                      std::pair{&names.down, &L.down}}) {
          const std::string prefix = name->substr(0, name->size() - std::string(".weight").size());
          const std::string expected = shape_str({m->rows, m->cols});
          Part p;
          p.m = m;
          if (auto it = qlinears.find(prefix); it != qlinears.end()) {
            p.q = &it->second;
            if (p.q->out != m->rows || p.q->in != m->cols)
              return make_error(where(prefix + ".qweight") + ": the quantised expert matrix is [" +
                                std::to_string(p.q->out) + ", " + std::to_string(p.q->in) +
                                "] (out, in), the model needs " + expected);
            ++quantised_experts;
          } else if ((p.w = ck.find(*name))) {
            if (p.w->shape != std::vector<int64_t>{m->rows, m->cols})
              return make_error(where(*name) + ": has shape " + shape_str(p.w->shape) + ", expected " + expected);
            if (p.w->dtype != DType::bf16 && p.w->dtype != DType::f16 && p.w->dtype != DType::f32)
              return make_error(where(*name) + ": has dtype " + dtype_name(p.w->dtype) + ", not a float type");
            consumed.insert(*name);
          } else {
            return make_error(out->path_ + ": missing expert weight '" + *name + "' (neither '" + prefix +
                              ".qweight' nor '" + *name + "' is in the checkpoint)");
          }
          // Our blobs have no expert bias: accept one only when it is all zeros.
          if (const TensorView* b = ck.find(prefix + ".bias")) {
            const std::vector<float> v = to_f32(*b);
            if (std::any_of(v.begin(), v.end(), [](float x) { return x != 0.0f; }))
              return make_error(where(b->name) + ": routed experts with a bias are not supported");
            consumed.insert(b->name);
          }
          parts.push_back(p);
        }
        uint8_t* blob = base + slot * stride;
        out->expert_blobs_[size_t(l) * size_t(E) + size_t(e)] = blob;
        jobs.push_back([parts, blob, stride, &cfg, &requantised]() -> Status {
          std::memset(blob, 0, stride);
          for (const Part& p : parts) {
            if (p.w) {
              q4_quantize_matrix(to_f32(*p.w).data(), *p.m, blob);
              continue;
            }
            const Unpacked u = unpack(*p.q, cfg);
            if (write_exact(*p.q, u, *p.m, blob)) continue;
            // Groups that do not nest in ours (act-order g_idx, a group size
            // that is not a multiple of ours): through f32 and our quantiser.
            std::vector<float> w(size_t(p.q->out) * size_t(p.q->in));
            dequantize(*p.q, u, w.data());
            q4_quantize_matrix(w.data(), *p.m, blob);
            ++requantised;
          }
          return {};
        });
      }
    }
  }

  // Every other quantised Linear: dequantised to f32, under its plain name.
  std::set<std::string> expert_prefixes;
  for (int l = 0; l < d.n_layers && out->experts_q4_; ++l) {
    if (!d.layer_is_moe[size_t(l)]) continue;
    for (int e = 0; e < E; ++e) {
      const ExpertWeightNames n = expert_weight_names(d, l, e);
      for (const std::string* name : {&n.gate, &n.up, &n.down})
        expert_prefixes.insert(name->substr(0, name->size() - std::string(".weight").size()));
    }
  }
  for (const auto& [prefix, q] : qlinears) {
    if (expert_prefixes.count(prefix)) continue;
    auto buffer = std::make_shared<std::vector<float>>(size_t(q.out) * size_t(q.in));
    TensorView t;
    t.name = prefix + ".weight";
    t.dtype = DType::f32;
    t.shape = {q.out, q.in};
    t.data = reinterpret_cast<const uint8_t*>(buffer->data());
    t.nbytes = buffer->size() * sizeof(float);
    out->packed_tensors_.emplace(t.name, std::move(t));
    out->owned_.push_back(buffer);
    const QLinear* qp = &q;
    jobs.push_back([qp, buffer, &cfg]() -> Status {
      dequantize(*qp, unpack(*qp, cfg), buffer->data());
      return {};
    });
  }

  // Everything the checkpoint stores unquantised: a view of the mapping.
  for (const auto& [name, t] : ck.tensors())
    if (!consumed.count(name)) out->packed_tensors_.emplace(name, t);

  MOE_TRY(run_jobs(jobs));
  if (requantised > 0)
    std::fprintf(stderr,
                 "%s: %d of %d quantised expert matrices requantised with the INT4 quantiser: their "
                 "groups (%s, group size %d) do not nest in the blob's groups of %d\n",
                 out->path_.c_str(), requantised.load(), quantised_experts,
                 cfg.desc_act ? "act order" : "contiguous", cfg.group_size, out->q4_group_);
  out->packed_ = true;  // tensors are looked up in packed_tensors_
  return {};
}

}  // namespace moe
