"""The gateway with its own worker, which serves once and then cannot start
again (as when its checkpoint is removed while it runs): after kill -9 of
the worker in the middle of a stream and of a plain request, both end with
the reason within seconds instead of waiting for a restart that never comes,
/health says "failing" with that reason, and a new request is refused with
it. Once the worker can start again, the gateway serves as before.

The worker is a script in front of the real moe-worker: while its marker
file exists it exits at once with status 3, as a worker does that finds its
checkpoint gone.
"""
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import http.client

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import redis_harness as h  # noqa: E402


def child_worker(gateway_pid):
    out = subprocess.run(["pgrep", "-P", str(gateway_pid), "-f", "moe-worker"], capture_output=True, text=True).stdout
    pids = [int(p) for p in out.split()]
    return pids[0] if pids else None


def health(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    c.request("GET", "/health")
    r = c.getresponse()
    return r.status, json.loads(r.read() or b"{}")


def main():
    c = h.Cluster("worker-failing")
    ok = False
    try:
        marker = os.path.join(c.dir, "checkpoint-gone")
        wrapper = os.path.join(c.dir, "start-worker.sh")
        with open(wrapper, "w") as f:
            f.write("#!/bin/sh\n"
                    f"if [ -e '{marker}' ]; then echo 'test worker: the checkpoint is gone' >&2; exit 3; fi\n"
                    f"touch '{marker}'\n"
                    f"exec '{os.environ['MOE_WORKER']}' \"$@\"\n")
        os.chmod(wrapper, os.stat(wrapper).st_mode | stat.S_IXUSR)
        env = dict(os.environ, MOE_WORKER_BIN=wrapper)
        port = c.start_gateway([], redis=False, env=env)
        assert os.path.exists(marker), "the worker did not start through the script"

        # A stream and a plain request in flight when the worker is killed.
        prompt = h.prompts(1)[0]
        stream = h.Stream(port, prompt, 4000).start()
        plain = {}

        def run_plain():
            plain["reply"] = h.complete(port, prompt, 4000)

        t = threading.Thread(target=run_plain, daemon=True)
        t.start()
        end = time.time() + 60
        while time.time() < end and stream.events < 3:
            time.sleep(0.01)
        assert stream.events >= 3, f"the stream did not start: {stream.error}"
        pid = child_worker(c.procs["gateway"].pid)
        assert pid, "no worker child found"
        killed = time.time()
        os.kill(pid, signal.SIGKILL)

        assert stream.join(30), "the stream still waits 30 s after its worker was killed"
        t.join(30)
        assert not t.is_alive(), "the plain request still waits 30 s after its worker was killed"
        waited = time.time() - killed
        assert stream.error and "failed 3 times in a row" in stream.error, f"stream: {stream.error!r}"
        assert "exited with status 3" in stream.error, stream.error
        status, _, body = plain["reply"]
        assert status == 500 and "failed 3 times in a row" in body["error"]["message"], (status, body)
        print(f"stream and plain request ended {waited:.1f} s after the kill: {stream.error}")

        status, body = health(port)
        assert status == 503 and body["status"] == "failing", (status, body)
        assert "exited with status 3" in body["error"], body
        status, headers, body = h.complete(port, prompt, 8)
        assert status == 503 and body["error"]["code"] == "engine_failing", (status, body)
        assert headers.get("retry-after") == "5", headers
        print(f"/health: {body['error']['message']}")

        # The checkpoint is back: the next restart serves, as before.
        os.remove(marker)
        c.wait_health(timeout=30)
        status, _, body = h.complete(port, prompt, 8)
        assert status == 200 and body["choices"][0]["text"], (status, body)
        status, body = health(port)
        assert status == 200 and body["status"] == "ok" and "error" not in body, (status, body)
        log = c.log("gateway")
        assert "the worker is failing" in log and "sequence(s) waiting for a worker ended" in log, log[-2000:]
        print("RESULT worker failing: ended in %.1f s, refused while failing, served again once it could start" % waited)
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
