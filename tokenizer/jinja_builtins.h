#pragma once
// The library a template can call: filters (`x|trim`), tests (`x is defined`),
// methods of strings, dicts and lists (`s.strip()`, `d.items()`), and the
// global functions (range, namespace, dict, raise_exception, strftime_now).

#include <string>

#include "tokenizer/jinja_ast.h"
#include "tokenizer/jinja_interpreter.h"

namespace moe::jinja {

// Throw TemplateError for unknown names or bad arguments.
Value apply_filter(Interpreter& in, const std::string& name, const Value& subject, CallArgs& args);
bool apply_test(Interpreter& in, const std::string& name, const Value& subject, CallArgs& args);

// A bound method of `object`, or undefined when it has none of that name.
// Methods that would modify a value (list.append, dict.update, …) exist but
// fail when called: chat templates are rendered in an immutable sandbox.
Value method_of(const Value& object, const std::string& name);

void add_globals(Interpreter& in);

// Fails at parse time, as Jinja does, on a filter or test no template could run.
void check_names(const Program& program);

}  // namespace moe::jinja
