#include "model/packed_model.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>
#include <vector>

#include "model/gguf_file.h"
#include "model/int4.h"
#include "model/parallel_for.h"
#include "model/model_files.h"
#include "model/safetensors.h"

namespace moe {

namespace {

using json = nlohmann::json;

constexpr const char* kQ4DType = "Q4EXPERT";

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

void put_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = uint8_t(v >> (8 * i));
}
void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}
uint32_t get_u32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// One tensor of the file being written.
struct OutTensor {
  std::string name;
  std::string dtype;  // safetensors spelling, or Q4EXPERT
  std::vector<int64_t> shape;
  size_t bytes = 0;
  size_t offset = 0;                // from the start of the data region
  const TensorView* src = nullptr;  // copied as stored; nullptr for a q4 blob
  int layer = -1, expert = -1;      // q4 blobs
};

// A file being written, with one error path: the first failure sticks.
class OutFile {
 public:
  explicit OutFile(std::string path) : path_(std::move(path)) {
    f_ = std::fopen(path_.c_str(), "wb");
    if (!f_) err_ = path_ + ": cannot create: " + std::strerror(errno);
  }
  ~OutFile() {
    if (f_) std::fclose(f_);
  }
  void write(const void* p, size_t n) {
    if (!err_.empty() || n == 0) return;
    if (std::fwrite(p, 1, n, f_) != n) err_ = path_ + ": write failed: " + std::strerror(errno);
    written_ += n;
  }
  void pad_to(size_t pos) {
    static const uint8_t zeros[kPackedAlign] = {};
    while (err_.empty() && written_ < pos) write(zeros, std::min(pos - written_, sizeof zeros));
  }
  Status close() {
    if (!f_) return make_error(err_);
    if (err_.empty() && std::fflush(f_) != 0)
      err_ = path_ + ": write failed: " + std::strerror(errno);
    if (err_.empty() && ::fsync(fileno(f_)) != 0)
      err_ = path_ + ": fsync failed: " + std::strerror(errno);
    if (std::fclose(f_) != 0 && err_.empty())
      err_ = path_ + ": close failed: " + std::strerror(errno);
    f_ = nullptr;
    if (!err_.empty()) return make_error(err_);
    return Status::ok_status();
  }
  size_t written() const { return written_; }
  bool failed() const { return !err_.empty(); }

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
  std::string err_;
  size_t written_ = 0;
};

bool is_float(DType t) {
  return t == DType::bf16 || t == DType::f16 || t == DType::f32 || t == DType::f64;
}

Status check_expert_matrix(const ModelFiles& files, const std::string& name, int64_t rows,
                           int64_t cols) {
  const TensorView* t = files.find(name);
  if (!t) return make_error(files.path() + ": missing expert weight '" + name + "'");
  if (t->shape != std::vector<int64_t>{rows, cols})
    return make_error(files.path() + ": expert weight '" + name + "' has shape [" +
                      (t->shape.size() == 2
                           ? std::to_string(t->shape[0]) + ", " + std::to_string(t->shape[1])
                           : std::string("rank ") + std::to_string(t->shape.size())) +
                      "], expected [" + std::to_string(rows) + ", " + std::to_string(cols) + "]");
  if (!is_float(t->dtype))
    return make_error(files.path() + ": expert weight '" + name + "' is " + dtype_name(t->dtype) +
                      ", not a float type");
  return Status::ok_status();
}

// Parses "model.layers.{L}.experts.{E}.q4".
bool parse_q4_name(const std::string& name, int* layer, int* expert) {
  int l = -1, e = -1, n = 0;
  if (std::sscanf(name.c_str(), "model.layers.%d.experts.%d.q4%n", &l, &e, &n) != 2) return false;
  if (size_t(n) != name.size() || expert_q4_name(l, e) != name) return false;
  *layer = l;
  *expert = e;
  return true;
}

// Tells the kernel a source tensor's pages are done with, so that converting
// a checkpoint larger than memory does not hold it all resident. Only whole
// pages inside the tensor; the mapping is read-only, so nothing is lost.
void drop_pages(const uint8_t* p, size_t n) {
  const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + n) / page * page;
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

std::vector<uint8_t> quantize_expert(const ModelFiles& files, const ExpertWeightNames& n,
                                     const ExpertLayout& layout) {
  std::vector<uint8_t> blob(layout.blob_bytes, 0);
  const std::pair<const std::string*, const Q4MatrixLayout*> parts[] = {
      {&n.gate, &layout.gate}, {&n.up, &layout.up}, {&n.down, &layout.down}};
  for (const auto& [name, m] : parts) {
    const TensorView& t = *files.find(*name);
    q4_quantize_matrix(to_f32(t).data(), *m, blob.data());
    drop_pages(t.data, t.nbytes);
  }
  return blob;
}

}  // namespace

ExpertWeightNames expert_weight_names(const ModelDesc& d, int layer, int expert) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  if (d.arch == Arch::mixtral) {
    const std::string e = p + "block_sparse_moe.experts." + std::to_string(expert) + ".";
    return {e + "w1.weight", e + "w3.weight", e + "w2.weight"};
  }
  const std::string e = p + "mlp.experts." + std::to_string(expert) + ".";
  return {e + "gate_proj.weight", e + "up_proj.weight", e + "down_proj.weight"};
}

std::string expert_q4_name(int layer, int expert) {
  return "model.layers." + std::to_string(layer) + ".experts." + std::to_string(expert) + ".q4";
}

bool is_packed_model_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[8] = {};
  if (!in.read(magic, 8)) return false;
  return std::memcmp(magic, kPackedMagic, 8) == 0;
}

Status write_packed_model(const std::string& model_dir, const std::string& out_path,
                          const PackOptions& opts) {
  if (opts.group_size != 32 && opts.group_size != 64 && opts.group_size != 128)
    return make_error("group size " + std::to_string(opts.group_size) +
                      " is not one of 32, 64, 128");
  if (!std::filesystem::is_directory(model_dir) && !is_gguf_file(model_dir))
    return make_error(model_dir + ": not a checkpoint folder (config.json + safetensors) or a GGUF file");
  auto opened = ModelFiles::open(model_dir);
  if (!opened) return make_error(opened.error());
  const ModelFiles& files = **opened;
  const ModelDesc& d = files.desc();
  const int H = d.hidden_size, I = d.moe.expert_intermediate;
  // A GPTQ/AWQ folder (docs/quantized-checkpoints.md): its experts are INT4
  // blobs already, of the group the checkpoint gave; they are written as
  // they are.
  const bool source_q4 = files.experts_q4();
  if (source_q4 && !opts.quantize_experts)
    return make_error(model_dir + (is_gguf_file(model_dir)
                                       ? ": a GGUF file's quantised experts become INT4 blobs (docs/gguf.md); "
                                         "--no-quantize is for checkpoint folders"
                                       : ": the routed experts of this GPTQ/AWQ checkpoint are INT4 already; "
                                         "--no-quantize cannot give them back in bf16"));
  const int group = source_q4 ? files.q4_group() : opts.group_size;
  const bool q4 = opts.quantize_experts && d.n_moe_layers() > 0;
  if (q4 && (H % 2 != 0 || I % 2 != 0))
    return make_error(model_dir + ": INT4 experts need even hidden and expert intermediate sizes");

  // Routed expert matrices, checked, in (layer, expert) order.
  std::set<std::string> expert_names;
  std::vector<OutTensor> out;
  std::vector<OutTensor> experts;
  const ExpertLayout layout = !q4 ? ExpertLayout{} : source_q4 ? files.expert_layout() : expert_layout(H, I, group);
  for (int l = 0; l < d.n_layers; ++l) {
    if (!d.layer_is_moe[size_t(l)]) continue;
    for (int e = 0; e < d.moe.n_experts; ++e) {
      const ExpertWeightNames n = expert_weight_names(d, l, e);
      if (!source_q4) {
        if (Status s = check_expert_matrix(files, n.gate, I, H); !s) return s;
        if (Status s = check_expert_matrix(files, n.up, I, H); !s) return s;
        if (Status s = check_expert_matrix(files, n.down, H, I); !s) return s;
        expert_names.insert({n.gate, n.up, n.down});
      }
      if (q4) {
        OutTensor t;
        t.name = expert_q4_name(l, e);
        t.dtype = kQ4DType;
        t.shape = {H, I};
        t.bytes = layout.blob_bytes;
        t.layer = l;
        t.expert = e;
        experts.push_back(std::move(t));
      } else {
        for (const std::string* name : {&n.gate, &n.up, &n.down}) {
          const TensorView* v = files.find(*name);
          experts.push_back({*name, dtype_name(v->dtype), v->shape, v->nbytes, 0, v, -1, -1});
        }
      }
    }
  }
  // Everything else is copied as stored, by name; then the experts, so that
  // they form one contiguous run of the file.
  for (const auto& [name, v] : files.tensors())
    if (!expert_names.count(name))
      out.push_back({name, dtype_name(v.dtype), v.shape, v.nbytes, 0, &v, -1, -1});
  for (auto& t : experts) out.push_back(std::move(t));

  size_t end = 0;
  uint64_t bytes_total = 0;
  json table = json::array();
  for (auto& t : out) {
    t.offset = align_up(end, kPackedAlign);
    end = t.offset + t.bytes;
    bytes_total += t.bytes;
    table.push_back({{"name", t.name},
                     {"dtype", t.dtype},
                     {"shape", t.shape},
                     {"offset", t.offset},
                     {"bytes", t.bytes}});
  }
  const size_t data_bytes = align_up(end, kPackedAlign);

  json text_files = json::object();
  for (const std::string& name : ModelFiles::text_file_names()) {
    if (name == "config.json") continue;
    const std::string text = files.tokenizer_file(name);
    if (!text.empty()) text_files[name] = text;
  }
  json quant = {{"experts", q4 ? "q4" : "bf16"}, {"group_size", q4 ? group : 0}};
  if (q4) quant["expert_blob_bytes"] = layout.blob_bytes;
  const json header = {{"format", "moe-packed"},
                       {"version", kPackedVersion},
                       {"config", files.tokenizer_file("config.json")},
                       {"files", text_files},
                       {"quantization", quant},
                       {"alignment", kPackedAlign},
                       {"data_bytes", data_bytes},
                       {"tensors", table}};
  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const json::exception& e) {
    return make_error(model_dir + ": a tokenizer or config file is not valid UTF-8: " + e.what());
  }
  const size_t data_offset = align_up(kPackedPrefixBytes + header_text.size(), kPackedAlign);

  const std::string tmp_path = out_path + ".tmp";
  Status status = [&]() -> Status {
    OutFile f(tmp_path);
    uint8_t prefix[kPackedPrefixBytes] = {};
    std::memcpy(prefix, kPackedMagic, 8);
    put_u32(prefix + 8, kPackedVersion);
    put_u32(prefix + 12, 0);  // flags, none yet
    put_u64(prefix + 16, header_text.size());
    put_u64(prefix + 24, data_offset);
    f.write(prefix, sizeof prefix);
    f.write(header_text.data(), header_text.size());

    uint64_t bytes_done = 0;
    if (opts.progress) opts.progress(0, out.size(), 0, bytes_total);
    // Expert blobs are quantised a batch at a time on all threads, then
    // written in order.
    const size_t threads =
        opts.threads > 0 ? size_t(opts.threads) : host_threads();
    std::vector<std::vector<uint8_t>> blobs;  // [batch][blob_bytes]
    size_t batch_begin = 0, batch_end = 0;    // the out[] range `blobs` holds
    for (size_t i = 0; i < out.size() && !f.failed(); ++i) {
      const OutTensor& t = out[i];
      f.pad_to(data_offset + t.offset);
      if (t.src) {
        f.write(t.src->data, t.bytes);
        drop_pages(t.src->data, t.bytes);
      } else if (source_q4) {
        f.write(files.expert_q4(t.layer, t.expert), t.bytes);
      } else {
        if (i >= batch_end) {
          batch_begin = i;
          batch_end = std::min(out.size(), i + 2 * threads);
          blobs.resize(batch_end - batch_begin);
          parallel_for(batch_end - batch_begin, threads, [&](size_t k) {
            const OutTensor& x = out[batch_begin + k];
            blobs[k] = quantize_expert(files, expert_weight_names(d, x.layer, x.expert), layout);
          });
        }
        f.write(blobs[i - batch_begin].data(), t.bytes);
      }
      bytes_done += t.bytes;
      if (opts.progress) opts.progress(i + 1, out.size(), bytes_done, bytes_total);
    }
    f.pad_to(data_offset + data_bytes);
    return f.close();
  }();
  if (!status) {
    std::remove(tmp_path.c_str());
    return status;
  }
  if (std::rename(tmp_path.c_str(), out_path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp_path.c_str());
    return make_error(out_path + ": cannot rename " + tmp_path + " over it: " + why);
  }
  return Status::ok_status();
}

Status PackedModelReader::read(const std::string& path, ModelFiles* out) {
  auto mapped = MappedFile::open(path);
  if (!mapped) return make_error(mapped.error());
  const MappedFile& f = **mapped;
  auto bad = [&](const std::string& why) { return make_error(path + ": " + why); };
  if (f.size() < kPackedPrefixBytes) return bad("too short for a packed model file");
  if (std::memcmp(f.data(), kPackedMagic, 8) != 0)
    return bad("not a packed model file (bad magic)");
  const uint32_t version = get_u32(f.data() + 8);
  if (version != kPackedVersion)
    return bad("packed format version " + std::to_string(version) + " (this build reads version " +
               std::to_string(kPackedVersion) + ")");
  const uint64_t header_len = get_u64(f.data() + 16);
  const uint64_t data_offset = get_u64(f.data() + 24);
  if (header_len > f.size() - kPackedPrefixBytes)
    return bad("the header runs past the end of the file (" + std::to_string(f.size()) +
               " bytes): truncated");
  if (data_offset % kPackedAlign != 0 || data_offset < kPackedPrefixBytes + header_len)
    return bad("data offset " + std::to_string(data_offset) +
               " is not a page boundary past the header");

  json h;
  try {
    h = json::parse(reinterpret_cast<const char*>(f.data()) + kPackedPrefixBytes,
                    reinterpret_cast<const char*>(f.data()) + kPackedPrefixBytes + header_len);
  } catch (const std::exception& e) {
    return bad(std::string("the header does not parse: ") + e.what());
  }
  try {
    const uint64_t data_bytes = h.at("data_bytes").get<uint64_t>();
    if (data_offset > f.size() || f.size() - data_offset != data_bytes)
      return bad("the file has " + std::to_string(f.size()) + " bytes but its header says " +
                 std::to_string(data_offset + data_bytes) + ": truncated or damaged");

    out->text_files_.clear();
    out->text_files_["config.json"] = h.at("config").get<std::string>();
    for (const auto& [name, text] : h.at("files").items())
      out->text_files_[name] = text.get<std::string>();
    auto desc = parse_model_desc(out->text_files_["config.json"],
                                 out->tokenizer_file("generation_config.json"));
    if (!desc) return bad(desc.error());
    out->desc_ = std::move(*desc);
    const ModelDesc& d = out->desc_;

    const json& q = h.at("quantization");
    const std::string experts = q.at("experts").get<std::string>();
    if (experts != "q4" && experts != "bf16")
      return bad("unknown expert quantisation '" + experts + "'");
    out->experts_q4_ = experts == "q4";
    out->q4_group_ = out->experts_q4_ ? q.at("group_size").get<int>() : 0;
    if (out->experts_q4_) {
      if (out->q4_group_ != 32 && out->q4_group_ != 64 && out->q4_group_ != 128)
        return bad("INT4 group size " + std::to_string(out->q4_group_) +
                   " is not one of 32, 64, 128");
      out->layout_ = expert_layout(d.hidden_size, d.moe.expert_intermediate, out->q4_group_);
      out->expert_blobs_.assign(size_t(d.n_layers) * size_t(d.moe.n_experts), nullptr);
    }

    const uint8_t* data = f.data() + data_offset;
    std::vector<std::pair<uint64_t, uint64_t>> spans;  // [offset, end)
    for (const json& e : h.at("tensors")) {
      const std::string name = e.at("name").get<std::string>();
      auto bad_tensor = [&](const std::string& why) {
        return bad("tensor '" + name + "': " + why);
      };
      const std::string dtype = e.at("dtype").get<std::string>();
      const uint64_t offset = e.at("offset").get<uint64_t>();
      const uint64_t bytes = e.at("bytes").get<uint64_t>();
      if (offset % kPackedAlign != 0)
        return bad_tensor("offset " + std::to_string(offset) + " is not page aligned");
      if (offset > data_bytes || bytes > data_bytes - offset)
        return bad_tensor("runs past the end of the data (" + std::to_string(data_bytes) +
                          " bytes)");
      spans.push_back({offset, offset + bytes});
      if (dtype == kQ4DType) {
        int l = -1, x = -1;
        if (!out->experts_q4_)
          return bad_tensor("an INT4 expert in a file whose experts are not INT4");
        if (!parse_q4_name(name, &l, &x) || l >= d.n_layers || !d.layer_is_moe[size_t(l)] ||
            x >= d.moe.n_experts)
          return bad_tensor("not the name of a routed expert of this model");
        if (bytes != out->layout_.blob_bytes)
          return bad_tensor("holds " + std::to_string(bytes) + " bytes, the expert layout needs " +
                            std::to_string(out->layout_.blob_bytes));
        out->expert_blobs_[size_t(l) * size_t(d.moe.n_experts) + size_t(x)] = data + offset;
        continue;
      }
      TensorView t;
      t.name = name;
      if (!dtype_from_name(dtype, &t.dtype)) return bad_tensor("unknown dtype '" + dtype + "'");
      t.shape = e.at("shape").get<std::vector<int64_t>>();
      for (int64_t dim : t.shape)
        if (dim < 0) return bad_tensor("negative dimension");
      if (uint64_t(t.numel()) * dtype_size(t.dtype) != bytes)
        return bad_tensor("holds " + std::to_string(bytes) +
                          " bytes, which does not match its dtype and shape");
      t.data = data + offset;
      t.nbytes = size_t(bytes);
      if (!out->packed_tensors_.emplace(name, std::move(t)).second)
        return bad_tensor("listed twice");
    }
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i)
      if (spans[i].first < spans[i - 1].second)
        return bad("two tensors overlap at offset " + std::to_string(spans[i].first));
    for (int l = 0; out->experts_q4_ && l < d.n_layers; ++l) {
      if (!d.layer_is_moe[size_t(l)]) continue;
      for (int x = 0; x < d.moe.n_experts; ++x)
        if (!out->expert_blobs_[size_t(l) * size_t(d.moe.n_experts) + size_t(x)])
          return bad("missing INT4 expert '" + expert_q4_name(l, x) + "'");
    }
  } catch (const json::exception& e) {
    return bad(std::string("the header lacks a field or has a wrong type: ") + e.what());
  }
  out->packed_file_ = std::move(*mapped);
  out->packed_ = true;
  out->path_ = path;
  return Status::ok_status();
}

}  // namespace moe
