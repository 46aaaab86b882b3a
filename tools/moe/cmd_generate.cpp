// moe generate: runs the CPU engine on a prompt and streams the generated
// text to stdout (nothing else goes there), stopping at an EOS token or after
// --max-tokens.

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/cpu_engine.h"
#include "model/model_files.h"
#include "tokenizer/chat_template.h"
#include "tools/moe/commands.h"
#include "tools/moe/load_tokenizer.h"

namespace moe::cli {

namespace {

void usage(FILE* out) {
  std::fprintf(out,
               "usage: moe generate --model DIR|FILE --prompt TEXT [options]\n\n"
               "  --model DIR|FILE   a checkpoint folder, a GGUF file or a packed model file\n"
               "  --prompt TEXT      the prompt\n"
               "  --chat             wrap the prompt as one user message in the chat template\n"
               "  --max-tokens N     tokens to generate at most (default 128)\n"
               "  --temperature T    0 for greedy (default 1)\n"
               "  --top-p P          nucleus sampling (default 1: off)\n"
               "  --top-k K          keep the K best tokens (default 0: off)\n"
               "  --seed S           random seed (default 0)\n"
               "  --threads N        CPU threads (default: all cores)\n");
}

// The chat template of a folder, or of a packed file's tokenizer files.
Result<ChatTemplate> chat_template_of(const std::string& path, const ModelFiles& files) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return load_chat_template(path);
  auto t = chat_template_from_files({path, files.tokenizer_file("chat_template.jinja"),
                                     files.tokenizer_file("tokenizer_config.json"), ""});
  if (!t) return make_error(t.error());
  if (!t->has_value()) return make_error(path + ": the model has no chat template");
  return std::move(**t);
}

}  // namespace

int cmd_generate(int argc, char** argv) {
  std::string model, prompt;
  bool chat = false, have_prompt = false;
  int max_tokens = 128, threads = 0;
  SamplingParams sp;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    } else if (a == "--chat") {
      chat = true;
    } else if (a == "--model" && has_value) {
      model = argv[++i];
    } else if (a == "--prompt" && has_value) {
      prompt = argv[++i];
      have_prompt = true;
    } else if (a == "--max-tokens" && has_value) {
      max_tokens = std::atoi(argv[++i]);
    } else if (a == "--temperature" && has_value) {
      sp.temperature = std::strtof(argv[++i], nullptr);
    } else if (a == "--top-p" && has_value) {
      sp.top_p = std::strtof(argv[++i], nullptr);
    } else if (a == "--top-k" && has_value) {
      sp.top_k = std::atoi(argv[++i]);
    } else if (a == "--seed" && has_value) {
      sp.seed = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--threads" && has_value) {
      threads = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "moe generate: unexpected argument '%s'\n", argv[i]);
      usage(stderr);
      return 2;
    }
  }
  if (model.empty() || !have_prompt) {
    usage(stderr);
    return 2;
  }

  auto files = ModelFiles::open(model);
  if (!files) {
    std::fprintf(stderr, "moe generate: %s\n", files.error().c_str());
    return 1;
  }
  auto tok = load_tokenizer(model);
  if (!tok) {
    std::fprintf(stderr, "moe generate: %s\n", tok.error().c_str());
    return 1;
  }
  const Tokenizer& tokenizer = *tok.value();
  std::vector<int32_t> ids;
  if (chat) {
    auto tmpl = chat_template_of(model, *files.value());
    if (!tmpl) {
      std::fprintf(stderr, "moe generate: %s\n", tmpl.error().c_str());
      return 1;
    }
    const nlohmann::json messages =
        nlohmann::json::array({{{"role", "user"}, {"content", prompt}}});
    auto text = tmpl->render(messages, /*add_generation_prompt=*/true);
    if (!text) {
      std::fprintf(stderr, "moe generate: chat template: %s\n", text.error().c_str());
      return 1;
    }
    // The template writes any BOS itself.
    ids = tokenizer.encode(*text, /*add_special_tokens=*/false);
  } else {
    ids = tokenizer.encode(prompt, /*add_special_tokens=*/true);
  }
  if (ids.empty()) {
    std::fprintf(stderr, "moe generate: the prompt has no tokens\n");
    return 1;
  }

  EngineOptions opts;
  opts.threads = threads;
  auto engine = CpuEngine::create(files.value(), opts);
  if (!engine) {
    std::fprintf(stderr, "moe generate: %s\n", engine.error().c_str());
    return 1;
  }
  CpuEngine& e = *engine.value();
  std::vector<int32_t> eos = e.desc().eos_token_ids;
  if (tokenizer.eos_id() >= 0) eos.push_back(tokenizer.eos_id());

  StreamDecoder stream(tokenizer);
  SeqInput in;
  in.seq_id = 1;
  in.tokens = ids;
  in.start_pos = 0;
  in.sampling = sp;
  for (int n = 0; n < max_tokens; ++n) {
    if (in.start_pos + int(in.tokens.size()) >= e.max_context()) break;
    auto out = e.step(std::span<const SeqInput>(&in, 1));
    if (!out) {
      std::fprintf(stderr, "moe generate: %s\n", out.error().c_str());
      return 1;
    }
    const int32_t t = (*out)[0].token;
    if (std::find(eos.begin(), eos.end(), t) != eos.end()) break;
    const std::string piece = stream.push(t);
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
    in.start_pos += int32_t(in.tokens.size());
    in.tokens = {t};
  }
  const std::string rest = stream.flush();
  std::fwrite(rest.data(), 1, rest.size(), stdout);
  // Only the generated text goes to a pipe or file, byte for byte; a
  // terminal gets a final newline so the prompt starts on its own line.
  if (isatty(fileno(stdout))) std::fputc('\n', stdout);
  return 0;
}

}  // namespace moe::cli
