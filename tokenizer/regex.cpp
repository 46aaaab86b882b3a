#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/regex.h"

#include <pcre2.h>

#include "tokenizer/utf8.h"

namespace moe::tok {

Result<std::shared_ptr<const Regex>> Regex::compile(std::string_view pattern) {
  int err = 0;
  PCRE2_SIZE err_at = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &err, &err_at, nullptr);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    return make_error("regex '" + std::string(pattern) + "' at " + std::to_string(err_at) + ": " +
                      reinterpret_cast<const char*>(msg));
  }
  // JIT is an optimisation only: without it pcre2_match interprets.
  const bool jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return std::shared_ptr<const Regex>(new Regex(code, jit));
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

void Regex::find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const {
  auto* code = static_cast<pcre2_code*>(code_);
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;
  bool use_jit = jit_;
  while (pos < text.size()) {
    // The direct JIT entry skips pcre2_match's per-call checks.
    const int rc = use_jit ? pcre2_jit_match(code, subject, text.size(), pos, 0, md, nullptr)
                           : pcre2_match(code, subject, text.size(), pos,
                                         PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, nullptr);
    if (rc < 0 && rc != PCRE2_ERROR_NOMATCH && use_jit) {
      // The JIT ran out of stack on a pathological input: interpret instead.
      use_jit = false;
      continue;
    }
    if (rc < 0) break;
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    if (ov[1] > ov[0]) {
      out.emplace_back(ov[0], ov[1]);
      pos = ov[1];
    } else {
      // Empty match: step over one character so the loop always advances.
      if (ov[0] >= text.size()) break;
      const size_t n = utf8_char_len(text, ov[0]);
      pos = ov[0] + (n ? n : 1);
    }
  }
  pcre2_match_data_free(md);
}

}  // namespace moe::tok
