"""Expert prediction end to end, with a private redis-server, real CPU
workers on the demo model and real gateways (docs/expert-prediction.md):
  1. the prompt's bucket tag travels gateway → worker (StepSequence.route_bucket)
     → routing summary in Redis, unchanged;
  2. after requests of one kind, the gateway's prediction for a similar,
     unseen prompt (POST /debug/experts) comes from that kind's bucket and
     matches the experts the worker reported for that kind;
  3. its requests' predictions hit (/metrics) and warm hints go out;
  4. a second gateway, started afterwards with its own worker, learns the
     first one's traffic from the routing stream: same prediction, and its
     first request is predicted well; it keeps learning live;
  5. one gateway drives both workers at once;
  6. with --predict off (the default) nothing of it is on.
"""
import http.client
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import redis_harness as h  # noqa: E402

ROUTING = "moe:" + h.MODEL + ":routing"
TOP = 8  # the gateway's --predict-experts default
ON = ("--predict", "on", "--grouped-batching", "on")  # both off by default (docs/expert-prediction.md)
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def kind_x(n, a, b, op):
    return (f"def test_index_{n}(self):\n    index = pd.Index([{a}, {b}, {a + b}])\n"
            f"    result = index.{op}()\n    tm.assert_index_equal(result, index)\n")


def kind_y(month, what):
    return (f"The committee met in {month} to discuss the annual budget, the {what}, "
            f"and the opening hours of the public library during the winter.\n")


TRAIN_X = [kind_x(n, a, b, op) for n, a, b, op in
           [(1, 1, 2, "copy"), (2, 3, 5, "sort_values"), (3, 7, 1, "unique"), (4, 2, 9, "copy"),
            (5, 4, 4, "drop_duplicates"), (6, 8, 3, "sort_values")]]
TRAIN_Y = [kind_y(m, w) for m, w in [("March", "new school"), ("June", "road repairs"), ("October", "park")]]
SIMILAR_X = kind_x(11, 6, 2, "unique")


def post(port, path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, json.loads(r.read() or b"{}")


def metrics(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(moe_gateway_\w+) (\S+)$", text, re.M)}


def wait_metric(port, name, at_least, timeout=20):
    end = time.time() + timeout
    while time.time() < end:
        v = metrics(port).get(name, 0)
        if v >= at_least:
            return v
        time.sleep(0.1)
    return metrics(port).get(name, 0)


def summaries(c):
    """Every routing summary in the stream: [(bucket tag, {layer: {expert: tokens}})]."""
    out = []
    lines = c.redis("XRANGE", ROUTING, "-", "+").split("\n")
    i = 0
    while i < len(lines):
        if re.match(r"^\d+-\d+$", lines[i]):
            j = i + 1
            fields = {}
            while j + 1 < len(lines) and not re.match(r"^\d+-\d+$", lines[j]):
                fields[lines[j]] = lines[j + 1]
                j += 2
            layers = {}
            for part in fields.get("layers", "").split():
                l, pairs = part.split(":")
                layers[int(l)] = {int(e): int(t) for e, t in (p.split("=") for p in pairs.split(","))}
            out.append((int(fields.get("bucket", "0")), layers))
            i = j
        else:
            i += 1
    return out


def reported_top(entries, n):
    """Per layer, the n experts with the most tokens summed over `entries`."""
    total = {}
    for _, layers in entries:
        for l, ex in layers.items():
            for e, t in ex.items():
                total.setdefault(l, {}).setdefault(e, 0)
                total[l][e] += t
    return {l: set(sorted(ex, key=lambda e: (-ex[e], e))[:n]) for l, ex in total.items()}


def overlap(pred, top):
    layers = pred["layers"]
    return sum(len(set(x["experts"]) & top.get(x["layer"], set())) for x in layers) / max(
        1, sum(len(x["experts"]) for x in layers))


def main():
    h.need_redis()
    t0 = time.time()
    c = h.Cluster("prediction")
    try:
        c.start_redis()
        w1 = c.start_worker("w1")
        a = c.start_gateway([w1], name="gateway-a", extra=ON)
        # /health says when the gateway reaches Redis (a scale-out host takes
        # traffic only then: deploy/scale-out/hosts.sh).
        health = {}

        def redis_connected():
            hc = http.client.HTTPConnection("127.0.0.1", a, timeout=10)
            hc.request("GET", "/health")
            health.update(json.loads(hc.getresponse().read()))
            return health.get("redis") == "connected"

        check(h.wait_for(redis_connected, 10), f"/health says Redis is connected ({health.get('redis')})")

        # 1. The bucket tag travels to the worker and back into Redis.
        st, p0 = post(a, "/debug/experts", {"prompt": TRAIN_X[0]})
        check(st == 200 and p0.get("source") == "none", f"before any traffic: nothing predicted ({p0.get('source')})")
        st, _, _ = h.complete(a, TRAIN_X[0], 8)
        check(st == 200, "a completion through gateway A")
        end = time.time() + 10
        while time.time() < end and not summaries(c):
            time.sleep(0.05)
        first = summaries(c)
        check(len(first) == 1 and first[0][0] == p0["route_bucket"],
              f"the worker's routing summary carries the gateway's route_bucket {p0['route_bucket']}: "
              f"{[s[0] for s in first]}")

        # 2. Traffic of two kinds; then a similar, unseen prompt of the first.
        x_tags = {p0["route_bucket"]}
        for p in TRAIN_X[1:]:
            x_tags.add(post(a, "/debug/experts", {"prompt": p})[1]["route_bucket"])
            h.complete(a, p, 8)
        for p in TRAIN_Y:
            h.complete(a, p, 8)
        n_train = len(TRAIN_X) + len(TRAIN_Y)
        learned = wait_metric(a, "moe_gateway_routing_summaries_learned_total", n_train)
        check(learned >= n_train, f"gateway A learned every summary from Redis ({learned:.0f} of {n_train})")
        entries = summaries(c)
        x_entries = [e for e in entries if e[0] in x_tags]
        y_entries = [e for e in entries if e[0] not in x_tags]
        st, pred = post(a, "/debug/experts", {"prompt": SIMILAR_X})
        x_buckets = {t & 0xffffffff for t in x_tags}
        check(pred["source"] in ("bucket", "nearest") and pred["from_bucket"] in x_buckets,
              f"the similar prompt is predicted from a bucket of its kind ({pred['source']}, bucket "
              f"{pred['bucket']} from {pred['from_bucket']}, distance {pred['distance']}; kind's buckets {sorted(x_buckets)})")
        ox = overlap(pred, reported_top(x_entries, TOP))
        oy = overlap(pred, reported_top(y_entries, TOP))
        print(f"RESULT predicted top-{TOP} vs the worker's reported top-{TOP}: its kind {ox:.3f}, the other kind {oy:.3f}")
        check(ox >= 0.75, f"prediction matches the experts the worker reported for its kind ({ox:.3f} >= 0.75)")
        check(ox > oy, f"and matches its own kind better than the other ({ox:.3f} > {oy:.3f})")

        # 3. Requests predicted from the table hit, and warm hints precede them.
        before = metrics(a)
        for n in (12, 13, 14):
            h.complete(a, kind_x(n, n, 2, "copy"), 8)
        m = metrics(a)
        predicted = m["moe_gateway_predicted_experts_total"] - before.get("moe_gateway_predicted_experts_total", 0)
        hits = m["moe_gateway_prediction_hits_total"] - before.get("moe_gateway_prediction_hits_total", 0)
        print(f"RESULT gateway A: {hits:.0f} of {predicted:.0f} predicted experts used")
        check(predicted >= 3 * 6 * TOP and hits / predicted >= 0.9, f"predictions hit ({hits:.0f}/{predicted:.0f})")
        check(m["moe_gateway_warm_hints_sent_total"] >= 3, "warm hints were sent before the prefills")
        check(m["moe_gateway_prediction_buckets"] >= 2, f"buckets known: {m['moe_gateway_prediction_buckets']:.0f}")
        steps = m.get("moe_gateway_steps_with_usage_total", 0)
        per_step = m.get("moe_gateway_step_experts_total", 0) / max(steps, 1)
        check(steps > 0 and 4 <= per_step <= 6 * 32, f"distinct experts per step on /metrics ({per_step:.1f} over {steps:.0f} steps)")

        # 4. A second gateway learns the first one's traffic through Redis.
        total = len(summaries(c))
        w2 = c.start_worker("w2")
        b = c.start_gateway([w2], name="gateway-b", extra=ON)
        learned_b = wait_metric(b, "moe_gateway_routing_summaries_learned_total", total)
        check(learned_b >= total, f"gateway B read the whole routing stream ({learned_b:.0f} of {total})")
        # Both tables hold the same summaries before they are compared.
        total = len(summaries(c))
        wait_metric(a, "moe_gateway_routing_summaries_learned_total", total)
        wait_metric(b, "moe_gateway_routing_summaries_learned_total", total)
        _, pred_a = post(a, "/debug/experts", {"prompt": SIMILAR_X})
        _, pred_b = post(b, "/debug/experts", {"prompt": SIMILAR_X})
        check(pred_b["layers"] == pred_a["layers"] and pred_b["source"] == pred_a["source"],
              "gateway B predicts what gateway A predicts, without having served anything")
        st, _, _ = h.complete(b, SIMILAR_X, 8)
        mb = metrics(b)
        check(st == 200 and mb["moe_gateway_prediction_requests_total"] == 1 and
              mb["moe_gateway_prediction_hits_total"] >= 0.9 * mb["moe_gateway_predicted_experts_total"] > 0,
              f"gateway B's first request was predicted from A's traffic "
              f"({mb['moe_gateway_prediction_hits_total']:.0f}/{mb['moe_gateway_predicted_experts_total']:.0f} hit)")
        # Live: A's next request reaches B's table too (and B's reaches A's).
        h.complete(a, kind_y("May", "harbour"), 8)
        now_b = wait_metric(b, "moe_gateway_routing_summaries_learned_total", total + 2)
        now_a = wait_metric(a, "moe_gateway_routing_summaries_learned_total", total + 2)
        check(now_b >= total + 2 and now_a >= total + 2,
              f"both gateways keep learning every worker's summaries ({now_a:.0f}, {now_b:.0f} of {total + 2})")
        check(c.procs["gateway-a"].poll() is None and c.procs["gateway-b"].poll() is None, "both gateways still run")

        # 5. One gateway driving both workers at once: concurrent streams are
        #    spread over them (each worker's summaries name it) and all finish.
        for n in ("gateway-a", "gateway-b"):
            c.procs[n].terminate()
            c.procs[n].wait(timeout=10)
        before = len(summaries(c))
        g = c.start_gateway([w1, w2], name="gateway-c", extra=ON)
        streams = [h.Stream(g, kind_x(20 + i, i, 3, "copy") if i % 2 else kind_y("July", f"item {i}"), 16).start()
                   for i in range(8)]
        for st_ in streams:
            st_.join(60)
        check(all(x.finish and not x.error for x in streams),
              f"8 concurrent streams over two workers finished ({[x.error for x in streams if x.error]})")
        end = time.time() + 10
        while time.time() < end and len(summaries(c)) < before + 8:
            time.sleep(0.05)
        names = c.redis("XRANGE", ROUTING, "-", "+").split("\n")
        served = [names[i + 1] for i, v in enumerate(names[:-1]) if v == "worker"][before:]
        print(f"RESULT gateway C spread 8 streams: w1 {served.count('w1')}, w2 {served.count('w2')}")
        check(served.count("w1") > 0 and served.count("w2") > 0, "both workers served gateway C's streams")
        text = http.client.HTTPConnection("127.0.0.1", g, timeout=10)
        text.request("GET", "/metrics")
        body = text.getresponse().read().decode()
        assigned = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^moe_gateway_worker_sequences_assigned_total\{worker="(\w+)",fallback="0"\} (\S+)$', body, re.M)}
        check(assigned.get("w1", 0) + assigned.get("w2", 0) == 8 and min(assigned.values()) > 0,
              f"/metrics counts the sequences given to each worker ({assigned})")
        # The workers' resident sets reach the gateway through Redis, read by
        # its own thread: wait for both rather than race that read.
        scored = []

        def both_scored():
            _, pc = post(g, "/debug/experts", {"prompt": SIMILAR_X})
            scored[:] = sorted(w["worker"] for w in pc["workers"])
            return scored == ["w1", "w2"]

        check(h.wait_for(both_scored, 10), f"/debug/experts scores both workers' resident sets ({scored})")

        # 6. --predict off: no endpoint, no prediction metrics, no bucket on the wire.
        c.procs["gateway-c"].terminate()
        c.procs["gateway-c"].wait(timeout=10)
        d = c.start_gateway([w1], name="gateway-d", extra=("--predict", "off"))
        st, _ = post(d, "/debug/experts", {"prompt": SIMILAR_X})
        check(st == 404, f"--predict off: /debug/experts is 404 ({st})")
        before = len(summaries(c))
        st, _, _ = h.complete(d, SIMILAR_X, 4)
        end = time.time() + 10
        while time.time() < end and len(summaries(c)) <= before:
            time.sleep(0.05)
        last = summaries(c)[-1]
        md = metrics(d)
        check(st == 200 and last[0] == 0 and not any(k.startswith("moe_gateway_predict") for k in md),
              f"--predict off: the request runs, its summary has no bucket ({last[0]}), no prediction metrics")
    finally:
        if failures:
            for n in ("gateway-a", "gateway-b", "gateway-c", "gateway-d", "w1", "w2"):
                print(f"--- {n} log ---\n" + c.log(n)[-3000:])
        c.close()
    print(f"RESULT wall {time.time() - t0:.1f} s")
    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
