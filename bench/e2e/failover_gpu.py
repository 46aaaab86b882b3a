"""The failover measurement of bench/e2e/failover_gpu.sh: deploy/supervise.sh
(the programs, supervisord and redis-server given by the environment that
script sets), 8 concurrent greedy streams (MAX_TOKENS each), kill -9 of the
main worker (BACKEND, cuda by default) mid-stream, and one JSON object:

  date, commit, backend, model, streams, max_tokens
  lost                       streams not ending in [DONE] with their full
                             token count, or with an error event
  longest_gap_ms             the longest pause between two token events of
                             any stream (the kill, the move to the fallback
                             and back included)
  restart_to_first_token_s   from the kill -9 to the first token of a new
                             request (one at a time, 4 tokens, started once
                             supervisord shows the new pid) served by the
                             restarted main worker: the first probe without
                             X-Moe-Degraded; its model load included
  process_start_to_first_token_s  the same from the restarted process's
                             start (/proc/PID/stat, 10 ms resolution)
  rewarm_s, rewarmed_experts the restarted worker's own log line
                             `re-warmed N of M experts from Redis in X ms`
                             (rewarm_previous is M)
  texts_equal_to_undisturbed every stream's text equals the same prompt's
                             undisturbed run (one at a time, before the kill)
  tokens_at_kill, all_mid_stream_at_kill, new_pid, probes, ...

Usage: python3 bench/e2e/failover_gpu.py MODEL OUT.json   (the env: see the .sh)
"""
import datetime
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
import supervised_stack as ss  # noqa: E402


def commit():
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main():
    model, out = sys.argv[1], sys.argv[2]
    streams = int(os.environ.get("STREAMS", "8"))
    max_tokens = int(os.environ.get("MAX_TOKENS", "128"))
    timeout = float(os.environ.get("FAILOVER_TIMEOUT_S", "900"))
    st = ss.Stack(model, name="failover-gpu", keep=bool(os.environ.get("KEEP")))
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
              "backend": os.environ.get("BACKEND", ""), "model": model, "worker_args": os.environ.get("WORKER_ARGS", "")}
    rc = 1
    try:
        t0 = time.monotonic()
        st.start()
        st.wait_ready(timeout)
        result["stack_ready_s"] = round(time.monotonic() - t0, 1)
        _, body = st.get("/v1/models")
        name = json.loads(body)["data"][0]["id"]
        print(f"failover: stack ready in {result['stack_ready_s']} s, model '{name}'", file=sys.stderr, flush=True)
        r = ss.failover_run(st, name, ss.prompts(model, streams), max_tokens, timeout=timeout,
                            log=lambda m: print("failover: " + m, file=sys.stderr, flush=True))
        result.update(r)
        rc = 0 if r["lost"] == 0 and r["texts_equal_to_undisturbed"] and r["probe_served_by_main"] else 1
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        print(f"failover: {result['error']}", file=sys.stderr)
    finally:
        if rc != 0:
            for prog in ("worker", "fallback", "gateway"):
                print(f"---- {prog} log (tail)\n" + st.log(prog)[-3000:], file=sys.stderr)
            print("---- supervise.sh\n" + st.output()[-2000:], file=sys.stderr)
        if os.environ.get("LOG_DIR"):
            os.makedirs(os.environ["LOG_DIR"], exist_ok=True)
            for prog in ("worker", "fallback", "gateway", "redis", "supervisord"):
                with open(os.path.join(os.environ["LOG_DIR"], prog + ".log"), "w") as f:
                    f.write(st.log(prog))
        left = st.close()
        if left:
            result["left_running"] = left
    keys = ["date", "commit", "streams", "lost", "longest_gap_ms", "restart_to_first_token_s", "rewarm_s",
            "rewarmed_experts", "texts_equal_to_undisturbed"]
    ordered = {k: result.get(k) for k in keys}
    ordered.update({k: v for k, v in result.items() if k not in ordered})
    with open(out, "w") as f:
        json.dump(ordered, f, indent=1)
        f.write("\n")
    print(json.dumps({k: ordered[k] for k in keys}))
    return rc


if __name__ == "__main__":
    sys.exit(main())
