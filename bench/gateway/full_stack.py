#!/usr/bin/env python3
"""The product as a user meets it, on the GPU machine: moe-worker (CUDA) on a
checkpoint folder or packed file, moe-gateway in front of it, and streaming
HTTP clients. For each --vram-budget it starts the worker (time to ready and
the host's peak RSS measured), samples the worker's GPU memory through
nvidia-smi every 100 ms for the whole run, and drives: one long prompt (its
time to first token), then streams of --new-tokens at each --concurrency
(output tokens/s, TTFT and inter-token latency p50/p99). Prompts are token
ids drawn from a seeded generator, so every run sees the same lengths.

    python3 bench/gateway/full_stack.py --build build --model /tmp/qwen3 --budgets 12GiB,8GiB,6GiB \\
        --concurrency 1,8 --json out.json

Prints a table and writes the rows (via "gateway") to --json.
"""
import argparse
import http.client
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class GpuSampler:
    """The peak GPU memory of one pid, from nvidia-smi every 100 ms."""

    def __init__(self, pid):
        self.pid, self.peak, self.samples = pid, 0, 0
        if not shutil.which("nvidia-smi"):
            self.proc, self.peak = None, -1
            return
        self.proc = subprocess.Popen(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                      "--format=csv,noheader,nounits", "-lms", "100"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) == self.pid:
                self.samples += 1
                self.peak = max(self.peak, int(parts[1]))

    def stop(self):
        if self.proc:
            self.proc.terminate()
            self.proc.wait()
        return self.peak


def percentile(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q / 100.0 * (len(xs) - 1)))))
    return xs[k]


def stream(port, model, prompt_ids, new_tokens):
    """One streamed /v1/completions: (ttft s, [itl s], completion tokens)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"model": model, "prompt": prompt_ids, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    times, tokens, buf = [], 0, b""
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            if not ev.startswith(b"data: ") or ev[6:] == b"[DONE]":
                continue
            obj = json.loads(ev[6:])
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
            elif obj.get("choices"):
                times.append(time.perf_counter())
    if not times:
        raise RuntimeError("no token came")
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])], tokens


def run_load(port, model, vocab, concurrency, prompt_tokens, new_tokens, requests_each, seed):
    rnd = random.Random(seed)
    prompts = [[rnd.randrange(100, vocab - 300) for _ in range(prompt_tokens)] for _ in range(concurrency * requests_each)]
    ttfts, itls, tokens, errors, decode_rates = [], [], [0], [], []
    lock = threading.Lock()

    def client(k):
        for i in range(requests_each):
            try:
                ttft, gaps, n = stream(port, model, prompts[k * requests_each + i], new_tokens)
                with lock:
                    ttfts.append(ttft)
                    itls.extend(gaps)
                    tokens[0] += n
                    if gaps:
                        decode_rates.append(len(gaps) / sum(gaps))
            except Exception as e:
                with lock:
                    errors.append(str(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    # decode_tok_s: a stream's tokens after its first over the time they took
    # (what the engine's decode rate is comparable with), the median stream.
    return {"out_tok_s": tokens[0] / wall, "decode_tok_s": percentile(decode_rates, 50), "ttft_ms_p50": 1e3 * percentile(ttfts, 50),
            "ttft_ms_p99": 1e3 * percentile(ttfts, 99), "itl_ms_p50": 1e3 * percentile(itls, 50),
            "itl_ms_p99": 1e3 * percentile(itls, 99), "tokens": tokens[0], "errors": errors}


def gateway_healthy(port):
    """True once the gateway on `port` answers /health with 200."""
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        c.request("GET", "/health")
        return c.getresponse().status == 200
    except OSError:
        return False


class Stack:
    """moe-worker on `model` (its log in `work`) and moe-gateway in front of
    it; `port` is the gateway's once entered, both are stopped on exit."""

    def __init__(self, build, model, work, backend="cuda", worker_args=(), gateway_args=()):
        self.build, self.model, self.work = build, model, work
        self.backend, self.worker_args, self.gateway_args = backend, list(worker_args), list(gateway_args)
        self.worker = self.gateway = None

    def __enter__(self):
        sock = os.path.join(self.work, "w.sock")
        self.worker_log = os.path.join(self.work, "worker.log")
        self.gateway_log = os.path.join(self.work, "gateway.log")
        wlog = open(self.worker_log, "w+")
        self.worker = subprocess.Popen([os.path.join(self.build, "worker", "moe-worker"), "--backend", self.backend,
                                        "--model", self.model, "--socket", sock, *self.worker_args],
                                       stdout=wlog, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: self.worker.poll() is not None or "listening on" in open(self.worker_log).read(), 900,
                     "the worker")
            if self.worker.poll() is not None:
                raise RuntimeError("the worker exited:\n" + open(self.worker_log).read()[-3000:])
            self.port = free_port()
            self.gateway = subprocess.Popen([os.path.join(self.build, "gateway", "moe-gateway"), "--model", self.model,
                                             "--worker", "unix:" + sock, "--port", str(self.port), *self.gateway_args],
                                            stdout=open(self.gateway_log, "w+"), stderr=subprocess.STDOUT)
            wait_for(lambda: gateway_healthy(self.port), 120, "the gateway")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        for p in (self.gateway, self.worker):
            if p and p.poll() is None:
                p.terminate()
                p.wait()


def wait_for(pred, timeout, what):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.05)
    raise RuntimeError("timed out waiting for " + what)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--model", required=True)
    ap.add_argument("--shape", default="", help="the shape's name for the rows (default: the model's folder name)")
    ap.add_argument("--budgets", default="12GiB", help="comma-separated --vram-budget values; 0 for resident")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--long-prompt", type=int, default=1024, help="the prompt whose TTFT is taken alone (0: none)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--kv-blocks", type=int, default=0)
    ap.add_argument("--source", default="", help="hf-folder or packed (default: from --model)")
    ap.add_argument("--worker-arg", action="append", default=[])
    ap.add_argument("--backend", default="cuda", help="the worker's (cpu: a dry run of this script)")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    worker_bin = os.path.join(a.build, "worker", "moe-worker")
    gateway_bin = os.path.join(a.build, "gateway", "moe-gateway")
    with open(os.path.join(a.model, "config.json") if os.path.isdir(a.model) else os.devnull) as f:
        cfg = json.load(f) if os.path.isdir(a.model) else {}
    vocab = cfg.get("vocab_size", 151936)
    shape = a.shape or os.path.basename(a.model.rstrip("/"))
    source = a.source or ("hf-folder" if os.path.isdir(a.model) else "packed")
    served = os.path.basename(a.model.rstrip("/"))
    rows, work = [], tempfile.mkdtemp(prefix="moe-full-stack-")
    try:
        for budget in a.budgets.split(","):
            sock = os.path.join(work, "w.sock")
            wlog = open(os.path.join(work, f"worker-{budget}.log"), "w+")
            args = [worker_bin, "--backend", a.backend, "--model", a.model, "--socket", sock, *a.worker_arg]
            if budget not in ("0", "resident") and a.backend == "cuda":
                args += ["--vram-budget", budget]
            if a.kv_blocks:
                args += ["--kv-blocks", str(a.kv_blocks)]
            t0 = time.time()
            w = subprocess.Popen(args, stdout=wlog, stderr=subprocess.STDOUT)
            gpu = GpuSampler(w.pid)
            try:
                wait_for(lambda: w.poll() is not None or "listening on" in open(wlog.name).read(), 900, "the worker")
                if w.poll() is not None:
                    raise RuntimeError("the worker exited:\n" + open(wlog.name).read()[-3000:])
                ready_s = time.time() - t0
                with open(f"/proc/{w.pid}/status") as f:
                    host_peak = int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) // 1024
                mode = "resident" if budget in ("0", "resident") else f"budget-{budget}"
                print(f"{shape} {mode}: worker ready in {ready_s:.1f} s from the {source}, host peak {host_peak} MiB",
                      flush=True)
                rows.append({"shape": shape, "via": "worker", "phase": "load", "source": source, "mode": mode,
                             "seconds": round(ready_s, 1), "host_peak_mib": host_peak})
                port = free_port()
                glog = open(os.path.join(work, f"gateway-{budget}.log"), "w+")
                g = subprocess.Popen([gateway_bin, "--model", a.model, "--worker", "unix:" + sock, "--port", str(port),
                                      "--max-request-tokens", str(1 << 30)], stdout=glog, stderr=subprocess.STDOUT)
                try:
                    wait_for(lambda: gateway_healthy(port), 120, "the gateway")
                    run_load(port, served, vocab, 1, a.prompt_tokens, 8, 2, 7)  # warm-up
                    if a.long_prompt:
                        lp = run_load(port, served, vocab, 1, a.long_prompt, 4, 1, 11)
                        print(f"  prompt of {a.long_prompt}: TTFT {lp['ttft_ms_p50']:.0f} ms", flush=True)
                        rows.append({"shape": shape, "via": "gateway", "mode": mode, "routing": "router",
                                     "concurrency": 1, "prompt_tokens": a.long_prompt, "phase": "prefill",
                                     "ttft_ms_p50": round(lp["ttft_ms_p50"], 1), "ttft_ms_p99": round(lp["ttft_ms_p99"], 1)})
                    for conc in [int(x) for x in a.concurrency.split(",")]:
                        r = run_load(port, served, vocab, conc, a.prompt_tokens, a.new_tokens, a.requests, 100 + conc)
                        print(f"  concurrency {conc}: {r['out_tok_s']:.1f} tok/s ({r['decode_tok_s']:.1f} a stream after its "
                              f"first token), TTFT p50/p99 {r['ttft_ms_p50']:.0f}/"
                              f"{r['ttft_ms_p99']:.0f} ms, ITL p50/p99 {r['itl_ms_p50']:.2f}/{r['itl_ms_p99']:.2f} ms, "
                              f"{r['tokens']} tokens, {len(r['errors'])} errors", flush=True)
                        rows.append({"shape": shape, "via": "gateway", "mode": mode, "routing": "router",
                                     "concurrency": conc, "prompt_tokens": a.prompt_tokens, "phase": "decode",
                                     "out_tok_s": round(r["out_tok_s"], 1),
                                     "decode_tok_s": round(r["decode_tok_s"], 1),
                                     **{k: round(r[k], 2) for k in ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50",
                                                                    "itl_ms_p99")},
                                     "errors": len(r["errors"])})
                finally:
                    g.terminate()
                    g.wait()
            finally:
                w.terminate()
                try:
                    w.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    w.kill()
                peak = gpu.stop()
                summary = [l for l in open(wlog.name).read().splitlines() if "device memory" in l or "budget" in l]
                for l in summary[-3:]:
                    print("  " + l, flush=True)
                for r in rows:
                    if r.get("mode") == (("resident" if budget in ("0", "resident") else f"budget-{budget}")):
                        r["peak_gpu_mib"] = peak
                print(f"  peak GPU memory of the worker (nvidia-smi): {peak} MiB", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
