#pragma once
// The GGUF container (version 2 and 3), read by mmap: the header, the
// metadata key/values, the tensor table and each tensor's bytes, over one
// file or the parts of a split model (`name-00001-of-00003.gguf`). Nothing
// here knows a model architecture or a tensor type's block layout
// (model/gguf_quants.h does); docs/gguf.md says what is read and why.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "model/result.h"
#include "model/safetensors.h"

namespace moe {

// One metadata value. Integers of every width are kept as int64/uint64,
// floats as double; arrays as vectors of values.
struct GgufValue {
  enum class Kind { u8, i8, u16, i16, u32, i32, f32, boolean, string, array, u64, i64, f64 };
  Kind kind = Kind::u32;
  std::variant<uint64_t, int64_t, double, bool, std::string, std::vector<GgufValue>> v;

  // The value as an integer (of any integer type that fits int64); false otherwise.
  bool as_int(int64_t* out) const;
  bool as_double(double* out) const;
  const std::string* as_string() const;             // nullptr unless a string
  const std::vector<GgufValue>* as_array() const;  // nullptr unless an array
};

const char* gguf_kind_name(GgufValue::Kind k);

struct GgufTensor {
  std::string name;
  uint32_t type = 0;             // ggml type id (model/gguf_quants.h)
  std::vector<int64_t> ne;       // ggml order: ne[0] is the innermost (contiguous) dimension
  const uint8_t* data = nullptr;  // inside the mapping of its part
  size_t nbytes = 0;
  int part = 0;                   // which file of a split model holds it

  int64_t numel() const;
  // The shape in row-major order (the reverse of ne): a ggml [ne0, ne1]
  // matrix is a PyTorch [ne1, ne0] one.
  std::vector<int64_t> shape() const;
};

class GgufFile {
 public:
  // `path`: a .gguf file; a first part named `…-00001-of-0000N.gguf` opens
  // every part beside it. Truncated or inconsistent files are errors naming
  // the file and, where it applies, the key or the tensor.
  static Result<std::unique_ptr<GgufFile>> open(const std::string& path);

  uint32_t version() const { return version_; }
  const std::string& path() const { return path_; }

  const std::map<std::string, GgufValue>& metadata() const { return meta_; }
  const GgufValue* find_value(const std::string& key) const;
  // Typed lookups: false when absent; an error when present with another type.
  Result<bool> get_int(const std::string& key, int64_t* out) const;
  Result<bool> get_float(const std::string& key, double* out) const;
  Result<bool> get_bool(const std::string& key, bool* out) const;
  Result<bool> get_string(const std::string& key, std::string* out) const;

  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  const GgufTensor* find_tensor(const std::string& name) const;

 private:
  std::string path_;
  uint32_t version_ = 0;
  std::vector<std::shared_ptr<MappedFile>> files_;
  std::map<std::string, GgufValue> meta_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, size_t> by_name_;
};

// True when the file at `path` starts with the GGUF magic.
bool is_gguf_file(const std::string& path);

}  // namespace moe
