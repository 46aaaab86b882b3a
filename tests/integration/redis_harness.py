"""Real processes for the failover and Redis tests: a private redis-server on
a free port (temp dir, never a system one), moe-worker processes, the
gateway, and a streaming HTTP client that times every SSE event.

Env (set by CTest): MOE_GATEWAY, MOE_WORKER, MOE_MODEL.
"""
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

SKIP = 77
MODEL = os.path.basename(os.environ.get("MOE_MODEL", "demo-moe").rstrip("/"))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_for(pred, timeout):
    """True as soon as pred() is, polled every 50 ms; False after `timeout` s."""
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def need_redis():
    if not shutil.which("redis-server") or not shutil.which("redis-cli"):
        print("SKIPPED: redis-server is not installed")
        sys.exit(SKIP)


class Cluster:
    """Everything one test runs, stopped (SIGKILL as a last resort) on close."""

    def __init__(self, name):
        self.dir = tempfile.mkdtemp(prefix=f"moe-{name}-")
        self.procs = {}
        self.logs = {}
        self.redis_port = None

    # ---------------------------------------------------------------- redis
    def start_redis(self, port=None, extra=(), password=None):
        """`password`: the default user's (requirepass); redis-cli then logs in."""
        self.redis_port = port or self.redis_port or free_port()
        self.redis_password = password
        rdir = os.path.join(self.dir, "redis")
        os.makedirs(rdir, exist_ok=True)
        auth = ["--requirepass", password] if password else []
        self._spawn("redis", ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
                              "--dir", rdir, "--save", "", "--appendonly", "no", "--daemonize", "no", *auth,
                              *extra])
        for _ in range(100):
            if self.redis("PING").strip() == "PONG":
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer")

    def redis_url(self):
        return f"redis://127.0.0.1:{self.redis_port}"

    def redis(self, *args):
        auth = ["-a", self.redis_password, "--no-auth-warning"] if getattr(self, "redis_password", None) else []
        r = subprocess.run(["redis-cli", "-p", str(self.redis_port), *auth, "--raw", *args],
                           capture_output=True, text=True, timeout=10)
        return r.stdout

    # -------------------------------------------------------------- workers
    def worker_args(self, name, socket_path, redis=True, extra=()):
        args = [os.environ["MOE_WORKER"], "--model", os.environ["MOE_MODEL"], "--socket", socket_path,
                "--backend", "cpu", "--threads", "1", *extra]
        if redis and self.redis_port:
            args += ["--redis", self.redis_url()]
        return args

    def start_worker(self, name, redis=True, extra=(), env=None):
        sock = os.path.join(self.dir, f"{name}.sock")
        self._spawn(name, self.worker_args(name, sock, redis, extra), env=env)
        return sock

    def start_gateway(self, workers, fallback=None, redis=True, name="gateway", extra=(), env=None, nofile=None,
                      wait=True):
        """Starts a gateway; returns its HTTP port (also self.http_port).
        `nofile`: its descriptor limit (soft and hard)."""
        self.http_port = free_port()
        args = [os.environ["MOE_GATEWAY"], "--model", os.environ["MOE_MODEL"], "--host", "127.0.0.1",
                "--port", str(self.http_port), *extra]
        for w in workers:
            args += ["--worker", "unix:" + w]
        if fallback:
            args += ["--fallback-worker", "unix:" + fallback]
        if redis and self.redis_port:
            args += ["--redis", self.redis_url()]
        self._spawn(name, args, env=env, nofile=nofile)
        if wait:
            self.wait_health(name=name)
        return self.http_port

    def wait_health(self, timeout=60, name="gateway", main=False):
        """Until /health says ok; `main`: and not degraded, i.e. a main
        worker serves (a fallback alone is ready too)."""
        end = time.time() + timeout
        while time.time() < end:
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=2)
                c.request("GET", "/health")
                r = c.getresponse()
                body = r.read()
                if r.status == 200 and b'"ok"' in body and (not main or json.loads(body).get("degraded") is False):
                    return
            except OSError:
                pass
            if self.procs[name].poll() is not None:
                raise RuntimeError(name + " exited:\n" + self.log(name))
            time.sleep(0.1)
        raise RuntimeError(name + " never became healthy:\n" + self.log(name))

    # ------------------------------------------------------------ processes
    def _spawn(self, name, args, env=None, nofile=None):
        path = os.path.join(self.dir, f"{name}.log")
        f = open(path, "ab")
        self.logs[name] = path
        full_env = dict(os.environ, **(env or {}))

        def limits():
            if nofile:
                import resource
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.procs[name] = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=full_env,
                                            preexec_fn=limits if nofile else None)

    def kill9(self, name):
        p = self.procs[name]
        p.send_signal(signal.SIGKILL)
        p.wait()

    def log(self, name):
        try:
            with open(self.logs[name], "r", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def close(self, keep=False):
        for name, p in self.procs.items():
            if p.poll() is None:
                p.terminate()
        for name, p in self.procs.items():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if not keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def prompts(n):
    with open(os.path.join(os.environ["MOE_MODEL"], "eval.txt"), encoding="utf-8") as f:
        lines = [l for l in f.read().split("\n") if len(l.strip()) > 8]
    return [lines[(i * 37) % len(lines)] + "\n" for i in range(n)]


class Stream:
    """One streamed greedy completion on its own thread."""

    def __init__(self, port, prompt, max_tokens, extra=None, headers=None):
        self.port, self.prompt, self.max_tokens = port, prompt, max_tokens
        self.extra = extra or {}
        self.req_headers = headers or {}
        self.text = ""
        self.events = 0
        self.finish = None
        self.error = None
        self.done = False  # [DONE] came
        self.times = []
        self.headers = {}
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self.thread.start()
        return self

    def join(self, timeout):
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def max_gap_s(self):
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        return max(gaps) if gaps else 0.0

    def _run(self):
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            body = {"model": MODEL, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0, "stream": True}
            body.update(self.extra)
            c.request("POST", "/v1/completions", json.dumps(body),
                      {"Content-Type": "application/json", **self.req_headers})
            r = c.getresponse()
            self.headers = {k.lower(): v for k, v in r.getheaders()}
            if r.status != 200:
                self.error = f"HTTP {r.status}: {r.read()[:300]!r}"
                return
            buf = b""
            while True:
                chunk = r.read1(65536) if hasattr(r, "read1") else r.read(1)
                if not chunk:
                    break
                buf += chunk
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    for line in ev.split(b"\n"):
                        if not line.startswith(b"data: "):
                            continue
                        data = line[6:]
                        if data == b"[DONE]":
                            self.done = True
                            return
                        obj = json.loads(data)
                        if "error" in obj:
                            self.error = str(obj["error"])
                            continue
                        self.times.append(time.monotonic())
                        self.events += 1
                        for ch in obj.get("choices", []):
                            self.text += ch.get("text") or ""
                            if ch.get("finish_reason"):
                                self.finish = ch["finish_reason"]
        except Exception as e:  # a broken stream is a lost request
            self.error = f"{type(e).__name__}: {e}"


def metrics(port, headers=None, host="127.0.0.1"):
    """The gateway's /metrics as {series with labels: value}."""
    c = http.client.HTTPConnection(host, port, timeout=10)
    c.request("GET", "/metrics", headers=headers or {})
    out = {}
    for line in c.getresponse().read().decode().splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            out[k] = float(v)
    return out


def twins_of(port, prompts_, max_tokens, headers=None):
    """Each prompt's greedy text when it runs alone."""
    out = []
    for p in prompts_:
        status, _, body = complete(port, p, max_tokens, headers=headers)
        assert status == 200, body
        out.append(body["choices"][0]["text"])
    return out


def lost_streams(streams, twins, label="", timeout=300):
    """Waits for every stream; counts (and prints) those that failed, ended
    badly or differ from their twin."""
    lost = 0
    for i, s in enumerate(streams):
        if not s.join(timeout):
            s.error = f"did not finish in {timeout} s"
        if s.error or s.finish not in ("stop", "length") or s.text != twins[i]:
            lost += 1
            print(f"{label}stream {i}: error={s.error} finish={s.finish}\n  got  {s.text!r}\n  want {twins[i]!r}")
    return lost


def complete(port, prompt, max_tokens, extra=None, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body.update(extra or {})
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    r = c.getresponse()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read() or b"{}")


def chat(port, messages, max_tokens, session=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if session:
        body["session_id"] = session
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read() or b"{}")
