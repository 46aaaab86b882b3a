"""Redis state with real processes and a private redis-server:
  1. a restarted worker re-warms the resident set it published before
     (compared through Redis) and says how long that took;
  2. entries a dead consumer left pending are claimed and replayed;
  3. garbage entries in the streams are skipped with a log line;
  4. a session continues through a restarted gateway;
  5. Redis killed and restarted under load: no request fails, the gateway
     reconnects, and the streams stay bounded (XLEN).
"""
import json
import os
import re
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import redis_harness as h  # noqa: E402

MODEL_KEY = "moe:" + os.path.basename(os.environ.get("MOE_MODEL", "demo-moe").rstrip("/"))
MAX_LEN = 50  # the workers' stream bound in this test (MOE_REDIS_STREAM_MAX_LEN)

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def last_resident(c):
    out = c.redis("XREVRANGE", MODEL_KEY + ":resident", "+", "-", "COUNT", "1").split("\n")
    # id, then field/value lines
    fields = dict(zip(out[1::2], out[2::2]))
    return fields.get("kind"), set(fields.get("experts", "").split()) - {""}


def wait_log(c, name, pattern, timeout=30, seen=0):
    """The match after the first `seen` ones (logs are appended across restarts)."""
    end = time.time() + timeout
    while time.time() < end:
        ms = list(re.finditer(pattern, c.log(name)))
        if len(ms) > seen:
            return ms[seen]
        time.sleep(0.05)
    return None


def run_requests(c, n, max_tokens=8, concurrency=16):
    ps = h.prompts(max(n, 1))
    done = 0
    errors = []
    while done < n:
        batch = [h.Stream(c.http_port, ps[(done + i) % len(ps)], max_tokens).start()
                 for i in range(min(concurrency, n - done))]
        for s in batch:
            if not s.join(120):
                s.error = "timeout"
            if s.error or s.finish not in ("stop", "length"):
                errors.append(s.error or f"finish={s.finish}")
        done += len(batch)
    return errors


def main():
    h.need_redis()
    os.environ["MOE_REDIS_STREAM_MAX_LEN"] = str(MAX_LEN)
    c = h.Cluster("redis")
    try:
        c.start_redis()
        sock = c.start_worker("w1")
        c.start_gateway([sock])
        check(wait_log(c, "gateway", r"Redis at .* connected") is not None, "gateway connected to Redis")

        # ---- 1. re-warm after kill -9
        errs = run_requests(c, 32, max_tokens=16)
        check(not errs, f"32 requests before the kill ({errs[:2]})")
        time.sleep(0.5)  # the publisher thread drains its queue
        kind, before = last_resident(c)
        check(len(before) > 0, f"the worker published a resident set ({len(before)} experts, entry kind {kind})")
        c.kill9("w1")
        # Another worker of the model (a fallback serving meanwhile) publishes
        # sets of its own after w1's, more than one page of the walk back:
        # w1 must re-warm its own, not those.
        for _ in range(300):
            c.redis("XADD", MODEL_KEY + ":resident", "*", "worker", "fallback", "kind", "snapshot", "experts", "0:0")
        c.start_worker("w1")
        m = wait_log(c, "w1", r"re-warmed (\d+) of (\d+) experts from Redis in ([0-9.]+) ms", seen=1)
        check(m is not None, "the restarted worker re-warmed from Redis")
        if m:
            print(f"RESULT rewarm: {m.group(1)} of {m.group(2)} experts in {m.group(3)} ms")
            check(int(m.group(2)) == len(before),
                  f"the set re-warmed is w1's own ({m.group(2)} experts), not the other worker's (1)")
        deadline = time.time() + 10
        after = set()
        while time.time() < deadline:
            kind, after = last_resident(c)
            if kind == "snapshot" and after != {"0:0"}:
                break
            time.sleep(0.05)
        check(kind == "snapshot" and after == before,
              f"the restarted worker's snapshot equals the set before the kill ({len(after)} vs {len(before)})")

        # ---- 2. pending entries of a dead consumer are claimed and replayed
        ev = MODEL_KEY + ":events"
        c.kill9("w1")  # so that only the ghost reads the next event
        c.redis("XADD", ev, "*", "type", "warm", "experts", "0:1 1:2")
        c.redis("XREADGROUP", "GROUP", "workers", "ghost", "COUNT", "10", "STREAMS", ev, ">")
        pend = c.redis("XPENDING", ev, "workers").split("\n")
        check(pend and pend[0] not in ("", "0"), f"a dead consumer holds pending events ({pend[0] if pend else ''})")
        time.sleep(5.5)  # older than the claim threshold (5 s)
        c.start_worker("w1")
        c.wait_health()
        check(wait_log(c, "w1", r"claimed \d+ pending events of dead workers", 15) is not None,
              "the restarted worker claimed the dead consumer's pending events")
        deadline = time.time() + 10
        while time.time() < deadline and c.redis("XPENDING", ev, "workers").split("\n")[0] != "0":
            time.sleep(0.1)
        check(c.redis("XPENDING", ev, "workers").split("\n")[0] == "0", "every event acknowledged")

        # ---- 3. garbage is skipped with a log line
        c.redis("XADD", ev, "*", "type", "warm", "experts", "not:a:list!")
        c.redis("XADD", ev, "*", "nonsense", "1")
        c.redis("XADD", MODEL_KEY + ":resident", "*", "worker", "x", "experts", "banana")
        c.redis("XADD", MODEL_KEY + ":routing", "*", "seq", "minus-one")
        check(wait_log(c, "w1", r"skipping garbage event .*not a layer:expert pair") is not None,
              "worker: garbage warm event skipped with a log line")
        check(wait_log(c, "w1", r"skipping garbage event .*type ''") is not None,
              "worker: event without a type skipped with a log line")
        check(wait_log(c, "gateway", r"skipping garbage entry .* in " + MODEL_KEY + ":resident") is not None,
              "gateway: garbage resident entry skipped with a log line")
        check(wait_log(c, "gateway", r"skipping garbage entry .* in " + MODEL_KEY + ":routing") is not None,
              "gateway: garbage routing entry skipped with a log line")
        c.wait_health()
        errs = run_requests(c, 4)
        check(not errs, f"requests still served after the garbage ({errs[:2]})")

        # ---- 4. a session continues through a restarted gateway
        def chat(msgs, session):
            status, hdr, body = h.chat(c.http_port, msgs, 8, session)
            return status, hdr, body

        # Without API keys the server issues the ids: "new" asks for one.
        s1, hd1, b1 = chat([{"role": "user", "content": "Once upon a time"}], "new")
        story1 = hd1.get("x-session-id", "")
        check(s1 == 200 and re.fullmatch(r"s-[0-9a-f]{32}", story1) is not None,
              f"first turn of a new session, id {story1!r} issued (HTTP {s1})")
        key1 = "moe:session:open:" + story1
        connects = c.log("gateway").count("connected")
        c.kill9("gateway")
        c.start_gateway([sock])
        end = time.time() + 15
        while time.time() < end and c.log("gateway").count("connected") <= connects:
            time.sleep(0.05)
        s2, _, b2 = chat([{"role": "user", "content": "and then"}], story1)
        s3, _, b3 = chat([{"role": "user", "content": "and then"}], None)
        stored = json.loads(c.redis("GET", key1) or "[]")
        check(s2 == 200 and s3 == 200 and b2["usage"]["prompt_tokens"] > b3["usage"]["prompt_tokens"],
              f"the restarted gateway prepended the stored turn ({b2.get('usage', {}).get('prompt_tokens')} > "
              f"{b3.get('usage', {}).get('prompt_tokens')} prompt tokens)")
        check([m["role"] for m in stored] == ["user", "assistant", "user", "assistant"] and
              stored[1]["content"] == b1["choices"][0]["message"]["content"],
              f"Redis holds the whole conversation ({[m['role'] for m in stored]})")
        check(all(sorted(m) == ["content", "role"] for m in stored), "turns hold role and content only")
        ttl = int(c.redis("TTL", key1).strip() or -2)
        check(ttl > 0, f"the session has a TTL ({ttl} s)")

        # ---- 5. Redis killed and restarted under load
        ps = h.prompts(16)
        streams = [h.Stream(c.http_port, p, 48).start() for p in ps]
        time.sleep(0.3)
        c.kill9("redis")
        time.sleep(1.0)
        c.start_redis()
        for s in streams:
            s.join(180)
        failed = [s.error or s.finish for s in streams if s.error or s.finish not in ("stop", "length")]
        check(not failed, f"16 streams across the Redis restart all completed ({failed[:2]})")
        check(wait_log(c, "gateway", r"Redis at .* connected again", 20) is not None, "the gateway reconnected")
        check(wait_log(c, "w1", r"lost Redis(.|\n)*Redis at \S+ connected", 20)
              is not None, "the worker reconnected")
        # Sessions work again through Redis.
        s4, hd4, _ = chat([{"role": "user", "content": "after the restart"}], "new")
        check(s4 == 200 and c.redis("EXISTS", "moe:session:open:" + hd4.get("x-session-id", "")).strip() == "1",
              "sessions are stored in the restarted Redis")
        # Bounded streams: many more summaries than the bound.
        errs = run_requests(c, 6 * MAX_LEN, max_tokens=2, concurrency=32)
        check(not errs, f"{6 * MAX_LEN} more requests ({errs[:2]})")
        time.sleep(0.5)
        xlen = int(c.redis("XLEN", MODEL_KEY + ":routing").strip() or 0)
        print(f"RESULT bounded: {6 * MAX_LEN} routing summaries, XLEN {xlen} with MAXLEN ~ {MAX_LEN}")
        check(0 < xlen < 4 * MAX_LEN, f"the routing stream stays bounded (XLEN {xlen})")
        check(c.redis("XLEN", MODEL_KEY + ":resident").strip() != "", "the resident stream exists again")

        # ---- 6. a frozen Redis (alive, silent: no socket closes) must not hang session turns
        log = c.log("gateway")
        pings, agains = len(re.findall(r"no answer to PING", log)), len(re.findall(r"connected again", log))
        c.procs["redis"].send_signal(signal.SIGSTOP)
        try:
            t0 = time.time()
            s5, _, _ = chat([{"role": "user", "content": "while Redis sleeps"}], story1)
            took = time.time() - t0
            print(f"RESULT frozen Redis: a session turn answered in {took:.1f} s")
            check(s5 == 200 and took < 15, f"a session turn is answered while Redis is frozen (HTTP {s5}, {took:.1f} s)")
            check(wait_log(c, "gateway", r"no answer to PING", 10, pings) is not None,
                  "the gateway gave up on the silent connection")
        finally:
            c.procs["redis"].send_signal(signal.SIGCONT)
        check(wait_log(c, "gateway", r"connected again", 20, agains) is not None,
              "the gateway reconnected after the freeze")
    except Exception as e:
        failures.append(f"{type(e).__name__}: {e}")
        print(f"FAILED: {type(e).__name__}: {e}")
    finally:
        if failures:
            print("---- gateway log\n" + c.log("gateway")[-3000:])
            print("---- worker log\n" + c.log("w1")[-3000:])
        c.close()
    print(f"{'FAILED' if failures else 'PASSED'}: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
