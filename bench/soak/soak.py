#!/usr/bin/env python3
"""An hour (--minutes) of mixed load on the demo model, served as deployed:
Redis with a password, a main CPU worker, a CPU fallback worker, and the
gateway with an API key file, on 127.0.0.1 only. The load: streams and
whole responses, disconnects mid-stream, bad requests (wrong JSON, numbers
past a double, deep nesting, costly parameters), session turns, and a kill -9
of the main worker every ten minutes (restarted by this script, as
supervisord would). Every minute it prints the gateway's and the workers'
resident memory and descriptors and the gateway's queue and state gauges.
At the end it checks that, after the warm-up, memory and descriptors stayed
flat within 5 % (descriptors within a few), and that the queues did not grow.

    python3 bench/soak/soak.py --build build --minutes 60 | tee bench/results/soak-DATE.txt

Not a test: it takes an hour and is not run in CI.
"""
import argparse
import http.client
import json
import os
import random
import re
import signal
import sys
import threading
import time

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(os.path.dirname(here))
sys.path.insert(0, os.path.join(root, "tests", "integration"))

KEY = "soak-key-1"
stop = threading.Event()
lock = threading.Lock()
counts = {}


def count(k):
    with lock:
        counts[k] = counts.get(k, 0) + 1


def post(port, path, body, timeout=120, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", path, body if isinstance(body, (str, bytes)) else json.dumps(body),
              {"Content-Type": "application/json", "Authorization": "Bearer " + KEY, **(headers or {})})
    r = c.getresponse()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()


def proc(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return float("nan"), -1


def gauges(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics", headers={"Authorization": "Bearer " + KEY})
    text = c.getresponse().read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(moe_gateway_[a-z_]+) ([0-9.e+-]+)$", text, re.M)}


def loop(name, fn, port, prompts):
    rnd = random.Random(name)
    while not stop.is_set():
        try:
            fn(port, rnd, prompts)
        except Exception as e:
            count(f"{name}: {type(e).__name__}")
        time.sleep(rnd.random() * 0.2)


def streams(port, rnd, ps):
    h_stream = __import__("redis_harness").Stream(port, rnd.choice(ps), rnd.randint(8, 64),
                                                  headers={"Authorization": "Bearer " + KEY}).start()
    h_stream.join(300)
    count("stream ok" if h_stream.finish in ("stop", "length") and not h_stream.error else "stream failed")


def whole(port, rnd, ps):
    status, _, _ = post(port, "/v1/completions", {"model": "demo-moe", "prompt": rnd.choice(ps),
                                                  "max_tokens": rnd.randint(4, 32), "n": rnd.randint(1, 3)})
    count(f"whole {status}")


def disconnects(port, rnd, ps):
    import socket
    body = json.dumps({"model": "demo-moe", "prompt": rnd.choice(ps), "max_tokens": 128, "stream": True})
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    s.recv(4096)
    time.sleep(rnd.random())
    s.close()
    count("disconnect")


def bad(port, rnd, ps):
    bodies = ['{"model":"demo-moe","messages":[{"role":"user","content":"a"}],"max_tokens":1e400}',
              '{"model":"demo-moe","messages":' + "[" * 5000 + "]" * 5000 + '}',
              '{"model":"demo-moe","messages":[{"role":"user","content":"a"}],"n":128,"max_tokens":100000}',
              '{"model":"demo-moe","messages":"nope"}', '{"model":"demo-moe"', "[]"]
    status, _, _ = post(port, "/v1/chat/completions", rnd.choice(bodies))
    count(f"bad {status}")


def sessions(port, rnd, ps):
    sid = f"user-{rnd.randint(0, 200)}"
    status, _, _ = post(port, "/v1/chat/completions",
                        {"model": "demo-moe", "session_id": sid, "max_tokens": 8,
                         "messages": [{"role": "user", "content": rnd.choice(ps)}]})
    count(f"session {status}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--kill-every", type=float, default=10, help="minutes between kills of the main worker")
    ap.add_argument("--warmup", type=float, default=5, help="minutes not judged")
    a = ap.parse_args()
    build = os.path.abspath(a.build)
    os.environ.setdefault("MOE_GATEWAY", os.path.join(build, "gateway", "moe-gateway"))
    os.environ.setdefault("MOE_WORKER", os.path.join(build, "worker", "moe-worker"))
    os.environ.setdefault("MOE_MODEL", os.path.join(root, "models", "demo-moe"))
    import redis_harness as h
    h.need_redis()
    c = h.Cluster("soak")
    ok = True
    try:
        c.start_redis(password="soak-pw")
        pw = os.path.join(c.dir, "redis.pass")
        keys = os.path.join(c.dir, "keys")
        for path, text in ((pw, "soak-pw\n"), (keys, KEY + "\n")):
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, 0o600)
        auth = ["--redis", f"redis://127.0.0.1:{c.redis_port}", "--redis-password-file", pw]
        main_sock = c.start_worker("main", redis=False, extra=auth)
        fb_sock = c.start_worker("fallback", redis=False, extra=auth)
        port = c.start_gateway([main_sock], fallback=fb_sock, redis=False, extra=auth + ["--api-key-file", keys])
        ps = h.prompts(64)
        plan = [("streams", streams, 4), ("whole", whole, 2), ("disconnects", disconnects, 1), ("bad", bad, 1),
                ("sessions", sessions, 1)]
        threads = []
        for name, fn, n in plan:
            for i in range(n):
                t = threading.Thread(target=loop, args=(f"{name}{i}", fn, port, ps), daemon=True)
                t.start()
                threads.append(t)
        t0 = time.time()
        next_kill = t0 + a.kill_every * 60
        samples = []
        print("minute  gw_rss_MiB gw_fds  main_rss main_fds  fb_rss fb_fds  conns gens admitted waiting running "
              "sessions session_KiB tokens/min  restarts", flush=True)
        last_tokens = None
        minute = 0
        while time.time() - t0 < a.minutes * 60:
            time.sleep(max(0.0, t0 + (minute + 1) * 60 - time.time()))
            minute += 1
            if time.time() >= next_kill:
                c.kill9("main")
                time.sleep(0.3)
                main_sock = c.start_worker("main", redis=False, extra=auth)
                next_kill += a.kill_every * 60
                count("main worker killed")
            g = gauges(port)
            gw = proc(c.procs["gateway"].pid)
            mw = proc(c.procs["main"].pid)
            fw = proc(c.procs["fallback"].pid)
            tokens = g.get("moe_gateway_completion_tokens_total", 0)
            rate = tokens - last_tokens if last_tokens is not None else float("nan")
            last_tokens = tokens
            row = (minute, gw[0], gw[1], mw[0], mw[1], fw[0], fw[1], g.get("moe_gateway_connections"),
                   g.get("moe_gateway_generations"), g.get("moe_gateway_sequences_admitted"),
                   g.get("moe_gateway_sequences_waiting"), g.get("moe_gateway_sequences_running"),
                   g.get("moe_gateway_sessions_in_memory"), g.get("moe_gateway_session_memory_bytes", 0) / 1024,
                   rate, counts.get("main worker killed", 0))
            samples.append(row)
            print("%6d  %10.1f %6d  %8.1f %8d  %6.1f %6d  %5d %4d %8d %7d %7d %8d %11.1f %10.0f  %8d" % row, flush=True)
        stop.set()
        for t in threads:
            t.join(60)
        print("counts: " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
        judged = [s for s in samples if s[0] > a.warmup]
        if not judged:
            print("too short to judge")
            return 0

        def flat(i, what, slack_abs=0.0):
            vals = [s[i] for s in judged]
            lo, hi = min(vals), max(vals)
            good = hi <= lo * 1.05 + slack_abs
            print(f"{'ok  ' if good else 'GREW'} {what}: {lo:.1f} .. {hi:.1f} after the warm-up")
            return good

        ok &= flat(1, "gateway resident MiB")
        # Descriptors move with the connections open at the sample: what is
        # left once those are counted out must not grow.
        fixed = [(s[2] - s[7]) for s in judged]
        lo, hi = min(fixed), max(fixed)
        good = hi <= lo + 2
        print(f"{'ok  ' if good else 'GREW'} gateway descriptors less open connections: {lo:.0f} .. {hi:.0f} "
              f"after the warm-up (the raw count {min(s[2] for s in judged)} .. {max(s[2] for s in judged)})")
        ok &= good
        ok &= flat(5, "fallback resident MiB")
        ok &= flat(6, "fallback descriptors", slack_abs=2)
        # Queues move with the load; they must not trend up: the last third's
        # mean within 5 % (plus one request's worth) of the first third's.
        third = max(1, len(judged) // 3)
        for i, what in ((8, "generations"), (10, "waiting sequences"), (12, "sessions in memory")):
            first = sum(s[i] for s in judged[:third]) / third
            last = sum(s[i] for s in judged[-third:]) / third
            good = last <= first * 1.05 + 4
            print(f"{'ok  ' if good else 'GREW'} {what}: mean {first:.1f} in the first third, {last:.1f} in the last")
            ok &= good
        print("PASSED" if ok else "FAILED")
    finally:
        stop.set()
        c.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
