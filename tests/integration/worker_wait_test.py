"""A gateway given its worker with --worker (started elsewhere, as by
supervisord) and no fallback, and --worker-wait-s 2: after kill -9 of the
worker in the middle of a stream and of a plain request, with nothing to
restart it, both end with the reason once no worker has been ready for 2 s
(the stream with an error event and [DONE], the plain request with 500),
instead of waiting for ever; /health then says "failing" with that reason
and a new request is refused with 503 engine_failing. Once the worker is
started again, the gateway serves as before. A second gateway on a socket
where nothing ever listens says "failing" too once the bound has passed.
"""
import json
import os
import sys
import threading
import time
import http.client

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import redis_harness as h  # noqa: E402

WAIT_S = 2


def health(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    c.request("GET", "/health")
    r = c.getresponse()
    return r.status, json.loads(r.read() or b"{}")


def in_flight(port):
    m = h.metrics(port)
    return m.get("moe_gateway_sequences_running", 0) + m.get("moe_gateway_sequences_waiting", 0)


def main():
    c = h.Cluster("worker-wait")
    ok = False
    try:
        sock = c.start_worker("worker", redis=False)
        port = c.start_gateway([sock], redis=False, extra=["--worker-wait-s", str(WAIT_S)])

        # A stream and a plain request in flight when the worker is killed.
        prompt = h.prompts(1)[0]
        stream = h.Stream(port, prompt, 4000).start()
        plain = {}

        def run_plain():
            plain["reply"] = h.complete(port, prompt, 4000)

        t = threading.Thread(target=run_plain, daemon=True)
        t.start()
        assert h.wait_for(lambda: stream.events >= 3 and in_flight(port) >= 2, 60), \
            f"the stream and the plain request did not both start: {stream.error}"
        killed = time.time()
        c.kill9("worker")  # and nothing starts it again

        assert stream.join(30), "the stream still waits 30 s after its worker was killed"
        t.join(30)
        assert not t.is_alive(), "the plain request still waits 30 s after its worker was killed"
        waited = time.time() - killed
        # Not before the bound: the clock starts when the gateway sees the worker go.
        assert waited >= WAIT_S - 0.1, f"ended {waited:.2f} s after the kill, before --worker-wait-s {WAIT_S}"
        assert stream.error and "No worker has been ready for" in stream.error, f"stream: {stream.error!r}"
        assert f"worker {sock}:" in stream.error, stream.error
        assert stream.done, "the stream's error event was not followed by [DONE]"
        status, _, body = plain["reply"]
        assert status == 500 and "No worker has been ready for" in body["error"]["message"], (status, body)
        print(f"stream and plain request ended {waited:.1f} s after the kill: {stream.error}")

        status, body = health(port)
        assert status == 503 and body["status"] == "failing", (status, body)
        assert f"worker {sock}:" in body["error"], body
        status, headers, body = h.complete(port, prompt, 8)
        assert status == 503 and body["error"]["code"] == "engine_failing", (status, body)
        assert "No worker has been ready for" in body["error"]["message"], body
        assert headers.get("retry-after") == "5", headers
        print(f"while failing, a new request: 503 {body['error']['message']}")

        # The worker is started again: served as before.
        c.start_worker("worker", redis=False)
        c.wait_health(timeout=60)
        status, _, body = h.complete(port, prompt, 8)
        assert status == 200 and body["choices"][0]["text"], (status, body)
        status, body = health(port)
        assert status == 200 and body["status"] == "ok" and "error" not in body, (status, body)
        log = c.log("gateway")
        assert "failing (what waits ends, new requests get 503)" in log, log[-2000:]
        assert "sequence(s) waiting for a worker ended" in log, log[-2000:]

        # A worker never reached (a wrong path): "starting", then "failing" naming it.
        nowhere = os.path.join(c.dir, "nowhere.sock")
        port2 = c.start_gateway([nowhere], redis=False, name="gateway-nowhere", wait=False,
                                extra=["--worker-wait-s", "1"])
        seen = {}

        def failing():
            try:
                seen["health"] = health(port2)
            except OSError:
                return False
            return seen["health"][1].get("status") == "failing"

        assert h.wait_for(failing, 30), f"never failing: {seen.get('health')}\n{c.log('gateway-nowhere')}"
        assert f"worker {nowhere}: connect:" in seen["health"][1]["error"], seen["health"]
        print(f"a worker never reached, /health: {seen['health'][1]['error']}")
        print("RESULT worker wait: ended %.1f s after the kill (bound %d s), refused while failing, "
              "served again once the worker was back" % (waited, WAIT_S))
        ok = True
    except Exception as e:  # noqa: BLE001 - printed with the gateway's log
        print(f"FAILED: {type(e).__name__}: {e}")
    finally:
        if not ok:
            print("---- gateway log\n" + c.log("gateway")[-4000:])
        c.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
