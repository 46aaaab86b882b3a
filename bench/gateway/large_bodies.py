"""How long /health waits while many clients send large JSON bodies: 40
clients each post a body of 330,000 numbers (~1 MB, under the 1 MiB limit)
to /v1/completions twice, while one client asks /health every 10 ms.
Reading, checking and freeing such a body must stay off the event loop, so
/health's latency is the figure.

    python3 bench/gateway/large_bodies.py PORT     # a running moe-gateway
"""
import http.client
import json
import sys
import threading
import time


def main():
    port = int(sys.argv[1])
    body = json.dumps({"model": "demo-moe", "prompt": [1] * 330000, "max_tokens": 1}).encode()
    done = threading.Event()
    lat = []

    def client():
        for _ in range(2):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            c.getresponse().read()

    def prober():
        while not done.is_set():
            t = time.time()
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            c.request("GET", "/health")
            c.getresponse().read()
            lat.append(time.time() - t)
            time.sleep(0.01)

    p = threading.Thread(target=prober)
    p.start()
    clients = [threading.Thread(target=client) for _ in range(40)]
    t0 = time.time()
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    done.set()
    p.join()
    lat.sort()
    print(f"80 bodies of {len(body) / 1e6:.1f} MB in {time.time() - t0:.1f} s; /health max {lat[-1]:.3f} s, "
          f"p90 {lat[int(0.9 * len(lat))]:.3f} s over {len(lat)} probes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
