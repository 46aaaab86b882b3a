#!/usr/bin/env python3
"""Our gateway + CUDA worker and llama.cpp's llama-server, one after the
other on the same GPU, under the same streaming load through HTTP.

For one model shape it runs, for each memory mode (resident, or a GPU
memory budget such as 12GiB):
  - ours: moe-worker --backend cuda on the packed file (--vram-budget for a
    budget; --kv-blocks as below), once per routing (--routing uniform, or
    replay:FILE for a recorded trace), with moe-gateway in front;
  - llama-server on the Q4_K_M GGUF of the same checkpoint (-ngl 99, and
    --n-cpu-moe N for a budget: N chosen so that its measured GPU memory is
    the largest that stays within the budget, predicted from the GGUF's
    per-layer expert bytes and the resident run, then measured and
    corrected);
and drives each with streams of --new-tokens at every --concurrency and
--prompts length (token-id prompts from a seeded generator: both servers
see the same ids). A row: output tokens/s over the wave's wall time, TTFT
and inter-token latency p50/p99, the server's peak GPU memory (nvidia-smi,
every 100 ms, its own process), and for ours the expert hits and misses
the worker counted in the row.

Both servers get the same KV capacity: resident 32 slots of --slot-tokens,
under a budget 8 (ours as --kv-blocks, llama-server as -np and -c; its
slots are fixed, ours paged).

Rows are appended to --rows (JSON lines) as they finish; a rerun skips the
rows already there, and --deadline (a Unix time) stops before a row that
would not finish in time, so the run resumes across calls.

    python3 bench/e2e/side_by_side.py --shape qwen3-30b-a3b --packed Q3.moepack --gguf Q3-Q4_K_M.gguf \\
        --bin BIN --llama-bin LLAMA/bin --modes resident,12GiB,8GiB \\
        --routings uniform,replay:bench/e2e/traces/qwen3-30b-a3b.safetensors --rows rows.jsonl
"""
import argparse
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "gateway"))
from full_stack import GpuSampler, free_port, percentile, wait_for  # noqa: E402

# KV bytes per token of llama.cpp's f16 cache, and the shapes' layer counts.
SHAPES = {
    "qwen3-30b-a3b": dict(layers=48, kv_heads=4, head_dim=128, vocab=151936),
    "qwen1.5-moe-a2.7b": dict(layers=24, kv_heads=16, head_dim=128, vocab=151936),
}


LLAMA_BANNED = []


def llama_banned(tokenizer_json, vocab):
    """[[id, False]] for every id whose text is not whole UTF-8 characters
    (byte-level BPE pieces), the added tokens and the ids past the vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    to_byte = {chr(c): b for b, c in zip(bs, cs)}
    tj = json.load(open(tokenizer_json))
    ok = set()
    for piece, i in tj["model"]["vocab"].items():
        try:
            text = bytes(to_byte[ch] for ch in piece).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue
        if "\r" not in text:
            ok.add(i)
    return [[i, False] for i in range(vocab) if i not in ok]


def log(msg):
    print(msg, flush=True)


# ---- GGUF: per-layer expert bytes, from the tensor infos --------------------

def gguf_tensor_bytes(path):
    """{tensor name: bytes} of a GGUF file (sizes from the offsets)."""
    with open(path, "rb") as f:
        def rd(fmt):
            n = struct.calcsize(fmt)
            return struct.unpack("<" + fmt, f.read(n))

        def rstr():
            (n,) = rd("Q")
            return f.read(n).decode("utf-8", "replace")

        scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

        def skip(t):
            if t == 8:
                rstr()
            elif t == 9:
                (et,) = rd("I")
                (cnt,) = rd("Q")
                if et in scalar:
                    f.seek(cnt * struct.calcsize(scalar[et]), 1)
                else:
                    for _ in range(cnt):
                        skip(et)
            else:
                rd(scalar[t])

        if f.read(4) != b"GGUF":
            raise ValueError(path + " is not a GGUF file")
        (version,) = rd("I")
        n_tensors, n_kv = rd("QQ")
        alignment = 32
        for _ in range(n_kv):
            key = rstr()
            (t,) = rd("I")
            if key == "general.alignment":
                (alignment,) = rd("I")
            else:
                skip(t)
        infos = []
        for _ in range(n_tensors):
            name = rstr()
            (nd,) = rd("I")
            rd("Q" * nd)
            (_t,) = rd("I")
            (off,) = rd("Q")
            infos.append((off, name))
        data_start = (f.tell() + alignment - 1) // alignment * alignment
    size = os.path.getsize(path)
    infos.sort()
    out = {}
    for i, (off, name) in enumerate(infos):
        end = infos[i + 1][0] if i + 1 < len(infos) else size - data_start
        out[name] = end - off
    return out


def expert_bytes_by_layer(path, layers):
    sizes = gguf_tensor_bytes(path)
    per = [0] * layers
    for name, b in sizes.items():
        m = re.match(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.", name)
        if m:
            per[int(m.group(1))] += b
    return per, sum(sizes.values())


# ---- one streamed completion, either server ---------------------------------

def stream(port, model, prompt_ids, new_tokens, llama):
    """(ttft s, [gaps s], completion tokens) of one streamed /v1/completions."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    body = {"model": model, "prompt": prompt_ids, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if llama:
        # Random weights emit pieces of characters (byte tokens) and special
        # ids, and llama-server's output parser then fails the stream at its
        # end ("does not match the expected Content-only format"): such ids
        # are banned there (llama_banned). Which ids come out does not change
        # the work per token.
        body.update(ignore_eos=True, cache_prompt=False, logit_bias=LLAMA_BANNED)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    times, tokens, chunks, buf = [], None, 0, b""
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            ev = ev.strip()
            if not ev.startswith(b"data: ") or ev[6:] == b"[DONE]":
                continue
            obj = json.loads(ev[6:])
            if obj.get("error"):
                raise RuntimeError("error event: " + json.dumps(obj["error"])[:300])
            if obj.get("usage"):
                tokens = obj["usage"].get("completion_tokens")
            if obj.get("timings") and tokens is None:
                tokens = obj["timings"].get("predicted_n")
            ch = obj.get("choices") or []
            if ch and (ch[0].get("text") or ch[0].get("finish_reason") is None):
                times.append(time.perf_counter())
                chunks += 1
    c.close()
    if not times:
        raise RuntimeError("no token came")
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])], tokens if tokens is not None else chunks


def run_wave(port, model, vocab, concurrency, prompt_tokens, new_tokens, requests, seed, llama):
    """`requests` streams, at most `concurrency` at once."""
    rnd = random.Random(seed)
    prompts = [[rnd.randrange(100, vocab - 300) for _ in range(prompt_tokens)] for _ in range(requests)]
    ttfts, itls, toks, errors = [], [], [], []
    lock = threading.Lock()
    nxt = [0]

    def client():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= requests:
                return
            try:
                ttft, gaps, n = stream(port, model, prompts[i], new_tokens, llama)
                with lock:
                    ttfts.append(ttft)
                    itls.extend(gaps)
                    toks.append(n)
            except Exception as e:  # a failed stream is counted, not fatal
                with lock:
                    errors.append(str(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"out_tok_s": sum(toks) / wall, "ttft_ms_p50": 1e3 * percentile(ttfts, 50),
            "ttft_ms_p99": 1e3 * percentile(ttfts, 99), "itl_ms_p50": 1e3 * percentile(itls, 50),
            "itl_ms_p99": 1e3 * percentile(itls, 99), "tokens": sum(toks),
            "short_streams": sum(1 for n in toks if n < new_tokens), "errors": errors, "wall_s": wall}


# ---- the servers -------------------------------------------------------------

class Server:
    """A started server: its pid for the GPU sampler, port, model name."""

    def __init__(self, name, procs, port, model, gpu_pid, logs):
        self.name, self.procs, self.port, self.model, self.logs = name, procs, port, model, logs
        self.gpu = GpuSampler(gpu_pid)

    def stop(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return self.gpu.stop()


def healthy(port):
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        c.request("GET", "/health")
        return c.getresponse().status == 200
    except OSError:
        return False


def tail(path, n=3000):
    try:
        return open(path, errors="replace").read()[-n:]
    except OSError:
        return ""


def start_ours(a, work, mode, routing, kv_blocks):
    sock = os.path.join(work, "w.sock")
    tag = f"ours-{mode}-{routing.split(':')[0]}"
    wlog = os.path.join(work, tag + "-worker.log")
    args = [os.path.join(a.bin, "moe-worker"), "--backend", a.ours_backend, "--model", a.packed, "--socket", sock,
            "--kv-blocks", str(kv_blocks)]
    if a.ours_backend == "cuda":  # a cpu worker (a dry run of this script) routes with the model's router
        args += ["--routing", routing]
    if mode != "resident":
        args += ["--vram-budget", mode]
    t0 = time.time()
    w = subprocess.Popen(args, stdout=open(wlog, "w"), stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: w.poll() is not None or "listening on" in tail(wlog, 100000), 900, "the worker")
    except RuntimeError:
        w.kill()
        raise
    if w.poll() is not None:
        raise RuntimeError("the worker exited:\n" + tail(wlog))
    ready = time.time() - t0
    port = free_port()
    glog = os.path.join(work, tag + "-gateway.log")
    g = subprocess.Popen([os.path.join(a.bin, "moe-gateway"), "--model", a.packed, "--worker", "unix:" + sock,
                          "--port", str(port), "--max-request-tokens", str(1 << 30)],
                         stdout=open(glog, "w"), stderr=subprocess.STDOUT)
    s = Server(tag, [w, g], port, os.path.basename(a.packed.rstrip("/")), w.pid, [wlog, glog])
    try:
        wait_for(lambda: g.poll() is not None or healthy(port), 120, "the gateway")
        if g.poll() is not None:
            raise RuntimeError("the gateway exited:\n" + tail(glog))
    except Exception:
        s.stop()
        raise
    s.ready_s = ready
    log(f"  {tag}: worker ready in {ready:.1f} s; " +
        "; ".join(l.strip() for l in tail(wlog, 100000).splitlines() if "arena" in l or "routing replayed" in l)[-400:])
    return s


def start_llama(a, work, mode, n_cpu_moe, slots, ctx):
    port = free_port()
    tag = f"llama-{mode}-ncmoe{n_cpu_moe}"
    lg = os.path.join(work, tag + ".log")
    args = [os.path.join(a.llama_bin, "llama-server"), "-m", a.gguf, "--host", "127.0.0.1", "--port", str(port),
            "-ngl", "99", "-t", str(a.threads), "-np", str(slots), "-c", str(ctx), "--no-warmup"]
    if n_cpu_moe > 0:
        args += ["--n-cpu-moe", str(n_cpu_moe)]
    t0 = time.time()
    p = subprocess.Popen(args, stdout=open(lg, "w"), stderr=subprocess.STDOUT)
    s = Server(tag, [p], port, "llama", p.pid, [lg])
    try:
        wait_for(lambda: p.poll() is not None or healthy(port), 900, "llama-server")
        if p.poll() is not None:
            raise RuntimeError("llama-server exited:\n" + tail(lg))
    except Exception:
        s.stop()
        raise
    s.ready_s = time.time() - t0
    log(f"  {tag}: ready in {s.ready_s:.1f} s")
    return s


def metric_sums(port, keys):
    """{key: the sum of its samples over every label set (None: none)} from
    the gateway's /metrics; None when it cannot be read."""
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
    except OSError:
        return None
    out = {}
    for key in keys:
        vals = [float(m.group(1)) for m in re.finditer(r"^" + key + r"(?:\{[^}]*\})? (\S+)$", text, re.M)]
        out[key] = sum(vals) if vals else None
    return out


EXPERT_KEYS = ("moe_gateway_worker_expert_hits_total", "moe_gateway_worker_expert_misses_total")


def scrape(port):
    """(expert hits, misses) the gateway's /metrics counts for its workers."""
    m = metric_sums(port, EXPERT_KEYS)
    return None if m is None else tuple(m[k] or 0.0 for k in EXPERT_KEYS)


# ---- the run ------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--packed", required=True, help="our packed model file (moe convert of the checkpoint)")
    ap.add_argument("--gguf", required=True, help="the Q4_K_M GGUF of the same checkpoint")
    ap.add_argument("--bin", required=True, help="a folder with moe-worker and moe-gateway")
    ap.add_argument("--llama-bin", required=True, help="a folder with llama-server")
    ap.add_argument("--servers", default="ours,llama.cpp")
    ap.add_argument("--modes", default="resident,12GiB")
    ap.add_argument("--routings", default="uniform", help="ours: uniform and/or replay:FILE, comma-separated")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompts", default="128,1024")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--long-max-concurrency", type=int, default=0,
                    help="prompts of 1,024+ tokens only up to this concurrency (0: every one)")
    ap.add_argument("--resident-routings", default="", help="ours, resident: these routings only (default: --routings)")
    ap.add_argument("--requests-at-1", type=int, default=3, help="streams in a concurrency-1 row (others: one wave)")
    ap.add_argument("--slot-tokens", type=int, default=1200, help="KV tokens a slot holds (prompt + new + margin)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 16, help="llama-server's -t")
    ap.add_argument("--tokenizer", required=True, help="the checkpoint's tokenizer.json (llama-server's banned ids)")
    ap.add_argument("--ours-backend", default="cuda", help="cpu: a dry run of this script without a GPU")
    ap.add_argument("--rows", required=True, help="JSON lines, appended; rows already there are skipped")
    ap.add_argument("--llama-resident-mib", type=int, default=0,
                    help="llama-server's peak GPU MiB all resident, from an earlier run of this shape (its row in "
                         "bench/results/e2e-latest.json): a budget mode then runs without the resident row; the "
                         "--n-cpu-moe it predicts is still measured after load and corrected")
    ap.add_argument("--deadline", type=float, default=0, help="Unix time: no row starts that would end after it")
    ap.add_argument("--work", default="", help="logs folder (default: a temp folder, kept)")
    a = ap.parse_args()
    shape = SHAPES[a.shape]
    work = a.work or tempfile.mkdtemp(prefix="moe-e2e-")
    os.makedirs(work, exist_ok=True)
    kv_tok = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * 2
    done = set()
    if os.path.exists(a.rows):
        for line in open(a.rows):
            if line.strip():
                r = json.loads(line)
                done.add((r["server"], r["mode"], r["routing"], r["concurrency"], r["prompt_tokens"]))
    concs = [int(x) for x in a.concurrency.split(",")]
    prompts = [int(x) for x in a.prompts.split(",")]
    row_cost = {}  # a rough guess of a row's seconds, from the rows measured

    def time_left():
        return a.deadline - time.time() if a.deadline else 1e9

    def emit(row):
        with open(a.rows, "a") as f:
            f.write(json.dumps(row) + "\n")
        done.add((row["server"], row["mode"], row["routing"], row["concurrency"], row["prompt_tokens"]))

    def drive(server, srv_name, mode, routing, extra):
        """The rows of one started server; False when the deadline stopped it."""
        llama = srv_name == "llama.cpp"
        run_wave(server.port, server.model, shape["vocab"], 1, 32, 8, 2, 7, llama)  # warm-up
        for p in prompts:
            for c in concs:
                key = (srv_name, mode, routing, c, p)
                if key in done or (a.long_max_concurrency and p >= 1024 and c > a.long_max_concurrency):
                    continue
                guess = row_cost.get((srv_name, mode, c, p), 30 if c < 32 else 90)
                if time_left() < guess + 20:
                    log(f"  deadline: {key} left for the next run")
                    return False
                before = None if llama else scrape(server.port)
                n = a.requests_at_1 if c == 1 else c
                r = run_wave(server.port, server.model, shape["vocab"], c, p, a.new_tokens, n, 1000 * c + p, llama)
                after = None if llama else scrape(server.port)
                row_cost[(srv_name, mode, c, p)] = r["wall_s"]
                row = {"shape": a.shape, "server": srv_name, "mode": mode, "routing": routing, "concurrency": c,
                       "prompt_tokens": p, "new_tokens": a.new_tokens, "requests": n,
                       **{k: round(r[k], 2) for k in ("out_tok_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50",
                                                      "itl_ms_p99")},
                       "tokens": r["tokens"], "short_streams": r["short_streams"], "errors": len(r["errors"]),
                       "peak_gpu_mib": None, **extra}
                if before and after:
                    row["expert_hits"] = int(after[0] - before[0])
                    row["expert_misses"] = int(after[1] - before[1])
                log(f"  {srv_name} {mode} {routing} c={c} prompt={p}: {r['out_tok_s']:.1f} tok/s, TTFT p50/p99 "
                    f"{r['ttft_ms_p50']:.0f}/{r['ttft_ms_p99']:.0f} ms, ITL p50/p99 {r['itl_ms_p50']:.2f}/"
                    f"{r['itl_ms_p99']:.2f} ms, {r['tokens']} tokens, {len(r['errors'])} errors"
                    + (f" ({r['errors'][0][:200]})" if r["errors"] else "")
                    + (f", misses {row.get('expert_misses')}" if "expert_misses" in row else ""))
                server.pending.append(row)
        return True

    def finish(server):
        peak = server.stop()
        for row in server.pending:
            row["peak_gpu_mib"] = peak
            emit(row)
        log(f"  {server.name}: peak GPU memory {peak} MiB")
        return peak

    def wanted(srv_name, mode, routing):
        return any((srv_name, mode, routing, c, p) not in done for c in concs for p in prompts
                   if not (a.long_max_concurrency and p >= 1024 and c > a.long_max_concurrency))

    LLAMA_BANNED.extend(llama_banned(a.tokenizer, shape["vocab"]))
    log(f"{a.shape}: {len(LLAMA_BANNED)} ids banned on llama-server (byte pieces, added tokens, padding)")
    per_layer, total = expert_bytes_by_layer(a.gguf, shape["layers"])
    log(f"{a.shape}: GGUF {total / 2**20:.0f} MiB of tensors, experts {sum(per_layer) / 2**20:.0f} MiB "
        f"({per_layer[0] / 2**20:.0f} MiB a layer)")
    llama_resident_peak = None
    calib_path = a.rows + ".llama-calibration.json"
    calib = json.load(open(calib_path)) if os.path.exists(calib_path) else {}
    if a.llama_resident_mib and "resident_peak_mib" not in calib:
        calib["resident_peak_mib"] = a.llama_resident_mib
    for mode in a.modes.split(","):
        resident = mode == "resident"
        slots = 32 if resident else 8
        if "ours" in a.servers:
            for routing in (a.resident_routings or a.routings).split(",") if resident else a.routings.split(","):
                label = routing.split(":")[0] if routing.startswith("replay") else routing
                label = "replayed" if label == "replay" else label
                if not wanted("ours", mode, label):
                    continue
                if time_left() < 120:
                    log("  deadline: ours " + mode + " " + label + " left for the next run")
                    return 3
                s = start_ours(a, work, mode, routing, slots * a.slot_tokens // 16)
                s.pending = []
                try:
                    drive(s, "ours", mode, label, {"kv_tokens": slots * a.slot_tokens // 16 * 16,
                                                    "ready_s": round(s.ready_s, 1)})
                finally:
                    finish(s)
        if "llama.cpp" in a.servers and wanted("llama.cpp", mode, "own-router"):
            ctx = slots * a.slot_tokens
            if resident:
                n = 0
            else:
                budget_mib = int(re.match(r"(\d+)GiB", mode).group(1)) * 1024
                base = calib.get("resident_peak_mib")
                if base is None:
                    raise SystemExit("side_by_side: llama.cpp's resident row first (its peak calibrates --n-cpu-moe), "
                                     "or --llama-resident-mib from an earlier run")
                # The resident peak less the KV it held, plus this mode's KV,
                # less the experts of the first N layers (--n-cpu-moe N).
                fixed = base - (32 - slots) * a.slot_tokens * kv_tok / 2**20
                n = calib.get(mode)
                if n is None:
                    n = 0
                    while n < shape["layers"] and fixed - sum(per_layer[:n]) / 2**20 > budget_mib:
                        n += 1
                log(f"  llama.cpp {mode}: --n-cpu-moe {n} predicted to take "
                    f"{fixed - sum(per_layer[:n]) / 2**20:.0f} MiB")
            for attempt in range(4):
                if time_left() < 150:
                    log("  deadline: llama.cpp " + mode + " left for the next run")
                    return 3
                s = start_llama(a, work, mode, n, slots, ctx)
                s.pending = []
                # llama.cpp allocates its buffers at load: what it holds after
                # a first request is what it holds.
                run_wave(s.port, s.model, shape["vocab"], 1, 64, 4, 1, 5, True)
                time.sleep(0.5)
                held = s.gpu.peak
                log(f"  llama.cpp {mode} --n-cpu-moe {n}: {held} MiB after load")
                if resident:
                    calib["resident_peak_mib"] = held
                    break
                over = held - budget_mib
                if over > 0 and n < shape["layers"]:
                    s.stop()
                    while n < shape["layers"] and over > 0:
                        over -= per_layer[n] / 2**20
                        n += 1
                    continue
                # One more layer's experts on the GPU would still fit?
                if n > 0 and held + per_layer[n - 1] / 2**20 <= budget_mib and attempt < 3:
                    s.stop()
                    n -= 1
                    continue
                calib[mode] = n
                break
            json.dump(calib, open(calib_path, "w"))
            try:
                drive(s, "llama.cpp", mode, "own-router", {"n_cpu_moe": n, "kv_tokens": ctx,
                                                           "ready_s": round(s.ready_s, 1)})
            finally:
                finish(s)
    log(f"{a.shape}: done; logs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
