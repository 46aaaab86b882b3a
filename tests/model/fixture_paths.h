#pragma once
// Where the model tests find the reference checkpoints.

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace moe::test {

inline std::string fixture_dir(const std::string& name) {
  return std::string(MOE_TEST_DATA) + "/fixtures/" + name;
}

inline const std::vector<std::string>& fixture_names() {
  static const std::vector<std::string> names = {"qwen2_moe", "qwen3_moe",   "mixtral",
                                                 "olmoe",     "qwen2_dense", "deepseek_v2"};
  return names;
}

inline std::string demo_model_dir() {
  return std::string(MOE_TEST_DATA) + "/../../models/demo-moe";
}

inline std::string read_file_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline nlohmann::json read_json(const std::string& path) {
  return nlohmann::json::parse(read_file_text(path));
}

}  // namespace moe::test
