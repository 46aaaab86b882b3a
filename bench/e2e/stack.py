"""Our CUDA worker and a gateway in front of it, started for one benchmark
row and stopped after it (warm_start.py, kv_dtype_ab.py)."""
import os
import subprocess
import sys

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
