"""kill -9 of the main worker in the middle of 16 concurrent greedy streams,
five times: every request completes, each stream's text equals its
undisturbed twin (no token lost or repeated), the fallback worker served
meanwhile (X-Moe-Degraded on requests that started there), and the main
worker takes over again once it is back. Prints the longest gap between two
events of any stream, and the requests lost (must be 0).
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import redis_harness as h  # noqa: E402

STREAMS = 16
ROUNDS = int(os.environ.get("MOE_FAILOVER_ROUNDS", "5"))
MAX_TOKENS = 48


def main():
    h.need_redis()
    c = h.Cluster("failover")
    ok = False
    try:
        c.start_redis()
        main_sock = c.start_worker("main")
        fb_sock = c.start_worker("fallback")
        c.start_gateway([main_sock], fallback=fb_sock)
        ps = h.prompts(STREAMS)

        # Undisturbed twins, one at a time so no batching effect can differ.
        twins = []
        for p in ps:
            status, _, body = h.complete(c.http_port, p, MAX_TOKENS)
            assert status == 200, body
            twins.append(body["choices"][0]["text"])

        lost = 0
        worst_gap = 0.0
        gaps = []
        for rnd in range(ROUNDS):
            streams = [h.Stream(c.http_port, p, MAX_TOKENS).start() for p in ps]
            # Kill once every stream has produced something: mid-stream for all.
            end = time.time() + 60
            while time.time() < end and min(s.events for s in streams) < 3:
                time.sleep(0.005)
            t_kill = time.monotonic()
            c.kill9("main")
            # The operator's supervisor restarts it (supervisord does in deploy/).
            time.sleep(0.3)
            c.start_worker("main")
            for s in streams:
                if not s.join(180):
                    s.error = "did not finish in 180 s"
            round_gap = 0.0
            for i, s in enumerate(streams):
                bad = s.error or s.finish not in ("stop", "length") or s.text != twins[i]
                if bad:
                    lost += 1
                    print(f"round {rnd} stream {i}: error={s.error} finish={s.finish}\n"
                          f"  got  {s.text!r}\n  want {twins[i]!r}")
                # Gap across the kill: the longest pause of this stream.
                round_gap = max(round_gap, s.max_gap_s())
            gaps.append(round_gap)
            worst_gap = max(worst_gap, round_gap)
            print(f"round {rnd}: {STREAMS} streams, longest gap {round_gap * 1000:.0f} ms "
                  f"(kill at +{(t_kill - min(s.times[0] for s in streams if s.times)) * 1000:.0f} ms)")
            # The main worker is back: new requests go to it (not degraded).
            deadline = time.time() + 30
            while time.time() < deadline:
                status, hdr, body = h.complete(c.http_port, ps[0], 4)
                if status == 200 and "x-moe-degraded" not in hdr:
                    break
                time.sleep(0.2)
            else:
                print("the main worker never took over again")
                lost += 1

        # Served degraded while the main worker is gone: the header says so.
        c.kill9("main")
        time.sleep(0.5)
        status, hdr, body = h.complete(c.http_port, ps[1], 8)
        degraded_header = hdr.get("x-moe-degraded")
        print(f"request while the main worker is down: HTTP {status}, X-Moe-Degraded={degraded_header}")
        if status != 200 or degraded_header != "1" or body["choices"][0]["text"] != twins[1][: len(body["choices"][0]["text"])]:
            print("degraded request not served or not marked")
            lost += 1

        print(f"RESULT failover: rounds={ROUNDS} streams={STREAMS} requests_lost={lost} "
              f"longest_gap_ms={worst_gap * 1000:.0f} per_round_ms={[round(g * 1000) for g in gaps]}")
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
