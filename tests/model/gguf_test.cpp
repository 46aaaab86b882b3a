// The GGUF reader against files llama.cpp's own tools made from our
// fixtures (tests/data/gguf/README.md): the container, each tensor type's
// dequantisation against llama.cpp's Python package (gguf-py) on the same
// bytes, the lossless move of Q4_0 / Q4_1 / Q4_K into our INT4 layout, the
// model description and names, and broken files.

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "model/gguf_file.h"
#include "model/gguf_model.h"
#include "model/gguf_quants.h"
#include "model/int4.h"
#include "model/model_files.h"
#include "model/safetensors.h"
#include "tests/model/fixture_paths.h"
#include "tests/model/gguf_writer.h"
#include "tests/model/temp_dir.h"

using namespace moe;
using namespace moe::test;
namespace fs = std::filesystem;

namespace {

std::string gguf_dir() { return std::string(MOE_TEST_DATA) + "/gguf"; }

std::vector<std::string> gguf_files() {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(gguf_dir()))
    if (e.path().extension() == ".gguf") out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::string stem_of(const std::string& path) { return fs::path(path).stem().string(); }

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

}  // namespace

TEST_CASE("every GGUF test file opens: header, metadata, tensor table", "[model][gguf]") {
  const auto files = gguf_files();
  REQUIRE(files.size() >= 6);
  for (const std::string& path : files) {
    INFO(path);
    auto g = GgufFile::open(path);
    REQUIRE(g.ok());
    CHECK((*g)->version() == 3);
    std::string arch;
    auto got = (*g)->get_string("general.architecture", &arch);
    REQUIRE(got.ok());
    CHECK(*got);
    CHECK((*g)->find_tensor("token_embd.weight") != nullptr);
    for (const GgufTensor& t : (*g)->tensors()) {
      const GgmlTypeInfo* info = ggml_type_info(t.type);
      REQUIRE(info != nullptr);
      CHECK(info->dequantizable);
      CHECK(t.nbytes == ggml_row_bytes(*info, t.ne[0]) * size_t(t.numel() / t.ne[0]));
    }
  }
}

TEST_CASE("dequantisation of every tensor type equals llama.cpp's gguf-py", "[model][gguf]") {
  std::map<std::string, int> types_seen;
  for (const std::string& path : gguf_files()) {
    const std::string ref_path = gguf_dir() + "/" + stem_of(path) + ".dequant.safetensors";
    if (!fs::exists(ref_path)) continue;
    INFO(path);
    auto g = GgufFile::open(path);
    REQUIRE(g.ok());
    auto ref = Checkpoint::open_file(ref_path);
    REQUIRE(ref.ok());
    for (const auto& [name, view] : ref->tensors()) {
      INFO(name);
      const GgufTensor* t = (*g)->find_tensor(name);
      REQUIRE(t != nullptr);
      const std::vector<float> want = to_f32(view);
      const int64_t row = t->ne[0];
      const int64_t rows = int64_t((want.size() + size_t(row) - 1) / size_t(row));
      std::vector<float> got(size_t(rows * row));
      const size_t row_bytes = ggml_row_bytes(*ggml_type_info(t->type), row);
      for (int64_t r = 0; r < rows; ++r)
        gguf_dequantize_row(t->type, t->data + size_t(r) * row_bytes, row, got.data() + r * row);
      float worst = 0, scale = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        worst = std::max(worst, std::abs(got[i] - want[i]));
        scale = std::max(scale, std::abs(want[i]));
      }
      // Both compute scale * code in f32; only the order of two products
      // may differ (one rounding of f32).
      CHECK(worst <= 2e-7f * scale);
      ++types_seen[ggml_type_info(t->type)->name];
    }
  }
  for (const char* type : {"F32", "Q8_0", "Q4_K", "Q6_K"}) {
    INFO(type);
    CHECK(types_seen[type] > 0);
  }
}

TEST_CASE("Q4_0, Q4_1 and Q4_K move into our INT4 layout with their codes", "[model][gguf]") {
  int matrices = 0;
  for (const std::string& path : gguf_files()) {
    auto g = GgufFile::open(path);
    REQUIRE(g.ok());
    for (const GgufTensor& t : (*g)->tensors()) {
      if (!gguf_maps_to_q4(t.type, 32) || t.ne.size() < 2) continue;
      INFO(path << ": " << t.name);
      const int cols = int(t.ne[0]);
      const int rows = int(std::min<int64_t>(t.ne[1], 64));
      const Q4MatrixLayout m = q4_matrix_layout(rows, cols, 32);
      REQUIRE(m.group == 32);
      std::vector<uint8_t> blob(q4_matrix_bytes(m));
      gguf_to_q4_rows(t.type, t.data, m, 0, rows, blob.data());
      const size_t row_bytes = ggml_row_bytes(*ggml_type_info(t.type), cols);
      std::vector<float> want(static_cast<size_t>(cols)), got(static_cast<size_t>(cols));
      for (int r = 0; r < rows; ++r) {
        gguf_dequantize_row(t.type, t.data + size_t(r) * row_bytes, cols, want.data());
        q4_dequantize_row(blob.data(), m, r, got.data());
        for (int g0 = 0; g0 < cols; g0 += 32) {
          // Q4_0/Q4_1: exact. Q4_K: the sub-block scale d*sc and offset
          // dmin*m are rounded to halves, so each weight moves by at most
          // 2^-11 * (15 * scale + |offset|) <= 2^-11 * 3 * max |w| of its group.
          float group_max = 0;
          for (int i = g0; i < g0 + 32; ++i) group_max = std::max(group_max, std::abs(want[size_t(i)]));
          const float tol = t.type == kGgmlQ4_K ? 3.0f / 2048 * group_max + 1e-7f : 0.0f;
          for (int i = g0; i < g0 + 32; ++i) REQUIRE(std::abs(got[size_t(i)] - want[size_t(i)]) <= tol);
        }
      }
      ++matrices;
    }
  }
  CHECK(matrices > 0);
}

TEST_CASE("a GGUF model opens as a ModelFiles with Hugging Face names", "[model][gguf]") {
  for (const std::string& fixture : fixture_names()) {
    const std::string path = gguf_dir() + "/" + fixture + "-q8_0.gguf";
    if (!fs::exists(path)) continue;
    INFO(path);
    auto files = ModelFiles::open(path);
    REQUIRE(files.ok());
    auto want = load_model_desc(fixture_dir(fixture));
    REQUIRE(want.ok());
    const ModelDesc& d = (*files)->desc();
    CHECK(d.arch == want->arch);
    CHECK(d.vocab_size == want->vocab_size);
    CHECK(d.hidden_size == want->hidden_size);
    CHECK(d.n_layers == want->n_layers);
    CHECK(d.n_heads == want->n_heads);
    CHECK(d.n_kv_heads == want->n_kv_heads);
    if (d.attention == AttentionKind::gqa) CHECK(d.head_dim == want->head_dim);
    CHECK(d.moe.n_experts == want->moe.n_experts);
    CHECK(d.moe.top_k == want->moe.top_k);
    CHECK(d.moe.expert_intermediate == want->moe.expert_intermediate);
    CHECK(d.moe.shared_intermediate == want->moe.shared_intermediate);
    CHECK(d.layer_is_moe == want->layer_is_moe);
    CHECK(d.tie_embeddings == want->tie_embeddings);
    CHECK(d.mla.kv_lora_rank == want->mla.kv_lora_rank);
    CHECK(d.mla.qk_nope_head_dim == want->mla.qk_nope_head_dim);
    CHECK(std::abs(d.rope.theta - want->rope.theta) <= 1e-3f * want->rope.theta);
    CHECK_FALSE((*files)->tokenizer_file("tokenizer.json").empty());
    // Every non-expert tensor of the checkpoint has its counterpart, same shape.
    auto ckpt = Checkpoint::open_dir(fixture_dir(fixture));
    REQUIRE(ckpt.ok());
    for (const auto& [name, view] : ckpt->tensors()) {
      if (name.find(".experts.") != std::string::npos) continue;
      if (name == "lm_head.weight" && d.tie_embeddings) continue;
      INFO(name);
      const TensorView* t = (*files)->find(name);
      REQUIRE(t != nullptr);
      CHECK(t->shape == view.shape);
    }
    if (d.moe.n_experts > 0) {
      CHECK((*files)->experts_q4());
      for (int l = 0; l < d.n_layers; ++l)
        CHECK(((*files)->expert_q4(l, d.moe.n_experts - 1) != nullptr) == bool(d.layer_is_moe[size_t(l)]));
    }
  }
}

TEST_CASE("a float GGUF's experts are views of the mapping by Hugging Face name", "[model][gguf]") {
  const std::string path = gguf_dir() + "/qwen3_moe-bf16.gguf";
  if (!fs::exists(path)) {
    WARN("no bf16 GGUF of qwen3_moe in tests/data/gguf");
    return;
  }
  auto files = ModelFiles::open(path);
  REQUIRE(files.ok());
  CHECK_FALSE((*files)->experts_q4());
  auto ckpt = Checkpoint::open_dir(fixture_dir("qwen3_moe"));
  REQUIRE(ckpt.ok());
  const std::string name = "model.layers.1.mlp.experts.3.down_proj.weight";
  const TensorView* got = (*files)->find(name);
  const TensorView* want = ckpt->find(name);
  REQUIRE(got != nullptr);
  REQUIRE(want != nullptr);
  CHECK(got->shape == want->shape);
  REQUIRE(got->nbytes == want->nbytes);
  CHECK(std::memcmp(got->data, want->data, want->nbytes) == 0);  // bf16 → bf16: the same bits
}

TEST_CASE("broken GGUF files are refused with the reason", "[model][gguf]") {
  const std::string path = gguf_dir() + "/qwen3_moe-q8_0.gguf";
  REQUIRE(fs::exists(path));
  const std::string bytes = read_file_text(path);
  TempDir tmp("gguf_broken");

  write_bytes(tmp.path / "truncated.gguf", bytes.substr(0, bytes.size() - 100));
  auto t = GgufFile::open((tmp.path / "truncated.gguf").string());
  REQUIRE_FALSE(t.ok());
  CHECK(t.error().find("truncated") != std::string::npos);

  write_bytes(tmp.path / "header.gguf", bytes.substr(0, 40));
  auto h = GgufFile::open((tmp.path / "header.gguf").string());
  REQUIRE_FALSE(h.ok());
  CHECK(h.error().find("file ends inside") != std::string::npos);

  std::string v = bytes;
  v[4] = 9;  // version 9
  write_bytes(tmp.path / "version.gguf", v);
  auto vv = GgufFile::open((tmp.path / "version.gguf").string());
  REQUIRE_FALSE(vv.ok());
  CHECK(vv.error().find("version 9") != std::string::npos);

  std::string c = bytes;
  c[8] = char(0xff), c[9] = char(0xff), c[10] = char(0xff), c[11] = char(0x7f);  // a huge tensor count
  write_bytes(tmp.path / "count.gguf", c);
  auto cc = GgufFile::open((tmp.path / "count.gguf").string());
  REQUIRE_FALSE(cc.ok());
  CHECK(cc.error().find("implausible") != std::string::npos);

  // A split model with a missing part names it.
  write_bytes(tmp.path / "m-00001-of-00002.gguf", bytes);
  auto sp = GgufFile::open((tmp.path / "m-00001-of-00002.gguf").string());
  REQUIRE_FALSE(sp.ok());
  CHECK(sp.error().find("m-00002-of-00002.gguf: missing") != std::string::npos);

  // ModelFiles says what it is.
  auto mf = ModelFiles::open((tmp.path / "truncated.gguf").string());
  REQUIRE_FALSE(mf.ok());
  CHECK(mf.error().find("truncated") != std::string::npos);
}

TEST_CASE("GGUF files changed in one place are refused with the reason, never read past", "[model][gguf]") {
  TempDir tmp("gguf_changed");
  auto qwen = GgufFile::open(gguf_dir() + "/qwen3_moe-q8_0.gguf");
  auto deepseek = GgufFile::open(gguf_dir() + "/deepseek_v2-q8_0.gguf");
  auto demo = GgufFile::open(gguf_dir() + "/demo-moe-q8_0.gguf");  // rows of 256: room for a K-quant block
  REQUIRE((qwen.ok() && deepseek.ok() && demo.ok()));
  // Rewritten unchanged, the file opens and serves the same tensors.
  GgufWriterFile::from(**qwen).write((tmp.path / "same.gguf").string());
  auto reopened = ModelFiles::open((tmp.path / "same.gguf").string());
  REQUIRE(reopened.ok());
  auto original = ModelFiles::open(gguf_dir() + "/qwen3_moe-q8_0.gguf");
  REQUIRE(original.ok());
  const TensorView* a = (*reopened)->find("model.layers.1.self_attn.q_proj.weight");
  const TensorView* b = (*original)->find("model.layers.1.self_attn.q_proj.weight");
  REQUIRE((a && b && a->nbytes == b->nbytes));
  CHECK(std::memcmp(a->data, b->data, a->nbytes) == 0);

  auto set_int = [](GgufWriterFile& f, const std::string& key, int64_t v) {
    f.set(key, gguf_integer(GgufValue::Kind::u64, v));
  };
  struct Case {
    const char* name;
    const GgufFile* base;
    std::function<void(GgufWriterFile&)> change;
    const char* says;
  };
  const Case cases[] = {
      {"a layer count of 400 million", qwen->get(),
       [&](GgufWriterFile& f) { set_int(f, "qwen3moe.block_count", 400000000); }, "out of range"},
      {"an expert count of a million", qwen->get(),
       [&](GgufWriterFile& f) { set_int(f, "qwen3moe.expert_count", 1000000); }, "out of range"},
      {"an alignment of 1", qwen->get(), [&](GgufWriterFile& f) { set_int(f, "general.alignment", 1); },
       "alignment"},
      {"a tensor name of 100 kB", qwen->get(),
       [](GgufWriterFile& f) { f.tensors[0].name = "blk.1." + std::string(100000, 'x'); }, "tensor name of"},
      {"dimensions whose product overflows", qwen->get(),
       [](GgufWriterFile& f) {
         f.tensors.push_back({"blk.0.extra.weight", kGgmlF32, {uint64_t(1) << 22, uint64_t(1) << 21, uint64_t(1) << 21}, ""});
       },
       "too many elements"},
      {"experts of a type we do not read", demo->get(),
       [](GgufWriterFile& f) {
         GgufWriterTensor* t = f.tensor("blk.0.ffn_up_exps.weight");
         REQUIRE(t != nullptr);
         REQUIRE(t->ne[0] == 256);
         t->type = kGgmlQ2_K;  // 84 bytes a block of 256 values
         t->bytes.assign(size_t(84) * t->ne[1] * t->ne[2], '\0');
       },
       "is Q2_K"},
      {"experts on a layer the metadata makes dense", deepseek->get(),
       [&](GgufWriterFile& f) { set_int(f, "deepseek2.leading_dense_block_count", 2); }, "makes dense"},
      {"kv_b halves that do not fit together", deepseek->get(),
       [](GgufWriterFile& f) {
         GgufWriterTensor* t = f.tensor("blk.1.attn_v_b.weight");
         REQUIRE(t != nullptr);
         t->ne.back() = 1;  // one head where attn_k_b has four
         t->bytes.resize(t->bytes.size() / 4);
       },
       "[kv_lora, v, heads]"},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    GgufWriterFile f = GgufWriterFile::from(*c.base);
    c.change(f);
    const std::string path = (tmp.path / "changed.gguf").string();
    f.write(path);
    auto m = ModelFiles::open(path);
    REQUIRE_FALSE(m.ok());
    INFO(m.error());
    CHECK(m.error().find(c.says) != std::string::npos);
  }

  // An array that claims more elements than the file has bytes left is
  // refused before anything is allocated for it.
  std::string bytes = GgufWriterFile::from(**qwen).bytes();
  const std::string key = "tokenizer.ggml.tokens";
  const size_t at = bytes.find(key);
  REQUIRE(at != std::string::npos);
  const uint64_t claimed = uint64_t(1) << 23;  // after the key: value type (4), element type (4), count (8)
  std::memcpy(&bytes[at + key.size() + 8], &claimed, 8);
  write_bytes(tmp.path / "vocab.gguf", bytes);
  auto v = ModelFiles::open((tmp.path / "vocab.gguf").string());
  REQUIRE_FALSE(v.ok());
  CHECK(v.error().find("the file ends before them") != std::string::npos);
}

TEST_CASE("a split GGUF (name-0000k-of-0000N.gguf) opens from its first part as the whole file", "[model][gguf]") {
  // The layout llama.cpp's gguf-split writes: every part a GGUF of its own,
  // the first holding the model's metadata, each part split.no / split.count
  // / split.tensors.count and its share of the tensors.
  TempDir tmp("gguf_split");
  auto whole = GgufFile::open(gguf_dir() + "/qwen3_moe-q8_0.gguf");
  REQUIRE(whole.ok());
  const GgufWriterFile all = GgufWriterFile::from(**whole);
  auto u16 = [](int64_t v) { return gguf_integer(GgufValue::Kind::u16, v); };
  auto i32 = [](int64_t v) { return gguf_integer(GgufValue::Kind::i32, v); };
  const size_t n = all.tensors.size(), cut = n / 3;
  const std::pair<size_t, size_t> ranges[] = {{0, cut}, {cut, 2 * cut}, {2 * cut, n}};
  for (int part = 0; part < 3; ++part) {
    GgufWriterFile f;
    if (part == 0) f.meta = all.meta;
    f.meta.emplace_back("split.no", u16(part));
    f.meta.emplace_back("split.count", u16(3));
    f.meta.emplace_back("split.tensors.count", i32(int64_t(n)));
    f.tensors.assign(all.tensors.begin() + ptrdiff_t(ranges[part].first), all.tensors.begin() + ptrdiff_t(ranges[part].second));
    f.write((tmp.path / ("m-0000" + std::to_string(part + 1) + "-of-00003.gguf")).string());
  }
  auto split = ModelFiles::open((tmp.path / "m-00001-of-00003.gguf").string());
  REQUIRE(split.ok());
  auto one = ModelFiles::open(gguf_dir() + "/qwen3_moe-q8_0.gguf");
  REQUIRE(one.ok());
  CHECK((*split)->tensors().size() == (*one)->tensors().size());
  for (const auto& [name, view] : (*one)->tensors()) {
    INFO(name);
    const TensorView* got = (*split)->find(name);
    REQUIRE(got != nullptr);
    REQUIRE(got->nbytes == view.nbytes);
    CHECK(std::memcmp(got->data, view.data, view.nbytes) == 0);
  }
  const ModelDesc& d = (*one)->desc();
  for (int l = 0; l < d.n_layers; ++l) {
    const uint8_t* a = (*split)->expert_q4(l, 5);
    const uint8_t* b = (*one)->expert_q4(l, 5);
    REQUIRE((a && b));
    CHECK(std::memcmp(a, b, (*one)->expert_layout().blob_bytes) == 0);
  }
  // A part that disagrees about the count is refused.
  GgufWriterFile bad;
  bad.meta = all.meta;
  bad.meta.emplace_back("split.count", u16(2));
  bad.tensors = all.tensors;
  bad.write((tmp.path / "b-00001-of-00003.gguf").string());
  for (int part = 2; part <= 3; ++part)
    std::filesystem::copy_file(tmp.path / ("m-0000" + std::to_string(part) + "-of-00003.gguf"),
                               tmp.path / ("b-0000" + std::to_string(part) + "-of-00003.gguf"));
  auto b = GgufFile::open((tmp.path / "b-00001-of-00003.gguf").string());
  REQUIRE_FALSE(b.ok());
  CHECK(b.error().find("split.count says 2") != std::string::npos);
}
