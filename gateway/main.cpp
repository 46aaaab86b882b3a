// moe-gateway: the OpenAI-compatible HTTP front end.
#include <cstdio>
#include <cstring>

#include "moe_version.h"

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--version")) {
      std::printf("moe-gateway %s\n", MOE_VERSION);
      return 0;
    }
    if (!std::strcmp(argv[i], "--help")) {
      std::printf("moe-gateway %s\nusage: moe-gateway [options]\n", MOE_VERSION);
      return 0;
    }
  }
  std::fprintf(stderr, "moe-gateway: not implemented yet\n");
  return 1;
}
