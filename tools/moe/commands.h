#pragma once
// The subcommands of `moe`. Each lives in a file of its own (cmd_<name>.cpp)
// and returns the process exit status. argv[0] is the subcommand's name.

namespace moe::cli {

struct Command {
  const char* name;
  const char* summary;  // one line for `moe --help`
  int (*run)(int argc, char** argv);
};

int cmd_tokenize(int argc, char** argv);
int cmd_detokenize(int argc, char** argv);
int cmd_convert(int argc, char** argv);
int cmd_generate(int argc, char** argv);
int cmd_perplexity(int argc, char** argv);
int cmd_template(int argc, char** argv);
int cmd_replay_trace(int argc, char** argv);
int cmd_profile(int argc, char** argv);
int cmd_layer_ahead(int argc, char** argv);

// The table, defined in main.cpp.
extern const Command kCommands[];
extern const int kNumCommands;

}  // namespace moe::cli
