"""Running it for a team (docs/operations.md), between real processes: CPU
workers on the demo model, the gateway, HTTP clients.

1. Overload with a fallback: the main worker's KV holds about three streams
   (--kv-blocks 12); 16 streams at once with --overload-queue-depth 3. The
   excess is served by the fallback worker (X-Moe-Degraded: 1) and every
   stream ends with the text it has when it runs alone: nothing lost.
2. Overload without a fallback: the same load is partly refused with 429
   `overloaded` and Retry-After; what is admitted completes.
3. Priorities from a keys file: eight requests of a priority-10 key fill the
   queue, then four of a priority-0 key come; the priority-0 ones get their
   first token before the last of the earlier priority-10 ones, some
   running priority-10 sequences are preempted for them, and every text
   still equals its twin. A body `priority` is refused unless allowed. A
   key with a rate of 2 a minute gets 429 rate_limit_exceeded on its third.
4. A session turn retried with its Idempotency-Key is answered from the
   store (whole and streamed), not run again.
5. Behind --trusted-proxy a keyless caller is the client X-Forwarded-For
   names; from anyone else the header is ignored.
6. /metrics: each worker's stats (islands, tokens, its card: not available
   on a CPU worker) and the overload counters.
"""
import hashlib
import http.client
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import redis_harness as h  # noqa: E402

MAX_TOKENS = 40


def overload_with_fallback(c):
    main = c.start_worker("main", redis=False, extra=["--kv-blocks", "12"])
    fb = c.start_worker("fallback", redis=False)
    port = c.start_gateway([main], fallback=fb, redis=False, extra=["--overload-queue-depth", "3"])
    ps = h.prompts(16)
    twins = h.twins_of(port, ps, MAX_TOKENS)
    streams = [h.Stream(port, p, MAX_TOKENS).start() for p in ps]
    lost = h.lost_streams(streams, twins, "overload ")
    degraded = sum(1 for s in streams if s.headers.get("x-moe-degraded") == "1")
    time.sleep(1.5)  # the workers' stats are asked for once a second
    m = h.metrics(port)
    sent = m.get("moe_gateway_overload_fallback_total", 0)
    fb_assigned = m.get('moe_gateway_worker_sequences_assigned_total{worker="fallback",fallback="1"}', 0)
    print(f"RESULT overload with fallback: streams=16 lost={lost} degraded={degraded} "
          f"sent_to_fallback={sent:.0f} fallback_assigned={fb_assigned:.0f}")
    assert lost == 0, f"{lost} streams lost or changed"
    assert degraded >= 1, "no stream went to the fallback"
    assert degraded < 16, "every stream went to the fallback"
    assert sent == degraded, (sent, degraded)
    assert fb_assigned >= degraded, "the fallback did not serve the degraded streams"
    # Each worker's stats: a CPU worker reads no card; tokens were counted.
    for w in ("main", "fallback"):
        lab = f'{{worker="{w}",fallback="{1 if w == "fallback" else 0}"}}'
        assert m.get("moe_worker_card_available" + lab) == 0, m
        assert m.get("moe_worker_tokens_total" + lab, 0) > 0, f"no tokens counted for {w}"
        assert ("moe_worker_card_temperature_celsius" + lab) not in m
        assert m.get("moe_gateway_worker_hot" + lab) == 0
    assert m.get("moe_gateway_worker_step_token_budget{worker=\"main\",fallback=\"0\"}", 0) > 0
    # Every series the Grafana dashboard reads exists: in this scrape, or
    # (the card's, absent on a CPU worker) among those the gateway renders.
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    dash = open(os.path.join(root, "deploy", "grafana", "moe-serve-dashboard.json")).read()
    source = open(os.path.join(root, "gateway", "metrics.cpp")).read()
    scraped = {re.sub(r"_(bucket|sum|count)$", "", k.split("{")[0]) for k in m}
    wanted = {re.sub(r"_bucket$", "", n) for n in re.findall(r"\b(moe_[a-z_]+)", dash)}
    missing = sorted(n for n in wanted
                     if n not in scraped and not (n.startswith("moe_worker_card_") and f'"{n}"' in source))
    assert not missing, f"the dashboard reads series the gateway does not have: {missing}"
    c.close(keep=True)


def overload_without_fallback(c):
    main = c.start_worker("main", redis=False, extra=["--kv-blocks", "12"])
    port = c.start_gateway([main], redis=False, extra=["--overload-queue-depth", "3"])
    ps = h.prompts(16)
    twins = h.twins_of(port, ps, MAX_TOKENS)
    streams = [h.Stream(port, p, MAX_TOKENS).start() for p in ps]
    for s in streams:
        s.join(300)
    refused = [s for s in streams if s.error and s.error.startswith("HTTP 429")]
    served = [i for i, s in enumerate(streams) if not s.error]
    wrong = [i for i in served if streams[i].text != twins[i] or streams[i].finish not in ("stop", "length")]
    other = [s.error for s in streams if s.error and not s.error.startswith("HTTP 429")]
    print(f"RESULT overload without fallback: streams=16 served={len(served)} refused={len(refused)} "
          f"wrong={len(wrong)} other_errors={other}")
    assert refused, "nothing was refused"
    assert len(served) >= 3, "too little was served"
    assert not wrong and not other
    for s in refused:
        assert "overloaded" in s.error, s.error
        ra = s.headers.get("retry-after")
        assert ra and 1 <= int(ra) <= 30, s.headers
    assert h.metrics(port).get("moe_gateway_overload_refused_total", 0) == len(refused)
    idempotent_turns(port)
    c.close(keep=True)


def post_chat(port, body, headers):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json", **headers})
    r = conn.getresponse()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()


def idempotent_turns(port):
    """A session turn retried with its Idempotency-Key is answered from the store, once."""
    turn = lambda text, sid: {"model": h.MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8,
                              "temperature": 0.8, "seed": 5, "session_id": sid}
    status, hdr, data = post_chat(port, turn("def first():\n", "new"), {"Idempotency-Key": "t1"})
    assert status == 200, data
    sid = hdr["x-session-id"]
    status, hdr, data = post_chat(port, turn("def second():\n", sid), {"Idempotency-Key": "t2"})
    assert status == 200 and "x-moe-replayed" not in hdr, data
    first = json.loads(data)
    answer = first["choices"][0]["message"]["content"]
    assert first["usage"]["completion_tokens"] > 0, first
    # The same key again (the answer lost on the way): the stored answer, not a new one, in the
    # response that first carried it: its id, time and usage.
    time.sleep(1.1)  # a response made anew would have a later "created"
    status, hdr, data = post_chat(port, turn("def second():\n", sid), {"Idempotency-Key": "t2"})
    assert status == 200 and hdr.get("x-moe-replayed") == "1", (hdr, data)
    again = json.loads(data)
    assert again["choices"][0]["message"]["content"] == answer
    for field in ("id", "created", "usage"):
        assert again[field] == first[field], (field, again[field], first[field])
    streamed = dict(turn("def second():\n", sid), stream=True, stream_options={"include_usage": True})
    status, hdr, data = post_chat(port, streamed, {"Idempotency-Key": "t2"})
    events = [json.loads(l[6:]) for l in data.decode().split("\n") if l.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert status == 200 and hdr.get("x-moe-replayed") == "1" and data.rstrip().endswith(b"data: [DONE]"), data
    assert text == answer, (text, answer)
    assert all(e["id"] == first["id"] and e["created"] == first["created"] for e in events), events
    assert events[-1]["choices"] == [] and events[-1]["usage"] == first["usage"], events[-1]
    # A new key runs a new turn; a malformed key is refused.
    status, hdr, data = post_chat(port, turn("def third():\n", sid), {"Idempotency-Key": "t3"})
    assert status == 200 and "x-moe-replayed" not in hdr
    status, _, data = post_chat(port, turn("def fourth():\n", sid), {"Idempotency-Key": "a b"})
    assert status == 400 and json.loads(data)["error"]["code"] == "invalid_idempotency_key", data
    # The last turn's key reused for another turn: refused, not answered with the old turn.
    status, _, data = post_chat(port, turn("def fourth():\n", sid), {"Idempotency-Key": "t3"})
    assert status == 422 and json.loads(data)["error"]["code"] == "idempotency_key_reused", data
    # The replayed answer keeps how the turn ended (max_tokens 8: length).
    status, hdr, data = post_chat(port, turn("def third():\n", sid), {"Idempotency-Key": "t3"})
    assert hdr.get("x-moe-replayed") == "1" and json.loads(data)["choices"][0]["finish_reason"] == "length", data
    # A retry that comes late, after later turns: still the stored turn, never run and stored again.
    status, hdr, data = post_chat(port, turn("def second():\n", sid), {"Idempotency-Key": "t2"})
    assert status == 200 and hdr.get("x-moe-replayed") == "1", (hdr, data)
    late = json.loads(data)
    assert late["id"] == first["id"] and late["choices"][0]["message"]["content"] == answer, late
    # A replay is checked as its request was: another model is 404, not an answer.
    status, _, data = post_chat(port, dict(turn("def second():\n", sid), model="other-model"), {"Idempotency-Key": "t2"})
    assert status == 404 and json.loads(data)["error"]["code"] == "model_not_found", data
    # A keyed turn asks for what the session can give again: one choice, no logprobs.
    for extra, param in (({"n": 2}, "n"), ({"logprobs": True}, "logprobs")):
        status, _, data = post_chat(port, dict(turn("def fifth():\n", sid), **extra), {"Idempotency-Key": "t5"})
        err = json.loads(data)["error"]
        assert status == 400 and err["param"] == param and err["code"] == "unsupported_value", data
    m = h.metrics(port)
    assert m.get("moe_gateway_replayed_turns_total") == 4, m.get("moe_gateway_replayed_turns_total")
    print("RESULT idempotent turns: retried turns answered from the store (whole, streamed, late, with their id, "
          "created, usage and finish reason, checked as their request); a key reused for another turn refused "
          "(422); a keyed turn of n 2 or with logprobs refused (400)")


def priorities(c):
    keys = {"urgent": "k-urgent-0123456789", "batch": "k-batch-0123456789", "limited": "k-limited-0123456789"}
    path = os.path.join(c.dir, "keys")
    with open(path, "w") as f:
        f.write("# name  sha256(key)  priority  requests/min\n")
        f.write(f"urgent  {hashlib.sha256(keys['urgent'].encode()).hexdigest()}  0  -\n")
        f.write(f"batch   {hashlib.sha256(keys['batch'].encode()).hexdigest()}  10  600\n")
        f.write(f"limited {hashlib.sha256(keys['limited'].encode()).hexdigest()}  0  2\n")
    # Short prompts and 4 KV blocks of 16 tokens: one sequence runs at a time.
    main = c.start_worker("main", redis=False, extra=["--kv-blocks", "4"])
    port = c.start_gateway([main], redis=False, extra=["--keys-file", path])
    auth = {k: {"Authorization": "Bearer " + v} for k, v in keys.items()}
    ps = [f"def function_{i}(values):\n" for i in range(12)]
    twins = h.twins_of(port, ps, MAX_TOKENS, headers=auth["urgent"])
    # Eight of the later priority queue up; once the first runs, four urgent ones come. The first to
    # run is whichever request reached the gateway first, not always the first thread started.
    batch = [h.Stream(port, p, MAX_TOKENS, headers=auth["batch"]).start() for p in ps[:8]]
    end = time.time() + 60
    while time.time() < end and not any(s.events >= 2 for s in batch):
        time.sleep(0.002)
    t_urgent = time.monotonic()
    urgent = [h.Stream(port, p, MAX_TOKENS, headers=auth["urgent"]).start() for p in ps[8:]]
    lost = h.lost_streams(batch + urgent, twins, "priority ")
    for name, group in (("batch", batch), ("urgent", urgent)):
        print(f"  {name} finished at " + " ".join(
            f"{(s.times[-1] - t_urgent) * 1000:+.0f}" if s.times else "-" for s in group) + " ms after the urgent came")
    # Every urgent stream ended before any batch stream still going when they came.
    unfinished = [s for s in batch if s.times and s.times[-1] > t_urgent]
    last_urgent = max(s.times[-1] for s in urgent if s.times)
    overtaken = sum(1 for s in unfinished if s.times[-1] > last_urgent)
    m = h.metrics(port, auth["urgent"])
    pre = m.get("moe_gateway_priority_preemptions_total", 0)
    print(f"RESULT priorities: lost={lost} batch_unfinished_when_urgent_came={len(unfinished)} "
          f"of_those_ending_after_every_urgent={overtaken} priority_preemptions={pre:.0f}")
    assert lost == 0
    assert len(unfinished) >= 6, "the queue was not full when the urgent requests came"
    assert overtaken == len(unfinished), "an urgent request waited behind an earlier batch one"
    assert pre >= 1, "no running sequence was preempted for the urgent ones"
    # A body priority is refused unless the operator allows it.
    status, _, body = h.complete(port, ps[0], 2, extra={"priority": -5}, headers=auth["batch"])
    assert status == 400 and body["error"]["code"] == "unsupported_parameter", body
    status, _, body = h.complete(port, ps[0], 2, extra={"priority": 0}, headers=auth["batch"])
    assert status == 200, body
    # Two a minute: the third is refused with the time to wait.
    codes = []
    for _ in range(3):
        status, hdr, body = h.complete(port, ps[0], 2, headers=auth["limited"])
        codes.append(status)
    assert codes == [200, 200, 429], codes
    assert body["error"]["code"] == "rate_limit_exceeded", body
    assert 1 <= int(hdr["retry-after"]) <= 31, hdr
    assert h.metrics(port, auth["urgent"]).get("moe_gateway_rate_limited_total") == 1
    # No key, a wrong key: 401 as before.
    status, _, _ = h.complete(port, ps[0], 2)
    assert status == 401
    c.close(keep=True)


def trusted_proxy(c):
    """Behind a trusted proxy a keyless caller is the client X-Forwarded-For
    names last; from anyone else the header is ignored."""
    main = c.start_worker("main", redis=False, extra=["--kv-blocks", "4"])
    port = c.start_gateway([main], redis=False, extra=["--trusted-proxy", "127.0.0.1", "--max-caller-sequences", "1"])
    ps = [f"def proxied_{i}(values):\n" for i in range(3)]

    def admitted(forwarded):
        """Starts a long stream for each X-Forwarded-For value at once;
        returns which were refused 429 too_many_sequences."""
        streams = [h.Stream(port, p, 60, headers={"X-Forwarded-For": f} if f else {}).start()
                   for p, f in zip(ps, forwarded)]
        for s in streams:
            assert s.join(60), f"a stream never ended (it has {s.events} events)"
            # Admitted ones run to the end of the 4-block cache: 'length', never a stall.
            assert s.error or s.finish == "length", (s.finish, s.error)
        return [bool(s.error and "429" in s.error and "too_many_sequences" in s.error) for s in streams]

    # Three clients behind the proxy: each its own caller, all admitted.
    distinct = admitted(["10.1.0.1", "198.51.100.7, 10.1.0.2", "10.1.0.3"])
    # The same client three times (a spoofed first hop is not the client: the last one is).
    same = admitted(["10.1.0.9", "6.6.6.6, 10.1.0.9", "10.1.0.9"])
    print(f"RESULT trusted proxy: distinct clients refused={distinct}, one client thrice refused={same}")
    assert distinct == [False, False, False], distinct
    assert sum(same) == 2, same
    c.close(keep=True)
    # Not behind a trusted proxy: the header is ignored, every stream is 127.0.0.1.
    port2 = c.start_gateway([c.start_worker("main2", redis=False, extra=["--kv-blocks", "4"])], redis=False,
                            name="gateway2", extra=["--max-caller-sequences", "1"])
    port = port2
    ignored = admitted(["10.1.0.1", "10.1.0.2", "10.1.0.3"])
    assert sum(ignored) == 2, ignored
    c.close(keep=True)


def smaller_fallback(c):
    """A main worker killed mid-stream while a fallback too small for the
    streams serves: they wait for the main one's return and go on whole,
    never cut at the fallback's KV ("length" early)."""
    main = c.start_worker("main", redis=False, extra=["--kv-blocks", "32"])
    fb = c.start_worker("fb", redis=False, extra=["--kv-blocks", "3"])  # 48 tokens: less than any stream needs
    port = c.start_gateway([main], fallback=fb, redis=False)
    # The fallback may be ready first: a fresh request it took would be cut
    # at its 48 tokens (a limit of its own, not what this part tests).
    c.wait_health(main=True)
    ps = [f"def resumed_{i}(values):\n" for i in range(3)]
    want = 100
    twins = h.twins_of(port, ps, want)
    streams = [h.Stream(port, p, want).start() for p in ps]
    end = time.time() + 60
    while time.time() < end and not all(s.events >= 8 for s in streams):
        time.sleep(0.002)
    c.kill9("main")
    time.sleep(1.0)  # the fallback serves meanwhile
    c.start_worker("main", redis=False, extra=["--kv-blocks", "32"])
    lost = h.lost_streams(streams, twins, "smaller fallback ", timeout=120)
    lengths = [len(s.text) for s in streams]
    print(f"RESULT smaller fallback: streams={len(streams)} lost={lost} finish={[s.finish for s in streams]} "
          f"chars={lengths}")
    assert lost == 0
    assert all(s.finish == "length" for s in streams)
    c.close(keep=True)


def main():
    ok = False
    clusters = []
    try:
        for name, part in (("overload-fb", overload_with_fallback), ("overload-429", overload_without_fallback),
                           ("priorities", priorities), ("proxy", trusted_proxy),
                           ("smaller-fallback", smaller_fallback)):
            c = h.Cluster(name)
            clusters.append(c)
            part(c)
        ok = True
    finally:
        for c in clusters:
            if not ok:
                for n in c.logs:
                    print(f"--- {n} log (last 30 lines)")
                    print("\n".join(c.log(n).splitlines()[-30:]))
            c.close(keep=False)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
