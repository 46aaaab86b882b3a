// GPTQ and AWQ checkpoints made from the fixtures (tests/model/
// quantized_checkpoint_writer.h) open through ModelFiles::open: every expert
// blob against a dequantiser written from the published formulas, within
// the bias's half rounding where the groups nest (and within the INT4
// quantiser's bound where they do not: act order), every other quantised
// Linear as f32 exactly, unquantised tensors as stored; broken checkpoints
// rejected with the file and the tensor named.

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "model/int4.h"
#include "model/model_config.h"
#include "model/model_files.h"
#include "model/packed_model.h"
#include "model/quantized_checkpoint.h"
#include "tests/model/fixture_paths.h"
#include "tests/model/quantized_checkpoint_writer.h"
#include "tests/model/temp_dir.h"

namespace fs = std::filesystem;
using namespace moe;
using moe::test::fixture_dir;
using moe::test::QuantRecipe;
using moe::test::TempDir;

namespace {

struct Figures {
  float max_exact_err = 0;        // |w' - w| over experts carried over as stored
  float max_exact_rel_scale = 0;  // the same over the group's scale
  float max_requant_err = 0;      // experts that went through our quantiser
  size_t exact = 0, requantised = 0, dense = 0, plain_experts = 0;
};
Figures g_figures;

std::string expert_prefix(const std::string& weight_name) { return weight_name.substr(0, weight_name.size() - 7); }

void load_params(const uint8_t* blob, const Q4MatrixLayout& m, int row, int group, uint16_t* s, uint16_t* b) {
  const uint8_t* p = blob + m.params_offset + (size_t(row) * size_t(m.cols / m.group) + size_t(group)) * 4;
  std::memcpy(s, p, 2);
  std::memcpy(b, p + 2, 2);
}

// One expert matrix of a blob against the reference weights `w` [rows, cols].
// `g_idx` (the checkpoint's group of each input, empty for a plain bf16
// matrix) decides which bound applies.
void check_expert_matrix(const uint8_t* blob, const Q4MatrixLayout& m, const std::vector<float>& w,
                         const std::vector<int>& g_idx, const TensorView* scales, const std::string& what) {
  REQUIRE(w.size() == size_t(m.rows) * size_t(m.cols));
  // Carried over exactly when every group of ours sits inside one of theirs.
  bool nests = !g_idx.empty() && scales && scales->dtype == DType::f16;
  for (int c = 0; nests && c < m.cols; ++c) nests = g_idx[size_t(c)] == g_idx[size_t(c / m.group * m.group)];
  std::vector<float> row(size_t(m.cols));
  int bad_row = -1, bad_col = -1;
  for (int r = 0; r < m.rows && bad_row < 0; ++r) {
    q4_dequantize_row(blob, m, r, row.data());
    for (int c = 0; c < m.cols; ++c) {
      uint16_t s, b;
      load_params(blob, m, r, c / m.group, &s, &b);
      const float want = w[size_t(r) * size_t(m.cols) + size_t(c)];
      const float err = std::fabs(row[size_t(c)] - want);
      float bound;
      if (nests) {
        // scale is the checkpoint's half bit for bit; the bias half(-z*s)
        // is off by at most half an ulp of a half: 2^-11 relative, 2^-25
        // below half's normal range; f32 rounding of q*s + b on top.
        uint16_t file_s;
        std::memcpy(&file_s, scales->data + 2 * (size_t(g_idx[size_t(c)]) * size_t(m.rows) + size_t(r)), 2);
        if (s != file_s) {
          bad_row = r, bad_col = c;
          break;
        }
        bound = std::fabs(f16_to_f32(b)) * 0x1p-11f * (1 + 0x1p-10f) + 0x1p-25f + std::fabs(want) * 0x1p-22f;
        g_figures.max_exact_err = std::max(g_figures.max_exact_err, err);
        if (f16_to_f32(s) > 0) g_figures.max_exact_rel_scale = std::max(g_figures.max_exact_rel_scale, err / f16_to_f32(s));
      } else {
        // Through our quantiser (docs/int4-experts.md's bound).
        bound = f16_to_f32(s) / 2 + std::fabs(f16_to_f32(b)) * 0x1p-11f + 1e-6f;
        g_figures.max_requant_err = std::max(g_figures.max_requant_err, err);
      }
      if (err > bound) {
        bad_row = r, bad_col = c;
        break;
      }
    }
  }
  INFO(what << (nests ? " (carried over)" : " (requantised)") << ": first weight out of bounds at row " << bad_row
            << " col " << bad_col);
  CHECK(bad_row == -1);
  if (g_idx.empty())
    ++g_figures.plain_experts;
  else if (nests)
    ++g_figures.exact;
  else
    ++g_figures.requantised;
}

std::vector<int> groups_of(const Checkpoint& ck, const std::string& prefix, const nlohmann::json& qc, int in) {
  std::vector<int> g(static_cast<size_t>(in));
  const int G = qc.at("group_size").get<int>() > 0 ? qc.at("group_size").get<int>() : in;
  const TensorView* gi = ck.find(prefix + ".g_idx");
  for (int i = 0; i < in; ++i) {
    g[size_t(i)] = i / G;
    if (gi) std::memcpy(&g[size_t(i)], gi->data + 4 * size_t(i), 4);
  }
  return g;
}

// Opens the quantised folder `qdir` and checks every tensor and blob
// against the files read with the reference dequantiser.
void check_quantized_folder(const std::string& qdir, int expected_group) {
  auto opened = ModelFiles::open(qdir);
  INFO((opened.ok() ? std::string() : opened.error()));
  REQUIRE(opened.ok());
  const ModelFiles& F = **opened;
  const ModelDesc& d = F.desc();
  auto ck = Checkpoint::open_dir(qdir);
  REQUIRE(ck.ok());
  const nlohmann::json qc = moe::test::read_json(qdir + "/config.json").at("quantization_config");

  std::set<std::string> expert_weights;
  if (d.n_moe_layers() > 0) {
    REQUIRE(F.experts_q4());
    CHECK(F.q4_group() == expected_group);
    const ExpertLayout& L = F.expert_layout();
    CHECK(L.blob_bytes == expert_layout(d.hidden_size, d.moe.expert_intermediate, expected_group).blob_bytes);
    for (int l = 0; l < d.n_layers; ++l)
      for (int e = 0; e < d.moe.n_experts; ++e) {
        const uint8_t* blob = F.expert_q4(l, e);
        if (!d.layer_is_moe[size_t(l)]) {
          CHECK(blob == nullptr);
          continue;
        }
        REQUIRE(blob != nullptr);
        CHECK(reinterpret_cast<uintptr_t>(blob) % kPackedAlign == 0);
        const ExpertWeightNames n = expert_weight_names(d, l, e);
        for (const auto& [name, m] : {std::pair{&n.gate, &L.gate}, std::pair{&n.up, &L.up}, std::pair{&n.down, &L.down}}) {
          const std::string prefix = expert_prefix(*name);
          expert_weights.insert(*name);
          CHECK(F.find(*name) == nullptr);
          CHECK(F.find(prefix + ".qweight") == nullptr);
          if (ck->find(prefix + ".qweight")) {
            int rows = 0, cols = 0;
            const auto w = moe::test::reference_dequantize(*ck, prefix, qc, &rows, &cols);
            REQUIRE(rows == m->rows);
            REQUIRE(cols == m->cols);
            check_expert_matrix(blob, *m, w, groups_of(*ck, prefix, qc, cols), ck->find(prefix + ".scales"), prefix);
          } else {
            REQUIRE(ck->find(*name));
            check_expert_matrix(blob, *m, to_f32(*ck->find(*name)), {}, nullptr, *name);
          }
        }
      }
  } else {
    CHECK_FALSE(F.experts_q4());
  }

  // Every other tensor: dense quantised Linears as f32, equal to the
  // reference exactly; the rest as stored.
  size_t exposed = 0;
  for (const auto& [name, t] : ck->tensors()) {
    const auto dot = name.rfind('.');
    const std::string prefix = name.substr(0, dot), part = name.substr(dot);
    INFO(name);
    if (ck->find(prefix + ".qweight") && (part == ".qzeros" || part == ".scales" || part == ".g_idx")) {
      CHECK(F.find(name) == nullptr);
      continue;
    }
    if (part == ".qweight") {
      CHECK(F.find(name) == nullptr);
      if (expert_weights.count(prefix + ".weight")) continue;
      int rows = 0, cols = 0;
      const auto w = moe::test::reference_dequantize(*ck, prefix, qc, &rows, &cols);
      const TensorView* got = F.find(prefix + ".weight");
      REQUIRE(got);
      CHECK(got->dtype == DType::f32);
      CHECK(got->shape == std::vector<int64_t>{rows, cols});
      REQUIRE(got->nbytes == w.size() * sizeof(float));
      CHECK(std::memcmp(got->data, w.data(), got->nbytes) == 0);
      ++g_figures.dense;
      ++exposed;
      continue;
    }
    if (expert_weights.count(name)) continue;
    const TensorView* got = F.find(name);
    REQUIRE(got);
    CHECK(got->dtype == t.dtype);
    CHECK(got->shape == t.shape);
    REQUIRE(got->nbytes == t.nbytes);
    CHECK(std::memcmp(got->data, t.data, t.nbytes) == 0);
    ++exposed;
  }
  CHECK(F.tensors().size() == exposed);
}

struct Case {
  const char* fixture;
  QuantRecipe recipe;
  int blob_group;
  const char* label;
};

QuantRecipe gptq(int group, bool sym = false, bool desc_act = false, bool v2 = false) {
  QuantRecipe r;
  r.group = group;
  r.sym = sym;
  r.desc_act = desc_act;
  r.v2 = v2;
  return r;
}
QuantRecipe awq(int group) {
  QuantRecipe r;
  r.method = "awq";
  r.group = group;
  return r;
}

std::string open_error(const std::string& dir) {
  auto r = ModelFiles::open(dir);
  return r.ok() ? std::string("(opened)") : r.error();
}

}  // namespace

TEST_CASE("GPTQ and AWQ checkpoints of every fixture open as INT4 experts and f32 Linears", "[quantized]") {
  const std::vector<Case> cases = {
      {"qwen3_moe", gptq(32), 32, "GPTQ v1 asym g32"},
      {"qwen3_moe", gptq(64, true), 64, "GPTQ v1 sym g64"},
      {"qwen3_moe", gptq(64, false, false, true), 64, "GPTQ v2 asym g64"},
      {"qwen3_moe", gptq(-1, true), 128, "GPTQ v1 sym, one group per row"},
      {"qwen3_moe", gptq(32, false, true), 32, "GPTQ v1 asym g32 act order"},
      {"qwen3_moe", awq(32), 32, "AWQ g32"},
      {"qwen3_moe", awq(64), 64, "AWQ g64 (K = 32 Linears stay bf16)"},
      {"mixtral", gptq(64), 64, "GPTQ v1 asym g64 (K = 96: two groups, ours of 32 nest)"},
      {"mixtral", gptq(32, true, true), 32, "GPTQ v1 sym g32 act order"},
      {"mixtral", awq(32), 32, "AWQ g32"},
      {"mixtral", awq(64), 64, "AWQ g64 (w2, K = 96, stays bf16)"},
      {"deepseek_v2", gptq(64, true), 64, "GPTQ v1 sym g64"},
      {"deepseek_v2", awq(32), 32, "AWQ g32"},
      {"qwen2_moe", gptq(32), 32, "GPTQ v1 asym g32"},
      {"olmoe", gptq(64, false, false, true), 64, "GPTQ v2 asym g64"},
      {"qwen2_dense", gptq(32), 0, "GPTQ v1 asym g32, a dense model"},
  };
  TempDir tmp("quantized");
  int k = 0;
  for (const Case& c : cases) {
    INFO(c.fixture << ": " << c.label);
    const std::string dir = (tmp.path / ("case" + std::to_string(k++))).string();
    moe::test::write_quantized_checkpoint(fixture_dir(c.fixture), dir, c.recipe);
    check_quantized_folder(dir, c.blob_group);
  }
  std::printf(
      "quantized checkpoints: %zu expert matrices carried over (max |w' - w| %.3g, %.3g of the scale), %zu "
      "requantised (max %.3g), %zu bf16 experts quantised, %zu dense Linears as f32 (exact)\n",
      g_figures.exact, double(g_figures.max_exact_err), double(g_figures.max_exact_rel_scale), g_figures.requantised,
      double(g_figures.max_requant_err), g_figures.plain_experts, g_figures.dense);
}

TEST_CASE("the nibble orders are the published ones", "[quantized]") {
  // Every word 0x76543210 (nibble n holds n), zeros stored 0, scales 1.
  TempDir tmp("nibbles");
  for (const char* method : {"gptq", "awq"}) {
    DYNAMIC_SECTION(method) {
      QuantRecipe r = std::string(method) == "awq" ? awq(32) : gptq(32);
      const std::string dir = (tmp.path / method).string();
      const std::string dense = "model.layers.0.self_attn.q_proj", expert = "model.layers.1.mlp.experts.5.gate_proj";
      moe::test::write_quantized_checkpoint(
          fixture_dir("qwen3_moe"), dir, r, [&](std::vector<moe::test::OwnedTensor>& ts, nlohmann::json&) {
            for (auto& t : ts) {
              const std::string& n = t.view.name;
              if (n.rfind(dense + ".", 0) != 0 && n.rfind(expert + ".", 0) != 0) continue;
              uint8_t* p = reinterpret_cast<uint8_t*>(t.bytes->data());
              if (n.size() > 8 && n.compare(n.size() - 8, 8, ".qweight") == 0)
                for (size_t i = 0; i < t.bytes->size(); i += 4) {
                  const uint32_t w = 0x76543210u;
                  std::memcpy(p + i, &w, 4);
                }
              if (n.size() > 7 && n.compare(n.size() - 7, 7, ".qzeros") == 0) std::memset(p, 0, t.bytes->size());
              if (n.size() > 7 && n.compare(n.size() - 7, 7, ".scales") == 0)
                for (size_t i = 0; i < t.bytes->size(); i += 2) {
                  const uint16_t one = 0x3c00;
                  std::memcpy(p + i, &one, 2);
                }
            }
          });
      auto f = ModelFiles::open(dir);
      REQUIRE(f.ok());
      // GPTQ: input i's code is nibble i % 8, and the v1 zero stored as 0 is 1.
      // AWQ: column 8c + j sits in nibble {0, 4, 1, 5, 2, 6, 3, 7}[j], zero 0.
      auto want = [&](int o, int i) -> float {
        static constexpr int kAwq[8] = {0, 4, 1, 5, 2, 6, 3, 7};
        return r.method == "awq" ? float(kAwq[o % 8]) : float(i % 8 - 1);
      };
      const TensorView* q = (*f)->find(dense + ".weight");
      REQUIRE(q);
      REQUIRE(q->dtype == DType::f32);
      const float* w = reinterpret_cast<const float*>(q->data);
      int wrong = 0;
      for (int o = 0; o < int(q->shape[0]); ++o)
        for (int i = 0; i < int(q->shape[1]); ++i) wrong += w[o * q->shape[1] + i] != want(o, i);
      CHECK(wrong == 0);
      const Q4MatrixLayout& m = (*f)->expert_layout().gate;
      std::vector<float> row(size_t(m.cols));
      wrong = 0;
      for (int o = 0; o < m.rows; ++o) {
        q4_dequantize_row((*f)->expert_q4(1, 5), m, o, row.data());
        for (int i = 0; i < m.cols; ++i) wrong += row[size_t(i)] != want(o, i);  // -z*s exact in half here
      }
      CHECK(wrong == 0);
    }
  }
}

TEST_CASE("quantization_config: what is read, what is refused, and ModelDesc ignores it", "[quantized]") {
  const std::string base = moe::test::read_file_text(fixture_dir("qwen3_moe") + "/config.json");
  auto with = [&](const nlohmann::json& qc) {
    auto j = nlohmann::json::parse(base);
    j["quantization_config"] = qc;
    return j.dump();
  };
  auto none = read_quantization_config(base);
  REQUIRE(none.ok());
  CHECK_FALSE(none->has_value());

  auto g = read_quantization_config(with({{"quant_method", "gptq"}, {"bits", 4}, {"group_size", 128},
                                          {"desc_act", true}, {"checkpoint_format", "gptq_v2"}}));
  REQUIRE(g.ok());
  REQUIRE(g->has_value());
  CHECK((*g)->method == QuantMethod::gptq);
  CHECK((*g)->group_size == 128);
  CHECK((*g)->desc_act);
  CHECK((*g)->gptq_v2);
  auto a = read_quantization_config(with({{"quant_method", "awq"}, {"bits", 4}, {"group_size", 64},
                                          {"version", "GEMM"}, {"modules_to_not_convert", {"visual"}}}));
  REQUIRE(a.ok());
  CHECK((*a)->method == QuantMethod::awq);
  CHECK((*a)->modules_to_not_convert == std::vector<std::string>{"visual"});

  auto refused = [&](const nlohmann::json& qc, const std::string& says) {
    auto r = read_quantization_config(with(qc));
    REQUIRE_FALSE(r.ok());
    INFO(r.error());
    CHECK(r.error().find(says) != std::string::npos);
  };
  refused({{"quant_method", "gptq"}, {"bits", 8}, {"group_size", 128}}, "bits is 8");
  refused({{"quant_method", "awq"}, {"bits", 3}, {"group_size", 128}}, "bits is 3");
  refused({{"quant_method", "exl2"}, {"bits", 4}}, "'exl2' is not supported");
  refused({{"quant_method", "awq"}, {"bits", 4}, {"group_size", 128}, {"version", "gemv"}}, "'gemv'");
  refused({{"quant_method", "gptq"}, {"bits", 4}, {"group_size", 128}, {"checkpoint_format", "marlin"}}, "'marlin'");
  refused({{"quant_method", "gptq"}, {"bits", 4}}, "group_size");
  refused({{"quant_method", "awq"}, {"bits", 4}, {"group_size", 128}, {"zero_point", false}}, "zero_point");

  // The model description does not look at quantization_config.
  auto plain = parse_model_desc(base);
  auto quant = parse_model_desc(with({{"quant_method", "gptq"}, {"bits", 4}, {"group_size", 128}}));
  REQUIRE(plain.ok());
  REQUIRE(quant.ok());
  CHECK(plain->hidden_size == quant->hidden_size);
  CHECK(plain->moe.n_experts == quant->moe.n_experts);
  CHECK(plain->n_layers == quant->n_layers);
}

TEST_CASE("broken GPTQ and AWQ checkpoints are refused, naming the file and the tensor", "[quantized]") {
  TempDir tmp("quantized_bad");
  const std::string dir = (tmp.path / "q").string();
  const std::string file = dir + "/model.safetensors";
  const std::string up = "model.layers.0.mlp.experts.3.up_proj";
  using moe::test::OwnedTensor;
  auto write = [&](const QuantRecipe& r, const std::function<void(std::vector<OwnedTensor>&, nlohmann::json&)>& edit) {
    fs::remove_all(dir);
    moe::test::write_quantized_checkpoint(fixture_dir("qwen3_moe"), dir, r, edit);
  };
  auto drop = [](std::vector<OwnedTensor>& ts, const std::string& name) {
    ts.erase(std::remove_if(ts.begin(), ts.end(), [&](const OwnedTensor& t) { return t.view.name == name; }), ts.end());
  };

  SECTION("bits 8") {
    write(gptq(64), [](auto&, nlohmann::json& c) { c["quantization_config"]["bits"] = 8; });
    const std::string e = open_error(dir);
    INFO(e);
    CHECK(e.find(dir + "/config.json") != std::string::npos);
    CHECK(e.find("bits is 8") != std::string::npos);
  }
  SECTION("an unknown method") {
    write(gptq(64), [](auto&, nlohmann::json& c) { c["quantization_config"]["quant_method"] = "hqq"; });
    CHECK(open_error(dir).find("'hqq' is not supported") != std::string::npos);
  }
  SECTION("missing scales") {
    write(awq(32), [&](auto& ts, nlohmann::json&) { drop(ts, up + ".scales"); });
    const std::string e = open_error(dir);
    INFO(e);
    CHECK(e.find(file) != std::string::npos);
    CHECK(e.find(up + ".scales") != std::string::npos);
    CHECK(e.find("missing") != std::string::npos);
  }
  SECTION("missing zeros") {
    write(gptq(64), [&](auto& ts, nlohmann::json&) { drop(ts, "model.layers.1.self_attn.o_proj.qzeros"); });
    CHECK(open_error(dir).find("model.layers.1.self_attn.o_proj.qzeros") != std::string::npos);
  }
  SECTION("scales of the wrong group count") {
    write(gptq(32), [&](auto& ts, nlohmann::json&) {
      for (auto& t : ts)
        if (t.view.name == up + ".scales")
          t = moe::test::owned_tensor(t.view.name, DType::f16, {1, t.view.shape[1]},
                                      t.bytes->substr(0, size_t(t.view.shape[1]) * 2));
    });
    const std::string e = open_error(dir);
    INFO(e);
    CHECK(e.find(file + ": tensor '" + up + ".scales'") != std::string::npos);
    CHECK(e.find("expected [2, 32]") != std::string::npos);
  }
  SECTION("qzeros of the wrong shape") {
    write(gptq(32), [&](auto& ts, nlohmann::json&) {
      for (auto& t : ts)
        if (t.view.name == up + ".qzeros") t.view.shape = {int64_t(t.view.nbytes / 4)};
    });
    CHECK(open_error(dir).find(up + ".qzeros") != std::string::npos);
  }
  SECTION("an expert of the wrong size") {
    write(gptq(32), [&](auto&, nlohmann::json& c) { c["moe_intermediate_size"] = 64; });
    const std::string e = open_error(dir);
    INFO(e);
    CHECK(e.find("model.layers.0.mlp.experts.0.gate_proj.qweight") != std::string::npos);
    CHECK(e.find("[64, 64]") != std::string::npos);
  }
  SECTION("act order without g_idx") {
    write(gptq(32, false, true), [&](auto& ts, nlohmann::json&) { drop(ts, up + ".g_idx"); });
    CHECK(open_error(dir).find(up + ".g_idx") != std::string::npos);
  }
  SECTION("g_idx naming a group that is not there") {
    write(gptq(32), [&](auto& ts, nlohmann::json&) {
      for (auto& t : ts)
        if (t.view.name == up + ".g_idx") {
          const int32_t big = 7;
          std::memcpy(t.bytes->data(), &big, 4);
        }
    });
    const std::string e = open_error(dir);
    INFO(e);
    CHECK(e.find(up + ".g_idx") != std::string::npos);
    CHECK(e.find("group 7") != std::string::npos);
  }
  SECTION("a Linear both quantised and plain") {
    write(gptq(32), [&](auto& ts, nlohmann::json&) {
      ts.push_back(moe::test::owned_tensor("model.layers.0.self_attn.q_proj.weight", DType::f32, {1}, std::string(4, '\0')));
    });
    CHECK(open_error(dir).find("both quantised") != std::string::npos);
  }
}

TEST_CASE("moe convert packs a GPTQ folder with its INT4 experts as they open", "[quantized][packed]") {
  TempDir tmp("quantized_pack");
  const std::string dir = (tmp.path / "q").string(), out = (tmp.path / "q.moepack").string();
  moe::test::write_quantized_checkpoint(fixture_dir("mixtral"), dir, gptq(32));
  PackOptions opts;  // group 64 asked; the checkpoint's 32 is kept
  REQUIRE(write_packed_model(dir, out, opts).ok());
  auto folder = ModelFiles::open(dir);
  auto packed = ModelFiles::open(out);
  REQUIRE(folder.ok());
  INFO((packed.ok() ? std::string() : packed.error()));
  REQUIRE(packed.ok());
  const ModelFiles& F = **folder;
  const ModelFiles& P = **packed;
  REQUIRE(P.experts_q4());
  CHECK(P.q4_group() == 32);
  REQUIRE(P.expert_layout().blob_bytes == F.expert_layout().blob_bytes);
  const ModelDesc& d = F.desc();
  for (int l = 0; l < d.n_layers; ++l)
    for (int e = 0; e < d.moe.n_experts; ++e)
      CHECK(std::memcmp(P.expert_q4(l, e), F.expert_q4(l, e), F.expert_layout().blob_bytes) == 0);
  REQUIRE(P.tensors().size() == F.tensors().size());
  for (const auto& [name, t] : F.tensors()) {
    INFO(name);
    const TensorView* p = P.find(name);
    REQUIRE(p);
    CHECK(p->dtype == t.dtype);
    REQUIRE(p->nbytes == t.nbytes);
    CHECK(std::memcmp(p->data, t.data, t.nbytes) == 0);
  }
  opts.quantize_experts = false;
  const Status s = write_packed_model(dir, out + "2", opts);
  REQUIRE_FALSE(s.ok());
  CHECK(s.error().find("INT4 already") != std::string::npos);
}

TEST_CASE("a sharded GPTQ checkpoint opens, and its errors name the shard", "[quantized]") {
  TempDir tmp("quantized_shards");
  const std::string dir = (tmp.path / "q").string();
  const std::string up = "model.layers.1.mlp.experts.2.up_proj";
  auto write_sharded = [&](bool break_scales) {
    fs::remove_all(dir);
    moe::test::write_quantized_checkpoint(fixture_dir("qwen3_moe"), dir, gptq(32),
                                          [&](std::vector<moe::test::OwnedTensor>& ts, nlohmann::json&) {
                                            if (!break_scales) return;
                                            for (auto& t : ts)
                                              if (t.view.name == up + ".scales") t.view.shape = {t.view.shape[1], 2};
                                          });
    // Layer 1 in a second shard, everything else in the first.
    const std::string single = dir + "/model.safetensors";
    {
      auto ck = Checkpoint::open_file(single);
      REQUIRE(ck.ok());
      std::vector<const TensorView*> a, b;
      nlohmann::json map = nlohmann::json::object();
      for (const auto& [name, t] : ck->tensors()) {
        const bool second = name.rfind("model.layers.1.", 0) == 0;
        (second ? b : a).push_back(&t);
        map[name] = second ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors";
      }
      moe::test::write_safetensors(dir + "/model-00001-of-00002.safetensors", a);
      moe::test::write_safetensors(dir + "/model-00002-of-00002.safetensors", b);
      std::ofstream(dir + "/model.safetensors.index.json") << nlohmann::json{{"weight_map", map}}.dump();
    }
    fs::remove(single);
  };
  write_sharded(false);
  check_quantized_folder(dir, 32);
  write_sharded(true);
  const std::string e = open_error(dir);
  INFO(e);
  CHECK(e.find(dir + "/model-00002-of-00002.safetensors: tensor '" + up + ".scales'") != std::string::npos);
}
