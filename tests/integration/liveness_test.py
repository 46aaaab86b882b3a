"""A worker that stops answering, with real processes (a main worker, a CPU
fallback, the gateway, Redis):
  1. frozen (SIGSTOP) mid-stream: the gateway declares it dead within 3 s,
     every stream completes on the fallback with its undisturbed text, and the
     main worker takes over again once it runs (SIGCONT);
  2. stuck in a step that never returns (MOE_WORKER_FAULT=hang-step): the
     same failover, and the worker ends itself (exit 3) after --stall-exit-s;
  3. in a long step that makes progress (MOE_WORKER_FAULT=slow-step, 4 s):
     never declared dead, the request is answered by it;
  4. a local process connecting to a worker the gateway holds is refused
     (an error frame, then close) and the gateway is not disturbed.
Prints RESULT lines with the measured gaps.
"""
import os
import re
import signal
import socket
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import redis_harness as h  # noqa: E402

STREAMS = 8
MAX_TOKENS = 40
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def count(c, name, pattern):
    return len(re.findall(pattern, c.log(name)))


def run_streams(c, ps, twins, disturb):
    """Starts the streams, waits until each produced 3 events, calls
    disturb(), then returns (lost, longest gap in s, seconds from the
    disturbance to the first event after it, worst stream)."""
    streams = [h.Stream(c.http_port, p, MAX_TOKENS).start() for p in ps]
    end = time.time() + 60
    while time.time() < end and min(s.events for s in streams) < 3:
        time.sleep(0.005)
    t0 = time.monotonic()
    disturb()
    lost = 0
    for i, s in enumerate(streams):
        if not s.join(120):
            s.error = "did not finish in 120 s"
        if s.error or s.finish not in ("stop", "length") or s.text != twins[i]:
            lost += 1
            print(f"stream {i}: error={s.error} finish={s.finish} text equal={s.text == twins[i]}")
    resume = max((next((t for t in s.times if t > t0), t0) - t0) for s in streams)
    return lost, max(s.max_gap_s() for s in streams), resume


def main():
    h.need_redis()
    c = h.Cluster("liveness")
    try:
        c.start_redis()
        main_sock = c.start_worker("main")
        fb_sock = c.start_worker("fallback")
        c.start_gateway([main_sock], fallback=fb_sock)
        ps = h.prompts(STREAMS)
        twins = []
        for p in ps:
            status, _, body = h.complete(c.http_port, p, MAX_TOKENS)
            assert status == 200, body
            twins.append(body["choices"][0]["text"])

        # ---- 1. frozen
        downs = count(c, "gateway", r"worker \S+main.sock down")
        lost, gap, resume = run_streams(c, ps, twins, lambda: c.procs["main"].send_signal(signal.SIGSTOP))
        print(f"RESULT frozen worker: lost {lost}, streams resumed {resume:.2f} s after SIGSTOP, longest gap {gap:.2f} s")
        check(lost == 0, "frozen worker: every stream completed with its undisturbed text")
        check(resume < 4.5, f"frozen worker: streams resumed within 4.5 s ({resume:.2f} s: 2.5 s of silence, then "
                            "the fallback's prefill)")
        check(re.search(r"main.sock down: no answer within 2500 ms", c.log("gateway")) is not None,
              "frozen worker: the gateway says it stopped answering")
        status, hdr, _ = h.complete(c.http_port, ps[0], 4)
        check(status == 200 and hdr.get("x-moe-degraded") == "1", "frozen worker: the fallback serves meanwhile")
        c.procs["main"].send_signal(signal.SIGCONT)
        back = h.wait_for(lambda: h.complete(c.http_port, ps[0], 2)[1].get("x-moe-degraded") != "1", 20)
        check(back, "frozen worker: after SIGCONT the main worker serves again")
        check(count(c, "gateway", r"worker \S+main.sock down") == downs + 1, "frozen worker: declared down once")

        # ---- 2. stuck in a step that never returns
        c.kill9("main")
        main_sock = c.start_worker("main", extra=["--stall-exit-s", "5"], env={"MOE_WORKER_FAULT": "hang-step=30"})
        check(h.wait_for(lambda: h.complete(c.http_port, ps[0], 2)[1].get("x-moe-degraded") != "1", 30),
              "hung worker: the main worker is back before the test")
        t_hang = [None]

        def hang_soon():
            t_hang[0] = time.monotonic()

        lost, gap, _ = run_streams(c, ps, twins, hang_soon)
        hung = re.search(r"injected fault: step \d+ never returns", c.log("main")) is not None
        check(hung, "hung worker: the injected step hung")
        print(f"RESULT hung worker: lost {lost}, longest gap {gap:.2f} s")
        check(lost == 0, "hung worker: every stream completed with its undisturbed text")
        check(gap < 4.5, f"hung worker: the longest gap in any stream stays under 4.5 s ({gap:.2f} s)")
        exited = h.wait_for(lambda: c.procs["main"].poll() is not None, 15)
        check(exited and c.procs["main"].returncode == 3,
              f"hung worker: it ended itself with exit 3 after --stall-exit-s (code {c.procs['main'].returncode})")
        check("made no progress for 5 s" in c.log("main"), "hung worker: its log says why")

        # ---- 3. a long step that advances is not a dead worker
        downs = count(c, "gateway", r"worker \S+main.sock down")
        # Every step from the second on runs 4 s longer, making progress.
        main_sock = c.start_worker("main", env={"MOE_WORKER_FAULT": "slow-step=2:4000"})
        check(h.wait_for(lambda: h.complete(c.http_port, ps[0], 1)[1].get("x-moe-degraded") != "1", 30),
              "slow step: the main worker serves")
        t0 = time.monotonic()
        status, hdr, body = h.complete(c.http_port, ps[1], 1)
        took = time.monotonic() - t0
        print(f"RESULT slow step: a 4 s step answered in {took:.1f} s by the main worker")
        check(status == 200 and took >= 3.5, f"slow step: the 4 s step happened ({took:.1f} s)")
        check(hdr.get("x-moe-degraded") != "1" and count(c, "gateway", r"worker \S+main.sock down") == downs,
              "slow step: never declared dead, no failover")

        # ---- 4. a local intruder on the worker's socket
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(main_sock)
        data = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        s.close()
        ok = len(data) >= 13 and data[4] == 0xFF and struct.unpack("<Q", data[5:13])[0] == 0
        check(ok, "intruder: refused with an error frame, then the connection closed")
        check("a gateway is connected to this worker" in c.log("main"), "intruder: the worker's log says why")
        status, hdr, _ = h.complete(c.http_port, ps[2], 1)
        check(status == 200 and hdr.get("x-moe-degraded") != "1", "intruder: the gateway's connection is untouched")
    except Exception as e:
        failures.append(f"{type(e).__name__}: {e}")
        print(f"FAILED: {type(e).__name__}: {e}")
    finally:
        if failures:
            print("---- gateway log\n" + c.log("gateway")[-4000:])
            print("---- main worker log\n" + c.log("main")[-3000:])
        c.close()
    print(f"{'FAILED' if failures else 'PASSED'}: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
