// moe tokenize: reads UTF-8 text from stdin, prints its token ids as one JSON
// array.

#include <cstdio>
#include <cstring>
#include <iostream>
#include <iterator>
#include <string>

#include "tools/moe/commands.h"
#include "tools/moe/load_tokenizer.h"

namespace moe::cli {

namespace {
void usage(FILE* out) {
  std::fprintf(out,
               "usage: moe tokenize --model DIR [--no-special] < text\n\n"
               "  --model DIR     a folder with tokenizer.json (and tokenizer_config.json),\n"
               "                  a GGUF file or a packed model file\n"
               "  --no-special    do not add the post-processor's special tokens (e.g. BOS);\n"
               "                  special tokens written in the text are still recognised\n");
}
}  // namespace

int cmd_tokenize(int argc, char** argv) {
  std::string model;
  bool add_special = true;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--model") && i + 1 < argc) {
      model = argv[++i];
    } else if (!std::strcmp(argv[i], "--no-special")) {
      add_special = false;
    } else if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      usage(stdout);
      return 0;
    } else {
      std::fprintf(stderr, "moe tokenize: unexpected argument '%s'\n", argv[i]);
      usage(stderr);
      return 2;
    }
  }
  if (model.empty()) {
    usage(stderr);
    return 2;
  }
  auto tok = load_tokenizer(model);
  if (!tok) {
    std::fprintf(stderr, "moe tokenize: %s\n", tok.error().c_str());
    return 1;
  }
  std::cin >> std::noskipws;
  const std::string text((std::istreambuf_iterator<char>(std::cin)),
                         std::istreambuf_iterator<char>());
  const auto ids = tok.value()->encode(text, add_special);
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(ids[i]);
  }
  out += "]\n";
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

}  // namespace moe::cli
