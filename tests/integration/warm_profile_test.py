"""Warm profiles with real processes (the CPU worker's island bookkeeping:
a quarter of the experts, as a small GPU would hold; docs/memory-islands.md):
  1. --save-profile keeps the worker's expert use: every layer's counts add
     up to top_k x the tokens counted, written every interval and at exit;
  2. a worker started with --warm-profile holds the profile's most used
     experts before its first request, and that request misses fewer
     experts than on a worker started cold;
  3. the same file as --warm-profile and --save-profile is added to;
  4. `moe profile` makes profiles from a text, from the demo's recorded
     routing and from the routing summaries in Redis that the worker takes;
  5. a missing file, another model's profile or a broken one stops the
     worker with a message naming the file.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import redis_harness as h  # noqa: E402

MOE = os.environ["MOE_CLI"]
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def wait_log(c, name, pattern, timeout=30):
    end = time.time() + timeout
    while time.time() < end:
        m = re.search(pattern, c.log(name))
        if m:
            return m
        time.sleep(0.05)
    return None


def stop(c, name):
    p = c.procs[name]
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=30)
    return c.log(name)


def experts_line(log):
    m = re.search(r"experts: (\d+) hits, (\d+) misses", log)
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


def serve(c, prompts, max_tokens=16):
    errors = []
    for p in prompts:
        status, _, body = h.complete(c.http_port, p, max_tokens)
        if status != 200:
            errors.append(f"{status} {body[:200]}")
    return errors


def layer_sums_ok(prof):
    k = prof["top_k"]
    sums = [sum(l["counts"]) for l in prof["layers"]]
    return prof["tokens"] > 0 and all(s == k * prof["tokens"] for s in sums), sums


def run_worker_expect_exit(args):
    r = subprocess.run([os.environ["MOE_WORKER"], "--model", os.environ["MOE_MODEL"], "--socket",
                        "/tmp/warm-profile-refused.sock", "--backend", "cpu", "--threads", "1", *args],
                       capture_output=True, text=True, timeout=120)
    return r.returncode, r.stderr


def main():
    c = h.Cluster("warm-profile")
    prof_path = os.path.join(c.dir, "routing.profile.json")
    ps = h.prompts(40)
    warmup, probe = ps[:24], ps[30:31]
    try:
        # ---- 1. the worker keeps its own expert use
        sock = c.start_worker("w1", redis=False, extra=["--save-profile", prof_path, "--save-profile-every-s", "1"])
        c.start_gateway([sock], redis=False, extra=["--predict", "off"])
        errs = serve(c, warmup)
        check(not errs, f"{len(warmup)} requests on the saving worker ({errs[:1]})")
        time.sleep(1.2)
        serve(c, ps[24:25])  # a step after the interval writes the file
        check(os.path.exists(prof_path), "the profile is written while the worker serves")
        periodic = json.load(open(prof_path)) if os.path.exists(prof_path) else {"tokens": 0, "layers": []}
        log = stop(c, "w1")
        check(re.search(r"routing profile saved to .*routing\.profile\.json \((\d+) tokens this run\)", log) is not None,
              "the worker saves the profile when it stops")
        prof = json.load(open(prof_path))
        ok, sums = layer_sums_ok(prof)
        check(prof["format"] == "moe-routing-profile" and prof["model"] == "demo-moe" and len(prof["layers"]) == 6
              and all(len(l["counts"]) == 32 for l in prof["layers"]), "the profile names the model and its shape")
        check(ok, f"each layer's counts sum to top_k x {prof['tokens']} tokens ({sums})")
        check(prof["tokens"] >= periodic["tokens"] > 0,
              f"the final write holds at least the periodic one ({prof['tokens']} >= {periodic['tokens']})")
        c.procs["gateway"].terminate()
        c.procs["gateway"].wait(timeout=30)

        # ---- 2. warmed vs cold: the first request after a start
        def first_request(name, extra):
            sock = c.start_worker(name, redis=False, extra=extra)
            c.start_gateway([sock], redis=False, extra=["--predict", "off"], name="gw-" + name)
            errs = serve(c, probe)
            log = stop(c, name)
            c.procs["gw-" + name].terminate()
            c.procs["gw-" + name].wait(timeout=30)
            return errs, log

        errs, cold_log = first_request("cold", [])
        check(not errs, "the probe on a cold worker")
        errs, warm_log = first_request("warm", ["--warm-profile", prof_path])
        check(not errs, "the probe on a warmed worker")
        m = re.search(r"warmed (\d+) of (\d+) experts from profile .* \((\d+) islands, 0 of its experts resident "
                      r"before; together they served ([\d.]+) %", warm_log)
        check(m is not None and int(m.group(1)) == int(m.group(2)) == int(m.group(3)) == 48,
              "the warmed worker filled all 48 islands from the profile before its first request"
              + (f" ({m.group(0)})" if m else ""))
        cold_hits, cold_misses = experts_line(cold_log)
        warm_hits, warm_misses = experts_line(warm_log)
        print(f"     first request: cold {cold_hits} hits / {cold_misses} misses, warmed {warm_hits} / {warm_misses}")
        check(cold_misses is not None and warm_misses is not None and warm_misses < cold_misses
              and warm_hits > cold_hits, "the warmed worker's first request misses fewer experts than the cold one's")

        # ---- 3. the same file both ways is added to
        before = json.load(open(prof_path))["tokens"]
        sock = c.start_worker("w3", redis=False, extra=["--warm-profile", prof_path, "--save-profile", prof_path])
        c.start_gateway([sock], redis=False, extra=["--predict", "off"], name="gw3")
        check(wait_log(c, "w3", r"adding this worker's expert use to the profile") is not None,
              "a worker saving to the profile it warmed from says it adds to it")
        serve(c, ps[25:28])
        stop(c, "w3")
        c.procs["gw3"].terminate()
        c.procs["gw3"].wait(timeout=30)
        after = json.load(open(prof_path))
        ok, sums = layer_sums_ok(after)
        check(after["tokens"] > before and ok, f"the profile grew from {before} to {after['tokens']} tokens, sums whole")

        # ---- 4. moe profile: text, trace, Redis
        text = os.path.join(c.dir, "sample.txt")
        with open(text, "w") as f:
            f.write("".join(ps[:8]))
        out_text = os.path.join(c.dir, "text.profile.json")
        r = subprocess.run([MOE, "profile", "--model", os.environ["MOE_MODEL"], "--text", text, "--out", out_text,
                            "--threads", "1"], capture_output=True, text=True, timeout=300)
        check(r.returncode == 0 and layer_sums_ok(json.load(open(out_text)))[0],
              f"moe profile --text routes a sample through the model ({r.stdout.strip() or r.stderr[-300:]})")
        out_trace = os.path.join(c.dir, "trace.profile.json")
        r = subprocess.run([MOE, "profile", "--model", os.environ["MOE_MODEL"], "--out", out_trace, "--trace",
                            os.path.join(os.environ["MOE_MODEL"], "reference.safetensors")],
                           capture_output=True, text=True, timeout=120)
        tp = json.load(open(out_trace)) if r.returncode == 0 else {}
        check(r.returncode == 0 and tp.get("tokens") == 8192 and layer_sums_ok(tp)[0],
              f"moe profile --trace counts the demo's recorded routing, 8,192 tokens ({r.stdout.strip() or r.stderr[-300:]})")
        r = subprocess.run([MOE, "profile", "--show", out_trace, "--islands", "48"], capture_output=True, text=True)
        check(r.returncode == 0 and "48 islands (25.0 % of the experts)" in r.stdout and "layer   5:" in r.stdout,
              "moe profile --show summarises it")

        if shutil.which("redis-server"):
            c.start_redis()
            sock = c.start_worker("wr", redis=True)
            c.start_gateway([sock], redis=True, extra=["--predict", "off"], name="gwr")
            serve(c, ps[:6])
            time.sleep(1.0)  # the publisher drains its queue
            out_redis = os.path.join(c.dir, "redis.profile.json")
            r = subprocess.run([MOE, "profile", "--model", os.environ["MOE_MODEL"], "--out", out_redis, "--redis",
                                c.redis_url()], capture_output=True, text=True, timeout=60)
            rp = json.load(open(out_redis)) if r.returncode == 0 else {}
            check(r.returncode == 0 and layer_sums_ok(rp)[0] and "6 routing summaries read" in r.stderr,
                  f"moe profile --redis sums the 6 requests' routing summaries ({r.stderr.strip()[-300:]})")
            stop(c, "wr")
            c.procs["gwr"].terminate()
            c.procs["gwr"].wait(timeout=30)
            r = subprocess.run([MOE, "profile", "--model", os.environ["MOE_MODEL"], "--out", out_redis, "--redis",
                                c.redis_url(), "--model-id", "no-such-model"], capture_output=True, text=True, timeout=60)
            check(r.returncode == 1 and "no routing summaries of model 'no-such-model'" in r.stderr,
                  "moe profile --redis with nothing published says so")
        else:
            print("skip the Redis part: no redis-server")

        # ---- 5. refusals
        rc, err = run_worker_expect_exit(["--warm-profile", os.path.join(c.dir, "absent.json")])
        check(rc == 2 and "cannot open routing profile" in err and "absent.json" in err,
              f"a missing profile stops the worker, naming it (rc {rc})")
        other = dict(json.load(open(prof_path)))
        other["layers"] = other["layers"][:4]
        other_path = os.path.join(c.dir, "other.json")
        json.dump(other, open(other_path, "w"))
        rc, err = run_worker_expect_exit(["--warm-profile", other_path])
        check(rc == 2 and "not of this model's shape" in err and "4 MoE layers, the model 6" in err,
              f"another model's profile is refused ({err.strip()[-160:]})")
        broken_path = os.path.join(c.dir, "broken.json")
        with open(broken_path, "w") as f:
            f.write(open(prof_path).read()[:100])
        rc, err = run_worker_expect_exit(["--warm-profile", broken_path])
        check(rc == 2 and "broken.json" in err and "not JSON" in err, "a cut-off profile is refused")
        # A supervised worker's own profile (the same file both ways) that
        # is broken does not stop it: it starts cold and writes a good one.
        with open(broken_path, "w") as f:
            f.write("{not a profile")
        sock = c.start_worker("w6", redis=False, extra=["--warm-profile", broken_path, "--save-profile", broken_path])
        c.start_gateway([sock], redis=False, extra=["--predict", "off"], name="gw6")
        serve(c, ps[:2])
        log = stop(c, "w6")
        c.procs["gw6"].terminate()
        c.procs["gw6"].wait(timeout=30)
        check("starting cold (--save-profile replaces it)" in log and layer_sums_ok(json.load(open(broken_path)))[0],
              "its own broken profile: the worker starts cold and replaces it with a good one")
        neg = json.load(open(prof_path))
        neg["layers"][0]["counts"][3] = -1
        json.dump(neg, open(broken_path, "w"))
        rc, err = run_worker_expect_exit(["--warm-profile", broken_path])
        check(rc == 2 and "layers[0].counts[3] is not a non-negative integer" in err, "a negative count is refused")
    finally:
        c.close(keep=bool(failures))
    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
