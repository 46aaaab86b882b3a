// libFuzzer entry: the input is a GGUF file (written to a temporary file, as
// a user's would be opened). Whatever it holds, opening it either fails with
// an error or gives a model whose every tensor, INT4 expert and tokenizer can
// be made; nothing may crash, read out of bounds or allocate without bound.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "model/gguf_model.h"
#include "tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/tmp/moe-gguf-fuzz-" + std::to_string(::getpid()) + ".gguf";
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  moe::GgufOpenOptions opts;
  opts.threads = 1;
  auto model = moe::open_gguf_model(path, opts);
  if (!model) return 0;
  const moe::ModelFiles& m = *model.value();
  for (const auto& [name, view] : m.tensors()) (void)view.data;
  const moe::ModelDesc& d = m.desc();
  if (m.experts_q4() && d.n_layers > 0 && d.moe.n_experts > 0)
    for (int l = 0; l < d.n_layers; ++l) (void)m.expert_q4(l, d.moe.n_experts - 1);
  auto tok = moe::Tokenizer::from_json(m.tokenizer_file("tokenizer.json"), m.tokenizer_file("tokenizer_config.json"));
  if (tok) (void)tok.value()->decode(tok.value()->encode("def f(x):\n    return x <|im_end|>", true), false);
  return 0;
}
