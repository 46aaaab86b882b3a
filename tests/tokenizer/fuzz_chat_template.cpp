// libFuzzer entry for the chat-template renderer as the gateway drives it:
// validated turns (a role and a text each) rendered through the real
// templates this repository holds (the demo model's and those of
// tests/tokenizer/chat_templates). The first byte picks the template and
// whether a generation prompt is asked for; the rest is cut at 0x01 bytes into
// turns, each turn's first byte picking its role. Template errors
// (raise_exception, roles out of order) are fine; crashes, hangs and bad
// reads are not. Inputs whose first byte is 0xFF are template source
// instead, and are only parsed: templates are the model's, not the client's,
// but the parser must still refuse garbage cleanly.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tokenizer/chat_template.h"

namespace {

std::vector<moe::ChatTemplate> load_templates() {
  std::vector<moe::ChatTemplate> out;
  std::vector<std::filesystem::path> files = {std::filesystem::path(MOE_FUZZ_MODEL) / "chat_template.jinja"};
  for (const auto& e : std::filesystem::directory_iterator(MOE_FUZZ_TEMPLATES)) files.push_back(e.path());
  for (const auto& f : files) {
    std::ifstream in(f);
    std::stringstream ss;
    ss << in.rdbuf();
    auto t = moe::ChatTemplate::parse(ss.str());
    if (!t.ok()) __builtin_trap();  // the shipped templates all parse
    t->set_special_tokens("<s>", "</s>");
    out.push_back(std::move(t.value()));
  }
  return out;
}

const std::vector<moe::ChatTemplate>& templates() {
  static const std::vector<moe::ChatTemplate> t = load_templates();
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] == 0xFF) {
    (void)moe::ChatTemplate::parse(rest);
    return 0;
  }
  const auto& all = templates();
  const moe::ChatTemplate& t = all[data[0] % all.size()];
  static const char* const kRoles[] = {"system", "user", "assistant", "tool"};
  nlohmann::json messages = nlohmann::json::array();
  size_t start = 0;
  while (start <= rest.size() && messages.size() < 64) {
    size_t end = rest.find('\x01', start);
    if (end == std::string::npos) end = rest.size();
    const std::string turn = rest.substr(start, end - start);
    const char* role = kRoles[turn.empty() ? 1 : static_cast<unsigned char>(turn[0]) % 4];
    messages.push_back({{"role", role}, {"content", turn.empty() ? turn : turn.substr(1)}});
    start = end + 1;
  }
  (void)t.render(messages, (data[0] & 0x80) != 0);
  return 0;
}
