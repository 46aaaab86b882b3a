#!/usr/bin/env python3
"""What constrained decoding costs, as a user meets it: moe-worker on a model
folder or packed file, moe-gateway in front, streaming chat clients. The
same load twice per concurrency: free text (ignore_eos, so every stream runs
to --new-tokens) and response_format json_schema (a schema that cannot
close within them: an array of at least 100 records of a string, an
integer, an enum and a boolean), so both modes run the same lengths. Reported per mode: decode tokens/s a stream after its first token,
inter-token latency p50/p99, and the gateway's mask counters from /metrics
(masks computed, cache hits, seconds spent).

    python3 bench/structured/structured_speed.py --build build --model /tmp/q15 --concurrency 1,8 --json out.json
"""
import argparse
import http.client
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gateway"))
from full_stack import Stack, percentile  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 100, "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "qty": {"type": "integer"}, "kind": {"enum": ["tool", "part", "kit"]},
                       "ok": {"type": "boolean"}},
        "required": ["name", "qty", "kind", "ok"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False,
}


def one_stream(port, model, i, new_tokens, structured, out):
    body = {"model": model, "max_tokens": new_tokens, "stream": True, "temperature": 1.0, "seed": 1000 + i,
            "messages": [{"role": "user", "content": f"Inventory list number {i}, as JSON."}]}
    if structured:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "inv", "strict": True, "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.time()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    stamps, text = [], ""
    for line in r:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        for ch in ev.get("choices", []):
            piece = ch.get("delta", {}).get("content")
            if piece:
                stamps.append(time.time())
                text += piece
    out.append({"t0": t0, "stamps": stamps, "text": text})


def metrics(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    body = c.getresponse().read().decode()
    get = lambda k: float(re.search(rf"^{k} ([0-9.e+-]+)$", body, re.M).group(1))
    return {k: get(f"moe_gateway_structured_{k}") for k in ("masks_computed_total", "mask_hits_total", "mask_seconds_total")}


def run(port, model, conc, new_tokens, structured, rounds):
    streams = []
    for r in range(rounds):
        threads = [threading.Thread(target=one_stream, args=(port, model, r * conc + i, new_tokens, structured, streams))
                   for i in range(conc)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    rates, itls, valid = [], [], 0
    for s in streams:
        st = s["stamps"]
        if len(st) >= 3:
            rates.append((len(st) - 1) / (st[-1] - st[0]))
            itls += [b - a for a, b in zip(st, st[1:])]
        if structured:
            try:
                json.loads(s["text"])
                valid += 1
            except ValueError:
                pass
    return {"decode_tok_s": statistics.mean(rates), "itl_ms_p50": percentile(itls, 50) * 1e3,
            "itl_ms_p99": percentile(itls, 99) * 1e3, "streams": len(streams),
            "pieces": sum(len(s["stamps"]) for s in streams), "whole_json": valid}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker-arg", action="append", default=[])
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rows = []
    with Stack(a.build, a.model, tempfile.mkdtemp(prefix="moe-structured-"), a.backend, a.worker_arg) as stack:
        port = stack.port
        model = os.path.basename(a.model.rstrip("/"))
        # Warm-up, a structured request included: a server that has seen the schema.
        run(port, model, 1, 16, False, 1)
        run(port, model, 1, 32, True, 1)
        for conc in [int(x) for x in a.concurrency.split(",")]:
            for structured in (False, True):
                before = metrics(port)
                r = run(port, model, conc, a.new_tokens, structured, a.rounds)
                after = metrics(port)
                r.update({k: round(after[k] - before[k], 4) for k in after})
                r.update({"concurrency": conc, "mode": "json_schema" if structured else "free text",
                          "backend": a.backend})
                rows.append(r)
                print(f"c{conc} {r['mode']:>11}: {r['decode_tok_s']:.1f} tok/s a stream, ITL p50/p99 "
                      f"{r['itl_ms_p50']:.2f}/{r['itl_ms_p99']:.2f} ms, {r['pieces']} pieces in {r['streams']} "
                      f"streams, masks computed {r['masks_computed_total']:.0f} ({r['mask_seconds_total']:.3f} s), "
                      f"hits {r['mask_hits_total']:.0f}" + (f", {r['whole_json']} whole JSON" if structured else ""),
                      flush=True)
            free, js = rows[-2], rows[-1]
            print(f"c{conc}: json_schema decodes at {100 * js['decode_tok_s'] / free['decode_tok_s']:.1f} % of free "
                  f"text", flush=True)
    sys.stdout.write("".join(l for l in open(stack.gateway_log) if "structured" in l))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
