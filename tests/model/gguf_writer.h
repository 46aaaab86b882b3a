#pragma once
// Writes a GGUF file (version 3) from metadata and tensors, following the
// published layout (header, key/values, tensor table, aligned data): for the
// tests that take a file llama.cpp made, change one thing and check how the
// reader answers. Values are written with the kinds they carry; a tensor's
// bytes are written as given (its type and shape need not agree with them:
// broken files are the point).

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "model/gguf_file.h"

namespace moe::test {

// An integer metadata value of the given kind (signed kinds held as int64).
inline GgufValue gguf_integer(GgufValue::Kind kind, int64_t v) {
  using K = GgufValue::Kind;
  GgufValue x;
  x.kind = kind;
  if (kind == K::i8 || kind == K::i16 || kind == K::i32 || kind == K::i64) x.v = v;
  else x.v = uint64_t(v);
  return x;
}

struct GgufWriterTensor {
  std::string name;
  uint32_t type = 0;
  std::vector<uint64_t> ne;
  std::string bytes;
};

struct GgufWriterFile {
  std::vector<std::pair<std::string, GgufValue>> meta;  // in order
  std::vector<GgufWriterTensor> tensors;
  uint64_t alignment = 32;

  // Everything a file llama.cpp made holds, in its order.
  static GgufWriterFile from(const GgufFile& g) {
    GgufWriterFile out;
    for (const auto& [k, v] : g.metadata()) out.meta.emplace_back(k, v);
    for (const GgufTensor& t : g.tensors())
      out.tensors.push_back({t.name, t.type, std::vector<uint64_t>(t.ne.begin(), t.ne.end()),
                             std::string(reinterpret_cast<const char*>(t.data), t.nbytes)});
    return out;
  }
  GgufValue* find(const std::string& key) {
    for (auto& [k, v] : meta)
      if (k == key) return &v;
    return nullptr;
  }
  // Sets `key` (replacing its value, or appending it).
  void set(const std::string& key, const GgufValue& v) {
    if (GgufValue* have = find(key)) *have = v;
    else meta.emplace_back(key, v);
  }
  GgufWriterTensor* tensor(const std::string& name) {
    for (auto& t : tensors)
      if (t.name == name) return &t;
    return nullptr;
  }

  std::string bytes() const {
    std::string out;
    auto put = [&out](const void* p, size_t n) { out.append(static_cast<const char*>(p), n); };
    auto u32 = [&](uint32_t x) { put(&x, 4); };
    auto u64 = [&](uint64_t x) { put(&x, 8); };
    auto str = [&](const std::string& s) {
      u64(s.size());
      out += s;
    };
    u32(0x46554747);
    u32(3);
    u64(tensors.size());
    u64(meta.size());
    for (const auto& [k, v] : meta) {
      str(k);
      u32(uint32_t(v.kind));
      put_value(out, v);
    }
    uint64_t offset = 0;
    for (const auto& t : tensors) {
      str(t.name);
      u32(uint32_t(t.ne.size()));
      for (uint64_t d : t.ne) u64(d);
      u32(t.type);
      u64(offset);
      offset = (offset + t.bytes.size() + alignment - 1) / alignment * alignment;
    }
    out.resize((out.size() + alignment - 1) / alignment * alignment, '\0');
    for (const auto& t : tensors) {
      out += t.bytes;
      out.resize((out.size() + alignment - 1) / alignment * alignment, '\0');
    }
    return out;
  }

  void write(const std::string& path) const {
    const std::string b = bytes();
    std::ofstream(path, std::ios::binary).write(b.data(), std::streamsize(b.size()));
  }

 private:
  static void put_value(std::string& out, const GgufValue& v) {
    using K = GgufValue::Kind;
    auto put = [&out](const void* p, size_t n) { out.append(static_cast<const char*>(p), n); };
    auto as_u = [&]() { return std::holds_alternative<uint64_t>(v.v) ? std::get<uint64_t>(v.v) : uint64_t(std::get<int64_t>(v.v)); };
    switch (v.kind) {
      case K::u8: case K::i8: { const uint8_t x = uint8_t(as_u()); put(&x, 1); break; }
      case K::u16: case K::i16: { const uint16_t x = uint16_t(as_u()); put(&x, 2); break; }
      case K::u32: case K::i32: { const uint32_t x = uint32_t(as_u()); put(&x, 4); break; }
      case K::u64: case K::i64: { const uint64_t x = as_u(); put(&x, 8); break; }
      case K::f32: { const float x = float(std::get<double>(v.v)); put(&x, 4); break; }
      case K::f64: { const double x = std::get<double>(v.v); put(&x, 8); break; }
      case K::boolean: { const uint8_t x = std::get<bool>(v.v) ? 1 : 0; put(&x, 1); break; }
      case K::string: {
        const std::string& s = std::get<std::string>(v.v);
        const uint64_t n = s.size();
        put(&n, 8);
        out += s;
        break;
      }
      case K::array: {
        const auto& items = std::get<std::vector<GgufValue>>(v.v);
        const uint32_t elem = items.empty() ? uint32_t(K::u8) : uint32_t(items[0].kind);
        const uint64_t n = items.size();
        put(&elem, 4);
        put(&n, 8);
        for (const GgufValue& item : items) put_value(out, item);
        break;
      }
    }
  }
};

}  // namespace moe::test
