// moe template: renders a conversation through a model's chat template and
// prints the prompt text exactly (no newline added), as the server would
// build it before tokenising.

#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

#include "tokenizer/chat_template.h"
#include "tools/moe/commands.h"

namespace moe::cli {

namespace {

void usage(FILE* out) {
  std::fprintf(
      out,
      "usage: moe template --model DIR --messages FILE [--add-generation-prompt] [--tools FILE]\n\n"
      "  --model DIR               folder with chat_template.jinja or tokenizer_config.json\n"
      "                            (tokenizer files are enough)\n"
      "  --messages FILE           JSON list of {\"role\", \"content\", ...}; - reads stdin\n"
      "  --add-generation-prompt   end with the assistant's turn opened\n"
      "  --tools FILE              JSON list of tool definitions, passed as `tools`\n\n"
      "prints the rendered prompt exactly as the template produces it\n");
}

// Key order is kept (ordered_json): templates print tool schemas with tojson.
bool read_json_file(const std::string& path, nlohmann::ordered_json* out, std::string* err) {
  std::string text;
  if (path == "-") {
    text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  } else {
    std::ifstream f(path, std::ios::binary);
    if (!f) {
      *err = "cannot open " + path;
      return false;
    }
    text.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  *out = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (out->is_discarded()) {
    *err = path + ": not valid JSON";
    return false;
  }
  return true;
}

}  // namespace

int cmd_template(int argc, char** argv) {
  std::string model_dir, messages_path, tools_path;
  bool add_generation_prompt = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    }
    if (a == "--add-generation-prompt") {
      add_generation_prompt = true;
      continue;
    }
    if (a != "--model" && a != "--messages" && a != "--tools") {
      std::fprintf(stderr, "template: unknown option %s\n", a.c_str());
      usage(stderr);
      return 2;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "template: %s needs a value\n", a.c_str());
      return 2;
    }
    (a == "--model" ? model_dir : a == "--messages" ? messages_path : tools_path) = argv[++i];
  }
  if (model_dir.empty() || messages_path.empty()) {
    usage(stderr);
    return 2;
  }

  auto tmpl = load_chat_template(model_dir);
  if (!tmpl) {
    std::fprintf(stderr, "template: %s\n", tmpl.error().c_str());
    return 1;
  }
  nlohmann::ordered_json messages;
  std::string err;
  if (!read_json_file(messages_path, &messages, &err)) {
    std::fprintf(stderr, "template: %s\n", err.c_str());
    return 1;
  }
  if (!messages.is_array()) {
    std::fprintf(stderr, "template: %s must hold a JSON list of messages\n", messages_path.c_str());
    return 1;
  }
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();
  if (!tools_path.empty()) {
    nlohmann::ordered_json tools;
    if (!read_json_file(tools_path, &tools, &err)) {
      std::fprintf(stderr, "template: %s\n", err.c_str());
      return 1;
    }
    extra["tools"] = std::move(tools);
  }
  auto text = tmpl->render_ordered(messages, add_generation_prompt, extra);
  if (!text) {
    std::fprintf(stderr, "template: %s\n", text.error().c_str());
    return 1;
  }
  std::fwrite(text->data(), 1, text->size(), stdout);
  return 0;
}

}  // namespace moe::cli
