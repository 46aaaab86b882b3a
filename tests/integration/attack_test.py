"""A bounded attack on a real gateway (its own CPU worker on the demo model,
Redis with a password, two API keys, a descriptor limit of 256): for
MOE_ATTACK_SECONDS (default 45) attackers run side by side with honest
clients and the gateway's worker is killed once. Afterwards:
  - no crash: the gateway ran throughout and exits 0 on SIGTERM (built with
    ASan, it would report any leak or bad access there);
  - no orphan: its worker exits with it, its folder is removed;
  - no unbounded growth: connections, generations and admitted sequences
    are back to nothing, descriptors to where they were, and the resident
    memory after the run is within 64 MiB of what it was after the warm-up;
  - the honest clients were served (429s only for the flooding key), each
    retrying a 503 or a cut at the connection cap as real clients do.
Every loop is bounded in count and time and talks to 127.0.0.1 only.
"""
import http.client
import json
import os
import random
import re
import signal
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import redis_harness as h  # noqa: E402

SECONDS = float(os.environ.get("MOE_ATTACK_SECONDS", "45"))
GOOD, BAD = "good-key-7f3a", "flood-key-91c2"
failures = []
lock = threading.Lock()
tally = {}


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def count(what):
    with lock:
        tally[what] = tally.get(what, 0) + 1


def proc_stats(pid):
    with open(f"/proc/{pid}/status") as f:
        rss = int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) // 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def metrics(port):
    # The connection flood may hold the cap: try again a few times.
    for attempt in range(20):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            c.request("GET", "/metrics", headers={"Authorization": "Bearer " + GOOD})
            r = c.getresponse()
            text = r.read().decode()
            if r.status == 200:
                return {m.group(1): float(m.group(2))
                        for m in re.finditer(r"^(moe_gateway_[a-z_]+) ([0-9.e+-]+)$", text, re.M)}
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError("/metrics did not answer")


def request(port, path, body, key=GOOD, timeout=60, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    hdr = {"Content-Type": "application/json", "Authorization": "Bearer " + key, **(headers or {})}
    c.request("POST", path, body if isinstance(body, (bytes, str)) else json.dumps(body), hdr)
    r = c.getresponse()
    data = r.read()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, data


def raw_send(port, data, read=True, linger=0.0):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        s.sendall(data)
        if linger:
            time.sleep(linger)
        if read:
            s.settimeout(10)
            return s.recv(65536)
    except OSError:
        return b""
    finally:
        s.close()
    return b""


def attacker(name, port, end, fn):
    def run():
        rnd = random.Random(hash(name) & 0xffff)
        n = 0
        while time.time() < end and n < 100000:
            n += 1
            try:
                fn(port, rnd)
                count(name + " runs")
            except Exception as e:  # an attacker's own failure (timeouts, resets) is no finding
                count(name + " (client error: " + type(e).__name__ + ")")
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


MODEL = h.MODEL
CHAT = "/v1/chat/completions"


def honest(port, rnd):
    """An honest client, as real ones behave at a server's connection cap:
    a 503 or a connection cut at connect is retried after a short backoff
    (three times); what it finally got is counted."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 12,
            "temperature": 0, "stream": rnd.random() < 0.5}
    for attempt in range(4):
        last = attempt == 3
        try:
            status, _, data = request(port, CHAT, body)
        except (ConnectionError, http.client.RemoteDisconnected):
            if last:
                raise
            count("retries of honest requests")
            time.sleep(0.1 * 2 ** attempt)
            continue
        if status == 503 and not last:
            count("retries of honest requests")
            time.sleep(0.1 * 2 ** attempt)
            continue
        count(f"honest HTTP {status}")
        return


def honest_session(port, rnd):
    status, hdr, _ = request(port, CHAT, {"model": MODEL, "session_id": "notes-" + str(rnd.randint(0, 3)),
                                          "messages": [{"role": "user", "content": "more"}], "max_tokens": 4})
    count(f"session HTTP {status}")


def flood(port, rnd):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * rnd.randint(1, 200)}], "n": 16,
            "max_tokens": 32, "stream": True}
    status, _, _ = request(port, CHAT, body, key=BAD)
    count(f"flood HTTP {status}")


def bad_json(port, rnd):
    bodies = ['{"model":"%s","messages":[{"role":"user","content":"a"}],"max_tokens":1e400}' % MODEL,
              '{"model":"%s","messages":%s}' % (MODEL, "[" * 50000 + "]" * 50000),
              '{"model":"%s","session_id":"new","messages":[{"role":"user","content":%s}]}' % (
                  MODEL, "[" * 100000 + "]" * 100000),
              '{"model":"%s","messages":[{"role":"user","content":"a"}],"n":128,"max_tokens":100000}' % MODEL,
              '{"model":"%s","messages":[{"role":"user","content":"a"}],"max_tokens":9223372036854775807}' % MODEL,
              '{"model":"%s","messages":[{"role":"user","content":"a"}],"logprobs":true,"top_logprobs":20,"n":64}' % MODEL,
              b'{"model":"demo-moe","messages":[{"role":"user","content":"\xff\xfe"}]}',
              '{"model":"%s","messages":[{"role":"nobody","content":1}],"temperature":"hot"}' % MODEL,
              '[' * 10]
    status, _, _ = request(port, rnd.choice([CHAT, "/v1/completions", "/debug/experts"]), rnd.choice(bodies))
    count(f"bad json HTTP {status}")


def poison_step(port, rnd):
    """Requests whose sampling, once narrowed to what the worker takes, it
    would refuse, and with it the whole step the honest requests share
    (the honest-client check below fails if any of them gets a 5xx)."""
    base = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 6}
    extra = rnd.choice([{"repetition_penalty": 1e-300}, {"top_p": 1e-50}, {"repetition_penalty": 1e-40},
                        {"response_format": {"type": "json_object"}, "ignore_eos": True},
                        {"response_format": {"type": "json_schema", "json_schema": {
                            "name": "n", "schema": {"type": "integer"}}}, "ignore_eos": True,
                         "logit_bias": {"24": 100}}])
    status, _, _ = request(port, CHAT, dict(base, **extra))
    count(f"poison step HTTP {status}")


def no_key(port, rnd):
    path = rnd.choice(["/v1/models", "/metrics", "/no/such", "/debug/experts", CHAT])
    status, _, _ = request(port, path, "{}", key="guess-" + str(rnd.randint(0, 10**6)))
    count(f"no key HTTP {status}")


def garbage_http(port, rnd):
    blobs = [bytes(rnd.getrandbits(8) for _ in range(rnd.randint(1, 3000))),
             b"GET / HTTP/1.1\r\n" + b"X: " + b"a" * 20000 + b"\r\n\r\n",
             b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
             b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n",
             b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
             b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 50]
    raw_send(port, rnd.choice(blobs))


def slowloris(port, rnd):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        for _ in range(20):
            s.sendall(b"X-A: b\r\n")
            time.sleep(0.25)
    except OSError:
        pass
    finally:
        s.close()


def pipeline_and_leave(port, rnd):
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 200})
    req = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {GOOD}\r\n"
           f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
    raw_send(port, req + b"J" * (1 << 20), read=False, linger=0.2)


def disconnect_mid_stream(port, rnd):
    body = json.dumps({"model": MODEL, "prompt": "import", "max_tokens": 200, "stream": True})
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {GOOD}\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        s.recv(4096)
        time.sleep(rnd.random() * 0.5)
    finally:
        s.close()


def never_read(port, rnd):
    body = json.dumps({"model": MODEL, "prompt": "def", "max_tokens": 400, "stream": True})
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.connect(("127.0.0.1", port))
    s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {GOOD}\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    time.sleep(3)  # past --write-timeout-ms: the server lets go first
    s.close()


def connection_flood(port, rnd):
    # Past the cap (192 at 256 descriptors) for a second, then a long pause.
    socks = []
    try:
        for _ in range(260):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    except OSError:
        pass
    time.sleep(1.0)
    for s in socks:
        s.close()
    time.sleep(10)


def main():
    h.need_redis()
    c = h.Cluster("attack")
    try:
        c.start_redis(password="attack-pw")
        keys = os.path.join(c.dir, "keys")
        with open(keys, "w") as f:
            f.write(f"# two callers\n{GOOD}\n{BAD}\n")
        os.chmod(keys, 0o600)
        url = f"redis://:attack-pw@127.0.0.1:{c.redis_port}"
        port = c.start_gateway([], redis=False, nofile=256,
                               extra=["--redis", url, "--api-key-file", keys, "--max-caller-sequences", "48",
                                      "--max-waiting", "96", "--write-timeout-ms", "1500",
                                      "--request-timeout-ms", "3000", "--max-body-bytes", "262144"])
        gw = c.procs["gateway"]
        worker = int(re.search(r"started moe-worker \(pid (\d+)\)", c.log("gateway")).group(1))
        folder = re.search(r"on (\S+)/worker.sock", c.log("gateway")).group(1)
        # Warm-up: the honest load alone.
        end = time.time() + 8
        ts = [attacker("honest", port, end, honest) for _ in range(2)]
        for t in ts:
            t.join()
        rss0, fds0 = proc_stats(gw.pid)
        print(f"RESULT after warm-up: RSS {rss0} MiB, {fds0} descriptors")

        end = time.time() + SECONDS
        plan = [("honest", honest, 3), ("session", honest_session, 1), ("flood", flood, 6), ("bad json", bad_json, 2),
                ("no key", no_key, 1), ("garbage http", garbage_http, 2), ("slowloris", slowloris, 4),
                ("pipeline+leave", pipeline_and_leave, 1), ("disconnect", disconnect_mid_stream, 2),
                ("never read", never_read, 2), ("connection flood", connection_flood, 1),
                ("poison step", poison_step, 1)]
        threads = [attacker(name, port, end, fn) for name, fn, n in plan for _ in range(n)]
        samples = []
        killed = False
        while time.time() < end:
            time.sleep(3)
            check_alive = gw.poll() is None
            if not check_alive:
                break
            rss, fds = proc_stats(gw.pid)
            m = metrics(port)
            samples.append((rss, fds, m.get("moe_gateway_connections", -1), m.get("moe_gateway_generations", -1)))
            print(f"sample: RSS {rss} MiB, {fds} fds, {m.get('moe_gateway_connections')} connections, "
                  f"{m.get('moe_gateway_generations')} generations, {m.get('moe_gateway_sequences_admitted')} "
                  f"admitted, {m.get('moe_gateway_sequences_waiting')} waiting, "
                  f"{m.get('moe_gateway_completion_tokens_total')} tokens, "
                  f"{m.get('moe_gateway_sessions_in_memory')} sessions", flush=True)
            if not killed and time.time() > end - SECONDS / 2:
                os.kill(int(re.findall(r"started moe-worker \(pid (\d+)\)", c.log("gateway"))[-1]), signal.SIGKILL)
                killed = True
        for t in threads:
            t.join(30)
        check(gw.poll() is None, "no crash: the gateway ran through the attack")
        time.sleep(4)  # let write deadlines and lingering closes run out
        m = metrics(port)
        rss1, fds1 = proc_stats(gw.pid)
        print("RESULT attackers: " + ", ".join(f"{k}: {v}" for k, v in sorted(tally.items())))
        print(f"RESULT after the attack: RSS {rss1} MiB (+{rss1 - rss0}), {fds1} descriptors ({fds1 - fds0:+d}), "
              f"peak RSS {max(s[0] for s in samples)} MiB, peak connections {max(s[2] for s in samples)}")
        check(m.get("moe_gateway_connections") == 1, f"no growth: only the metrics scrape is connected "
                                                      f"({m.get('moe_gateway_connections')})")
        check(m.get("moe_gateway_generations") == 0, "no growth: no generation left")
        check(m.get("moe_gateway_sequences_admitted") == 0, "no growth: no admitted sequence left")
        if os.environ.get("MOE_SANITIZED"):
            # ASan keeps freed memory in quarantine (256 MiB): its LeakSanitizer judges leaks at exit instead.
            print(f"note: sanitized build, resident memory {rss1 - rss0:+d} MiB not judged (LeakSanitizer is)")
        else:
            check(rss1 - rss0 <= 64, f"no growth: resident memory within 64 MiB of the warm-up ({rss1 - rss0:+d} MiB)")
        check(fds1 <= fds0 + 4, f"no growth: descriptors back to the warm-up's ({fds0} -> {fds1})")
        check(m.get("moe_gateway_internal_errors_total", 0) == 0, "no internal error escaped a handler")
        # Honest requests: served, or (while the connection flood holds the cap) told 503 or cut at connect.
        honest_ok = tally.get("honest HTTP 200", 0)
        honest_all = sum(v for k, v in tally.items() if k.startswith("honest") and not k.endswith(" runs"))
        check(honest_all > 0 and honest_ok >= 0.8 * honest_all,
              f"the honest clients were served ({honest_ok} of {honest_all}; "
              f"{tally.get('retries of honest requests', 0)} retries at the cap)")
        check(not any(k.startswith("honest HTTP 5") and k != "honest HTTP 503" for k in tally) and
              "honest HTTP 429" not in tally, "no honest request failed for anything but the connection cap")
        check(tally.get("flood HTTP 429", 0) > 0, "the flooding key met its bound (429)")
        check(not any(k.startswith("poison step HTTP 5") and k != "poison step HTTP 503" for k in tally),
              "a request the worker would refuse is refused alone, as a 400 (or served)")
        check(m.get("moe_gateway_connections_refused_total", 0) > 0, "the connection flood met the cap (503)")
        check(killed and len(re.findall(r"started moe-worker", c.log("gateway"))) >= 2,
              "the worker killed mid-attack was restarted")
        # Orderly exit: status 0, worker gone with it, folder removed.
        gw.send_signal(signal.SIGTERM)
        try:
            rc = gw.wait(timeout=20)
        except Exception:
            rc = None
        check(rc == 0, f"the gateway exits 0 on SIGTERM (status {rc})")
        check("ERROR: AddressSanitizer" not in c.log("gateway") and "LeakSanitizer" not in c.log("gateway"),
              "no sanitizer report")
        workers = [int(p) for p in re.findall(r"started moe-worker \(pid (\d+)\)", c.log("gateway"))]
        end = time.time() + 10
        while time.time() < end and any(os.path.exists(f"/proc/{p}") for p in workers):
            time.sleep(0.1)
        check(not any(os.path.exists(f"/proc/{p}/cmdline") and open(f"/proc/{p}/cmdline").read() for p in workers),
              "no orphan: every worker the gateway started is gone")
        check(not os.path.exists(folder),
              f"no orphan: the gateway's folder is removed ({folder}: {os.listdir(folder) if os.path.exists(folder) else 'gone'})")
        del worker
    except Exception as e:
        failures.append(f"{type(e).__name__}: {e}")
        print(f"FAILED: {type(e).__name__}: {e}")
    finally:
        if failures:
            print("---- gateway log\n" + c.log("gateway")[-5000:])
        c.close()
    print(f"{'FAILED' if failures else 'PASSED'}: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
