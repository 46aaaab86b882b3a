#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace moe {

namespace {

using json = nlohmann::json;

struct DTypeInfo {
  DType type;
  const char* name;
  size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::f32, "F32", 4},      {DType::f16, "F16", 2}, {DType::bf16, "BF16", 2},
    {DType::f64, "F64", 8},      {DType::i64, "I64", 8}, {DType::i32, "I32", 4},
    {DType::i16, "I16", 2},      {DType::i8, "I8", 1},   {DType::u8, "U8", 1},
    {DType::boolean, "BOOL", 1},
};

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Parses one mapped safetensors file and appends its tensors to `out`.
Status parse_file(const MappedFile& f, std::map<std::string, TensorView>* out) {
  const std::string& path = f.path();
  if (f.size() < 8)
    return make_error(path + ": too short for a safetensors file (" + std::to_string(f.size()) +
                      " bytes)");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | f.data()[i];  // little-endian u64
  if (header_len > f.size() - 8)
    return make_error(path + ": header length " + std::to_string(header_len) +
                      " runs past the end of the file (" + std::to_string(f.size()) +
                      " bytes): truncated or not a safetensors file");
  json header;
  try {
    header = json::parse(reinterpret_cast<const char*>(f.data()) + 8,
                         reinterpret_cast<const char*>(f.data()) + 8 + header_len);
  } catch (const std::exception& e) {
    return make_error(path + ": the JSON header does not parse: " + e.what());
  }
  if (!header.is_object()) return make_error(path + ": the JSON header is not an object");

  const uint8_t* region = f.data() + 8 + header_len;
  const size_t region_bytes = f.size() - 8 - header_len;

  struct Span {
    size_t begin, end;
    std::string name;
  };
  std::vector<Span> spans;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") continue;
    const json& e = it.value();
    auto bad = [&](const std::string& why) {
      return make_error(path + ": tensor '" + name + "': " + why);
    };
    if (!e.is_object()) return bad("entry is not an object");
    if (!e.contains("dtype") || !e["dtype"].is_string()) return bad("missing dtype");
    TensorView t;
    t.name = name;
    const std::string dt = e["dtype"].get<std::string>();
    if (!dtype_from_name(dt, &t.dtype)) return bad("unknown dtype '" + dt + "'");
    if (!e.contains("shape") || !e["shape"].is_array()) return bad("missing shape");
    for (const auto& d : e["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0)
        return bad("shape has a non-integer or negative dimension");
      t.shape.push_back(d.get<int64_t>());
    }
    if (!e.contains("data_offsets") || !e["data_offsets"].is_array() ||
        e["data_offsets"].size() != 2 || !e["data_offsets"][0].is_number_unsigned() ||
        !e["data_offsets"][1].is_number_unsigned())
      return bad("data_offsets must be two non-negative integers");
    const uint64_t begin = e["data_offsets"][0].get<uint64_t>();
    const uint64_t end = e["data_offsets"][1].get<uint64_t>();
    if (begin > end)
      return bad("data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                 "] are reversed");
    if (end > region_bytes)
      return bad("data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                 "] run past the end of the data region (" + std::to_string(region_bytes) +
                 " bytes): the file is truncated or inconsistent");
    const uint64_t want = uint64_t(t.numel()) * dtype_size(t.dtype);
    if (end - begin != want)
      return bad("holds " + std::to_string(end - begin) + " bytes but " + dt + " " +
                 shape_str(t.shape) + " needs " + std::to_string(want));
    t.data = region + begin;
    t.nbytes = size_t(want);
    spans.push_back({size_t(begin), size_t(end), name});
    if (out->count(name)) return bad("appears in more than one file");
    (*out)[name] = std::move(t);
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].begin < spans[i - 1].end)
      return make_error(path + ": tensors '" + spans[i - 1].name + "' and '" + spans[i].name +
                        "' overlap");
  return Status::ok_status();
}

Result<std::string> read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error(path + ": cannot open: " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

bool dtype_from_name(const std::string& s, DType* out) {
  for (const auto& d : kDTypes)
    if (s == d.name) {
      *out = d.type;
      return true;
    }
  return false;
}

size_t dtype_size(DType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.size;
  return 0;
}

const char* dtype_name(DType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.name;
  return "?";
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Result<std::shared_ptr<MappedFile>> MappedFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return make_error(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    std::string why = std::strerror(errno);
    ::close(fd);
    return make_error(path + ": cannot stat: " + why);
  }
  std::shared_ptr<MappedFile> f(new MappedFile());
  f->path_ = path;
  f->size_ = size_t(st.st_size);
  if (f->size_ > 0) {
    void* p = mmap(nullptr, f->size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      std::string why = std::strerror(errno);
      ::close(fd);
      return make_error(path + ": cannot map: " + why);
    }
    f->data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping keeps the file alive
  return f;
}

MappedFile::~MappedFile() {
  if (data_) munmap(const_cast<uint8_t*>(data_), size_);
}

Result<Checkpoint> Checkpoint::open_file(const std::string& path) {
  auto f = MappedFile::open(path);
  if (!f) return make_error(f.error());
  Checkpoint c;
  if (Status s = parse_file(**f, &c.tensors_); !s) return make_error(s.error());
  c.files_.push_back(std::move(*f));
  return c;
}

Result<Checkpoint> Checkpoint::open_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single_path = fs::path(dir) / "model.safetensors";
  if (!fs::exists(index_path)) {
    if (!fs::exists(single_path))
      return make_error(dir +
                        ": no model.safetensors or model.safetensors.index.json in this folder");
    return open_file(single_path.string());
  }

  auto text = read_text(index_path.string());
  if (!text) return make_error(text.error());
  json index;
  try {
    index = json::parse(*text);
  } catch (const std::exception& e) {
    return make_error(index_path.string() + ": does not parse: " + e.what());
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    return make_error(index_path.string() + ": missing the 'weight_map' object");

  // Shards in first-seen order, each opened once.
  std::vector<std::string> shards;
  std::set<std::string> seen;
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
    if (!it.value().is_string())
      return make_error(index_path.string() + ": tensor '" + it.key() +
                        "': the shard name is not a string");
    const std::string shard = it.value().get<std::string>();
    if (shard.find('/') != std::string::npos || shard == "..")
      return make_error(index_path.string() + ": tensor '" + it.key() + "': shard '" + shard +
                        "' is outside the folder");
    if (seen.insert(shard).second) shards.push_back(shard);
  }

  Checkpoint c;
  for (const auto& shard : shards) {
    auto f = MappedFile::open((fs::path(dir) / shard).string());
    if (!f) return make_error(f.error());
    std::map<std::string, TensorView> part;
    if (Status s = parse_file(**f, &part); !s) return make_error(s.error());
    for (auto& [name, t] : part) {
      if (c.tensors_.count(name))
        return make_error((fs::path(dir) / shard).string() + ": tensor '" + name +
                          "' appears in more than one shard");
      c.tensors_[name] = std::move(t);
    }
    c.files_.push_back(std::move(*f));
  }
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it)
    if (!c.tensors_.count(it.key()))
      return make_error(index_path.string() + ": tensor '" + it.key() + "' is listed for shard '" +
                        it.value().get<std::string>() + "' but that file does not hold it");
  return c;
}

const TensorView* Checkpoint::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_bf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays a quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                         // round to nearest even
  return uint16_t(u >> 16);
}

float f16_to_f32(uint16_t v) {
  const uint32_t sign = uint32_t(v & 0x8000u) << 16;
  uint32_t exp = (v >> 10) & 0x1fu;
  uint32_t mant = v & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);  // inf / NaN
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;
  } else {
    // Subnormal half: normalise into an f32 normal.
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    u = sign | (uint32_t(112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (abs >= 0x38800000u) {                                 // normal half (>= 2^-14)
    uint32_t r = abs - 0x38000000u;                         // rebias exponent 127 -> 15
    r += 0xfffu + ((r >> 13) & 1u);                         // round to nearest even
    return uint16_t(sign | (r >> 13));
  }
  if (abs < 0x33000000u) return sign;  // below half the smallest subnormal: zero
  // Subnormal half: value = mant * 2^-24.
  const uint32_t exp = abs >> 23;
  const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - exp;  // 14..24 for exp 102..112
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return uint16_t(sign | q);
}

std::vector<float> to_f32(const TensorView& t) {
  const size_t n = size_t(t.numel());
  std::vector<float> out;
  switch (t.dtype) {
    case DType::f32:
      out.resize(n);
      std::memcpy(out.data(), t.data, n * 4);
      break;
    case DType::f64:
      out.resize(n);
      for (size_t i = 0; i < n; ++i) {
        double d;
        std::memcpy(&d, t.data + 8 * i, 8);
        out[i] = float(d);
      }
      break;
    case DType::bf16:
    case DType::f16:
      out.resize(n);
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, t.data + 2 * i, 2);
        out[i] = t.dtype == DType::bf16 ? bf16_to_f32(h) : f16_to_f32(h);
      }
      break;
    default:
      break;  // not a float tensor: empty
  }
  return out;
}

}  // namespace moe
