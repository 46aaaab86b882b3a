#pragma once
// Hugging Face checkpoints that are already INT4: GPTQ (AutoGPTQ / GPTQModel
// "gptq" and "gptq_v2" formats) and AWQ (AutoAWQ GEMM), recognised by the
// `quantization_config` of config.json (docs/quantized-checkpoints.md).
//
// At open, every routed expert becomes an INT4 blob of docs/int4-experts.md
// (the checkpoint's codes and scales carried over as they are where its
// groups nest inside ours; requantised with q4_quantize_matrix where they do
// not, as with act-order GPTQ), every other quantised Linear is dequantised
// to f32 under its plain name `<prefix>.weight`, and every tensor the
// checkpoint stores unquantised stays a view of the mapping. The engines then
// read the model as they read a packed file.

#include <optional>
#include <string>
#include <vector>

#include "model/result.h"

namespace moe {

class ModelFiles;

enum class QuantMethod { gptq, awq };

// The parts of config.json's `quantization_config` that decide the layout.
struct QuantizedCheckpointConfig {
  QuantMethod method = QuantMethod::gptq;
  int bits = 4;
  int group_size = 128;     // inputs per group; -1 (GPTQ): one group over the whole row
  bool desc_act = false;    // GPTQ act order: g_idx may be a permutation of the groups
  bool gptq_v2 = false;     // GPTQ zeros stored as they are (v1 stores zero - 1)
  std::vector<std::string> modules_to_not_convert;  // AWQ; informational
};

// Reads `quantization_config` from the text of a config.json: nullopt when
// there is none. A config that names another method, another bit width or a
// layout this reader does not know is an error that says which key.
[[nodiscard]] Result<std::optional<QuantizedCheckpointConfig>> read_quantization_config(
    const std::string& config_json_text);

// Fills a ModelFiles whose path_, desc_, ckpt_ and text_files_ are set from a
// checkpoint folder (ModelFiles::open's folder branch) with the tensors and
// expert blobs of a GPTQ or AWQ checkpoint.
class QuantizedCheckpointReader {
 public:
  [[nodiscard]] static Status read(const QuantizedCheckpointConfig& config, ModelFiles* out);
};

}  // namespace moe
