#!/usr/bin/env python3
"""End to end on the GPU machine: the demo model served by moe-worker --backend
cuda under a VRAM budget that holds half its experts, behind moe-gateway, with
concurrent clients sending prompts drawn from the model's held-out text.
Compares expert prediction on/off (expert misses per token, tokens/s) and
expert-grouped batching on/off (tokens/s).

Only the Python standard library: it runs on a bare GPU machine.

  e2e_prediction.py --bin DIR --model PATH --eval FILE [--clients 8]
                    [--requests 96] [--warmup 48] [--max-tokens 48] [--json OUT]
                    [--prompt-chars 100,400] [--gateway-args "..."]

DIR holds moe-worker and moe-gateway (built with MOE_STATIC_DEPS=ON).
"""
import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, timeout, what):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.05)
    raise RuntimeError("timed out waiting for " + what)


UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(num, unit):
    return float(num) * UNITS[unit]


def plan_of(log):
    """(arena bytes, islands, island bytes) from the worker's start-up line."""
    m = re.search(r"arena ([\d.]+) (B|KiB|MiB|GiB):.*?(\d+) islands of ([\d.]+) (B|KiB|MiB|GiB)", log)
    if not m:
        raise RuntimeError("no arena line in the worker's log:\n" + log)
    return parse_size(m.group(1), m.group(2)), int(m.group(3)), parse_size(m.group(4), m.group(5))


class Worker:
    def __init__(self, bindir, model, budget, backend="cuda", extra=()):
        self.dir = tempfile.mkdtemp(prefix="moe-e2e-")
        self.socket = os.path.join(self.dir, "w", "worker.sock")
        self.log_path = os.path.join(self.dir, "worker.log")
        args = [os.path.join(bindir, "moe-worker"), "--model", model, "--socket", self.socket,
                "--backend", backend, "--kv-blocks", "2048"]
        if backend == "cuda":
            args += ["--dense-weights", "bf16"]
        if budget:
            args += ["--vram-budget", str(int(budget))]
        args += list(extra)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(self.log_path, "w"))
        wait_for(lambda: os.path.exists(self.socket) or self.proc.poll() is not None, 120, "the worker")
        if self.proc.poll() is not None:
            raise RuntimeError("worker exited:\n" + self.log())

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        return self.log()


class Gateway:
    def __init__(self, bindir, model, worker_socket, extra=()):
        self.port = free_port()
        self.log_path = tempfile.mktemp(prefix="moe-e2e-gw-", suffix=".log")
        args = [os.path.join(bindir, "moe-gateway"), "--model", model, "--worker", "unix:" + worker_socket,
                "--port", str(self.port), "--max-step-tokens", "512"] + list(extra)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(self.log_path, "w"))

        def up():
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/health")
                return c.getresponse().status == 200
            except OSError:
                return False

        wait_for(lambda: up() or self.proc.poll() is not None, 60, "the gateway")
        if self.proc.poll() is not None:
            raise RuntimeError("gateway exited:\n" + open(self.log_path).read())

    def metrics(self):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        c.request("GET", "/metrics")
        out = {}
        for line in c.getresponse().read().decode().splitlines():
            if line and not line.startswith("#"):
                k, _, v = line.rpartition(" ")
                try:
                    out[k] = float(v)
                except ValueError:
                    pass
        return out

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def complete(port, prompt, max_tokens):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = json.dumps({"model": "demo-moe", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    data = json.loads(r.read())
    if r.status != 200:
        raise RuntimeError("HTTP %d: %s" % (r.status, data))
    return data["usage"]


def run_load(port, prompts, clients, max_tokens):
    """Every client takes the next prompt until none is left; returns
    (completion tokens, prompt tokens, seconds)."""
    lock = threading.Lock()
    queue = list(prompts)
    totals = {"completion": 0, "prompt": 0}
    errors = []

    def client():
        while True:
            with lock:
                if not queue:
                    return
                p = queue.pop(0)
            try:
                u = complete(port, p, max_tokens)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(str(e))
                return
            with lock:
                totals["completion"] += u["completion_tokens"]
                totals["prompt"] += u["prompt_tokens"]

    t0 = time.time()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("%d requests failed, first: %s" % (len(errors), errors[0]))
    return totals["completion"], totals["prompt"], time.time() - t0


def prompts_from(text, n, seed, lo, hi):
    """n windows of lo..hi characters of the held-out text, starting at line starts."""
    rng = random.Random(seed)
    starts = [m.start() for m in re.finditer(r"\n", text)]
    out = []
    for _ in range(n):
        s = rng.choice(starts) + 1
        out.append(text[s:s + rng.randint(lo, hi)])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--warmup", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", default="")
    ap.add_argument("--backend", default="cuda", help="cpu: a dry run of the script itself (no islands)")
    ap.add_argument("--prompt-chars", default="100,400", help="prompt length range in characters (default 100,400)")
    ap.add_argument("--gateway-args", default="", help="more moe-gateway options for every run")
    a = ap.parse_args()
    text = open(a.eval, encoding="utf-8").read()

    # The budget that holds half the experts: the whole plan less half the islands.
    budget = 0
    if a.backend == "cuda":
        probe = Worker(a.bin, a.model, 0)
        arena, islands, island = plan_of(probe.log())
        probe.stop()
        budget = arena - (islands // 2) * island + island / 2
        print("plan with every expert resident: arena %.2f MiB, %d islands of %.1f KiB; budget for half: %.2f MiB"
              % (arena / 2**20, islands, island / 1024, budget / 2**20), flush=True)

    lo, hi = (int(v) for v in a.prompt_chars.split(","))
    warm = prompts_from(text, a.warmup, 1, lo, hi)
    measured = prompts_from(text, a.requests, 2, lo, hi)
    configs = [
        ("prediction on, grouped batching on", ["--predict", "on", "--grouped-batching", "on"]),
        ("prediction off (first come first served)", ["--predict", "off", "--grouped-batching", "off"]),
        ("prediction on, grouped batching off", ["--predict", "on", "--grouped-batching", "off"]),
    ]
    rows = []
    for name, flags in configs:
        w = Worker(a.bin, a.model, budget, a.backend)
        got_islands = plan_of(w.log())[1] if a.backend == "cuda" else 0
        g = Gateway(a.bin, a.model, w.socket, flags + a.gateway_args.split())
        try:
            run_load(g.port, warm, a.clients, a.max_tokens)
            m0 = g.metrics()
            comp, prompt_toks, secs = run_load(g.port, measured, a.clients, a.max_tokens)
            m1 = g.metrics()
        finally:
            g.stop()
            log = w.stop()
        d = lambda k: m1.get(k, 0.0) - m0.get(k, 0.0)  # noqa: E731
        misses = d("moe_gateway_worker_expert_misses_total")
        hits = d("moe_gateway_worker_expert_hits_total")
        pred = d("moe_gateway_predicted_experts_total")
        pred_hits = d("moe_gateway_prediction_hits_total")
        row = {
            "config": name, "islands": got_islands, "clients": a.clients, "requests": a.requests,
            "completion_tokens": comp, "prompt_tokens": prompt_toks, "seconds": round(secs, 2),
            "completion_tok_s": round(comp / secs, 1), "all_tok_s": round((comp + prompt_toks) / secs, 1),
            "expert_misses": misses, "expert_hits": hits,
            "misses_per_token": round(misses / max(1, comp + prompt_toks), 3),
            "hit_rate": round(hits / max(1.0, hits + misses), 3),
            "prediction_precision": round(pred_hits / pred, 3) if pred else None,
            "worker_summary": [l for l in log.splitlines() if "served" in l][-1:],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)

    print("\n| config | completion tok/s | all tok/s | expert misses / token | hit rate | prediction precision |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| %s | %.1f | %.1f | %.3f | %.3f | %s |" % (r["config"], r["completion_tok_s"], r["all_tok_s"],
                                                       r["misses_per_token"], r["hit_rate"],
                                                       r["prediction_precision"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
