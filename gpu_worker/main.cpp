// moe-worker: the inference worker (CPU or CUDA backend).
#include <cstdio>
#include <cstring>

#include "moe_version.h"

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--version")) {
      std::printf("moe-worker %s\n", MOE_VERSION);
      return 0;
    }
    if (!std::strcmp(argv[i], "--help")) {
      std::printf("moe-worker %s\nusage: moe-worker [options]\n", MOE_VERSION);
      return 0;
    }
  }
  std::fprintf(stderr, "moe-worker: not implemented yet\n");
  return 1;
}
