"""The /experts page end to end (docs/experts-page.md): a real CPU worker on
the demo model (48 islands for its 192 experts, so misses happen), a real
gateway with an API key, and headless Chromium reading the page:
  1. the page and its data are behind the key: 401 with a Basic challenge
     without it, 200 with the key as a Bearer token or as the Basic password;
  2. before any request the map shows no hot expert;
  3. under load (streams of Python code) the rendered map shows resident
     and hot experts and misses, matching the data's per-layer shape, and a
     screenshot is taken (kept as experts-page-under-load.png);
  4. under a second, different load (English prose) the rendered heat map
     has changed;
  5. the hit-rate series carries values in [0, 1];
  6. with --experts-page off neither path exists.
Needs chromium (deploy/test.sh installs it).
"""
import base64
import hashlib
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import redis_harness as h  # noqa: E402

KEY = "sk-experts-page-test-0123456789"
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def get(port, path, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", path, headers=headers or {})
    r = c.getresponse()
    return r.status, dict(r.getheaders()), r.read()


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def browser(exe, url, out_dir, *extra):
    """Runs headless Chromium on `url`; returns its stdout."""
    args = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--user-data-dir=" + os.path.join(out_dir, "chromium-profile"), "--window-size=1100,700", *extra, url]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    return r.stdout


def rendered_cells(exe, port, out_dir):
    """{(layer, expert): classes} of the map as the page rendered it after
    its script read the data a few times."""
    dom = browser(exe, f"http://page:{KEY}@127.0.0.1:{port}/experts", out_dir, "--virtual-time-budget=2500",
                  "--dump-dom")
    cells = {}
    for tag in re.findall(r"<i [^>]*>", dom):
        t = re.search(r'title="layer (\d+), expert (\d+)"', tag)
        if not t:
            continue
        c = re.search(r'class="([^"]*)"', tag)
        cells[(int(t.group(1)), int(t.group(2)))] = set((c.group(1) if c else "").split())
    updates = re.search(r'data-updates="(\d+)"', dom)
    return cells, int(updates.group(1)) if updates else 0


def load(port, prompts, stop):
    """Streams of completions, one after another, until `stop` is set."""
    i = 0
    while not stop.is_set():
        body = {"model": h.MODEL, "prompt": prompts[i % len(prompts)], "max_tokens": 48, "temperature": 0}
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        c.request("POST", "/v1/completions", json.dumps(body),
                  {"Content-Type": "application/json", "Authorization": "Bearer " + KEY})
        c.getresponse().read()
        i += 1


def watch_for(port, seconds):
    """Keeps the page's data watched (as an open page does) for `seconds`."""
    end = time.time() + seconds
    last = None
    while time.time() < end:
        _, _, body = get(port, "/experts.json", {"Authorization": "Bearer " + KEY})
        last = json.loads(body)
        time.sleep(0.5)
    return last


def main():
    exe = chromium()
    if not exe:
        print("FAIL chromium is not installed (deploy/test.sh installs it: apt-get install chromium)")
        return 1
    cl = h.Cluster("experts-page")
    out_dir = cl.dir
    try:
        keys = os.path.join(cl.dir, "keys")
        with open(keys, "w") as f:
            f.write(f"page-test {hashlib.sha256(KEY.encode()).hexdigest()} 0 -\n")
        sock = cl.start_worker("worker", redis=False)
        port = cl.start_gateway([sock], redis=False, extra=["--keys-file", keys])

        # 1. Behind the key.
        st, hd, _ = get(port, "/experts")
        check(st == 401 and hd.get("WWW-Authenticate", "").startswith("Basic"),
              f"/experts without the key: 401 with a Basic challenge (got {st}, {hd.get('WWW-Authenticate')})")
        st, _, _ = get(port, "/experts.json")
        check(st == 401, f"/experts.json without the key: 401 (got {st})")
        basic = "Basic " + base64.b64encode(("anyone:" + KEY).encode()).decode()
        st, hd, body = get(port, "/experts", {"Authorization": basic})
        check(st == 200 and hd.get("Content-Type", "").startswith("text/html") and b"experts.json" in body,
              f"/experts with the key as the Basic password: the page (got {st})")
        # Only the page takes the browser's login: elsewhere another site's page
        # could post with it.
        st, _, _ = get(port, "/v1/models", {"Authorization": basic})
        check(st == 401, f"/v1/models with the key as a Basic password: 401 (got {st})")
        st, _, _ = get(port, "/v1/models", {"Authorization": "Bearer " + KEY})
        check(st == 200, f"/v1/models with the Bearer key: 200 (got {st})")
        wrong = "Basic " + base64.b64encode(b"anyone:not-the-key").decode()
        st, _, _ = get(port, "/experts", {"Authorization": wrong})
        check(st == 401, f"/experts with a wrong Basic password: 401 (got {st})")
        st, _, body = get(port, "/experts.json", {"Authorization": "Bearer " + KEY})
        data = json.loads(body) if st == 200 else {}
        workers = data.get("workers", [])
        check(st == 200 and len(workers) == 1, f"/experts.json with the Bearer key: one worker (got {st})")
        if not workers:
            return 1
        w = workers[0]
        n_layers, n_experts = len(w["moe_layers"]), w["n_experts"]
        check(n_layers > 0 and n_experts > 0 and len(w["resident"]) == n_layers * n_experts and
              len(w["hot"]) == n_layers * n_experts, f"the data's map is {n_layers} layers x {n_experts} experts")

        # 2. Idle: nothing hot.
        watch_for(port, 2.5)
        idle, updates = rendered_cells(exe, port, out_dir)
        check(len(idle) == n_layers * n_experts, f"the page drew {len(idle)} cells (want {n_layers * n_experts})")
        check(updates >= 2, f"the page read its data more than once ({updates} updates)")
        check(not any("h" in c for c in idle.values()), "idle: no expert is hot")

        # 3. Under a load of Python code.
        code = [f"def function_{i}(values):\n    total = 0\n    for v in values:\n        total += v * {i}\n"
                for i in range(6)]
        stop = threading.Event()
        t = threading.Thread(target=load, args=(port, code, stop))
        t.start()
        try:
            watch_for(port, 4)
            busy, _ = rendered_cells(exe, port, out_dir)
            shot = os.path.join(out_dir, "under-load.png")
            browser(exe, f"http://page:{KEY}@127.0.0.1:{port}/experts", out_dir, "--virtual-time-budget=2500",
                    "--screenshot=" + shot)
            data = watch_for(port, 1.5)
        finally:
            stop.set()
            t.join()
        hot = {k for k, c in busy.items() if "h" in c}
        resident = {k for k, c in busy.items() if "r" in c}
        check(len(hot) > 0, f"under load: {len(hot)} experts drawn hot")
        check(len(resident) > 0, f"under load: {len(resident)} experts drawn resident")
        missed_ever = any(m > 0 for m in data["workers"][0]["missed"]) or any("m" in c for c in busy.values())
        check(missed_ever or len(resident) >= n_layers * n_experts,
              "under load with fewer islands than experts: misses are drawn or reported")
        ok_shot = os.path.exists(shot) and os.path.getsize(shot) > 10_000
        check(ok_shot, "a screenshot of the page under load was taken")
        if ok_shot:
            keep = os.path.join(os.environ.get("MOE_BUILD_DIR", os.getcwd()), "experts-page-under-load.png")
            try:
                shutil.copy(shot, keep)
                print(f"     screenshot kept as {keep}")
            except OSError:
                pass
        series = data["workers"][0]["series"]
        rates = [s["hit_rate"] for s in series if s["hit_rate"] is not None]
        check(len(rates) > 0 and all(0 <= r <= 1 for r in rates), f"hit-rate series: {rates[-5:]}")

        # 4. A different load: the heat map changes.
        prose = [f"The committee met in {m} to discuss the annual budget and the opening hours of the library.\n"
                 for m in ("March", "June", "October", "December")]
        time.sleep(12)  # the first load's heat decays away
        stop = threading.Event()
        t = threading.Thread(target=load, args=(port, prose, stop))
        t.start()
        try:
            watch_for(port, 4)
            other, _ = rendered_cells(exe, port, out_dir)
        finally:
            stop.set()
            t.join()
        hot2 = {k for k, c in other.items() if "h" in c}
        check(len(hot2) > 0 and hot2 != hot,
              f"a second load of other text: the heat map changed ({len(hot ^ hot2)} cells differ)")

        # 6. --experts-page off: neither path exists.
        off = cl.start_gateway([cl.start_worker("worker2", redis=False)], redis=False, name="gateway2",
                               extra=["--keys-file", keys, "--experts-page", "off"])
        st, _, _ = get(off, "/experts", {"Authorization": basic})
        st2, _, _ = get(off, "/experts.json", {"Authorization": "Bearer " + KEY})
        check(st == 404 and st2 == 404, f"--experts-page off: 404 for both paths (got {st}, {st2})")
    finally:
        if failures:
            for name in ("gateway", "worker"):
                print(f"---- {name} log (tail)\n" + cl.log(name)[-3000:])
        cl.close()
    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
