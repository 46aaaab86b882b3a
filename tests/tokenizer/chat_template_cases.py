#!/usr/bin/env python3
"""Writes chat_template_cases.json: templates and contexts rendered by Jinja2
configured exactly as transformers' apply_chat_template configures it, so the
C++ interpreter can be checked against the reference renderer.

Run: python3 tests/tokenizer/chat_template_cases.py   (needs jinja2)
"""
import json
import os
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))


class GenerationTag(jinja2.ext.Extension):
    """{% generation %}…{% endgeneration %}: renders its body (it only marks
    assistant text for training masks)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def make_env():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}

CHATS = {
    "single": [{"role": "user", "content": "What is a mixture of experts?"}],
    "system_multi": [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Explain KV cache.\n"}],
    "unicode": [{"role": "user", "content": "显存不够，硬盘来凑 — «quotes» 'single' \"double\" \\ back\tslash 🙂"}],
    "bad_alternation": [
        {"role": "user", "content": "one"},
        {"role": "user", "content": "two"}],
    "thinking": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nsimple sum\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "<think>add</think>6"}],
    "tool_round": [
        {"role": "system", "content": "You check the weather."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "{\"temp\": 4}"},
        {"role": "assistant", "content": "Paris 21°C, Oslo 4°C."}],
    "parts": [
        {"role": "system", "content": [{"type": "text", "text": "Describe images."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "  What is this?  "}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}],
    "only_system": [{"role": "system", "content": "sys"}],
}

DEEPSEEK_TOOLS = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
        {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "content": "21"},
    {"role": "tool", "content": "4"},
    {"role": "assistant", "content": "Warm and cold."}]

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}

# Template file → chats to render it with (each with and without the generation prompt).
FILE_CASES = {
    "chatml_tools.jinja": [("single", {}), ("system_multi", {}), ("unicode", {}), ("tool_round", {}),
                           ("tool_round", {"tools": [WEATHER_TOOL]}), ("single", {"tools": [WEATHER_TOOL]})],
    "header_turns.jinja": [("single", {}), ("system_multi", {}), ("bad_alternation", {}), ("unicode", {})],
    "inst_system_merge.jinja": [("single", {}), ("system_multi", {}), ("bad_alternation", {}), ("tool_round", {})],
    "thinking.jinja": [("thinking", {}), ("thinking", {"enable_thinking": False}), ("system_multi", {}),
                       ("parts", {})],
    "model_role.jinja": [("single", {}), ("system_multi", {}), ("parts", {}), ("bad_alternation", {})],
    "namespace_flags.jinja": [("single", {}), ("system_multi", {}), ("thinking", {}), ("deepseek_tools", {})],
    "filtered_loop.jinja": [("single", {}), ("system_multi", {}), ("only_system", {})],
}

# Small templates, one language feature each (rendered with chat "system_multi").
SNIPPETS = {
    "loop_vars": "{% for m in messages %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.revindex }}/{{ loop.revindex0 }}/{{ loop.first }}/{{ loop.last }}/{{ loop.length }}|{% endfor %}",
    "loop_prev_next": "{% for x in [1, 2, 3] %}[{{ loop.previtem }}<{{ x }}>{{ loop.nextitem }}]{% endfor %}",
    "loop_cycle": "{% for x in range(5) %}{{ loop.cycle('a', 'b') }}{% endfor %}",
    "loop_else": "{% for x in [] %}x{% else %}empty{% endfor %}{% for x in [1] %}one{% else %}never{% endfor %}",
    "loop_break_continue": "{% for x in range(10) %}{% if x is odd %}{% continue %}{% endif %}{% if x > 6 %}{% break %}{% endif %}{{ x }}{% endfor %}",
    "loop_items": "{% for k, v in {'b': 1, 'a': [1, 2]}.items() %}{{ k }}={{ v }};{% endfor %}{% for k, v in {'x': 'y'}|items %}{{ k }}:{{ v }}{% endfor %}",
    "loop_filter_len": "{% for m in messages if m.role != 'system' %}{{ loop.index }}of{{ loop.length }} {% endfor %}",
    "loop_scope": "{% set x = 'outer' %}{% for i in [1, 2] %}{{ x }}{% set x = i %}{{ x }}{% endfor %}|{{ x }}",
    "loop_nested": "{% for i in range(3) %}{% for j in range(i) %}({{ loop.index }}{{ i }}{{ j }}){% endfor %}{{ loop.index }}{% endfor %}",
    "namespace": "{% set ns = namespace(found=false, n=0) %}{% for m in messages %}{% if m.role == 'assistant' %}{% set ns.found = true %}{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.found }} {{ ns.n }}",
    "set_block": "{% set greeting | upper %}hello {{ messages[1].content }}{% endset %}[{{ greeting }}]{% set plain %}a\nb{% endset %}{{ plain | length }}",
    "filter_block": "{% filter upper %}shout {{ 'this' }}{% endfilter %}",
    "macro": "{% macro turn(role, text='(empty)') %}<{{ role }}>{{ text }}</{{ role }}>{% endmacro %}{% for m in messages %}{{ turn(m.role, m.content | trim) }}{% endfor %}{{ turn('x') }}{{ turn(text='kw', role='y') }}",
    "macro_recursive": "{% macro render(v) %}{% if v is mapping %}{% for k, x in v.items() %}{{ k }}:{{ render(x) }};{% endfor %}{% elif v is iterable and v is not string %}[{% for x in v %}{{ render(x) }},{% endfor %}]{% else %}{{ v }}{% endif %}{% endmacro %}{{ render({'a': [1, {'b': 'c'}], 'd': none}) }}",
    "whitespace": "a  {%- if true -%}  b  {%- endif -%}  c\n  {% if true %}\n    d\n  {% endif %}\n{{- '  e  ' -}}\n  f {{ 'g' }}  \n{%+ if true %}h{% endif +%}\ni\n{# comment #}\nj",
    "lstrip_comment": "x\n    {# indented comment #}\ny\n  {%- raw %}{{ not evaluated }} {% if %}{% endraw %}\nz",
    "trailing_newline": "line\n",
    "strings": "{{ 'a\\tb\\n' }}{{ \"it's\" }}{{ 'x' ~ 1 ~ none ~ true }}{{ 'ab' * 3 }}{{ 'q' 'r' }}{{ '\\u00e9\\x41' }}",
    "string_methods": "{{ '  pad  '.strip() }}|{{ 'xxhixx'.strip('x') }}|{{ '  l'.lstrip() }}|{{ 'r  '.rstrip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|{{ 'Hello'.startswith('He') }}|{{ 'Hello'.endswith(('x', 'lo')) }}|{{ 'MiXed'.upper() }}{{ 'MiXed'.lower() }}|{{ 'they are here'.title() }}|{{ 'abcabc'.replace('b', 'B') }}|{{ 'abc'.find('c') }}|{{ '-'.join(['a', 'b']) }}|{{ 'hello world'.capitalize() }}",
    "filters_text": "{{ '  t  ' | trim }}|{{ 'abc' | upper }}|{{ 'ABC' | lower }}|{{ 'the quick-brown (fox)' | title }}|{{ 'hELLO' | capitalize }}|{{ 'aaa' | replace('a', 'b', 2) }}|{{ '<&>\"' | e }}|{{ 'x' | safe }}|{{ 42 | string }}|{{ 'hi' | length }}|{{ '显存' | length }}",
    "filters_num": "{{ '42' | int }}|{{ '4.7' | int }}|{{ 'x' | int(7) }}|{{ 3.9 | int }}|{{ '2.5' | float }}|{{ -3 | abs }}|{{ 2.5 | round }}|{{ 3.14159 | round(2) }}|{{ 2.1 | round(0, 'ceil') }}|{{ [1, 2, 3] | sum }}|{{ [3, 1, 2] | max }}{{ [3, 1, 2] | min }}",
    "filters_list": "{{ [3, 1, 2] | first }}|{{ [3, 1, 2] | last }}|{{ [1, 2] | join(', ') }}|{{ [3, 1, 2] | sort }}|{{ [3, 1, 2] | sort(reverse=true) }}|{{ ['b', 'A', 'c'] | sort }}|{{ [1, 2, 1, 3] | unique | list }}|{{ [1, 2, 3] | reverse | list }}|{{ 'abc' | list }}|{{ messages | length }}|{{ {'a': 1} | length }}",
    "filters_attr": "{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | join('+') }}|{{ messages | rejectattr('role', 'eq', 'user') | map(attribute='role') | list }}|{{ messages | map(attribute='missing', default='-') | join }}|{{ [0, 1, 2, 3] | select('odd') | list }}|{{ [0, 1, '', 'x'] | select | list }}|{{ ['a', 'b'] | map('upper') | join }}|{{ messages | selectattr('content') | list | length }}",
    "filter_default": "{{ missing | default('dflt') }}|{{ '' | default('empty', true) }}|{{ none | default('n') }}|{{ missing | d('x') }}|{{ 0 | default(5, boolean=true) }}",
    "tojson": "{{ messages[0] | tojson }}|{{ {'z': 1, 'a': [1, 2.5, none, true, 'é\\n\"']} | tojson }}|{{ [] | tojson }}|{{ {} | tojson(indent=2) }}|{{ {'k': {'n': [1, {}]}, 'e': []} | tojson(indent=2) }}|{{ 'x' | tojson(ensure_ascii=true) }}|{{ '显' | tojson(ensure_ascii=true) }}|{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}|{{ [1, 2] | tojson(separators=(',', ':')) }}|{{ 1.0 | tojson }}|{{ 1e20 | tojson }}",
    "tests": "{{ missing is defined }}{{ missing is undefined }}{{ none is none }}{{ 'a' is string }}{{ 1 is number }}{{ 1 is integer }}{{ 1.5 is float }}{{ true is boolean }}{{ {} is mapping }}{{ [] is iterable }}{{ 'x' is sequence }}{{ 4 is even }}{{ 9 is divisibleby 3 }}{{ 9 is divisibleby(4) }}{{ 'a' is in 'cat' }}{{ 2 is in [1, 2] }}{{ x is not defined }}{{ 'abc' is lower }}{{ 1 is eq 1 }}{{ 3 is gt 2 }}{{ raise_exception is callable }}{{ true is sameas true }}{{ false is false }}",
    "expressions": "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 1 - -1 }} {{ 0.1 + 0.2 }} {{ 1e16 }} {{ 1.5e-5 }} {{ 10 / 4 }} {{ 3 * 1.0 }} {{ 1_000 }} {{ true + 1 }}",
    "arithmetic_edges": "{{ (-1) ** 3 }} {{ (-1) ** 4 }} {{ 0 ** 0 }} {{ 2 ** 62 }} {{ 2 ** -1 }} {{ range(9223372036854775800, 9223372036854775807, 3) | list }} {{ range(5, -5, -4) | list }} [{{ '' * 1000000000000 }}] {{ [] * 1000000000000 }} [{{ 'a' * -2 }}] {{ 10 % 3.5 }} {{ -7.5 // 2 }}",
    "compare_logic": "{{ 1 < 2 < 3 }} {{ 1 < 3 < 2 }} {{ 'a' < 'b' }} {{ [1, 2] == [1, 2] }} {{ 1 == 1.0 }} {{ 'x' in 'xyz' }} {{ 'q' not in ['a'] }} {{ 'k' in {'k': 1} }} {{ none or 'fallback' }} {{ 0 and 'never' }} {{ 'a' and 'b' }} {{ not none }} {{ 1 != 2 }} {{ [] or [1] }}",
    "conditional_expr": "{{ 'yes' if messages else 'no' }}|{{ 'a' if false }}|{{ 'x' if none else 'y' if true else 'z' }}",
    "subscripts": "{{ messages[0].role }} {{ messages[0]['role'] }} {{ messages[-1].content }} {{ messages[1:3] | map(attribute='role') | join(',') }} {{ [1, 2, 3, 4][::-1] }} {{ [1, 2, 3, 4][::2] }} {{ 'hello'[1:4] }} {{ 'hello'[::-1] }} {{ '显存不够'[1:3] }} {{ 'abc'[-1] }} {{ [1, 2][5] }}|{{ messages[9] is defined }} {{ {'a': {'b': 'c'}}.a.b }} {{ [1, [2, 3]][1][0] }} {{ [1,2,3][-2:] }} {{ [1,2,3][:-1] }}",
    "dict_methods": "{% set d = {'a': 1, 'b': 2} %}{{ d.keys() | list }} {{ d.values() | list }} {{ d.get('a') }} {{ d.get('z') }} {{ d.get('z', 'dflt') }} {{ d['a'] }} {{ d.a }} {{ d | list }} {{ dict(x=1, y='2') }}",
    "print_values": "{{ [1, 'a', none, true, 1.5, {'k': 'v'}] }} {{ {'q': \"it's\"} }} {{ none }} {{ true }} {{ (1, 2) }} {{ (1,) }} {{ {'a': 1}.items() | list }} {{ missing }}|",
    "range": "{{ range(3) | list }} {{ range(1, 10, 3) | list }} {{ range(5, 0, -2) | list }} {% for i in range(2) %}{{ i }}{% endfor %}",
    "undefined_ops": "{{ missing }}{{ missing ~ 'x' }}{% if not missing %}falsy{% endif %}{% for x in missing %}never{% endfor %}{{ missing | length }}",
    "set_tuple": "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = (3, 4) %}{{ t[1] }}",
    "indent_filter": "{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'a\\nb' | indent(4, true) }}|{{ 'x\\n\\ny' | indent(2, blank=true) }}",
    "generation_tag": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content | trim }}{% endif %}{% endfor %}",
}

# Templates that must fail; only whether they fail is compared (and, for
# raise_exception, the message).
ERROR_SNIPPETS = {
    "err_raise": "{{ raise_exception('custom failure: ' ~ messages | length) }}",
    "err_undefined_attr": "{{ missing.attr }}",
    "err_undefined_add": "{{ missing + 1 }}",
    "err_type_add": "{{ 'a' + 1 }}",
    "err_div_zero": "{{ 1 // 0 }}",
    "err_append": "{% set l = [] %}{{ l.append(1) }}",
    "err_none_iter": "{% for x in none %}{% endfor %}",
    "err_set_attr": "{% set d = {} %}{% set d.x = 1 %}",
    "err_range": "{{ range(1000000) | length }}",
    "err_call_non_callable": "{{ messages() }}",
}


def render(env, source, messages, add_generation_prompt, extra):
    ctx = dict(extra)
    ctx.setdefault("tools", None)
    try:
        text = env.from_string(source).render(messages=messages, add_generation_prompt=add_generation_prompt, **ctx)
        return {"text": text}
    except jinja2.exceptions.TemplateError as e:
        if type(e) is jinja2.exceptions.TemplateError:  # raise_exception()
            return {"error": str(e)}
        return {"error": ""}
    except Exception:
        return {"error": ""}


def main():
    env = make_env()
    cases = []
    chats = dict(CHATS, deepseek_tools=DEEPSEEK_TOOLS)
    for name, runs in FILE_CASES.items():
        with open(os.path.join(HERE, "chat_templates", name), encoding="utf-8") as f:
            source = f.read()
        for chat, extra in runs:
            for agp in (False, True):
                ctx = dict(SPECIAL, **extra)
                case = {"name": f"{name}/{chat}/{'gen' if agp else 'nogen'}{'/' + ','.join(extra) if extra else ''}",
                        "template_file": name, "messages": chats[chat], "add_generation_prompt": agp,
                        "context": ctx}
                case.update(render(env, source, chats[chat], agp, ctx))
                cases.append(case)
    for name, source in list(SNIPPETS.items()) + list(ERROR_SNIPPETS.items()):
        case = {"name": name, "template": source, "messages": CHATS["system_multi"], "add_generation_prompt": True,
                "context": SPECIAL}
        case.update(render(env, source, CHATS["system_multi"], True, SPECIAL))
        if name in ERROR_SNIPPETS:
            assert "error" in case, name
        else:
            assert "text" in case, (name, case)
        cases.append(case)
    with open(os.path.join(HERE, "chat_template_cases.json"), "w", encoding="utf-8") as f:
        json.dump({"generator": "jinja2 " + jinja2.__version__ + ", configured as transformers' apply_chat_template",
                   "cases": cases}, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(len(cases), "cases")


if __name__ == "__main__":
    main()
