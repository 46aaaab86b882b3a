"""What must not take the service down, with real processes, a real Redis
(with a password and an ACL user) and real sockets:
  1. Redis AUTH: the gateway (URL credentials) and the worker (a password
     file) log in; wrong credentials are said clearly and the service goes on;
  2. bytes from Redis are untrusted: a worker name of invalid UTF-8 in the
     resident stream and a session that is not a list of turns (nested 100,000
     deep) change nothing, also after a gateway restart;
  3. a client gone while its session loads from (a frozen) Redis gets nothing
     run and nothing saved, and no generation is left behind;
  4. a gateway killed with -9 leaves no worker behind, and the next gateway
     removes the folder it left (and kills a child still running in such a
     folder);
  5. at a low descriptor limit the clients past --max-connections are told
     503 (not reset), and the gateway's own worker is restarted and serves.
"""
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import redis_harness as h  # noqa: E402

MODEL_KEY = "moe:" + h.MODEL
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def resp(*parts):
    """A Redis command in RESP, from bytes."""
    out = b"*%d\r\n" % len(parts)
    for p in parts:
        p = p if isinstance(p, bytes) else p.encode()
        out += b"$%d\r\n%s\r\n" % (len(p), p)
    return out


def raw_redis(port, password, *cmd):
    """One command with exact bytes (redis-cli cannot send invalid UTF-8 as is)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(resp("AUTH", password) + resp(*cmd))
    time.sleep(0.2)
    data = s.recv(65536)
    s.close()
    return data


def metric(port, name):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    m = re.search(r"\n" + re.escape(name) + r" ([0-9.e+-]+)\n", text)
    return float(m.group(1)) if m else -1.0


def debug_experts(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("POST", "/debug/experts", json.dumps({"prompt": "def f(x):"}), {"Content-Type": "application/json"})
    r = c.getresponse()
    body = r.read()
    try:
        return r.status, json.loads(body)
    except ValueError:
        return r.status, None


def gateway_folders():
    tmp = tempfile.gettempdir()
    return {os.path.join(tmp, d) for d in os.listdir(tmp) if d.startswith("moe-gateway-")}


def child_pid(c, name, nth=0):
    ms = re.findall(r"started moe-worker \(pid (\d+)\)", c.log(name))
    return int(ms[nth]) if len(ms) > nth else None


def main():
    h.need_redis()
    # A temp folder of its own (TMPDIR, which the gateways read too): every
    # gateway that starts removes the machine's stale moe-gateway-* folders,
    # so one of a test running beside this one could take the folder that
    # part 4 expects this test's next gateway to remove.
    private_tmp = tempfile.mkdtemp(prefix="moe-hardening-tmp-")
    os.environ["TMPDIR"] = private_tmp
    tempfile.tempdir = private_tmp
    c = h.Cluster("hardening")
    try:
        c.start_redis(password="s3cret")
        c.redis("ACL", "SETUSER", "moe", "on", ">p@ss:word", "~*", "&*", "+@all")

        # ---- 1. AUTH: URL credentials (an ACL user), a password file, wrong ones
        url = f"redis://moe:p%40ss%3Aword@127.0.0.1:{c.redis_port}"
        pw_file = os.path.join(c.dir, "redis.pass")
        with open(pw_file, "w") as f:
            f.write("s3cret\n")
        os.chmod(pw_file, 0o600)
        w = c.start_worker("w1", redis=False, extra=["--redis", f"redis://127.0.0.1:{c.redis_port}",
                                                     "--redis-password-file", pw_file])
        c.start_gateway([w], redis=False, extra=["--redis", url, "--predict", "on"])  # /debug/experts scores what Redis holds
        check(h.wait_for(lambda: "connected and logged in" in c.log("gateway"), 10),
              "AUTH: the gateway logged in as an ACL user from the URL")
        check(h.wait_for(lambda: "connected and logged in" in c.log("w1"), 10),
              "AUTH: the worker logged in with the password file")
        check(url.split("@")[0] not in c.log("gateway") and "p@ss" not in c.log("gateway"),
              "AUTH: the credentials never reach the log")
        status, hdr, _ = h.chat(c.http_port, [{"role": "user", "content": "hi"}], 4, "new")
        sid = hdr.get("x-session-id", "")
        check(status == 200 and h.wait_for(lambda: c.redis("EXISTS", "moe:session:open:" + sid).strip() == "1", 5),
              "AUTH: a session turn is stored through the logged-in connection")
        check(h.wait_for(lambda: c.redis("XLEN", MODEL_KEY + ":resident").strip() not in ("", "0"), 10),
              "AUTH: the worker publishes through its logged-in connection")
        port_ok = c.http_port
        c.start_gateway([w], redis=False, name="wrong", extra=["--redis", f"redis://:nope@127.0.0.1:{c.redis_port}"],
                        wait=False)
        # A second gateway may not take the worker (one at a time): it answers 503 but must say why it has no Redis.
        check(h.wait_for(lambda: "refused the credentials" in c.log("wrong"), 10),
              "AUTH: wrong credentials are said clearly")
        check(c.procs["wrong"].poll() is None, "AUTH: a gateway with wrong credentials keeps running")
        c.procs["wrong"].terminate()
        c.procs["wrong"].wait()
        # A --worker path where nothing listens: said after 10 s, not retried in silence.
        c.start_gateway([os.path.join(c.dir, "no-such-worker.sock")], redis=False, name="nowhere", wait=False)
        check(h.wait_for(lambda: "no-such-worker.sock not reachable for" in c.log("nowhere"), 25),
              "a worker path where nothing listens is said in the log")
        c.procs["nowhere"].terminate()
        c.procs["nowhere"].wait()
        c.http_port = port_ok

        # ---- 2. untrusted bytes from Redis
        before = metric(c.http_port, "moe_gateway_internal_errors_total")
        raw_redis(c.redis_port, "s3cret", "XADD", MODEL_KEY + ":resident", "*", "worker", b"\xff\xfe\xc3bad",
                  "kind", "snapshot", "experts", "1:2 1:3")
        check(h.wait_for(lambda: re.search(r"skipping garbage entry .* in " + MODEL_KEY + ":resident",
                                         c.log("gateway")) is not None, 10),
              "untrusted: the gateway skips a worker name that is not one")
        status, body = debug_experts(c.http_port)
        check(status == 200 and body is not None and all(isinstance(wk["worker"], str) for wk in body["workers"]),
              f"untrusted: /debug/experts answers valid JSON (HTTP {status})")
        deep_sid = "s-" + "0" * 31 + "1"
        raw_redis(c.redis_port, "s3cret", "SET", "moe:session:open:" + deep_sid, "[" * 100000 + "]" * 100000)
        status, _, body = h.chat(c.http_port, [{"role": "user", "content": "hi"}], 4, deep_sid)
        check(status == 200, f"untrusted: a stored session nested 100,000 deep is ignored (HTTP {status})")
        check("holds no" in c.log("gateway") or "not JSON" in c.log("gateway") or "ignored" in c.log("gateway"),
              "untrusted: the gateway says the stored session was ignored")
        c.kill9("gateway")
        c.start_gateway([w], redis=False, extra=["--redis", url, "--predict", "on"])  # /debug/experts scores what Redis holds
        status, body = debug_experts(c.http_port)
        check(status == 200 and body is not None, f"untrusted: /debug/experts still answers after a restart ({status})")
        check(metric(c.http_port, "moe_gateway_internal_errors_total") in (0.0, before),
              "untrusted: no internal error on the way")

        # ---- 3. a client gone while its session loads from a frozen Redis
        tokens0 = metric(c.http_port, "moe_gateway_prompt_tokens_total")
        stored0 = c.redis("GET", "moe:session:open:" + sid)
        c.procs["redis"].send_signal(signal.SIGSTOP)
        try:
            body = json.dumps({"model": h.MODEL, "messages": [{"role": "user", "content": "are you there"}],
                               "max_tokens": 8, "session_id": sid})
            s = socket.create_connection(("127.0.0.1", c.http_port))
            s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
            time.sleep(0.5)
            s.close()
            # A worker that starts meanwhile: its AUTH gets no answer, which is not a refusal.
            c.start_worker("w2", redis=False, extra=["--redis", f"redis://127.0.0.1:{c.redis_port}",
                                                     "--redis-password-file", pw_file])
            # The gateway gives up on the frozen Redis after 3 s and answers from memory: to nobody.
            time.sleep(4.0)
        finally:
            c.procs["redis"].send_signal(signal.SIGCONT)
        time.sleep(0.5)
        check("did not answer AUTH" in c.log("w2") and "refused the credentials" not in c.log("w2"),
              "frozen Redis: a worker says it did not answer, not that it refused the credentials")
        check(h.wait_for(lambda: "connected and logged in" in c.log("w2"), 10),
              "frozen Redis: the worker logs in once Redis answers again")
        c.procs["w2"].terminate()
        c.procs["w2"].wait()
        check(metric(c.http_port, "moe_gateway_prompt_tokens_total") == tokens0,
              "gone while loading: nothing was run for it")
        check(metric(c.http_port, "moe_gateway_generations") == 0, "gone while loading: no generation left behind")
        check(h.wait_for(lambda: c.redis("GET", "moe:session:open:" + sid) == stored0, 5),
              "gone while loading: the session is unchanged")

        # ---- 4. kill -9 of a gateway with its own worker: no orphan, the folder cleaned
        c.start_gateway([], redis=False, name="embedded")
        # Its own worker chose its backend and said why; /health and /v1/models say which serves.
        chose = re.search(r"moe-worker: the (CPU|CUDA) backend", c.log("embedded"))
        hc = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=10)
        hc.request("GET", "/health")
        health = json.loads(hc.getresponse().read())
        check(chose is not None and health.get("backend") == chose.group(1).lower(),
              f"backend: the embedded worker chose {chose and chose.group(1)}, /health says {health.get('backend')}")
        pid = child_pid(c, "embedded")
        folders = gateway_folders()
        mine = [f for f in folders if os.path.exists(os.path.join(f, "gateway.pid")) and
                open(os.path.join(f, "gateway.pid")).read().strip() == str(c.procs["embedded"].pid)]
        check(pid is not None and alive(pid) and len(mine) == 1, "orphan: the gateway runs its worker in its folder")
        # A folder of a gone gateway with a child still running in it.
        planted = tempfile.mkdtemp(prefix="moe-gateway-")
        with open(os.path.join(planted, "gateway.pid"), "w") as f:
            f.write("999999\n")
        squatter = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                                     os.path.join(planted, "worker.sock")])
        with open(os.path.join(planted, "worker.pid"), "w") as f:
            f.write(f"{squatter.pid}\n")
        c.kill9("embedded")
        check(h.wait_for(lambda: not alive(pid), 5), "orphan: the worker exits when its gateway is killed -9")
        c.start_gateway([], redis=False, name="embedded2")
        log = c.log("embedded2")
        check(mine and not os.path.exists(mine[0]) and f"removed the stale folder {mine[0]}" in log,
              "orphan: the next gateway removes the folder the killed one left")
        check(h.wait_for(lambda: squatter.poll() is not None, 5) and not os.path.exists(planted),
              "orphan: a child still running in a stale folder is killed, the folder removed")
        c.procs["embedded2"].terminate()
        c.procs["embedded2"].wait()

        # ---- 5. a low descriptor limit: 503 past the cap, the worker restarts and serves
        c.start_gateway([], redis=False, name="lowfd", nofile=128)
        check("up to 64 connections" in c.log("lowfd"), "fd limit: 128 descriptors leave 64 connections")
        idle = []
        refused = 0
        for _ in range(80):
            s = socket.create_connection(("127.0.0.1", c.http_port), timeout=5)
            idle.append(s)
        time.sleep(0.3)
        kept = []
        for s in idle:
            s.setblocking(False)
            try:
                data = s.recv(4096)
            except BlockingIOError:
                data = None
            if data and data.startswith(b"HTTP/1.1 503"):
                refused += 1
                s.close()
            else:
                kept.append(s)
        print(f"RESULT fd limit: {len(kept)} connections kept, {refused} told 503")
        check(len(kept) == 64 and refused == 16, f"fd limit: 64 kept, 16 told 503 ({len(kept)}, {refused})")
        first = child_pid(c, "lowfd")
        os.kill(first, signal.SIGKILL)
        check(h.wait_for(lambda: child_pid(c, "lowfd", 1) is not None, 10),
              "fd limit: the worker is restarted at the connection cap")
        check(h.wait_for(lambda: len(re.findall(r"worker \S+ ready", c.log("lowfd"))) >= 2, 30),
              "fd limit: the restarted worker said hello")
        s = kept[0]
        s.setblocking(True)
        s.settimeout(60)
        body = json.dumps({"model": h.MODEL, "prompt": "x = ", "max_tokens": 2})
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        head = b""
        while b"\r\n" not in head:
            chunk = s.recv(65536)
            if not chunk:
                break
            head += chunk
        ok = head.startswith(b"HTTP/1.1 200")
        check(ok, "fd limit: the restarted worker serves a kept connection")
        for s in kept:
            s.close()
        squatter.kill()
    except Exception as e:
        failures.append(f"{type(e).__name__}: {e}")
        print(f"FAILED: {type(e).__name__}: {e}")
    finally:
        if failures:
            for name in ("gateway", "w1", "embedded2", "lowfd"):
                if name in c.logs:
                    print(f"---- {name} log\n" + c.log(name)[-3000:])
        c.close()
        shutil.rmtree(private_tmp, ignore_errors=True)
    print(f"{'FAILED' if failures else 'PASSED'}: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
