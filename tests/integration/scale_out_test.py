"""More than one host (docs/scale-out.md), on the topology of
deploy/scale-out/hosts.sh: 3 hosts in network namespaces (each its own
address, gateway and CPU worker on the demo model), one Redis, nginx in
front hashing on the session id.

64 concurrent chat sessions of 4 turns each go through nginx; once a quarter
of all turns are done, host 2 is killed (kill -9 of its gateway and worker).
A turn that fails (502, a dropped connection) is retried with the same
Idempotency-Key. Then every session's history, as Redis holds it, must be
exactly its 4 turns in order with the answers the client received: none
lost, none twice. Prints every retried request and how it ended, and what
Redis carried (commands a second, bytes a session).

Needs root (network namespaces), nginx and redis-server; skipped (77)
without them.
"""
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import redis_harness as h  # noqa: E402

SKIP = 77
SESSIONS = int(os.environ.get("MOE_SCALE_OUT_SESSIONS", "64"))
TURNS = 4
HOSTS = 3
KILLED = 2
MAX_TOKENS = 8
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
HOSTS_SH = os.path.join(ROOT, "deploy", "scale-out", "hosts.sh")


def skip(why):
    print("SKIPPED: " + why)
    sys.exit(SKIP)


def can_make_namespaces(name):
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True)
    if r.returncode != 0:
        return False
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return True


class Session(threading.Thread):
    def __init__(self, index, port, log):
        super().__init__(daemon=True)
        self.index, self.port, self.log = index, port, log
        self.id = None
        self.sent, self.answers = [], []
        self.retries = []  # (turn, attempt, what happened)
        self.error = None

    def post(self, body, key):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            c.request("POST", "/v1/chat/completions", json.dumps(body),
                      {"Content-Type": "application/json", "Idempotency-Key": key})
            r = c.getresponse()
            data = r.read()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, data
        finally:
            c.close()

    def run(self):
        try:
            for turn in range(TURNS):
                text = f"# session {self.index}, turn {turn}: a function named f_{self.index}_{turn}\n"
                key = f"s{self.index}-t{turn}-{uuid.uuid4().hex}"
                body = {"model": "demo-moe", "messages": [{"role": "user", "content": text}],
                        "max_tokens": MAX_TOKENS, "temperature": 0, "session_id": self.id or "new"}
                for attempt in range(30):
                    try:
                        status, headers, data = self.post(body, key)
                    except (OSError, http.client.HTTPException) as e:
                        self.retries.append((turn, attempt, f"{type(e).__name__}: {e}"))
                        time.sleep(0.3)
                        continue
                    if status != 200:
                        what = f"HTTP {status}: {data[:120]!r}"
                        try:
                            what = f"HTTP {status} {json.loads(data)['error']['code']}, Retry-After {headers.get('retry-after')}"
                        except (ValueError, KeyError, TypeError):
                            pass
                        self.retries.append((turn, attempt, what))
                        time.sleep(0.3)
                        continue
                    answer = json.loads(data)["choices"][0]["message"]["content"]
                    if attempt > 0:
                        how = "answered from the store" if headers.get("x-moe-replayed") == "1" else "generated"
                        self.retries.append((turn, attempt, "then 200, " + how))
                    self.id = self.id or headers["x-session-id"]
                    self.sent.append(text)
                    self.answers.append(answer)
                    with self.log:
                        self.log.done += 1
                    break
                else:
                    raise RuntimeError(f"turn {turn} failed 30 times: {self.retries[-3:]}")
        except Exception as e:  # a session that cannot finish is a failure
            self.error = f"{type(e).__name__}: {e}"


class Progress:
    def __init__(self):
        self.lock = threading.Lock()
        self.done = 0

    def __enter__(self):
        self.lock.acquire()

    def __exit__(self, *a):
        self.lock.release()


def redis(port, *args):
    return subprocess.run(["redis-cli", "-p", str(port), "--raw", *args], capture_output=True, text=True,
                          timeout=10).stdout


def main():
    for tool in ("nginx", "redis-server", "redis-cli", "ip", "curl"):
        if not shutil.which(tool):
            skip(f"{tool} is not installed")
    name = f"mt{os.getpid() % 10000}"
    if not can_make_namespaces(name + "-probe"):
        skip("cannot make network namespaces here (needs root and CAP_SYS_ADMIN)")
    build = os.path.dirname(os.path.dirname(os.environ["MOE_GATEWAY"]))
    state = tempfile.mkdtemp(prefix="moe-scale-out-")
    port = 18000 + os.getpid() % 1000
    redis_port = port + 1000
    env = dict(os.environ, BUILD_DIR=build, MODEL=os.environ["MOE_MODEL"], STATE_DIR=state, NAME=name,
               NET=f"10.{232 + os.getpid() % 20}.{os.getpid() % 250}", PORT=str(port), REDIS_PORT=str(redis_port),
               GATEWAY_ARGS="--predict on")  # every gateway learning every worker's routing is checked below
    ok = False
    try:
        r = subprocess.run(["bash", HOSTS_SH, "start", str(HOSTS)], env=env, capture_output=True, text=True,
                           timeout=180)
        print(r.stderr.strip())
        if r.returncode != 0:
            raise RuntimeError("the topology did not start:\n" + r.stdout + r.stderr)
        before = redis(redis_port, "INFO", "stats")
        t0 = time.monotonic()
        progress = Progress()
        sessions = [Session(i, port, progress) for i in range(SESSIONS)]
        for s in sessions:
            s.start()
        end = time.time() + 300
        while time.time() < end and progress.done < SESSIONS * TURNS // 4:
            time.sleep(0.01)
        t_kill = time.monotonic()
        subprocess.run(["bash", HOSTS_SH, "kill", str(KILLED)], env=env, check=True, timeout=30)
        print(f"host {KILLED} killed after {progress.done} of {SESSIONS * TURNS} turns "
              f"({t_kill - t0:.1f} s into the run)")
        for s in sessions:
            s.join(600)
        wall = time.monotonic() - t0
        after = redis(redis_port, "INFO", "stats")

        def commands(info):
            for line in info.splitlines():
                if line.startswith("total_commands_processed:"):
                    return int(line.split(":")[1])
            return 0

        # Every session as Redis holds it: its turns, in order, once each.
        bad, sizes = 0, []
        for s in sessions:
            if s.error or s.id is None:
                bad += 1
                print(f"session {s.index}: {s.error}")
                continue
            key = f"moe:session:open:{s.id}"
            stored = json.loads(redis(redis_port, "GET", key) or "[]")
            want = []
            for text, answer in zip(s.sent, s.answers):
                want += [("user", text), ("assistant", answer)]
            got = [(m["role"], m["content"]) for m in stored]
            if got != want:
                bad += 1
                print(f"session {s.index} ({s.id}): stored {len(got)} turns, want {len(want)}:\n"
                      f"  got  {got}\n  want {want}")
            mem = redis(redis_port, "MEMORY", "USAGE", key).strip()
            if mem.isdigit():
                sizes.append(int(mem))
        # A turn whose answer was lost after it was stored, retried: answered
        # from the store, the history unchanged.
        for s in sessions[:8]:
            if s.error or s.id is None:
                continue
            key_before = redis(redis_port, "GET", f"moe:session:open:{s.id}")
            last_key = json.loads(key_before)[-1]["request_key"]
            body = {"model": "demo-moe", "messages": [{"role": "user", "content": s.sent[-1]}],
                    "max_tokens": MAX_TOKENS, "temperature": 0, "session_id": s.id}
            status, headers, data = s.post(body, last_key)
            assert status == 200 and headers.get("x-moe-replayed") == "1", (status, headers, data[:200])
            assert json.loads(data)["choices"][0]["message"]["content"] == s.answers[-1]
            assert redis(redis_port, "GET", f"moe:session:open:{s.id}") == key_before, "a replay changed the history"
        retried = [(s.index, turn, attempt, what) for s in sessions for (turn, attempt, what) in s.retries]
        print(f"{len(retried)} failed attempts, then retried:")
        for r in retried:
            print(f"  session {r[0]} turn {r[1]} attempt {r[2]}: {r[3]}")
        replayed = sum(1 for r in retried if "from the store" in r[3])
        per_s = (commands(after) - commands(before)) / wall
        per_turn = (commands(after) - commands(before)) / (SESSIONS * TURNS)
        print(f"RESULT scale-out: hosts={HOSTS} killed=1 sessions={SESSIONS} turns={TURNS} bad_sessions={bad} "
              f"failed_attempts={len(retried)} answered_from_store={replayed} wall_s={wall:.1f} "
              f"redis_commands_per_s={per_s:.0f} redis_commands_per_turn={per_turn:.1f} "
              f"redis_bytes_per_session={sum(sizes) // max(len(sizes), 1)}")
        assert bad == 0, f"{bad} sessions lost or changed turns"
        assert any(s.retries for s in sessions), "no request failed: the host was killed too late to matter"
        # Every gateway learns routing from every worker (the Redis streams):
        # a survivor learned more routing summaries than it served requests.
        learned = {}
        for i in range(1, HOSTS + 1):
            if i == KILLED:
                continue
            m = h.metrics(8080, host=f"{env['NET']}.{10 + i}")
            served = m.get('moe_gateway_requests_total{endpoint="/v1/chat/completions",status="200"}', 0)
            learned[i] = (served, m.get("moe_gateway_routing_summaries_learned_total", 0))
        print("routing summaries learned by each surviving gateway (its own requests, learned): " +
              ", ".join(f"host {i}: {a:.0f}, {b:.0f}" for i, (a, b) in learned.items()))
        assert all(b > a for a, b in learned.values()), "a gateway learned only from its own requests"
        # The survivors served everything after the kill; the killed host is down.
        st = subprocess.run(["bash", HOSTS_SH, "status"], env=env, capture_output=True, text=True).stdout
        print(st.strip())
        assert f"host {KILLED}" in st and "down" in st.splitlines()[KILLED - 1]
        ok = True
    finally:
        if not ok:
            for f in sorted(os.listdir(os.path.join(state, "logs"))) if os.path.isdir(os.path.join(state, "logs")) else []:
                print(f"--- {f} (last 15 lines)")
                with open(os.path.join(state, "logs", f), errors="replace") as fh:
                    print("".join(fh.readlines()[-15:]))
        subprocess.run(["bash", HOSTS_SH, "stop"], env=env, capture_output=True, timeout=60)
        shutil.rmtree(state, ignore_errors=True)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
