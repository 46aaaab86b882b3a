#!/usr/bin/env python3
"""What the prefix cache saves a chat session, as a user meets it: moe-worker
with --prefix-cache on, then off, moe-gateway in front, and one client that
holds a 5-turn conversation (a long system prompt, each turn resending the
whole history, as the SDKs do). Per turn: time to first token, prompt
tokens, and the cached tokens the response's usage reports.

    python3 bench/prefix/session_ttft.py --build build --model /tmp/q15 --json out.json
"""
import argparse
import http.client
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gateway"))
from full_stack import Stack  # noqa: E402

SYSTEM = ("You are a careful assistant for a team that maintains a large C++ inference server. " * 40).strip()
QUESTIONS = ["How do I add a new sampling parameter?", "Where are the KV blocks allocated?",
             "What happens when the worker crashes?", "How is the chat template rendered?",
             "Which tests should I run before landing?"]


def turn(port, model, messages, max_tokens):
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.time()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    ttft, text, usage = None, "", None
    for line in r:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices", []):
            piece = ch.get("delta", {}).get("content")
            if piece and ttft is None:
                ttft = time.time() - t0
            if piece:
                text += piece
    return ttft, text, usage


def session(port, model, max_tokens):
    messages = [{"role": "system", "content": SYSTEM}]
    rows = []
    for i, q in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": q})
        ttft, text, usage = turn(port, model, messages, max_tokens)
        messages.append({"role": "assistant", "content": text})
        rows.append({"turn": i + 1, "ttft_ms": round(ttft * 1e3, 1), "prompt_tokens": usage["prompt_tokens"],
                     "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    model = os.path.basename(a.model.rstrip("/"))
    out = []
    for mode in ("on", "off"):
        with Stack(a.build, a.model, tempfile.mkdtemp(prefix="moe-prefix-"), a.backend,
                   worker_args=["--prefix-cache", mode]) as stack:
            turn(stack.port, model, [{"role": "user", "content": "warm up"}], 4)
            rows = session(stack.port, model, a.max_tokens)
            for r in rows:
                r["prefix_cache"] = mode
                print(f"prefix cache {mode}: turn {r['turn']}: TTFT {r['ttft_ms']:.1f} ms, prompt {r['prompt_tokens']} "
                      f"tokens, {r['cached_tokens']} from the cache", flush=True)
            out += rows
    on = [r for r in out if r["prefix_cache"] == "on"]
    off = [r for r in out if r["prefix_cache"] == "off"]
    for x, y in zip(on, off):
        print(f"turn {x['turn']}: {x['ttft_ms']:.1f} vs {y['ttft_ms']:.1f} ms ({y['ttft_ms'] / max(x['ttft_ms'], 1e-3):.2f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
