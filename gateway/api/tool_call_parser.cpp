#include "gateway/api/tool_call_parser.h"

#include <nlohmann/json.hpp>

namespace moe::gw {
namespace {

constexpr std::string_view kOpen = "<tool_call>";
constexpr std::string_view kClose = "</tool_call>";
constexpr std::string_view kMarker = "[TOOL_CALLS]";

// One call object: {"name": string, "arguments": object or string}.
bool as_call(const nlohmann::json& j, ToolCallParser::Call* out) {
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) return false;
  if (j.contains("arguments") && !j["arguments"].is_object() && !j["arguments"].is_string()) return false;
  out->name = j["name"].get<std::string>();
  out->arguments = !j.contains("arguments") ? "{}" : j["arguments"].is_string() ? j["arguments"].get<std::string>()
                                                                               : j["arguments"].dump();
  return true;
}

// How much of the end of `s` could be the start of `tag`.
size_t partial_suffix(std::string_view s, std::string_view tag) {
  for (size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n)
    if (s.substr(s.size() - n) == tag.substr(0, n)) return n;
  return 0;
}

}  // namespace

void ToolCallParser::take_list(Step* out) {
  const nlohmann::json j = nlohmann::json::parse(held_, nullptr, false);
  std::vector<Call> calls;
  bool ok = j.is_array() && !j.empty();
  for (size_t i = 0; ok && i < j.size(); ++i) {
    Call c;
    ok = as_call(j[i], &c);
    calls.push_back(std::move(c));
  }
  if (ok)
    out->calls.insert(out->calls.end(), calls.begin(), calls.end());
  else
    out->text += std::string(kMarker) + held_;
  held_.clear();
  inside_ = false;
}

void ToolCallParser::take_block(Step* out, bool closed) {
  const nlohmann::json j = nlohmann::json::parse(held_, nullptr, false);
  Call c;
  if (as_call(j, &c)) {
    after_call_ = true;
    out->calls.push_back(std::move(c));
  } else {  // not a call after all: the text as the model wrote it
    out->text += std::string(kOpen) + held_ + (closed ? std::string(kClose) : std::string());
  }
  held_.clear();
  inside_ = false;
}

ToolCallParser::Step ToolCallParser::push(std::string_view piece) {
  Step out;
  held_.append(piece);
  if (markup_ == Markup::mistral) {
    if (inside_) return out;  // the list runs to the end of the output
    const size_t at = held_.find(kMarker);
    if (at == std::string::npos) {
      const size_t keep = partial_suffix(held_, kMarker);
      out.text += held_.substr(0, held_.size() - keep);
      held_.erase(0, held_.size() - keep);
      return out;
    }
    out.text += held_.substr(0, at);
    held_.erase(0, at + kMarker.size());
    inside_ = true;
    return out;
  }
  for (;;) {
    if (!inside_) {
      // Whitespace right after a call (between calls) is not content.
      if (after_call_) {
        size_t skip = 0;
        while (skip < held_.size() && (held_[skip] == '\n' || held_[skip] == ' ' || held_[skip] == '\r')) ++skip;
        held_.erase(0, skip);
        if (held_.empty()) return out;
        after_call_ = false;
      }
      const size_t at = held_.find(kOpen);
      if (at == std::string::npos) {
        const size_t keep = partial_suffix(held_, kOpen);
        out.text += held_.substr(0, held_.size() - keep);
        held_.erase(0, held_.size() - keep);
        return out;
      }
      out.text += held_.substr(0, at);
      held_.erase(0, at + kOpen.size());
      inside_ = true;
    }
    const size_t end = held_.find(kClose);
    if (end == std::string::npos) return out;
    std::string rest = held_.substr(end + kClose.size());
    held_.resize(end);
    take_block(&out, true);
    held_ = std::move(rest);
  }
}

ToolCallParser::Step ToolCallParser::finish() {
  Step out;
  if (inside_ && markup_ == Markup::mistral) {
    take_list(&out);
  } else if (inside_) {
    take_block(&out, false);
  } else {
    if (!after_call_) out.text = held_;  // (whitespace after a call is not content)
    held_.clear();
  }
  return out;
}

}  // namespace moe::gw
