"""deploy/supervise.sh itself (CPU backend, the demo model, its own ports and
state folder under a temp dir, BUILD_DIR the test's build folder): 8
concurrent greedy streams, kill -9 of the main worker mid-stream, and then
  - every stream completes: no error event, [DONE], its full token count
    (streamed logprobs = the usage's count = the undisturbed run's), and
    its text equals the undisturbed run's (continued on the fallback);
  - the streams were moved to the fallback (its assigned-sequences counter);
  - supervisord restarted the main worker (a new pid, RUNNING);
  - the restarted worker re-warmed from Redis (its log's `re-warmed N of M`,
    M > 0: the set it published before the kill);
  - a new request is served by the main worker again (no X-Moe-Degraded,
    the worker ready in /metrics).
Also: supervise.sh refuses a FALLBACK_MODEL with another tokenizer before
starting anything, and the gateway refuses a fallback worker whose model has
another vocabulary (tests/data/fixtures/qwen3_moe against the demo model).
Skipped (77) without supervisord or redis-server. Env (CTest): MOE_GATEWAY,
MOE_WORKER, MOE_MODEL, MOE_BUILD_DIR.
"""
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import supervised_stack as ss  # noqa: E402

SKIP = 77
STREAMS = 8
MAX_TOKENS = int(os.environ.get("MOE_SUPERVISE_MAX_TOKENS", "96"))
OTHER_TOKENIZER = os.path.join(ss.ROOT, "tests", "data", "fixtures", "qwen3_moe")

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def env():
    return {"BUILD_DIR": os.environ["MOE_BUILD_DIR"], "BACKEND": "cpu", "WORKER_ARGS": "--threads 1",
            "FALLBACK_MODEL": "", "API_KEY_FILE": "", "MOE_API_KEY": "", "REDIS_PASSWORD_FILE": ""}


def failover():
    model = os.environ["MOE_MODEL"]
    st = ss.Stack(model, env(), name="supervise-failover")
    t0 = time.monotonic()
    try:
        st.start()
        st.wait_ready(240)
        print(f"stack ready in {time.monotonic() - t0:.1f} s (http {st.port}, redis {st.redis_port})", flush=True)
        r = ss.failover_run(st, os.path.basename(model.rstrip("/")), ss.prompts(model, STREAMS), MAX_TOKENS)
        print("result:", r, flush=True)
        check(r["all_mid_stream_at_kill"], f"every stream was mid-stream at the kill ({r['tokens_at_kill']})")
        check(r["lost"] == 0, f"0 streams lost: each [DONE], no error, its full token count ({r['lost']} lost)")
        check(r["stream_tokens"] == r["twin_tokens"], "token counts equal the undisturbed run's")
        check(r["texts_equal_to_undisturbed"], f"texts equal the undisturbed run's ({r['texts_unequal']} differ)")
        check(r["fallback_sequences_assigned"] >= STREAMS,
              f"the streams moved to the fallback ({r['fallback_sequences_assigned']:.0f} sequences assigned there)")
        check(r["new_pid"] != r["old_pid"], f"supervisord restarted the worker (pid {r['old_pid']} -> {r['new_pid']})")
        check(r["rewarm_previous"] > 0 and r["rewarmed_experts"] == r["rewarm_previous"] and r["rewarm_redis_reachable"],
              f"the restarted worker re-warmed {r['rewarmed_experts']} of {r['rewarm_previous']} experts from Redis "
              f"in {r['rewarm_s'] * 1000:.1f} ms")
        check(r["probe_served_by_main"] and r["main_ready_after"],
              f"a new request is served by the main worker again ({r['probes']} probes, first token "
              f"{r.get('restart_to_first_token_s')} s after the kill)")
        print(f"RESULT supervise_failover: streams={STREAMS} lost={r['lost']} longest_gap_ms={r['longest_gap_ms']} "
              f"restart_to_first_token_s={r.get('restart_to_first_token_s')} rewarm_ms={r['rewarm_s'] * 1000:.1f} "
              f"rewarmed={r['rewarmed_experts']}", flush=True)
    except Exception as e:
        check(False, f"{type(e).__name__}: {e}")
    finally:
        if failures:
            for prog in ("gateway", "worker", "fallback", "supervisord"):
                print(f"---- {prog} log\n" + st.log(prog)[-3000:])
            print("---- supervise.sh\n" + st.output()[-2000:])
        left = st.close()
        check(not left, f"nothing left running after close ({left})")


def other_tokenizer():
    model = os.environ["MOE_MODEL"]
    # 1. supervise.sh refuses before starting anything.
    e = env()
    e["FALLBACK_MODEL"] = OTHER_TOKENIZER
    st = ss.Stack(model, e, name="supervise-tokenizer")
    try:
        st.start()
        rc = st.proc.wait(60)
        out = st.output()
        check(rc != 0 and "another tokenizer" in out and "tokenizer.json differ" in out,
              f"supervise.sh refuses a FALLBACK_MODEL of another tokenizer (rc {rc}): {out.strip()[-300:]}")
        check(not os.path.exists(os.path.join(st.state, "run", "supervisord.pid")), "nothing was started")
    finally:
        st.close()
    # 2. The gateway refuses such a fallback worker (when something else started it).
    c = ss.Stack(model, name="gateway-vocab")
    procs = []
    try:
        os.makedirs(c.state)
        main_sock, fb_sock = os.path.join(c.state, "main.sock"), os.path.join(c.state, "fb.sock")
        log = open(os.path.join(c.dir, "gateway.log"), "wb")
        for sock, m in ((main_sock, model), (fb_sock, OTHER_TOKENIZER)):
            procs.append(subprocess.Popen([os.environ["MOE_WORKER"], "--model", m, "--socket", sock, "--backend", "cpu",
                                           "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        procs.append(subprocess.Popen([os.environ["MOE_GATEWAY"], "--model", model, "--host", "127.0.0.1", "--port",
                                       str(c.port), "--worker", "unix:" + main_sock, "--fallback-worker",
                                       "unix:" + fb_sock], stdout=log, stderr=subprocess.STDOUT))
        gw_log = os.path.join(c.dir, "gateway.log")
        read = lambda: open(gw_log, errors="replace").read()  # noqa: E731
        c.wait(lambda: "fb.sock refused" in read(), 120, "the gateway to refuse the fallback")
        c.wait(lambda: c.health().get("status") == "ok", 120, "/health ok")
        text = read()
        line = next(l for l in text.splitlines() if "fb.sock refused" in l)
        print("gateway:", line)
        check("vocabulary of 1027 token ids" in line and "'demo-moe' one of 4099" in line and "tokenizer" in line,
              "the gateway names both vocabularies and the reason")
        check(c.worker_metric("moe_gateway_worker_ready", "fb") == 0 and c.worker_metric("moe_gateway_worker_ready", "main") == 1,
              "the refused fallback is never ready; the main worker is")
        time.sleep(2.5)  # it keeps retrying (the worker may be replaced) but says so once
        check(read().count("fb.sock refused") == 1, "the refusal is logged once")
    except Exception as ex:
        check(False, f"{type(ex).__name__}: {ex}")
    finally:
        for p in procs:
            p.kill()
            p.wait()
        c.close()


def main():
    missing = [p for p in ("supervisord", "redis-server") if not shutil.which(p)]
    if missing:
        print(f"SKIPPED: {' and '.join(missing)} not installed")
        return SKIP
    # supervise.sh would build what is missing: the test runs this build's programs or none.
    for var, rel in (("MOE_GATEWAY", "gateway/moe-gateway"), ("MOE_WORKER", "worker/moe-worker")):
        want = os.path.join(os.environ["MOE_BUILD_DIR"], rel)
        if not (os.path.exists(want) and os.path.exists(os.environ[var]) and os.path.samefile(os.environ[var], want)):
            print(f"FAILED: {var} {os.environ[var]} is not MOE_BUILD_DIR/{rel}")
            return 1
    t0 = time.monotonic()
    other_tokenizer()
    failover()
    print(f"{len(failures)} failures, {time.monotonic() - t0:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
