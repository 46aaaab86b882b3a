// Writes a GPTQ or AWQ checkpoint made from a reference fixture, and the
// plain checkpoint of its weights dequantised by the reference dequantiser
// (tests/model/quantized_checkpoint_writer.h), for the `moe` CLI check.
//   moe_write_quantized_fixture FIXTURE_DIR gptq|awq GROUP QUANT_OUT PLAIN_OUT

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>

#include "tests/model/quantized_checkpoint_writer.h"

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s FIXTURE_DIR gptq|awq GROUP QUANT_OUT PLAIN_OUT\n", argv[0]);
    return 2;
  }
  moe::test::QuantRecipe r;
  r.method = argv[2];
  r.group = std::atoi(argv[3]);
  try {
    std::filesystem::remove_all(argv[4]);
    std::filesystem::remove_all(argv[5]);
    moe::test::write_quantized_checkpoint(argv[1], argv[4], r);
    moe::test::write_dequantized_checkpoint(argv[4], argv[5]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
