#include "model/gguf_file.h"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>

#include "model/gguf_quants.h"

namespace moe {

namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr uint32_t kDefaultAlignment = 32;
// Bounds on what a header may claim, so that a corrupt count fails as an
// error instead of an allocation of terabytes.
constexpr uint64_t kMaxArrayLength = uint64_t(1) << 24;  // vocabularies are < 2^19
constexpr uint64_t kMaxValues = uint64_t(1) << 25;       // every metadata value of a part
constexpr uint64_t kMaxStringBytes = uint64_t(1) << 30;
constexpr uint64_t kMaxNameBytes = 256;                  // ggml's own limit is 64
constexpr uint64_t kMaxTensorCount = uint64_t(1) << 20;
constexpr int kMaxDims = 4;
constexpr int kMaxNesting = 4;

// The fewest bytes one value of a metadata type takes in the file (an array:
// its element type and length), so that a length is checked against the
// bytes left before anything is allocated for it.
uint64_t min_value_bytes(uint32_t type) {
  static constexpr uint64_t kBytes[] = {1, 1, 2, 2, 4, 4, 4, 1, 8, 12, 8, 8, 8};
  return type < std::size(kBytes) ? kBytes[type] : 1;
}

// A bounds-checked cursor over the start of one mapped part.
class Cursor {
 public:
  Cursor(const MappedFile& f) : p_(f.data()), end_(f.data() + f.size()), base_(f.data()), path_(f.path()) {}

  size_t offset() const { return size_t(p_ - base_); }
  uint64_t left() const { return uint64_t(end_ - p_); }
  // Counts values read against kMaxValues.
  bool count_values(uint64_t n) {
    values_ += n;
    return values_ <= kMaxValues;
  }

  template <typename T>
  Status read(T* out, const char* what) {
    if (size_t(end_ - p_) < sizeof(T)) return truncated(what);
    std::memcpy(out, p_, sizeof(T));
    p_ += sizeof(T);
    return Status::ok_status();
  }

  Status read_string(std::string* out, const char* what, uint64_t max_bytes = kMaxStringBytes) {
    uint64_t n = 0;
    MOE_TRY(read(&n, what));
    if (n > uint64_t(end_ - p_)) return truncated(what);
    if (n > max_bytes) return error(std::string(what) + " of " + std::to_string(n) + " bytes");
    out->assign(reinterpret_cast<const char*>(p_), size_t(n));
    p_ += n;
    return Status::ok_status();
  }

  Error error(const std::string& msg) const {
    return make_error(path_ + ": at byte " + std::to_string(offset()) + ": " + msg);
  }

 private:
  Status truncated(const char* what) const { return error(std::string("file ends inside ") + what); }

  const uint8_t* p_;
  const uint8_t* end_;
  const uint8_t* base_;
  std::string path_;
  uint64_t values_ = 0;
};

Status read_value(Cursor& c, uint32_t type, int depth, GgufValue* out);

Status read_scalar(Cursor& c, GgufValue::Kind kind, GgufValue* out) {
  out->kind = kind;
  using K = GgufValue::Kind;
  switch (kind) {
#define MOE_GGUF_INT(KIND, T, STORE)   \
  case K::KIND: {                      \
    T x{};                             \
    MOE_TRY(c.read(&x, "a value"));    \
    out->v = STORE(x);                 \
    return Status::ok_status();        \
  }
    MOE_GGUF_INT(u8, uint8_t, uint64_t)
    MOE_GGUF_INT(u16, uint16_t, uint64_t)
    MOE_GGUF_INT(u32, uint32_t, uint64_t)
    MOE_GGUF_INT(u64, uint64_t, uint64_t)
    MOE_GGUF_INT(i8, int8_t, int64_t)
    MOE_GGUF_INT(i16, int16_t, int64_t)
    MOE_GGUF_INT(i32, int32_t, int64_t)
    MOE_GGUF_INT(i64, int64_t, int64_t)
    MOE_GGUF_INT(f32, float, double)
    MOE_GGUF_INT(f64, double, double)
#undef MOE_GGUF_INT
    case K::boolean: {
      uint8_t b = 0;
      MOE_TRY(c.read(&b, "a value"));
      if (b > 1) return c.error("a boolean value of " + std::to_string(b));
      out->v = b == 1;
      return Status::ok_status();
    }
    case K::string: {
      std::string s;
      MOE_TRY(c.read_string(&s, "a string value"));
      out->v = std::move(s);
      return Status::ok_status();
    }
    case K::array:
      break;
  }
  return c.error("unexpected value kind");
}

bool kind_from_type(uint32_t type, GgufValue::Kind* out) {
  using K = GgufValue::Kind;
  static constexpr K kKinds[] = {K::u8,     K::i8,     K::u16,   K::i16, K::u32, K::i32, K::f32,
                                 K::boolean, K::string, K::array, K::u64, K::i64, K::f64};
  if (type >= std::size(kKinds)) return false;
  *out = kKinds[type];
  return true;
}

Status read_value(Cursor& c, uint32_t type, int depth, GgufValue* out) {
  GgufValue::Kind kind;
  if (!kind_from_type(type, &kind)) return c.error("unknown metadata value type " + std::to_string(type));
  if (kind != GgufValue::Kind::array) return read_scalar(c, kind, out);
  if (depth >= kMaxNesting) return c.error("arrays nested deeper than " + std::to_string(kMaxNesting));
  uint32_t elem_type = 0;
  uint64_t n = 0;
  MOE_TRY(c.read(&elem_type, "an array's element type"));
  MOE_TRY(c.read(&n, "an array's length"));
  if (n > kMaxArrayLength) return c.error("an array of " + std::to_string(n) + " elements");
  if (n > c.left() / min_value_bytes(elem_type)) return c.error("an array of " + std::to_string(n) +
                                                                " elements: the file ends before them");
  if (!c.count_values(n)) return c.error("more than " + std::to_string(kMaxValues) + " metadata values");
  std::vector<GgufValue> items;
  items.reserve(static_cast<size_t>(n));
  for (uint64_t i = 0; i < n; ++i) {
    items.emplace_back();
    MOE_TRY(read_value(c, elem_type, depth + 1, &items.back()));
  }
  out->kind = GgufValue::Kind::array;
  out->v = std::move(items);
  return Status::ok_status();
}

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// The parts of a split model: for `dir/name-00001-of-00003.gguf`, the three
// paths in order; otherwise the path alone.
std::vector<std::string> part_paths(const std::string& path) {
  static const std::regex kSplit(R"((.*)-(\d{5})-of-(\d{5})\.gguf)");
  std::smatch m;
  if (!std::regex_match(path, m, kSplit)) return {path};
  const int count = std::stoi(m[3].str());  // five digits
  if (count < 1) return {path};  // "-of-00000": not a split name; opens (and fails) as one file
  std::vector<std::string> out;
  for (int i = 1; i <= count; ++i) {
    char tail[32];
    std::snprintf(tail, sizeof tail, "-%05d-of-%05d.gguf", i, count);
    out.push_back(m[1].str() + tail);
  }
  return out;
}

}  // namespace

bool GgufValue::as_int(int64_t* out) const {
  if (const auto* u = std::get_if<uint64_t>(&v)) {
    if (*u > uint64_t(INT64_MAX)) return false;
    *out = int64_t(*u);
    return true;
  }
  if (const auto* i = std::get_if<int64_t>(&v)) {
    *out = *i;
    return true;
  }
  return false;
}

bool GgufValue::as_double(double* out) const {
  if (const auto* d = std::get_if<double>(&v)) {
    *out = *d;
    return true;
  }
  int64_t i = 0;
  if (!as_int(&i)) return false;
  *out = double(i);
  return true;
}

const std::string* GgufValue::as_string() const { return std::get_if<std::string>(&v); }

const std::vector<GgufValue>* GgufValue::as_array() const {
  return std::get_if<std::vector<GgufValue>>(&v);
}

const char* gguf_kind_name(GgufValue::Kind k) {
  using K = GgufValue::Kind;
  switch (k) {
    case K::u8: return "uint8";
    case K::i8: return "int8";
    case K::u16: return "uint16";
    case K::i16: return "int16";
    case K::u32: return "uint32";
    case K::i32: return "int32";
    case K::f32: return "float32";
    case K::boolean: return "bool";
    case K::string: return "string";
    case K::array: return "array";
    case K::u64: return "uint64";
    case K::i64: return "int64";
    case K::f64: return "float64";
  }
  return "?";
}

int64_t GgufTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;  // bounded at open (at most 2^62)
  return n;
}

std::vector<int64_t> GgufTensor::shape() const { return std::vector<int64_t>(ne.rbegin(), ne.rend()); }

bool is_gguf_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  uint32_t magic = 0;
  return in.read(reinterpret_cast<char*>(&magic), 4) && magic == kGgufMagic;
}

const GgufValue* GgufFile::find_value(const std::string& key) const {
  auto it = meta_.find(key);
  return it == meta_.end() ? nullptr : &it->second;
}

Result<bool> GgufFile::get_int(const std::string& key, int64_t* out) const {
  const GgufValue* v = find_value(key);
  if (!v) return false;
  if (!v->as_int(out)) return make_error(path_ + ": metadata '" + key + "' is " + gguf_kind_name(v->kind) +
                                         ", not an integer");
  return true;
}

Result<bool> GgufFile::get_float(const std::string& key, double* out) const {
  const GgufValue* v = find_value(key);
  if (!v) return false;
  if (!v->as_double(out))
    return make_error(path_ + ": metadata '" + key + "' is " + gguf_kind_name(v->kind) + ", not a number");
  return true;
}

Result<bool> GgufFile::get_bool(const std::string& key, bool* out) const {
  const GgufValue* v = find_value(key);
  if (!v) return false;
  if (const bool* b = std::get_if<bool>(&v->v)) {
    *out = *b;
    return true;
  }
  return make_error(path_ + ": metadata '" + key + "' is " + gguf_kind_name(v->kind) + ", not a bool");
}

Result<bool> GgufFile::get_string(const std::string& key, std::string* out) const {
  const GgufValue* v = find_value(key);
  if (!v) return false;
  if (const std::string* s = v->as_string()) {
    *out = *s;
    return true;
  }
  return make_error(path_ + ": metadata '" + key + "' is " + gguf_kind_name(v->kind) + ", not a string");
}

const GgufTensor* GgufFile::find_tensor(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

Result<std::unique_ptr<GgufFile>> GgufFile::open(const std::string& path) {
  auto g = std::unique_ptr<GgufFile>(new GgufFile());
  g->path_ = path;
  const std::vector<std::string> paths = part_paths(path);
  for (size_t part = 0; part < paths.size(); ++part) {
    const std::string& p = paths[part];
    std::error_code ec;
    if (!std::filesystem::exists(p, ec))
      return make_error(p + ": missing (part " + std::to_string(part + 1) + " of " +
                        std::to_string(paths.size()) + " of " + path + ")");
    auto mapped = MappedFile::open(p);
    if (!mapped) return make_error(mapped.error());
    g->files_.push_back(*mapped);
    const MappedFile& f = **mapped;
    Cursor c(f);

    uint32_t magic = 0, version = 0;
    MOE_TRY(c.read(&magic, "the magic"));
    if (magic != kGgufMagic) return make_error(p + ": not a GGUF file (bad magic)");
    MOE_TRY(c.read(&version, "the version"));
    if (version != 2 && version != 3)
      return make_error(p + ": GGUF version " + std::to_string(version) + " (versions 2 and 3 are read)");
    if (part == 0) g->version_ = version;
    uint64_t n_tensors = 0, n_kv = 0;
    MOE_TRY(c.read(&n_tensors, "the tensor count"));
    MOE_TRY(c.read(&n_kv, "the metadata count"));
    if (n_tensors > kMaxTensorCount || n_kv > kMaxArrayLength)
      return c.error("implausible counts: " + std::to_string(n_tensors) + " tensors, " + std::to_string(n_kv) +
                     " metadata keys");

    std::map<std::string, GgufValue> meta;
    for (uint64_t i = 0; i < n_kv; ++i) {
      std::string key;
      uint32_t type = 0;
      MOE_TRY(c.read_string(&key, "a metadata key", 65535));
      MOE_TRY(c.read(&type, "a metadata value type"));
      GgufValue v;
      if (Status s = read_value(c, type, 0, &v); !s) return make_error(s.error() + " (key '" + key + "')");
      if (!meta.emplace(key, std::move(v)).second) return c.error("metadata key '" + key + "' appears twice");
    }
    uint64_t alignment = kDefaultAlignment;
    if (auto it = meta.find("general.alignment"); it != meta.end()) {
      int64_t a = 0;
      if (!it->second.as_int(&a) || a < 8 || a > (1 << 20) || (a & (a - 1)) != 0)
        return make_error(p + ": general.alignment is not a power of two of at least 8");
      alignment = uint64_t(a);
    }

    struct Pending {
      GgufTensor t;
      uint64_t offset;
    };
    std::vector<Pending> pending;
    for (uint64_t i = 0; i < n_tensors; ++i) {
      Pending pt;
      GgufTensor& t = pt.t;
      uint32_t n_dims = 0;
      MOE_TRY(c.read_string(&t.name, "a tensor name", kMaxNameBytes));
      MOE_TRY(c.read(&n_dims, "a tensor's dimension count"));
      if (n_dims < 1 || n_dims > kMaxDims)
        return c.error("tensor '" + t.name + "' has " + std::to_string(n_dims) + " dimensions");
      uint64_t numel = 1;
      for (uint32_t d = 0; d < n_dims; ++d) {
        uint64_t ne = 0;
        MOE_TRY(c.read(&ne, "a tensor's shape"));
        if (ne == 0 || ne > (uint64_t(1) << 40) || __builtin_mul_overflow(numel, ne, &numel) ||
            numel > (uint64_t(1) << 62))
          return c.error("tensor '" + t.name + "' has a dimension of " + std::to_string(ne) +
                         " (or too many elements in all)");
        t.ne.push_back(int64_t(ne));
      }
      MOE_TRY(c.read(&t.type, "a tensor's type"));
      MOE_TRY(c.read(&pt.offset, "a tensor's offset"));
      const GgmlTypeInfo* info = ggml_type_info(t.type);
      if (!info) return make_error(p + ": tensor '" + t.name + "' has unknown type id " + std::to_string(t.type));
      if (t.ne[0] % info->block_elems != 0)
        return make_error(p + ": tensor '" + t.name + "' (" + info->name + ") has rows of " +
                          std::to_string(t.ne[0]) + ", not a multiple of its block of " +
                          std::to_string(info->block_elems));
      const uint64_t row_bytes = ggml_row_bytes(*info, t.ne[0]);
      uint64_t nbytes = 0;
      if (__builtin_mul_overflow(row_bytes, uint64_t(t.numel() / t.ne[0]), &nbytes) || nbytes > f.size())
        return make_error(p + ": tensor '" + t.name + "' would hold more bytes than the file has");
      t.nbytes = size_t(nbytes);
      t.part = int(part);
      pending.push_back(std::move(pt));
    }
    const uint64_t data_start = align_up(c.offset(), alignment);
    for (Pending& pt : pending) {
      GgufTensor& t = pt.t;
      if (pt.offset % alignment != 0)
        return make_error(p + ": tensor '" + t.name + "' is not aligned to " + std::to_string(alignment));
      if (data_start > f.size() || pt.offset > f.size() - data_start ||
          t.nbytes > f.size() - data_start - pt.offset)
        return make_error(p + ": tensor '" + t.name + "' extends past the end of the file (" +
                          std::to_string(f.size()) + " bytes): truncated?");
      t.data = f.data() + data_start + pt.offset;
      if (!g->by_name_.emplace(t.name, g->tensors_.size()).second)
        return make_error(p + ": tensor '" + t.name + "' appears twice");
      g->tensors_.push_back(std::move(t));
    }

    if (part == 0) {
      g->meta_ = std::move(meta);
      int64_t count = 1;
      if (auto it = g->meta_.find("split.count"); it != g->meta_.end() && it->second.as_int(&count) &&
                                                  count != int64_t(paths.size()))
        return make_error(p + ": split.count says " + std::to_string(count) + " parts, the file name " +
                          std::to_string(paths.size()));
    }
  }
  int64_t expected = 0;
  if (auto it = g->meta_.find("split.tensors.count");
      it != g->meta_.end() && it->second.as_int(&expected) && expected != int64_t(g->tensors_.size()))
    return make_error(path + ": split.tensors.count says " + std::to_string(expected) + " tensors, the parts hold " +
                      std::to_string(g->tensors_.size()));
  return g;
}

}  // namespace moe
