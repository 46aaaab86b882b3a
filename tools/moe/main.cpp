// moe: the offline command-line tool. Dispatches to one subcommand.

#include <cstdio>
#include <cstring>

#include "moe_version.h"
#include "tools/moe/commands.h"

namespace moe::cli {

const Command kCommands[] = {
    {"tokenize", "text on stdin -> token ids (JSON array)", cmd_tokenize},
    {"detokenize", "token ids (JSON array) on stdin -> text", cmd_detokenize},
    {"convert", "checkpoint folder -> one packed model file (INT4 experts)", cmd_convert},
    {"generate", "generate text from a prompt on the CPU engine", cmd_generate},
    {"perplexity", "perplexity of a text file under the model (CPU engine)", cmd_perplexity},
    {"layer-ahead", "how well each MoE layer's experts can be guessed before it runs (CPU engine)", cmd_layer_ahead},
    {"template", "chat messages (JSON) -> the prompt the model's chat template renders", cmd_template},
    {"replay-trace", "routing trace -> expert-island hit rate per eviction policy", cmd_replay_trace},
    {"profile", "text, routing trace or Redis -> routing profile (moe-worker --warm-profile)", cmd_profile},
    {nullptr, nullptr, nullptr},
};
const int kNumCommands = sizeof(kCommands) / sizeof(kCommands[0]) - 1;

}  // namespace moe::cli

static void print_help(FILE* out) {
  std::fprintf(out,
               "moe %s - offline tools for the MoE inference server\n\n"
               "usage: moe <command> [options]    (moe <command> --help for its options)\n\n"
               "commands:\n",
               MOE_VERSION);
  for (int i = 0; i < moe::cli::kNumCommands; ++i)
    std::fprintf(out, "  %-16s %s\n", moe::cli::kCommands[i].name, moe::cli::kCommands[i].summary);
  std::fprintf(out, "\noptions:\n  --help       this text\n  --version    print the version\n");
}

int main(int argc, char** argv) {
  if (argc < 2) {
    print_help(stderr);
    return 2;
  }
  const char* cmd = argv[1];
  if (!std::strcmp(cmd, "--help") || !std::strcmp(cmd, "-h") || !std::strcmp(cmd, "help")) {
    print_help(stdout);
    return 0;
  }
  if (!std::strcmp(cmd, "--version")) {
    std::printf("moe %s\n", MOE_VERSION);
    return 0;
  }
  for (int i = 0; i < moe::cli::kNumCommands; ++i)
    if (!std::strcmp(cmd, moe::cli::kCommands[i].name)) return moe::cli::kCommands[i].run(argc - 1, argv + 1);
  std::fprintf(stderr, "moe: unknown command '%s' (see moe --help)\n", cmd);
  return 2;
}
