#include "tokenizer/post_processor.h"

#include <string>
#include <utility>

namespace moe::tok {

namespace {

// Special ids before and after the sequence; covers TemplateProcessing's
// single template as well as Roberta/Bert (cls A sep).
class Wrap final : public PostProcessor {
 public:
  Wrap(std::vector<int32_t> prefix, std::vector<int32_t> suffix)
      : prefix_(std::move(prefix)), suffix_(std::move(suffix)) {}
  void process(std::vector<int32_t>& ids) const override {
    ids.insert(ids.begin(), prefix_.begin(), prefix_.end());
    ids.insert(ids.end(), suffix_.begin(), suffix_.end());
  }

 private:
  std::vector<int32_t> prefix_, suffix_;
};

class Sequence final : public PostProcessor {
 public:
  explicit Sequence(std::vector<std::unique_ptr<PostProcessor>> parts) : parts_(std::move(parts)) {}
  void process(std::vector<int32_t>& ids) const override {
    for (const auto& p : parts_) p->process(ids);
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> parts_;
};

Result<std::unique_ptr<PostProcessor>> template_processing(const nlohmann::json& spec) {
  const auto& single = spec.value("single", nlohmann::json::array());
  const auto& specials = spec.value("special_tokens", nlohmann::json::object());
  std::vector<int32_t> prefix, suffix;
  bool seen_a = false;
  for (const auto& item : single) {
    if (item.contains("Sequence")) {
      if (seen_a)
        return make_error("TemplateProcessing: the single template uses a sequence twice");
      seen_a = true;
    } else if (item.contains("SpecialToken")) {
      const std::string name = item["SpecialToken"].value("id", "");
      if (!specials.contains(name))
        return make_error("TemplateProcessing: special token '" + name + "' undefined");
      auto& dst = seen_a ? suffix : prefix;
      for (const auto& id : specials[name].value("ids", nlohmann::json::array()))
        dst.push_back(id.get<int32_t>());
    } else {
      return make_error("TemplateProcessing: unknown template item " + item.dump());
    }
  }
  if (!seen_a) return make_error("TemplateProcessing: the single template has no sequence");
  return std::unique_ptr<PostProcessor>(new Wrap(std::move(prefix), std::move(suffix)));
}

}  // namespace

std::unique_ptr<PostProcessor> make_wrap_processor(std::vector<int32_t> prefix,
                                                   std::vector<int32_t> suffix) {
  return std::unique_ptr<PostProcessor>(new Wrap(std::move(prefix), std::move(suffix)));
}

Result<std::unique_ptr<PostProcessor>> make_post_processor(const nlohmann::json& spec) {
  if (spec.is_null()) return std::unique_ptr<PostProcessor>();
  if (!spec.is_object() || !spec.contains("type"))
    return make_error("post_processor: not an object with a type");
  const std::string type = spec["type"].get<std::string>();
  if (type == "ByteLevel") return std::unique_ptr<PostProcessor>();  // only trims offsets
  if (type == "TemplateProcessing") return template_processing(spec);
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    // "cls": [token, id], "sep": [token, id]
    if (!spec.contains("cls") || !spec.contains("sep"))
      return make_error(type + ": missing cls or sep");
    return std::unique_ptr<PostProcessor>(
        new Wrap({spec["cls"][1].get<int32_t>()}, {spec["sep"][1].get<int32_t>()}));
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PostProcessor>> parts;
    for (const auto& sub : spec.value("processors", nlohmann::json::array())) {
      auto p = make_post_processor(sub);
      if (!p) return make_error(p.error());
      if (p.value()) parts.push_back(std::move(p.value()));
    }
    return std::unique_ptr<PostProcessor>(new Sequence(std::move(parts)));
  }
  return make_error("post_processor type '" + type + "' is not supported");
}

}  // namespace moe::tok
