#pragma once
// Read-only access to Hugging Face safetensors checkpoints, by mmap: tensors
// are views into the mapped files, never copies on the heap.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/result.h"

namespace moe {

enum class DType { f32, f16, bf16, f64, i64, i32, i16, i8, u8, boolean };

size_t dtype_size(DType t);
const char* dtype_name(DType t);  // safetensors spelling: "F32", "BF16", ...
bool dtype_from_name(const std::string& name, DType* out);  // false for an unknown spelling

// A view of one tensor inside a mapped file. Valid while its Checkpoint lives.
struct TensorView {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const;
};

// One mapped file (the mapping is released when the last reference goes).
class MappedFile {
 public:
  static Result<std::shared_ptr<MappedFile>> open(const std::string& path);
  ~MappedFile();
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile() = default;
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// All tensors of a checkpoint folder: `model.safetensors`, or the shards
// listed in `model.safetensors.index.json`; or one given .safetensors file.
// Rejects truncated or inconsistent files with a message naming the file and
// the tensor.
class Checkpoint {
 public:
  static Result<Checkpoint> open_dir(const std::string& dir);
  static Result<Checkpoint> open_file(const std::string& path);

  const TensorView* find(const std::string& name) const;  // nullptr if absent
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }

 private:
  std::vector<std::shared_ptr<MappedFile>> files_;
  std::map<std::string, TensorView> tensors_;
};

// bf16/f16 helpers for the CPU paths.
float bf16_to_f32(uint16_t v);
uint16_t f32_to_bf16(float v);  // round to nearest even
float f16_to_f32(uint16_t v);
uint16_t f32_to_f16(float v);
// Converts any float tensor (f32, f16, bf16) to f32 values.
std::vector<float> to_f32(const TensorView& t);

}  // namespace moe
