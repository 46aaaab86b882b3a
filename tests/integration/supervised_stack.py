"""deploy/supervise.sh itself, driven from Python: the whole supervised stack
(Redis, the main worker, the CPU fallback worker, the gateway) in a private
state folder on free ports, asked through supervisord's own XML-RPC socket
(no supervisorctl needed), and a streaming client that records every SSE
event. Shared by tests/integration/supervise_failover_test.py (CI, CPU) and
bench/e2e/failover_gpu.py (the GPU machine, carried binaries).

Everything started is stopped on close(): supervisord with SIGTERM (it stops
its programs), then SIGKILL for any process whose command line names the
private folder or whose working directory is in it (only this stack's
processes can: the path is a fresh temp dir), so nothing is left behind even when supervisord itself is gone.
"""
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import xmlrpc.client

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def now():
    """Seconds since boot: the clock /proc/PID/stat's start times are on."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def process_start(pid):
    """When process `pid` started, on now()'s clock (10 ms resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


REWARM_RE = re.compile(r"moe-worker: re-warmed (\d+) of (\d+) experts from Redis in ([0-9.]+) ms(.*)")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class _UnixTransport(xmlrpc.client.Transport):
    def __init__(self, path):
        super().__init__()
        self.path = path

    def make_connection(self, host):
        path = self.path

        class C(http.client.HTTPConnection):
            def connect(self):
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(10)
                self.sock.connect(path)

        return C("localhost")


class Stack:
    """deploy/supervise.sh MODEL with `env` on top of ours; state under a temp dir."""

    def __init__(self, model, env=None, name="supervise", keep=False):
        self.dir = tempfile.mkdtemp(prefix=f"moe-{name}-")
        self.state = os.path.join(self.dir, "state")
        self.port = free_port()
        self.redis_port = free_port()
        self.keep = keep
        self.model = model
        self.env = dict(os.environ, MOE_STATE_DIR=self.state, PORT=str(self.port), REDIS_PORT=str(self.redis_port),
                        HOST="127.0.0.1", **(env or {}))
        self.out_path = os.path.join(self.dir, "supervise.out")
        self.proc = None

    # ------------------------------------------------------------ lifecycle
    def start(self):
        out = open(self.out_path, "ab")
        # Its own session: a signal meant for the test never reaches it by accident.
        self.proc = subprocess.Popen(["bash", os.path.join(ROOT, "deploy", "supervise.sh"), self.model], env=self.env,
                                     stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def rpc(self):
        return xmlrpc.client.ServerProxy("http://localhost",
                                         transport=_UnixTransport(os.path.join(self.state, "run", "supervisor.sock")))

    def info(self, program):
        """supervisord's getProcessInfo: pid, statename, start (epoch s), ..."""
        return self.rpc().supervisor.getProcessInfo(program)

    def wait(self, cond, timeout, what, step=0.05):
        """Polls cond() until it is truthy (returned); raises after `timeout` s."""
        end = time.monotonic() + timeout
        last_exc = None
        while time.monotonic() < end:
            try:
                v = cond()
                if v:
                    return v
            except (OSError, xmlrpc.client.Error, http.client.HTTPException, ValueError) as e:
                last_exc = e
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"supervise.sh exited ({self.proc.returncode}) while waiting for {what}:\n"
                                   + self.output()[-3000:])
            time.sleep(step)
        raise RuntimeError(f"timed out after {timeout} s waiting for {what}" + (f" (last: {last_exc})" if last_exc else ""))

    def wait_ready(self, timeout=180):
        """/health ok and both workers ready in the gateway's metrics."""
        self.wait(lambda: self.health().get("status") == "ok", timeout, "/health ok")
        self.wait(lambda: self.worker_metric("moe_gateway_worker_ready", "worker") == 1 and
                  self.worker_metric("moe_gateway_worker_ready", "fallback") == 1, timeout, "both workers ready")

    def own_pids(self):
        """Every live process whose command line names our folder, or working in it."""
        pids = []
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == os.getpid():
                continue
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            try:  # redis-server rewrites its command line, but works in state/run
                cwd = os.readlink(f"/proc/{d}/cwd")
            except OSError:
                cwd = ""
            if self.dir.encode() in cmd or cwd == self.dir or cwd.startswith(self.dir + "/"):
                pids.append(int(d))
        return pids

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # supervisord stops its programs, then exits
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for _ in range(50):
            left = self.own_pids()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        left = self.own_pids()
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)
        return left

    # ----------------------------------------------------------------- logs
    def log(self, program):
        try:
            with open(os.path.join(self.state, "logs", program + ".log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def output(self):
        try:
            with open(self.out_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def rewarms(self, program="worker"):
        """(resident, previous, ms, rest-of-line) per start of the worker, in order."""
        return [(int(m[1]), int(m[2]), float(m[3]), m[4]) for m in REWARM_RE.finditer(self.log(program))]

    # ----------------------------------------------------------------- HTTP
    def get(self, path):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode(errors="replace")

    def health(self):
        status, body = self.get("/health")
        return json.loads(body) if status in (200, 503) else {}

    def metrics(self):
        return self.get("/metrics")[1]

    def worker_metric(self, name, worker, text=None):
        m = re.search(r"^" + re.escape(name) + r'\{worker="' + re.escape(worker) + r'",fallback="[01]"\} (\S+)$',
                      text if text is not None else self.metrics(), re.M)
        return float(m.group(1)) if m else None


class Stream:
    """One streamed completion on its own thread, every SSE event timed.
    Tokens are counted from the streamed logprobs (one entry a token), and the
    final usage chunk (stream_options.include_usage) says the server's count."""

    def __init__(self, port, model, prompt, max_tokens, timeout=600):
        self.port, self.model, self.prompt, self.max_tokens, self.timeout = port, model, prompt, max_tokens, timeout
        self.text = ""
        self.tokens = 0
        self.usage_tokens = None
        self.finish = None
        self.error = None
        self.done_marker = False
        self.times = []  # monotonic time of each event carrying tokens
        self.first_token_t = None
        self.headers = {}
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self.t_start = now()
        self.thread.start()
        return self

    def join(self, timeout):
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def max_gap_s(self):
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        return max(gaps) if gaps else 0.0

    def complete_ok(self):
        """[DONE], no error event, a finish reason, and as many tokens as the usage says."""
        return (self.error is None and self.done_marker and self.finish in ("stop", "length") and
                self.usage_tokens == self.tokens and (self.finish == "stop" or self.tokens == self.max_tokens))

    def _run(self):
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
            body = {"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                    "stream": True, "logprobs": 0, "stream_options": {"include_usage": True}}
            c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            self.headers = {k.lower(): v for k, v in r.getheaders()}
            if r.status != 200:
                self.error = f"HTTP {r.status}: {r.read()[:300]!r}"
                return
            buf = b""
            while True:
                chunk = r.read1(65536)
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
                            self.done_marker = True
                            return
                        obj = json.loads(data)
                        if "error" in obj:
                            self.error = str(obj["error"])
                            continue
                        if obj.get("usage"):
                            self.usage_tokens = obj["usage"].get("completion_tokens")
                        n = 0
                        for ch in obj.get("choices", []):
                            self.text += ch.get("text") or ""
                            lp = ch.get("logprobs") or {}
                            n += len(lp.get("tokens") or [])
                            if ch.get("finish_reason"):
                                self.finish = ch["finish_reason"]
                        if n:
                            t = now()
                            if self.first_token_t is None:
                                self.first_token_t = t
                            self.times.append(t)
                            self.tokens += n
            self.error = self.error or "the stream ended without [DONE]"
        except Exception as e:  # a broken stream is a lost request
            self.error = f"{type(e).__name__}: {e}"


def prompts(model_dir, n):
    """n prompts from the model folder's eval.txt (or fixed ones when it has none)."""
    path = os.path.join(model_dir, "eval.txt") if os.path.isdir(model_dir) else ""
    lines = []
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            lines = [l for l in f.read().split("\n") if len(l.strip()) > 8]
    if not lines:
        lines = ["The history of the printing press begins", "In a small village by the sea there lived",
                 "The main ideas of thermodynamics are", "A recipe for bread needs", "Rivers of Europe include",
                 "The first computers were built", "Once upon a time, a fox", "The rules of chess say that"]
    return [lines[(i * 37) % len(lines)] + "\n" for i in range(n)]


def failover_run(stack, model_name, ps, max_tokens, min_tokens_at_kill=8, timeout=600, log=print):
    """The scenario both callers measure: one undisturbed stream per prompt,
    one at a time (the twins); then all prompts streamed at once, kill -9 of
    the main worker (supervisord's program "worker") once every stream has
    `min_tokens_at_kill` tokens; meanwhile probes (new 4-token requests, one
    at a time) until one is served by the restarted main worker. Returns a
    dict of what happened; the caller judges it."""
    r = {"streams": len(ps), "max_tokens": max_tokens}
    twins = []
    for p in ps:
        s = Stream(stack.port, model_name, p, max_tokens, timeout).start()
        if not s.join(timeout) or not s.complete_ok():
            raise RuntimeError(f"undisturbed stream failed: error={s.error} finish={s.finish} tokens={s.tokens}")
        twins.append(s)
    r["twin_tokens"] = [s.tokens for s in twins]
    rewarms_before = len(stack.rewarms("worker"))
    m0 = stack.metrics()
    fb_assigned0 = stack.worker_metric("moe_gateway_worker_sequences_assigned_total", "fallback", m0) or 0
    old = stack.info("worker")
    r["old_pid"] = old["pid"]

    streams = [Stream(stack.port, model_name, p, max_tokens, timeout).start() for p in ps]
    stack.wait(lambda: min(s.tokens for s in streams) >= min_tokens_at_kill or any(not s.thread.is_alive() for s in streams),
               timeout, f"{min_tokens_at_kill} tokens in every stream", step=0.002)
    os.kill(old["pid"], signal.SIGKILL)
    t_kill = now()
    at_kill = [(s.tokens, s.finish, s.thread.is_alive()) for s in streams]
    r["tokens_at_kill"] = [a[0] for a in at_kill]
    r["all_mid_stream_at_kill"] = all(alive and fin is None and 0 < n < max_tokens for n, fin, alive in at_kill)
    log(f"kill -9 of the main worker (pid {old['pid']}) with tokens per stream {r['tokens_at_kill']}")

    # supervisord restarts it: a new pid, RUNNING.
    new = stack.wait(lambda: (lambda i: i if i["pid"] not in (0, old["pid"]) and i["statename"] == "RUNNING" else None)(
        stack.info("worker")), timeout, "supervisord to restart the worker", step=0.01)
    r["new_pid"] = new["pid"]
    try:
        r["restarted_process_start_s"] = round(process_start(new["pid"]) - t_kill, 3)
        t_proc = process_start(new["pid"])
    except OSError:
        t_proc = None
    # New requests, one at a time, until one is not degraded (the main worker took it).
    probe = None
    probes = 0
    deadline = now() + timeout
    while now() < deadline:
        q = Stream(stack.port, model_name, ps[probes % len(ps)], 4, timeout).start()
        probes += 1
        q.join(timeout)
        if q.complete_ok() and "x-moe-degraded" not in q.headers:
            probe = q
            break
        time.sleep(0.01)
    r["probes"] = probes
    r["probe_served_by_main"] = probe is not None
    if probe is not None:
        r["restart_to_first_token_s"] = round(probe.first_token_t - t_kill, 3)
        if t_proc is not None:
            r["process_start_to_first_token_s"] = round(probe.first_token_t - t_proc, 3)
    for s in streams:
        if not s.join(timeout):
            s.error = s.error or f"did not finish in {timeout} s"
    m1 = stack.metrics()
    r["fallback_sequences_assigned"] = (stack.worker_metric("moe_gateway_worker_sequences_assigned_total", "fallback", m1) or 0) - fb_assigned0
    r["main_ready_after"] = stack.worker_metric("moe_gateway_worker_ready", "worker", m1) == 1
    # The restarted worker's re-warm line (its log is appended across restarts).
    rw = stack.wait(lambda: stack.rewarms("worker")[rewarms_before:] or None, 60, "the restarted worker's re-warm line")
    res, prev, ms, rest = rw[0]
    r["rewarmed_experts"], r["rewarm_previous"], r["rewarm_s"] = res, prev, round(ms / 1000.0, 6)
    r["rewarm_redis_reachable"] = "unreachable" not in rest
    lost = 0
    unequal = 0
    for i, s in enumerate(streams):
        ok = s.complete_ok() and s.tokens == twins[i].tokens
        if not ok:
            lost += 1
        if s.text != twins[i].text:
            unequal += 1
        if not ok or s.text != twins[i].text:
            log(f"stream {i}: error={s.error} done={s.done_marker} finish={s.finish} tokens={s.tokens} "
                f"usage={s.usage_tokens} (twin {twins[i].tokens})\n  got  {s.text!r}\n  want {twins[i].text!r}")
    r["lost"] = lost
    r["texts_unequal"] = unequal
    r["texts_equal_to_undisturbed"] = unequal == 0
    r["stream_tokens"] = [s.tokens for s in streams]
    r["longest_gap_ms"] = round(max(s.max_gap_s() for s in streams) * 1000)
    return r
