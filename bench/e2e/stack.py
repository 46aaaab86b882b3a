"""Our CUDA worker and a gateway in front of it, started for one benchmark
row and stopped after it (warm_start.py, kv_dtype_ab.py)."""
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import side_by_side as sbs  # noqa: E402


def start(bin_dir, model, work, tag, worker_args, gateway_args=()):
    """(worker, gateway, HTTP port, worker log): the worker with `worker_args`
    after --model and --socket, the gateway (with `gateway_args`) once the
    worker listens."""
    sock = os.path.join(work, tag + ".sock")
    wlog = os.path.join(work, tag + "-worker.log")
    w = subprocess.Popen([os.path.join(bin_dir, "moe-worker"), "--model", model, "--socket", sock, *worker_args],
                         stdout=open(wlog, "w"), stderr=subprocess.STDOUT)
    sbs.wait_for(lambda: w.poll() is not None or "listening on" in sbs.tail(wlog, 100000), 900, "the worker")
    if w.poll() is not None:
        raise RuntimeError("the worker exited:\n" + sbs.tail(wlog))
    port = sbs.free_port()
    glog = os.path.join(work, tag + "-gateway.log")
    g = subprocess.Popen([os.path.join(bin_dir, "moe-gateway"), "--model", model, "--worker", "unix:" + sock,
                          "--port", str(port), "--max-request-tokens", str(1 << 30), *gateway_args],
                         stdout=open(glog, "w"), stderr=subprocess.STDOUT)
    sbs.wait_for(lambda: g.poll() is not None or sbs.healthy(port), 120, "the gateway")
    if g.poll() is not None:
        w.kill()
        raise RuntimeError("the gateway exited:\n" + sbs.tail(glog))
    return w, g, port, wlog


def run_arguments(ap):
    """The options every benchmark run on the GPU machine takes: the packed
    model, our programs, the routing, the rows file a resumed run appends
    to, a work folder, and a deadline (Unix time; 0: none)."""
    ap.add_argument("--packed", required=True)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--routing", required=True)
    ap.add_argument("--rows", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--deadline", type=float, default=0)


def done_rows(path, key):
    """key(row) of each row an earlier call of the run wrote to `path`."""
    if not os.path.exists(path):
        return set()
    return {key(json.loads(line)) for line in open(path)}


def past_deadline(a, margin):
    """True, said, when fewer than `margin` s are left before a.deadline."""
    if a.deadline and time.time() > a.deadline - margin:
        sbs.log("deadline: stopping")
        return True
    return False


def settled_metrics(port, keys):
    """metric_sums of `keys` once the gateway has asked its workers for stats
    again (every second); {} when /metrics cannot be read."""
    time.sleep(1.3)
    return sbs.metric_sums(port, keys) or {}


def stop(w, g):
    """SIGTERM to both (the worker writes its closing line), SIGKILL after 60 s."""
    for p in (g, w):
        if p.poll() is None:
            p.terminate()
    for p in (g, w):
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
