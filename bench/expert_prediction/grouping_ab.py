#!/usr/bin/env python3
"""Expert-grouped batching, on and off: the distinct experts each worker step
uses (what grouping lowers, and what a GPU worker pays for in expert copies)
and the wall time of a burst of concurrent requests of two kinds.

moe-gateway (no Redis: the table learns from the gateway's own replies) over
one CPU moe-worker on the demo model, given few KV blocks so that only a few
requests run at once and the choice of which to admit next matters. Per mode: the gateway learns 12
requests of each kind, then a burst of concurrent requests alternating the
kinds runs; the figures are the burst's deltas of
moe_gateway_step_experts_total / moe_gateway_steps_with_usage_total.

    python3 bench/expert_prediction/grouping_ab.py --build build-pred [--rounds 2]
"""
import argparse
import http.client
import json
import os
import re
import socket
import subprocess
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "models", "demo-moe")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def kind_x(n):
    return (f"def test_index_{n}(self):\n    index = pd.Index([{n}, {n + 1}, {2 * n}])\n"
            f"    result = index.copy()\n    tm.assert_index_equal(result, index)\n")


def kind_y(n):
    return (f"The committee met on day {n} to discuss the annual budget, the new school, "
            f"and the opening hours of the public library during the winter.\n")


def complete(port, prompt, max_tokens):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/v1/completions", json.dumps({"model": "demo-moe", "prompt": prompt,
                                                     "max_tokens": max_tokens, "temperature": 0}),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    body = json.loads(r.read())
    if r.status != 200:
        raise SystemExit(f"HTTP {r.status}: {body}")
    return body["usage"]["completion_tokens"]


def metrics(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(moe_gateway_\w+) (\S+)$", text, re.M)}


def run(args, mode):
    tmp = tempfile.mkdtemp(prefix="moe-grouping-")
    sock = os.path.join(tmp, "w.sock")
    port = free_port()
    w = subprocess.Popen([os.path.join(args.build, "worker", "moe-worker"), "--model", MODEL, "--socket", sock,
                          "--threads", str(args.threads), "--kv-blocks", str(args.kv_blocks)],
                         stderr=subprocess.DEVNULL)
    g = subprocess.Popen([os.path.join(args.build, "gateway", "moe-gateway"), "--model", MODEL, "--worker",
                          "unix:" + sock, "--port", str(port), "--grouped-batching", mode, "--predict", "on",
                          "--max-step-tokens", str(args.step_tokens), "--grouping-max-skips", str(args.max_skips)],
                         stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        for i in range(12):
            complete(port, kind_x(100 + i), 4)
            complete(port, kind_y(100 + i), 4)
        m0 = metrics(port)
        tokens = []
        threads = [threading.Thread(target=lambda i=i: tokens.append(
            complete(port, kind_x(i) if i % 2 else kind_y(i), args.max_tokens))) for i in range(args.burst)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        m1 = metrics(port)
        steps = m1["moe_gateway_steps_with_usage_total"] - m0["moe_gateway_steps_with_usage_total"]
        experts = m1["moe_gateway_step_experts_total"] - m0["moe_gateway_step_experts_total"]
        hits = m1["moe_gateway_prediction_hits_total"] - m0["moe_gateway_prediction_hits_total"]
        pred = m1["moe_gateway_predicted_experts_total"] - m0["moe_gateway_predicted_experts_total"]
        print(f"grouped-batching {mode:3}: {steps:4.0f} steps, {experts / steps:6.1f} distinct experts per step, "
              f"burst {wall:5.2f} s, {sum(tokens) / wall:6.1f} tokens/s, prediction hits {hits:.0f}/{pred:.0f}")
    finally:
        for p in (g, w):
            p.terminate()
            p.wait(timeout=10)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--burst", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--step-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-skips", type=int, default=4, help="the gateway's --grouping-max-skips")
    ap.add_argument("--kv-blocks", type=int, default=24,
                    help="the worker's KV blocks (16 tokens each): few, so admission is contended")
    args = ap.parse_args()
    print(f"demo model, CPU worker ({args.threads} threads, {args.kv_blocks} KV blocks), "
          f"--max-step-tokens {args.step_tokens}, --grouping-max-skips {args.max_skips}, "
          f"burst of {args.burst} concurrent requests x {args.max_tokens} tokens, two kinds alternating")
    for _ in range(args.rounds):
        for mode in ("on", "off"):
            run(args, mode)


if __name__ == "__main__":
    main()
