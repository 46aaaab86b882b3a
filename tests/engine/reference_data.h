#pragma once
// Reading the reference tensors of tests/data/fixtures/<arch> (and the demo
// model) for the engine tests.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "engine/cpu_engine.h"
#include "model/model_files.h"
#include "model/safetensors.h"
#include "tests/reference_tensors.h"  // ints()

namespace moe::test {

inline std::string fixture_dir(const std::string& arch) {
  return std::string(MOE_TEST_DATA) + "/fixtures/" + arch;
}
inline std::string demo_dir() { return std::string(MOE_TEST_DATA) + "/../../models/demo-moe"; }

inline float max_abs(const std::vector<float>& v) {
  float m = 0;
  for (float x : v) m = std::max(m, std::abs(x));
  return m;
}

inline float max_abs_diff(const float* a, const float* b, size_t n) {
  float m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

inline std::unique_ptr<CpuEngine> make_engine(const std::string& dir, EngineOptions opts = {}) {
  auto files = ModelFiles::open(dir);
  if (!files) throw std::runtime_error(files.error());
  if (opts.threads == 0) opts.threads = 2;
  auto e = CpuEngine::create(files.value(), opts);
  if (!e) throw std::runtime_error(e.error());
  return std::move(e.value());
}

// The first n ids of the demo's held-out text (reference.safetensors).
inline std::vector<int32_t> demo_eval_ids(size_t n) {
  auto ref = Checkpoint::open_file(demo_dir() + "/reference.safetensors");
  REQUIRE(ref.ok());
  auto ids = ints(*ref->find("eval.ids"));
  REQUIRE(ids.size() >= n);
  ids.resize(n);
  return ids;
}

}  // namespace moe::test
