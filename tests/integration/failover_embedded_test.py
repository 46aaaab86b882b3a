"""The gateway alone with its own worker (the embedded default, no Redis):
kill -9 of that worker in the middle of 16 greedy streams, twice: the
gateway restarts it and resumes every stream on it; each stream's text
equals its undisturbed twin. Prints the longest gap and the requests lost.
"""
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import redis_harness as h  # noqa: E402

STREAMS = 16
ROUNDS = 2
MAX_TOKENS = 48


def child_worker(gateway_pid):
    out = subprocess.run(["pgrep", "-P", str(gateway_pid), "-f", "moe-worker"], capture_output=True, text=True).stdout
    pids = [int(p) for p in out.split()]
    return pids[0] if pids else None


def main():
    os.environ["MOE_WORKER_BIN"] = os.environ["MOE_WORKER"]
    c = h.Cluster("embedded")
    ok = False
    try:
        c.start_gateway([], redis=False)
        ps = h.prompts(STREAMS)
        twins = []
        for p in ps:
            status, _, body = h.complete(c.http_port, p, MAX_TOKENS)
            assert status == 200, body
            twins.append(body["choices"][0]["text"])
        lost, worst = 0, 0.0
        for rnd in range(ROUNDS):
            streams = [h.Stream(c.http_port, p, MAX_TOKENS).start() for p in ps]
            end = time.time() + 60
            while time.time() < end and min(s.events for s in streams) < 3:
                time.sleep(0.005)
            pid = child_worker(c.procs["gateway"].pid)
            assert pid, "no worker child found"
            os.kill(pid, signal.SIGKILL)
            for s in streams:
                if not s.join(180):
                    s.error = "did not finish in 180 s"
            gap = max(s.max_gap_s() for s in streams)
            worst = max(worst, gap)
            for i, s in enumerate(streams):
                if s.error or s.finish not in ("stop", "length") or s.text != twins[i]:
                    lost += 1
                    print(f"round {rnd} stream {i}: error={s.error} finish={s.finish}\n  got  {s.text!r}\n  want {twins[i]!r}")
            new_pid = child_worker(c.procs["gateway"].pid)
            print(f"round {rnd}: worker {pid} killed, restarted as {new_pid}; longest gap {gap * 1000:.0f} ms")
        print(f"RESULT embedded failover: rounds={ROUNDS} streams={STREAMS} requests_lost={lost} "
              f"longest_gap_ms={worst * 1000:.0f}")
        ok = lost == 0
    except Exception as e:
        print(f"FAILED: {type(e).__name__}: {e}")
    finally:
        if not ok:
            print("---- gateway log\n" + c.log("gateway")[-4000:])
        c.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
