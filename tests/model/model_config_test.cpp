// config.json -> ModelDesc for the six architectures, checked against the
// fixture configs and against the shapes of the weights they describe.

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>

#include "model/model_config.h"
#include "model/safetensors.h"
#include "tests/model/fixture_paths.h"
#include "tests/model/temp_dir.h"

using namespace moe;
using moe::test::fixture_dir;
using moe::test::fixture_names;
using nlohmann::json;

namespace {

ModelDesc load(const std::string& fixture) {
  auto d = load_model_desc(fixture_dir(fixture));
  INFO(fixture << ": " << (d.ok() ? "" : d.error()));
  REQUIRE(d.ok());
  return *d;
}

json fixture_config(const std::string& fixture) {
  return moe::test::read_json(fixture_dir(fixture) + "/config.json");
}

// The error the qwen3_moe fixture's config gives with `key` set to `value`
// (it must give one).
std::string refusal(const char* key, const json& value) {
  json c = fixture_config("qwen3_moe");
  c[key] = value;
  INFO(key << " = " << value.dump());
  auto r = parse_model_desc(c.dump());
  REQUIRE_FALSE(r.ok());
  return r.error();
}

std::vector<int64_t> shape_of(const Checkpoint& ck, const std::string& name) {
  const TensorView* t = ck.find(name);
  INFO("tensor " << name);
  REQUIRE(t != nullptr);
  return t->shape;
}

}  // namespace

TEST_CASE("qwen2_moe: qkv bias, sigmoid-gated shared expert, no renormalising", "[config]") {
  const ModelDesc d = load("qwen2_moe");
  CHECK(d.arch == Arch::qwen2_moe);
  CHECK(d.model_type == "qwen2_moe");
  CHECK(d.vocab_size == 1027);
  CHECK(d.hidden_size == 64);
  CHECK(d.n_layers == 2);
  CHECK(d.n_heads == 4);
  CHECK(d.n_kv_heads == 2);
  CHECK(d.head_dim == 16);
  CHECK(d.qkv_bias);
  CHECK(d.qk_norm == QkNorm::none);
  CHECK(d.attention == AttentionKind::gqa);
  CHECK(d.moe.n_experts == 8);
  CHECK(d.moe.top_k == 2);
  CHECK_FALSE(d.moe.norm_topk_prob);
  CHECK(d.moe.expert_intermediate == 32);
  CHECK(d.moe.shared_intermediate == 64);
  CHECK(d.moe.shared_expert_gate);
  CHECK(d.rope.theta == 1000000.0f);
  CHECK(d.rope.type == "default");
  CHECK(d.rms_eps == 1e-6f);
  CHECK(d.layer_is_moe == std::vector<bool>{true, true});
  CHECK(d.eos_token_ids == std::vector<int32_t>{1026});
  CHECK(d.bos_token_id == -1);
  CHECK_FALSE(d.tie_embeddings);
}

TEST_CASE("qwen3_moe: per-head q/k norm, explicit head_dim, renormalised top-k", "[config]") {
  const ModelDesc d = load("qwen3_moe");
  CHECK(d.arch == Arch::qwen3_moe);
  CHECK(d.head_dim == 32);
  CHECK(d.n_heads == 4);
  CHECK(d.n_kv_heads == 2);
  CHECK(d.qk_norm == QkNorm::per_head);
  CHECK_FALSE(d.qkv_bias);
  CHECK(d.moe.n_experts == 16);
  CHECK(d.moe.top_k == 4);
  CHECK(d.moe.norm_topk_prob);
  CHECK(d.moe.expert_intermediate == 32);
  CHECK(d.moe.shared_intermediate == 0);
  CHECK_FALSE(d.moe.shared_expert_gate);
  CHECK(d.n_moe_layers() == 2);
  CHECK(d.max_position == 512);
}

TEST_CASE("mixtral: num_local_experts, renormalised top-2, head_dim null, BOS", "[config]") {
  const ModelDesc d = load("mixtral");
  CHECK(d.arch == Arch::mixtral);
  CHECK(d.head_dim == 16);  // null in config.json: hidden / heads
  CHECK(d.n_kv_heads == 2);
  CHECK(d.moe.n_experts == 8);
  CHECK(d.moe.top_k == 2);
  CHECK(d.moe.norm_topk_prob);
  CHECK(d.moe.expert_intermediate == 96);
  CHECK(d.rms_eps == 1e-5f);
  CHECK(d.rope.theta == 1000000.0f);
  CHECK(d.bos_token_id == 1);
  CHECK(d.eos_token_ids == std::vector<int32_t>{2});
  CHECK_FALSE(d.qkv_bias);
}

TEST_CASE("olmoe: whole-projection q/k norm, top-4 of 16 without renormalising", "[config]") {
  const ModelDesc d = load("olmoe");
  CHECK(d.arch == Arch::olmoe);
  CHECK(d.qk_norm == QkNorm::whole);
  CHECK(d.moe.n_experts == 16);
  CHECK(d.moe.top_k == 4);
  CHECK_FALSE(d.moe.norm_topk_prob);
  CHECK(d.moe.expert_intermediate == 32);
  CHECK(d.rope.theta == 10000.0f);
  CHECK(d.eos_token_ids == std::vector<int32_t>{768});
  CHECK(d.vocab_size == 771);
}

TEST_CASE("qwen2 dense: transformers-5 rope_parameters, tied embeddings, no MoE layer",
          "[config]") {
  const ModelDesc d = load("qwen2_dense");
  CHECK(d.arch == Arch::qwen2);
  CHECK(d.tie_embeddings);
  CHECK(d.qkv_bias);
  CHECK(d.intermediate_size == 160);
  CHECK(d.rope.theta == 1000000.0f);
  CHECK(d.layer_is_moe == std::vector<bool>{false, false});
  CHECK(d.n_moe_layers() == 0);
  CHECK(d.moe_layer_index(0) == -1);
}

TEST_CASE("deepseek_v2: MLA, shared experts, first layer dense", "[config]") {
  const ModelDesc d = load("deepseek_v2");
  CHECK(d.arch == Arch::deepseek_v2);
  CHECK(d.attention == AttentionKind::mla);
  CHECK(d.mla.q_lora_rank == 0);
  CHECK(d.mla.kv_lora_rank == 32);
  CHECK(d.mla.qk_nope_head_dim == 16);
  CHECK(d.mla.qk_rope_head_dim == 8);
  CHECK(d.mla.v_head_dim == 16);
  CHECK(d.moe.n_experts == 8);
  CHECK(d.moe.top_k == 3);
  CHECK(d.moe.n_shared_experts == 2);
  CHECK(d.moe.shared_intermediate == 64);
  CHECK_FALSE(d.moe.shared_expert_gate);
  CHECK(d.moe.routed_scaling == 1.0f);
  CHECK(d.moe.topk_method == "greedy");
  CHECK(d.moe.n_group == 1);
  CHECK(d.moe.topk_group == 1);
  CHECK(d.intermediate_size == 128);
  CHECK(d.layer_is_moe == std::vector<bool>{false, true, true});
  CHECK(d.moe_layer_index(0) == -1);
  CHECK(d.moe_layer_index(1) == 0);
  CHECK(d.moe_layer_index(2) == 1);
  CHECK(d.rope.theta == 10000.0f);
}

TEST_CASE("every fixture's description fits the shapes of its weights", "[config]") {
  for (const auto& name : fixture_names()) {
    INFO("fixture " << name);
    const ModelDesc d = load(name);
    auto ck = Checkpoint::open_dir(fixture_dir(name));
    REQUIRE(ck.ok());
    const int64_t H = d.hidden_size;
    CHECK(shape_of(*ck, "model.embed_tokens.weight") == std::vector<int64_t>{d.vocab_size, H});
    CHECK((ck->find("lm_head.weight") == nullptr) == d.tie_embeddings);
    for (int l = 0; l < d.n_layers; ++l) {
      INFO("layer " << l);
      const std::string p = "model.layers." + std::to_string(l) + ".";
      if (d.attention == AttentionKind::gqa) {
        CHECK(shape_of(*ck, p + "self_attn.q_proj.weight") ==
              std::vector<int64_t>{d.n_heads * d.head_dim, H});
        CHECK(shape_of(*ck, p + "self_attn.k_proj.weight") ==
              std::vector<int64_t>{d.n_kv_heads * d.head_dim, H});
        CHECK((ck->find(p + "self_attn.q_proj.bias") != nullptr) == d.qkv_bias);
        if (d.qk_norm == QkNorm::per_head)
          CHECK(shape_of(*ck, p + "self_attn.q_norm.weight") == std::vector<int64_t>{d.head_dim});
        if (d.qk_norm == QkNorm::whole) {
          CHECK(shape_of(*ck, p + "self_attn.q_norm.weight") ==
                std::vector<int64_t>{d.n_heads * d.head_dim});
          CHECK(shape_of(*ck, p + "self_attn.k_norm.weight") ==
                std::vector<int64_t>{d.n_kv_heads * d.head_dim});
        }
        if (d.qk_norm == QkNorm::none) CHECK(ck->find(p + "self_attn.q_norm.weight") == nullptr);
      } else {
        const int qk = d.mla.qk_nope_head_dim + d.mla.qk_rope_head_dim;
        CHECK(shape_of(*ck, p + "self_attn.q_proj.weight") ==
              std::vector<int64_t>{d.n_heads * qk, H});
        CHECK(shape_of(*ck, p + "self_attn.kv_a_proj_with_mqa.weight") ==
              std::vector<int64_t>{d.mla.kv_lora_rank + d.mla.qk_rope_head_dim, H});
        CHECK(shape_of(*ck, p + "self_attn.kv_b_proj.weight") ==
              std::vector<int64_t>{d.n_heads * (d.mla.qk_nope_head_dim + d.mla.v_head_dim),
                                   d.mla.kv_lora_rank});
        CHECK(shape_of(*ck, p + "self_attn.o_proj.weight") ==
              std::vector<int64_t>{H, d.n_heads * d.mla.v_head_dim});
      }

      const std::string moe_prefix = d.arch == Arch::mixtral ? p + "block_sparse_moe." : p + "mlp.";
      const std::string gate_name = d.arch == Arch::mixtral ? "w1" : "gate_proj";
      if (!d.layer_is_moe[size_t(l)]) {
        CHECK(shape_of(*ck, p + "mlp.gate_proj.weight") ==
              std::vector<int64_t>{d.intermediate_size, H});
        CHECK(ck->find(moe_prefix + "experts.0." + gate_name + ".weight") == nullptr);
        continue;
      }
      CHECK(shape_of(*ck, moe_prefix + "gate.weight") == std::vector<int64_t>{d.moe.n_experts, H});
      for (int e = 0; e < d.moe.n_experts; ++e)
        CHECK(shape_of(*ck, moe_prefix + "experts." + std::to_string(e) + "." + gate_name +
                                ".weight") == std::vector<int64_t>{d.moe.expert_intermediate, H});
      CHECK(ck->find(moe_prefix + "experts." + std::to_string(d.moe.n_experts) + "." + gate_name +
                     ".weight") == nullptr);
      if (d.arch == Arch::qwen2_moe) {
        CHECK(shape_of(*ck, p + "mlp.shared_expert.gate_proj.weight") ==
              std::vector<int64_t>{d.moe.shared_intermediate, H});
        CHECK(shape_of(*ck, p + "mlp.shared_expert_gate.weight") == std::vector<int64_t>{1, H});
      }
      if (d.arch == Arch::deepseek_v2)
        CHECK(shape_of(*ck, p + "mlp.shared_experts.up_proj.weight") ==
              std::vector<int64_t>{d.moe.shared_intermediate, H});
    }
  }
}

TEST_CASE("the demo model's description", "[config]") {
  auto d = load_model_desc(moe::test::demo_model_dir());
  REQUIRE(d.ok());
  CHECK(d->arch == Arch::qwen3_moe);
  CHECK(d->n_layers == 6);
  CHECK(d->moe.n_experts == 32);
  CHECK(d->moe.top_k == 4);
  CHECK(d->head_dim == 64);
  CHECK(d->eos_token_ids == std::vector<int32_t>{4096});
}

TEST_CASE("hub and transformers-5 spellings give the same description", "[config]") {
  json hub = fixture_config("qwen3_moe");
  json t5 = hub;
  t5.erase("rope_theta");
  t5.erase("rope_scaling");
  t5["rope_parameters"] = {{"rope_theta", 1000000.0}, {"rope_type", "default"}};
  t5.erase("num_experts");
  t5["num_local_experts"] = 16;
  auto a = parse_model_desc(hub.dump());
  auto b = parse_model_desc(t5.dump());
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a->rope.theta == b->rope.theta);
  CHECK(a->moe.n_experts == b->moe.n_experts);
  CHECK(a->head_dim == b->head_dim);

  // deepseek in hub spelling: rope_theta + yarn rope_scaling.
  json ds = fixture_config("deepseek_v2");
  ds.erase("rope_parameters");
  ds["rope_theta"] = 10000.0;
  ds["rope_scaling"] = {
      {"type", "yarn"},         {"factor", 40.0},   {"original_max_position_embeddings", 4096},
      {"beta_fast", 32.0},      {"beta_slow", 1.0}, {"mscale", 0.707},
      {"mscale_all_dim", 0.707}};
  ds["q_lora_rank"] = 1536;
  auto c = parse_model_desc(ds.dump());
  REQUIRE(c.ok());
  CHECK(c->rope.type == "yarn");
  CHECK(c->rope.factor == 40.0f);
  CHECK(c->rope.original_max_position == 4096);
  CHECK(c->rope.mscale_all_dim == Approx(0.707f));
  CHECK(c->mla.q_lora_rank == 1536);
}

TEST_CASE(
    "which layers are MoE follows decoder_sparse_step, mlp_only_layers, first_k_dense_replace and "
    "moe_layer_freq",
    "[config]") {
  json q = fixture_config("qwen2_moe");
  q["num_hidden_layers"] = 6;
  q["decoder_sparse_step"] = 2;
  q["mlp_only_layers"] = {3};
  auto a = parse_model_desc(q.dump());
  REQUIRE(a.ok());
  CHECK(a->layer_is_moe == std::vector<bool>{false, true, false, false, false, true});
  CHECK(a->moe_layer_index(5) == 1);

  json ds = fixture_config("deepseek_v2");
  ds["num_hidden_layers"] = 6;
  ds["first_k_dense_replace"] = 2;
  ds["moe_layer_freq"] = 2;
  auto b = parse_model_desc(ds.dump());
  REQUIRE(b.ok());
  CHECK(b->layer_is_moe == std::vector<bool>{false, false, true, false, true, false});
}

TEST_CASE("EOS ids come from config.json and generation_config.json, as int or list", "[config]") {
  json c = fixture_config("mixtral");
  c["eos_token_id"] = json::array({2, 7});
  auto a = parse_model_desc(c.dump(), R"({"eos_token_id": [7, 9], "bos_token_id": 1})");
  REQUIRE(a.ok());
  CHECK(a->eos_token_ids == std::vector<int32_t>{2, 7, 9});
  CHECK(a->bos_token_id == 1);

  c["eos_token_id"] = nullptr;
  c["bos_token_id"] = nullptr;
  auto b = parse_model_desc(c.dump(), R"({"eos_token_id": 5, "bos_token_id": 3})");
  REQUIRE(b.ok());
  CHECK(b->eos_token_ids == std::vector<int32_t>{5});
  CHECK(b->bos_token_id == 3);
}

TEST_CASE("unsupported types and missing keys are errors naming them", "[config]") {
  json c = fixture_config("qwen3_moe");
  SECTION("unsupported model_type") {
    c["model_type"] = "llama4";
    auto r = parse_model_desc(c.dump());
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("llama4") != std::string::npos);
  }
  SECTION("no model_type") {
    c.erase("model_type");
    auto r = parse_model_desc(c.dump());
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("model_type") != std::string::npos);
  }
  SECTION("missing hidden_size") {
    c.erase("hidden_size");
    auto r = parse_model_desc(c.dump());
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("hidden_size") != std::string::npos);
  }
  SECTION("missing expert count") {
    c.erase("num_experts");
    auto r = parse_model_desc(c.dump());
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("num_experts") != std::string::npos);
  }
  SECTION("missing MLA rank") {
    json ds = fixture_config("deepseek_v2");
    ds.erase("kv_lora_rank");
    auto r = parse_model_desc(ds.dump());
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("kv_lora_rank") != std::string::npos);
  }
  SECTION("not JSON") {
    auto r = parse_model_desc("{not json");
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("config.json") != std::string::npos);
  }
  SECTION("a folder without config.json") {
    moe::test::TempDir tmp("noconfig");
    auto r = load_model_desc(tmp.path.string());
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().find("config.json") != std::string::npos);
  }
}

TEST_CASE("values past any real model are errors naming the key, before anything is sized by them", "[config]") {
  // 1e9 layers had a vector of a billion layers allocated (std::bad_alloc,
  // an abort) before the weights were checked; 2^31 experts read as a
  // negative int.
  struct Case {
    const char* key;
    json value;
    const char* says;
  };
  for (const Case& k : {Case{"num_hidden_layers", 1000000000, "more than 4096"},
                        Case{"num_hidden_layers", 5000000, "more than 4096"},
                        Case{"vocab_size", int64_t(10000000000), "out of range"},
                        Case{"hidden_size", int64_t(1000000000000), "out of range"},
                        Case{"hidden_size", 1 << 20, "more than 131072"},
                        Case{"num_experts", int64_t(1) << 31, "out of range"},
                        Case{"num_experts", 100000, "more than 4096"},
                        Case{"num_attention_heads", json(uint64_t(1) << 63), "out of range"}}) {
    const std::string error = refusal(k.key, k.value);
    INFO(k.key << " = " << k.value.dump() << ": " << error);
    CHECK(error.find(k.key) != std::string::npos);
    CHECK(error.find(k.says) != std::string::npos);
  }
}

TEST_CASE("values that would turn every output into noise are errors naming the key", "[config]") {
  // Each loaded and gave garbage text (an epsilon of -1 takes the square
  // root of a negative number; a rope base of 0 makes every angle NaN).
  struct Case {
    const char* key;
    json value;
    const char* says;
  };
  for (const Case& k : {Case{"rms_norm_eps", -1, "rms_norm_eps"}, Case{"rms_norm_eps", 0, "rms_norm_eps"},
                        Case{"rope_theta", 0, "rope_theta"}, Case{"rope_theta", -10000, "rope_theta"},
                        Case{"rope_scaling", {{"rope_type", "linear"}, {"factor", 0}}, "scaling factor"},
                        Case{"rope_scaling", {{"rope_type", "linear"}, {"factor", -1}}, "scaling factor"},
                        Case{"max_position_embeddings", -1, "max_position_embeddings"},
                        Case{"mlp_only_layers", {-1}, "mlp_only_layers"},
                        Case{"intermediate_size", -1, "intermediate_size"}}) {
    const std::string error = refusal(k.key, k.value);
    INFO(k.key << " = " << k.value.dump() << ": " << error);
    CHECK(error.find(k.says) != std::string::npos);
  }
}

TEST_CASE("model config: a negative shared expert width or count is an error, not a model without one",
          "[model][config]") {
  // Both loaded: the shared expert was dropped in silence (its width < 0 read
  // as "none"), or sized negative (DeepSeek-V2's count).
  json q2 = fixture_config("qwen2_moe");
  q2["shared_expert_intermediate_size"] = -64;
  auto r = parse_model_desc(q2.dump());
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().find("shared_expert_intermediate_size") != std::string::npos);
  json ds = fixture_config("deepseek_v2");
  ds["n_shared_experts"] = -2;
  r = parse_model_desc(ds.dump());
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().find("n_shared_experts") != std::string::npos);
  q2["shared_expert_intermediate_size"] = 0;  // no shared expert: still a model
  CHECK(parse_model_desc(q2.dump()).ok());
}
