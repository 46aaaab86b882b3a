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
Also: WORKERS=2 runs two main workers, each its own program, socket and
name, streams spread over both, kill -9 of one lost no stream (several_workers);
supervise.sh refuses a FALLBACK_MODEL with another tokenizer before
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


def refused(model, e, name):
    """supervise.sh run with env `e` until it exits: (exit code, its output,
    whether supervisord had started)."""
    st = ss.Stack(model, e, name=name)
    try:
        st.start()
        rc = st.proc.wait(60)
        return rc, st.output(), os.path.exists(os.path.join(st.state, "run", "supervisord.pid"))
    finally:
        st.close()


def several_workers():
    """WORKERS=2 (CPU workers, as a host of two GPUs gets one a GPU): each
    its own program, socket, log and name in Redis and /metrics, the gateway
    driving both; streams spread over both and all complete; kill -9 of the
    second costs no stream and supervisord restarts it. Also: WORKERS out of
    range, more CUDA workers than visible GPUs, and --device on the CPU
    backend are refused."""
    model = os.environ["MOE_MODEL"]
    e = env()
    e["WORKERS"] = "2"
    st = ss.Stack(model, e, name="supervise-workers")
    try:
        st.start()
        st.wait_ready(240)
        st.wait(lambda: st.worker_metric("moe_gateway_worker_ready", "worker-1") == 1, 120, "worker-1 ready")
        run = os.path.join(st.state, "run")
        check(os.path.exists(os.path.join(run, "worker.sock")) and os.path.exists(os.path.join(run, "worker-1.sock")),
              "each main worker has its own socket")
        pid0, pid1 = st.info("worker")["pid"], st.info("worker-1")["pid"]
        check(pid0 != pid1 and pid0 > 0 and pid1 > 0, f"two worker programs under supervisord ({pid0}, {pid1})")
        name = os.path.basename(model.rstrip("/"))
        streams = [ss.Stream(st.port, name, p, 24).start() for p in ss.prompts(model, STREAMS)]
        for x in streams:
            x.join(300)
        check(all(x.complete_ok() for x in streams),
              f"{STREAMS} concurrent streams over two workers completed ({[x.error for x in streams if x.error]})")
        text = st.metrics()
        a0 = st.worker_metric("moe_gateway_worker_sequences_assigned_total", "worker", text) or 0
        a1 = st.worker_metric("moe_gateway_worker_sequences_assigned_total", "worker-1", text) or 0
        check(a0 > 0 and a1 > 0 and a0 + a1 >= STREAMS, f"both workers served them ({a0:.0f} and {a1:.0f})")
        check("worker-1.sock" in st.log("worker-1"), "worker-1 logs to worker-1.log")
        # kill -9 of the second worker mid-stream: its streams move on, supervisord restarts it.
        streams = [ss.Stream(st.port, name, p, 48).start() for p in ss.prompts(model, STREAMS)]
        st.wait(lambda: sum(1 for x in streams if x.tokens >= 4) == STREAMS, 120, "every stream under way")
        os.kill(pid1, 9)
        for x in streams:
            x.join(300)
        check(all(x.complete_ok() for x in streams),
              f"kill -9 of worker-1 lost no stream ({[x.error for x in streams if x.error]})")
        st.wait(lambda: st.info("worker-1")["pid"] not in (0, pid1) and st.info("worker-1")["statename"] == "RUNNING",
                120, "worker-1 restarted")
        st.wait(lambda: st.worker_metric("moe_gateway_worker_ready", "worker-1") == 1, 120, "worker-1 ready again")
        check(True, f"supervisord restarted worker-1 (pid {pid1} -> {st.info('worker-1')['pid']}), ready again")
    except Exception as ex:
        check(False, f"{type(ex).__name__}: {ex}")
    finally:
        if failures:
            for prog in ("gateway", "worker", "worker-1", "supervisord"):
                print(f"---- {prog} log\n" + st.log(prog)[-2000:])
            print("---- supervise.sh\n" + st.output()[-2000:])
        left = st.close()
        check(not left, f"nothing left running after close ({left})")
    for bad in ("0", "17", "two"):
        rc, out, _ = refused(model, dict(env(), WORKERS=bad), "supervise-workers-bad")
        check(rc != 0 and "WORKERS must be a number from 1 to 16" in out, f"WORKERS={bad} is refused (rc {rc})")
    rc, out, _ = refused(model, dict(env(), BACKEND="cuda", WORKERS="3", CUDA_VISIBLE_DEVICES="0"),
                         "supervise-workers-gpus")
    check(rc != 0 and "WORKERS=3 CUDA workers, but 1 GPU(s) are visible" in out,
          f"more CUDA workers than visible GPUs are refused (rc {rc})")
    r = subprocess.run([os.environ["MOE_WORKER"], "--model", model, "--socket", "/nonexistent/x.sock", "--backend",
                        "cpu", "--device", "1"], capture_output=True, text=True, timeout=60)
    check(r.returncode == 2 and "--device 1 chooses a CUDA device" in r.stderr,
          f"--device with the CPU backend is refused (rc {r.returncode}: {r.stderr.strip()[-200:]})")


def other_tokenizer():
    model = os.environ["MOE_MODEL"]
    # 1. supervise.sh refuses before starting anything.
    rc, out, started = refused(model, dict(env(), FALLBACK_MODEL=OTHER_TOKENIZER), "supervise-tokenizer")
    check(rc != 0 and "another tokenizer" in out and "tokenizer.json differ" in out,
          f"supervise.sh refuses a FALLBACK_MODEL of another tokenizer (rc {rc}): {out.strip()[-300:]}")
    check(not started, "nothing was started")
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
    several_workers()
    failover()
    print(f"{len(failures)} failures, {time.monotonic() - t0:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
