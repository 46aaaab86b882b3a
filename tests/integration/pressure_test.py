"""KV pressure between real processes: a CPU worker with a small KV pool
(24 blocks) behind the gateway, 12 concurrent greedy streams that need more
than it holds. The worker says `warn`/`evict` as its pool fills (the gateway
counts them on /metrics and holds new sequences back), and every stream
still ends with the text it has when it runs alone.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import redis_harness as h  # noqa: E402

STREAMS = 12
MAX_TOKENS = 48


def main():
    c = h.Cluster("pressure")
    ok = False
    try:
        sock = c.start_worker("worker", redis=False, extra=["--kv-blocks", "24"])
        port = c.start_gateway([sock], redis=False)
        ps = h.prompts(STREAMS)
        twins = h.twins_of(port, ps, MAX_TOKENS)
        streams = [h.Stream(port, p, MAX_TOKENS).start() for p in ps]
        lost = h.lost_streams(streams, twins)
        m = h.metrics(port)
        warn = m.get('moe_gateway_worker_pressure_total{level="warn"}', 0)
        evict = m.get('moe_gateway_worker_pressure_total{level="evict"}', 0)
        said = [l for l in c.log("gateway").splitlines() if "says warn" in l or "says evict" in l]
        print(f"RESULT pressure: streams={STREAMS} lost={lost} warn={warn:.0f} evict={evict:.0f} "
              f"preemptions={m.get('moe_gateway_preemptions_total', 0):.0f}")
        for l in said[:4]:
            print("  " + l)
        assert lost == 0, f"{lost} streams lost or changed"
        assert warn + evict >= 1, "the worker never said pressure"
        assert said, "the gateway did not log the pressure"
        ok = True
    finally:
        if not ok:
            for name in c.procs:
                print(f"---- {name} log ----\n{c.log(name)[-3000:]}")
        c.close(keep=not ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
