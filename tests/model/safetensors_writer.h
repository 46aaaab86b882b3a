#pragma once
// Writes small safetensors files for the tests: shards of a real checkpoint
// and deliberately broken files.

#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/safetensors.h"

namespace moe::test {

// Writes `header` (whose entries carry data_offsets already) and `data`.
inline void write_raw_safetensors(const std::string& path, const nlohmann::json& header,
                                  const std::string& data) {
  std::string h = header.dump();
  while (h.size() % 8) h += ' ';
  const uint64_t n = h.size();
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i < 8; ++i) out.put(char((n >> (8 * i)) & 0xff));
  out << h << data;
}

// Writes the given tensors, packed in order, as one safetensors file.
inline void write_safetensors(const std::string& path,
                              const std::vector<const TensorView*>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const TensorView* t : tensors) {
    header[t->name] = {{"dtype", dtype_name(t->dtype)},
                       {"shape", t->shape},
                       {"data_offsets", {data.size(), data.size() + t->nbytes}}};
    data.append(reinterpret_cast<const char*>(t->data), t->nbytes);
  }
  write_raw_safetensors(path, header, data);
}

}  // namespace moe::test
