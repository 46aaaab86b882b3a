// The packed model file: every fixture and the demo model converted, read
// back through ModelFiles and compared with the checkpoint folder; INT4
// experts within the quantisation bound; damaged files rejected.

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

#include "model/int4.h"
#include "model/model_files.h"
#include "model/packed_model.h"
#include "tests/model/fixture_paths.h"
#include "tests/model/temp_dir.h"

namespace fs = std::filesystem;
using namespace moe;
using moe::test::fixture_dir;
using moe::test::fixture_names;
using moe::test::TempDir;

namespace {

void check_same_desc(const ModelDesc& a, const ModelDesc& b) {
  CHECK(a.arch == b.arch);
  CHECK(a.model_type == b.model_type);
  CHECK(a.vocab_size == b.vocab_size);
  CHECK(a.hidden_size == b.hidden_size);
  CHECK(a.n_layers == b.n_layers);
  CHECK(a.n_heads == b.n_heads);
  CHECK(a.n_kv_heads == b.n_kv_heads);
  CHECK(a.head_dim == b.head_dim);
  CHECK(a.intermediate_size == b.intermediate_size);
  CHECK(a.rms_eps == b.rms_eps);
  CHECK(a.tie_embeddings == b.tie_embeddings);
  CHECK(a.qkv_bias == b.qkv_bias);
  CHECK(a.qk_norm == b.qk_norm);
  CHECK(a.attention == b.attention);
  CHECK(a.mla.kv_lora_rank == b.mla.kv_lora_rank);
  CHECK(a.mla.q_lora_rank == b.mla.q_lora_rank);
  CHECK(a.rope.theta == b.rope.theta);
  CHECK(a.rope.type == b.rope.type);
  CHECK(a.moe.n_experts == b.moe.n_experts);
  CHECK(a.moe.top_k == b.moe.top_k);
  CHECK(a.moe.norm_topk_prob == b.moe.norm_topk_prob);
  CHECK(a.moe.expert_intermediate == b.moe.expert_intermediate);
  CHECK(a.moe.shared_intermediate == b.moe.shared_intermediate);
  CHECK(a.moe.shared_expert_gate == b.moe.shared_expert_gate);
  CHECK(a.layer_is_moe == b.layer_is_moe);
  CHECK(a.max_position == b.max_position);
  CHECK(a.eos_token_ids == b.eos_token_ids);
  CHECK(a.bos_token_id == b.bos_token_id);
}

bool page_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kPackedAlign == 0; }

// Checks one INT4 matrix of a blob against the checkpoint's weights, with the
// bound of docs/int4-experts.md.
void check_q4_matrix(const uint8_t* blob, const Q4MatrixLayout& m, const TensorView& src) {
  const std::vector<float> w = to_f32(src);
  REQUIRE(w.size() == size_t(m.rows) * size_t(m.cols));
  std::vector<float> row(static_cast<size_t>(m.cols));
  int bad_row = -1, bad_col = -1;  // the first weight out of bounds
  for (int r = 0; r < m.rows && bad_row < 0; ++r) {
    q4_dequantize_row(blob, m, r, row.data());
    const uint8_t* params = blob + m.params_offset + size_t(r) * size_t(m.cols / m.group) * 4;
    for (int c = 0; c < m.cols; ++c) {
      uint16_t sb[2];
      std::memcpy(sb, params + size_t(c / m.group) * 4, 4);
      const float bound = f16_to_f32(sb[0]) / 2 + std::fabs(f16_to_f32(sb[1])) * 0x1p-11f + 1e-6f;
      if (std::fabs(row[size_t(c)] - w[size_t(r) * size_t(m.cols) + size_t(c)]) > bound) {
        bad_row = r;
        bad_col = c;
        break;
      }
    }
  }
  INFO(src.name << ": first weight out of bounds at row " << bad_row << " col " << bad_col);
  CHECK(bad_row == -1);
}

// Converts `dir` and checks the packed file against the folder.
void check_conversion(const std::string& dir, const std::string& out, int group) {
  PackOptions opts;
  opts.group_size = group;
  size_t calls = 0, last_done = 0, last_total = 0;
  opts.progress = [&](size_t done, size_t total, uint64_t, uint64_t) {
    ++calls;
    last_done = done;
    last_total = total;
  };
  Status s = write_packed_model(dir, out, opts);
  INFO(s.error());
  REQUIRE(s.ok());
  CHECK_FALSE(fs::exists(out + ".tmp"));
  CHECK(last_done == last_total);
  CHECK(calls == last_total + 1);

  auto folder = ModelFiles::open(dir);
  auto packed = ModelFiles::open(out);
  REQUIRE(folder.ok());
  INFO((packed.ok() ? "" : packed.error()));
  REQUIRE(packed.ok());
  const ModelFiles& F = **folder;
  const ModelFiles& P = **packed;
  CHECK_FALSE(F.is_packed());
  CHECK(P.is_packed());
  check_same_desc(F.desc(), P.desc());
  const ModelDesc& d = F.desc();

  for (const std::string& name : ModelFiles::text_file_names())
    CHECK(P.tokenizer_file(name) == F.tokenizer_file(name));
  CHECK(!P.tokenizer_file("tokenizer.json").empty());

  // Non-expert tensors: byte-identical and page aligned; expert matrices gone.
  size_t n_plain = 0, n_expert_matrices = 0;
  for (const auto& [name, t] : F.tensors()) {
    INFO(name);
    const bool is_expert = name.find(".experts.") != std::string::npos;
    const TensorView* p = P.find(name);
    if (is_expert && d.n_moe_layers() > 0) {
      CHECK(p == nullptr);
      ++n_expert_matrices;
      continue;
    }
    REQUIRE(p != nullptr);
    CHECK(p->dtype == t.dtype);
    CHECK(p->shape == t.shape);
    REQUIRE(p->nbytes == t.nbytes);
    CHECK(std::memcmp(p->data, t.data, t.nbytes) == 0);
    CHECK(page_aligned(p->data));
    ++n_plain;
  }
  CHECK(P.tensors().size() == n_plain);
  CHECK(n_expert_matrices == size_t(3 * d.n_moe_layers() * d.moe.n_experts));

  if (d.n_moe_layers() == 0) {
    CHECK_FALSE(P.experts_q4());
    return;
  }
  REQUIRE(P.experts_q4());
  CHECK(P.q4_group() == group);
  const ExpertLayout& L = P.expert_layout();
  CHECK(L.hidden == d.hidden_size);
  CHECK(L.inter == d.moe.expert_intermediate);
  CHECK(L.blob_bytes == expert_layout(d.hidden_size, d.moe.expert_intermediate, group).blob_bytes);
  for (int l = 0; l < d.n_layers; ++l) {
    for (int e = 0; e < d.moe.n_experts; ++e) {
      const uint8_t* blob = P.expert_q4(l, e);
      if (!d.layer_is_moe[size_t(l)]) {
        CHECK(blob == nullptr);
        continue;
      }
      REQUIRE(blob != nullptr);
      CHECK(page_aligned(blob));
      const ExpertWeightNames n = expert_weight_names(d, l, e);
      check_q4_matrix(blob, L.gate, *F.find(n.gate));
      check_q4_matrix(blob, L.up, *F.find(n.up));
      check_q4_matrix(blob, L.down, *F.find(n.down));
    }
  }
  CHECK(P.expert_q4(0, d.moe.n_experts) == nullptr);
  CHECK(P.expert_q4(d.n_layers, 0) == nullptr);
}

std::string copy_prefix(const std::string& src, const std::string& dst, size_t bytes) {
  std::ifstream in(src, std::ios::binary);
  std::string buf(bytes, '\0');
  in.read(buf.data(), std::streamsize(bytes));
  std::ofstream(dst, std::ios::binary).write(buf.data(), std::streamsize(bytes));
  return dst;
}

// Rewrites the JSON header of a packed file in place; the edit must not make
// the header longer than the room before the data.
void rewrite_header(const std::string& path, const std::function<void(nlohmann::json&)>& edit) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  uint8_t prefix[kPackedPrefixBytes];
  f.read(reinterpret_cast<char*>(prefix), sizeof prefix);
  uint64_t n = 0, data_offset = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[16 + i];
  for (int i = 7; i >= 0; --i) data_offset = (data_offset << 8) | prefix[24 + i];
  std::string text(n, '\0');
  f.read(text.data(), std::streamsize(n));
  auto h = nlohmann::json::parse(text);
  edit(h);
  const std::string out = h.dump();
  REQUIRE(kPackedPrefixBytes + out.size() <= data_offset);
  for (int i = 0; i < 8; ++i) prefix[16 + i] = uint8_t(uint64_t(out.size()) >> (8 * i));
  f.seekp(0);
  f.write(reinterpret_cast<const char*>(prefix), sizeof prefix);
  f.write(out.data(), std::streamsize(out.size()));
}

long resident_kb() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}

}  // namespace

TEST_CASE("every fixture converts, and the packed file reads back like the folder", "[packed]") {
  TempDir tmp("pack");
  for (const auto& name : fixture_names()) {
    INFO("fixture " << name);
    check_conversion(fixture_dir(name), (tmp.path / (name + ".moepack")).string(), 64);
  }
}

TEST_CASE("group sizes 32 and 128, Mixtral's K = 96 falling back to 32", "[packed]") {
  TempDir tmp("groups");
  check_conversion(fixture_dir("mixtral"), (tmp.path / "m128.moepack").string(), 128);
  check_conversion(fixture_dir("olmoe"), (tmp.path / "o32.moepack").string(), 32);
  auto m = ModelFiles::open((tmp.path / "m128.moepack").string());
  REQUIRE(m.ok());
  CHECK((*m)->expert_layout().gate.group == 64);  // K = hidden = 64
  CHECK((*m)->expert_layout().down.group == 32);  // K = 96
}

TEST_CASE("the demo model converts and maps without copying", "[packed]") {
  TempDir tmp("demo");
  const std::string out = (tmp.path / "demo.moepack").string();
  check_conversion(moe::test::demo_model_dir(), out, 64);
  const size_t file_bytes = fs::file_size(out);
  // INT4 experts: the packed file is well under the bf16 checkpoint.
  CHECK(file_bytes < fs::file_size(moe::test::demo_model_dir() + "/model.safetensors") / 2);

  const long before = resident_kb();
  auto m = ModelFiles::open(out);
  REQUIRE(m.ok());
  // Touch every page of every tensor and blob.
  volatile uint8_t sink = 0;
  for (const auto& [name, t] : (*m)->tensors())
    for (size_t i = 0; i < t.nbytes; i += 4096) sink = sink + t.data[i];
  for (int l = 0; l < (*m)->desc().n_layers; ++l)
    for (int e = 0; e < (*m)->desc().moe.n_experts; ++e)
      for (size_t i = 0; i < (*m)->expert_layout().blob_bytes; i += 4096)
        sink = sink + (*m)->expert_q4(l, e)[i];
  const long grown_kb = resident_kb() - before;
  INFO("resident memory grew by " << grown_kb << " KB for a " << file_bytes / 1024 << " KB file");
  CHECK(grown_kb < long(file_bytes / 1024) * 5 / 4 + 4096);
}

TEST_CASE("--no-quantize keeps every tensor, experts included, byte-identical", "[packed]") {
  TempDir tmp("noq");
  const std::string out = (tmp.path / "q2.moepack").string();
  PackOptions opts;
  opts.quantize_experts = false;
  REQUIRE(write_packed_model(fixture_dir("qwen2_moe"), out, opts).ok());
  auto folder = ModelFiles::open(fixture_dir("qwen2_moe"));
  auto packed = ModelFiles::open(out);
  REQUIRE(folder.ok());
  REQUIRE(packed.ok());
  CHECK_FALSE((*packed)->experts_q4());
  CHECK((*packed)->expert_q4(0, 0) == nullptr);
  REQUIRE((*packed)->tensors().size() == (*folder)->tensors().size());
  for (const auto& [name, t] : (*folder)->tensors()) {
    INFO(name);
    const TensorView* p = (*packed)->find(name);
    REQUIRE(p);
    REQUIRE(p->nbytes == t.nbytes);
    CHECK(std::memcmp(p->data, t.data, t.nbytes) == 0);
    CHECK(page_aligned(p->data));
  }
}

TEST_CASE("damaged packed files are rejected with a clear message", "[packed]") {
  TempDir tmp("damaged");
  const std::string good = (tmp.path / "good.moepack").string();
  REQUIRE(write_packed_model(fixture_dir("olmoe"), good, PackOptions{}).ok());
  const size_t size = fs::file_size(good);

  SECTION("cut in the data") {
    const std::string p = copy_prefix(good, (tmp.path / "cut.moepack").string(), size - 5000);
    auto r = ModelFiles::open(p);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find(p) != std::string::npos);
    CHECK(r.error().find("truncated") != std::string::npos);
  }
  SECTION("cut in the header") {
    const std::string p = copy_prefix(good, (tmp.path / "cut.moepack").string(), 200);
    auto r = ModelFiles::open(p);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("truncated") != std::string::npos);
  }
  SECTION("cut in the prefix") {
    const std::string p = copy_prefix(good, (tmp.path / "cut.moepack").string(), 12);
    auto r = ModelFiles::open(p);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find(p) != std::string::npos);
  }
  SECTION("another version") {
    std::fstream f(good, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f.put(char(9));
    f.close();
    auto r = ModelFiles::open(good);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("version 9") != std::string::npos);
  }
  SECTION("an expert missing from the tensor table") {
    rewrite_header(good, [](nlohmann::json& h) {
      auto& t = h["tensors"];
      for (auto it = t.begin(); it != t.end(); ++it)
        if ((*it)["name"] == "model.layers.1.experts.3.q4") {
          t.erase(it);
          break;
        }
    });
    auto r = ModelFiles::open(good);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("model.layers.1.experts.3.q4") != std::string::npos);
  }
  SECTION("a tensor whose size does not match its dtype") {
    rewrite_header(good, [](nlohmann::json& h) {
      for (auto& t : h["tensors"])
        if (t["name"] == "model.norm.weight") t["dtype"] = "F32";
    });
    auto r = ModelFiles::open(good);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("'model.norm.weight'") != std::string::npos);
  }
  SECTION("not a model at all") {
    const std::string p = (tmp.path / "text.txt").string();
    std::ofstream(p) << "hello, this is not a model file at all";
    auto r = ModelFiles::open(p);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("magic") != std::string::npos);
  }
}

TEST_CASE("conversion errors are reported, and leave no file behind", "[packed]") {
  TempDir tmp("converr");
  const std::string out = (tmp.path / "x.moepack").string();
  PackOptions opts;
  SECTION("a folder that is no checkpoint") {
    auto s = write_packed_model(tmp.path.string(), out, opts);
    REQUIRE_FALSE(s.ok());
    CHECK(s.error().find("config.json") != std::string::npos);
  }
  SECTION("a group size the format does not have") {
    opts.group_size = 48;
    auto s = write_packed_model(fixture_dir("olmoe"), out, opts);
    REQUIRE_FALSE(s.ok());
    CHECK(s.error().find("48") != std::string::npos);
  }
  SECTION("an output folder that does not exist") {
    const std::string bad = (tmp.path / "no" / "such" / "dir" / "x.moepack").string();
    auto s = write_packed_model(fixture_dir("olmoe"), bad, opts);
    REQUIRE_FALSE(s.ok());
    CHECK(s.error().find(bad + ".tmp") != std::string::npos);
  }
  SECTION("a checkpoint missing an expert") {
    for (const char* f : {"config.json", "generation_config.json"})
      fs::copy_file(fs::path(fixture_dir("olmoe")) / f, tmp.path / f);
    // A config that claims more experts than the weights hold.
    auto cfg = moe::test::read_json((tmp.path / "config.json").string());
    cfg["num_experts"] = 17;
    std::ofstream(tmp.path / "config.json", std::ios::trunc) << cfg.dump();
    fs::create_symlink(fs::path(fixture_dir("olmoe")) / "model.safetensors",
                       tmp.path / "model.safetensors");
    auto s = write_packed_model(tmp.path.string(), out, opts);
    REQUIRE_FALSE(s.ok());
    CHECK(s.error().find("model.layers.0.mlp.experts.16.gate_proj.weight") != std::string::npos);
  }
  CHECK_FALSE(fs::exists(out));
  CHECK_FALSE(fs::exists(out + ".tmp"));
}
