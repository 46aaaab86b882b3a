// Checkpoint reading against the reference fixtures: every listed weight is
// found with its shape, bf16 decodes to what transformers computed, broken and
// truncated files are rejected by name, and sharded checkpoints load the same.

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "model/safetensors.h"
#include "tests/model/fixture_paths.h"
#include "tests/model/safetensors_writer.h"
#include "tests/model/temp_dir.h"

namespace fs = std::filesystem;
using namespace moe;
using moe::test::fixture_dir;
using moe::test::fixture_names;
using moe::test::TempDir;
using moe::test::write_raw_safetensors;
using moe::test::write_safetensors;

namespace {

bool is_reference_tensor(const std::string& name) {
  return name.size() >= 2 && name[0] == 'p' && std::isdigit(static_cast<unsigned char>(name[1]));
}

DType dtype_of_torch(const std::string& s) {
  if (s == "torch.bfloat16") return DType::bf16;
  if (s == "torch.float32") return DType::f32;
  if (s == "torch.int64") return DType::i64;
  FAIL("unexpected dtype " << s);
  return DType::u8;
}

std::string copy_prefix(const fs::path& src, const fs::path& dst, size_t bytes) {
  std::ifstream in(src, std::ios::binary);
  std::string buf(bytes, '\0');
  in.read(buf.data(), std::streamsize(bytes));
  std::ofstream out(dst, std::ios::binary);
  out.write(buf.data(), std::streamsize(bytes));
  return dst.string();
}

}  // namespace

TEST_CASE("every weight listed in reference.json is in model.safetensors with its shape",
          "[safetensors]") {
  for (const auto& name : fixture_names()) {
    INFO("fixture " << name);
    auto ck = Checkpoint::open_dir(fixture_dir(name));
    REQUIRE(ck.ok());
    const auto ref = moe::test::read_json(fixture_dir(name) + "/reference.json");
    size_t n_weights = 0;
    for (const auto& w : ref["weights"]) {
      const std::string wname = w[0].get<std::string>();
      if (is_reference_tensor(wname)) continue;
      INFO("weight " << wname);
      const TensorView* t = ck->find(wname);
      REQUIRE(t != nullptr);
      CHECK(t->shape == w[1].get<std::vector<int64_t>>());
      CHECK(t->dtype == dtype_of_torch(w[2].get<std::string>()));
      CHECK(t->nbytes == size_t(t->numel()) * 2);
      ++n_weights;
    }
    // The checkpoint holds the listed weights and nothing else.
    CHECK(ck->tensors().size() == n_weights);
  }
}

TEST_CASE("bf16 embedding rows decode to the hidden state transformers fed layer 0",
          "[safetensors]") {
  for (const auto& name : fixture_names()) {
    INFO("fixture " << name);
    auto ck = Checkpoint::open_dir(fixture_dir(name));
    auto ref = Checkpoint::open_file(fixture_dir(name) + "/reference.safetensors");
    REQUIRE(ck.ok());
    REQUIRE(ref.ok());
    const TensorView* emb = ck->find("model.embed_tokens.weight");
    const TensorView* ids = ref->find("p0.input_ids");
    const TensorView* h0 = ref->find("p0.hidden.0");
    REQUIRE(emb);
    REQUIRE(ids);
    REQUIRE(h0);
    REQUIRE(ids->dtype == DType::i64);
    REQUIRE(h0->dtype == DType::f32);
    const int64_t hidden = emb->shape[1];
    REQUIRE(h0->shape == std::vector<int64_t>{ids->shape[0], hidden});
    const std::vector<float> table = to_f32(*emb);
    const std::vector<float> want = to_f32(*h0);
    for (int64_t t = 0; t < ids->shape[0]; ++t) {
      int64_t id;
      std::memcpy(&id, ids->data + 8 * t, 8);
      REQUIRE(id >= 0);
      REQUIRE(id < emb->shape[0]);
      for (int64_t c = 0; c < hidden; ++c)
        REQUIRE(table[size_t(id * hidden + c)] == want[size_t(t * hidden + c)]);
    }
  }
}

TEST_CASE("bf16 and f16 conversions", "[safetensors]") {
  CHECK(bf16_to_f32(0x3f80) == 1.0f);
  CHECK(bf16_to_f32(0xc040) == -3.0f);
  CHECK(f32_to_bf16(1.0f) == 0x3f80);
  // Ties round to even: 1 + 2^-8 sits halfway between 0x3f80 and 0x3f81.
  CHECK(f32_to_bf16(1.00390625f) == 0x3f80);
  CHECK(f32_to_bf16(1.01171875f) == 0x3f82);
  CHECK(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));

  CHECK(f16_to_f32(0x3c00) == 1.0f);
  CHECK(f16_to_f32(0x7bff) == 65504.0f);
  CHECK(f16_to_f32(0x0001) == std::ldexp(1.0f, -24));
  CHECK(f32_to_f16(1.0f) == 0x3c00);
  CHECK(f32_to_f16(-2.0f) == 0xc000);
  CHECK(f32_to_f16(65504.0f) == 0x7bff);
  CHECK(f32_to_f16(70000.0f) == 0x7c00);
  CHECK(f32_to_f16(std::ldexp(1.0f, -24)) == 0x0001);
  CHECK(f32_to_f16(std::ldexp(1.0f, -26)) == 0x0000);
  CHECK(f32_to_f16(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);  // tie to even
  // Every finite half and bf16 survives the trip through f32 exactly.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t v = uint16_t(h);
    if ((v & 0x7c00) != 0x7c00) REQUIRE(f32_to_f16(f16_to_f32(v)) == v);
    if ((v & 0x7f80) != 0x7f80) REQUIRE(f32_to_bf16(bf16_to_f32(v)) == v);
  }
}

TEST_CASE("truncated copies of a real checkpoint are rejected naming the file and tensor",
          "[safetensors]") {
  const fs::path src = fs::path(fixture_dir("qwen3_moe")) / "model.safetensors";
  auto full = Checkpoint::open_file(src.string());
  REQUIRE(full.ok());
  const size_t size = fs::file_size(src);
  TempDir tmp("trunc");

  SECTION("cut inside the data") {
    // Drop the last 100 bytes: the tensors that ended there now run past the end.
    const std::string path = copy_prefix(src, tmp.path / "model.safetensors", size - 100);
    auto r = Checkpoint::open_file(path);
    REQUIRE_FALSE(r.ok());
    INFO(r.error());
    CHECK(r.error().find(path) != std::string::npos);
    CHECK(r.error().find("past the end") != std::string::npos);
    bool names_a_cut_tensor = false;
    const uint8_t* data_end =
        full->tensors().begin()->second.data;  // any tensor: find the region end
    for (const auto& [n, t] : full->tensors()) data_end = std::max(data_end, t.data + t.nbytes);
    for (const auto& [n, t] : full->tensors())
      if (t.data + t.nbytes > data_end - 100 && r.error().find("'" + n + "'") != std::string::npos)
        names_a_cut_tensor = true;
    CHECK(names_a_cut_tensor);
    // The folder form fails the same way.
    auto d = Checkpoint::open_dir(tmp.path.string());
    CHECK_FALSE(d.ok());
  }
  SECTION("cut inside the JSON header") {
    const std::string path = copy_prefix(src, tmp.path / "model.safetensors", 1000);
    auto r = Checkpoint::open_file(path);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find(path) != std::string::npos);
    CHECK(r.error().find("header length") != std::string::npos);
  }
  SECTION("cut inside the length prefix") {
    const std::string path = copy_prefix(src, tmp.path / "model.safetensors", 5);
    auto r = Checkpoint::open_file(path);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find(path) != std::string::npos);
  }
}

TEST_CASE("inconsistent headers are rejected naming the tensor", "[safetensors]") {
  TempDir tmp("bad");
  const std::string path = (tmp.path / "bad.safetensors").string();
  const std::string data(64, '\0');
  using nlohmann::json;

  SECTION("byte count does not match dtype and shape") {
    write_raw_safetensors(
        path, json{{"w", {{"dtype", "F32"}, {"shape", {4, 4}}, {"data_offsets", {0, 32}}}}}, data);
    auto r = Checkpoint::open_file(path);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("'w'") != std::string::npos);
    CHECK(r.error().find(path) != std::string::npos);
  }
  SECTION("unknown dtype") {
    write_raw_safetensors(
        path, json{{"w", {{"dtype", "Q4"}, {"shape", {8}}, {"data_offsets", {0, 4}}}}}, data);
    auto r = Checkpoint::open_file(path);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("'w'") != std::string::npos);
    CHECK(r.error().find("Q4") != std::string::npos);
  }
  SECTION("overlapping tensors") {
    write_raw_safetensors(
        path,
        json{{"a", {{"dtype", "F32"}, {"shape", {8}}, {"data_offsets", {0, 32}}}},
             {"b", {{"dtype", "F32"}, {"shape", {8}}, {"data_offsets", {16, 48}}}}},
        data);
    auto r = Checkpoint::open_file(path);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("overlap") != std::string::npos);
    CHECK(r.error().find("'a'") != std::string::npos);
    CHECK(r.error().find("'b'") != std::string::npos);
  }
  SECTION("offsets past the data region") {
    write_raw_safetensors(
        path, json{{"w", {{"dtype", "U8"}, {"shape", {32}}, {"data_offsets", {40, 72}}}}}, data);
    auto r = Checkpoint::open_file(path);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("'w'") != std::string::npos);
  }
  SECTION("every listed dtype is accepted") {
    json h = json::object();
    size_t off = 0;
    for (DType t : {DType::f32, DType::f16, DType::bf16, DType::f64, DType::i64, DType::i32,
                    DType::i16, DType::i8, DType::u8, DType::boolean}) {
      const size_t bytes = 2 * dtype_size(t);
      h[std::string("t_") + dtype_name(t)] = {
          {"dtype", dtype_name(t)}, {"shape", {2}}, {"data_offsets", {off, off + bytes}}};
      off += bytes;
    }
    write_raw_safetensors(path, h, std::string(off, '\0'));
    auto r = Checkpoint::open_file(path);
    REQUIRE(r.ok());
    CHECK(r->tensors().size() == 10);
    CHECK(r->find("t_BOOL")->dtype == DType::boolean);
  }
  SECTION("a missing file") {
    auto r = Checkpoint::open_file((tmp.path / "nope.safetensors").string());
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("nope.safetensors") != std::string::npos);
  }
}

TEST_CASE("a sharded checkpoint loads the same tensors as the single file", "[safetensors]") {
  auto single = Checkpoint::open_dir(fixture_dir("deepseek_v2"));
  REQUIRE(single.ok());
  TempDir tmp("shard");
  std::vector<const TensorView*> first, second;
  nlohmann::json weight_map = nlohmann::json::object();
  size_t i = 0;
  for (const auto& [name, t] : single->tensors()) {
    const bool in_first = i++ % 2 == 0;
    (in_first ? first : second).push_back(&t);
    weight_map[name] =
        in_first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  write_safetensors((tmp.path / "model-00001-of-00002.safetensors").string(), first);
  write_safetensors((tmp.path / "model-00002-of-00002.safetensors").string(), second);
  {
    std::ofstream idx(tmp.path / "model.safetensors.index.json");
    idx << nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}.dump(2);
  }

  auto sharded = Checkpoint::open_dir(tmp.path.string());
  REQUIRE(sharded.ok());
  REQUIRE(sharded->tensors().size() == single->tensors().size());
  for (const auto& [name, t] : single->tensors()) {
    INFO(name);
    const TensorView* s = sharded->find(name);
    REQUIRE(s);
    CHECK(s->dtype == t.dtype);
    CHECK(s->shape == t.shape);
    REQUIRE(s->nbytes == t.nbytes);
    CHECK(std::memcmp(s->data, t.data, t.nbytes) == 0);
  }

  SECTION("an index naming a tensor its shard lacks is rejected") {
    weight_map["model.extra.weight"] = "model-00001-of-00002.safetensors";
    std::ofstream(tmp.path / "model.safetensors.index.json")
        << nlohmann::json{{"weight_map", weight_map}}.dump();
    auto r = Checkpoint::open_dir(tmp.path.string());
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("model.extra.weight") != std::string::npos);
  }
  SECTION("a missing shard is rejected naming it") {
    fs::remove(tmp.path / "model-00002-of-00002.safetensors");
    auto r = Checkpoint::open_dir(tmp.path.string());
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("model-00002-of-00002.safetensors") != std::string::npos);
  }
}
