#!/usr/bin/env python3
"""What the gateway itself costs, and what the whole server does end to end.

1. Overhead: moe-gateway in front of moe-bench-instant-worker (the real
   worker socket server with a backend that answers every step at once).
   Client processes on keep-alive connections send 1-token completions for a
   fixed time; prints requests/s and the latency p50/p99 each request saw,
   which is what the gateway adds (tokenise, schedule, frame, detokenise,
   HTTP) plus the instant worker's socket round trip.
2. End to end: moe-gateway with its own CPU worker on the demo model;
   concurrent greedy streams; prints generated tokens/s.

Usage: bench/gateway/gateway_bench.py [--build build] [--seconds 10]
       [--clients 8] [--streams 8] [--stream-tokens 64]
"""
import argparse
import http.client
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "models", "demo-moe")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_healthy(port, proc, seconds=120):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit("gateway exited early")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("gateway never became healthy")


def client_loop(port, seconds, body, out):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    lat = []
    end = time.time() + seconds
    while time.time() < end:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        if r.status != 200:
            raise SystemExit(f"HTTP {r.status}")
        lat.append(time.perf_counter() - t0)
    out.put(lat)


def overhead(args, gateway, worker):
    tmp = tempfile.mkdtemp(prefix="moe-gwbench-")
    sock = os.path.join(tmp, "run", "instant.sock")
    port = free_port()
    w = subprocess.Popen([worker, "--model", MODEL, "--socket", sock])
    time.sleep(0.5)
    g = subprocess.Popen([gateway, "--model", MODEL, "--worker", "unix:" + sock,
                          "--port", str(port)], stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port, g)
        body = json.dumps({"model": "demo-moe", "prompt": "def f(x):", "max_tokens": 1,
                           "temperature": 0})
        q = mp.Queue()
        procs = [mp.Process(target=client_loop, args=(port, args.seconds, body, q))
                 for _ in range(args.clients)]
        for p in procs:
            p.start()
        lat = []
        for _ in procs:
            lat += q.get()
        for p in procs:
            p.join()
        lat.sort()
        n = len(lat)
        print(f"overhead: {args.clients} keep-alive clients, 1-token completions, {args.seconds} s")
        print(f"  requests/s {n / args.seconds:.0f}   latency p50 {lat[n // 2] * 1e3:.2f} ms"
              f"   p99 {lat[min(n - 1, int(n * 0.99))] * 1e3:.2f} ms   ({n} requests)")
    finally:
        g.send_signal(signal.SIGTERM)
        w.send_signal(signal.SIGTERM)
        g.wait()
        w.wait()


def stream_one(port, prompt, tokens, out):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"model": "demo-moe", "prompt": prompt, "max_tokens": tokens,
                       "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    used = 0
    for line in r:
        line = line.strip()
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                used = chunk["usage"]["completion_tokens"]
    out.put(used)


def end_to_end(args, gateway):
    port = free_port()
    g = subprocess.Popen([gateway, "--model", MODEL, "--port", str(port)],
                         stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port, g)
        lines = [l for l in open(os.path.join(MODEL, "eval.txt")).read().split("\n") if len(l) > 8]
        q = mp.Queue()
        t0 = time.perf_counter()
        procs = [mp.Process(target=stream_one, args=(port, lines[i * 41] + "\n", args.stream_tokens, q))
                 for i in range(args.streams)]
        for p in procs:
            p.start()
        total = sum(q.get() for _ in procs)
        for p in procs:
            p.join()
        dt = time.perf_counter() - t0
        print(f"end to end: demo model on the CPU worker, {args.streams} concurrent streams of "
              f"{args.stream_tokens} tokens")
        print(f"  {total} tokens in {dt:.2f} s: {total / dt:.0f} tokens/s")
    finally:
        g.send_signal(signal.SIGTERM)
        g.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=64)
    args = ap.parse_args()
    gateway = os.path.join(args.build, "gateway", "moe-gateway")
    worker = os.path.join(args.build, "bench", "moe-bench-instant-worker")
    print(f"machine: {os.cpu_count()} cores")
    overhead(args, gateway, worker)
    end_to_end(args, gateway)


if __name__ == "__main__":
    main()
