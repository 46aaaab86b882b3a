"""The first requests after a worker starts, with and without a warm profile.

Each cycle starts the CUDA worker (and a gateway in front of it) afresh under
a VRAM budget, twice: cold, and with `--warm-profile FILE`. Right after it is
ready, `concurrency` streams each send one prompt and read `new_tokens`
tokens through HTTP; then the worker is stopped and its closing line gives
the expert hits, misses and bytes streamed of exactly those requests. One
JSON line per (cycle, state, concurrency) is appended to --rows.

  python3 bench/e2e/warm_start.py --packed M.moepack --bin BIN --profile P.json \\
      --routing replay:bench/e2e/traces/qwen1.5-moe-a2.7b.safetensors --mode 6GiB --rows rows.jsonl
"""
import argparse
import json
import os
import re
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import side_by_side as sbs  # noqa: E402
import stack  # noqa: E402


def start(a, work, tag, profile):
    """The worker (with `--warm-profile` when given) and its gateway; the
    worker's ready time."""
    args = ["--backend", a.backend, "--kv-blocks", str(a.kv_blocks)]
    if a.backend == "cuda":  # a cpu worker (a dry run of this script) keeps a quarter of the experts' worth
        args += ["--vram-budget", a.mode, "--routing", a.routing]
    if profile:
        args += ["--warm-profile", profile]
    t0 = time.time()
    w, g, port, wlog = stack.start(a.bin, a.packed, work, tag, args, ["--predict", a.predict])
    return w, g, port, time.time() - t0, wlog


def text_wave(port, model, prompts, new_tokens):
    """One stream per text prompt, all at once: run_wave's figures."""
    out, lock = [], threading.Lock()

    def one(p):
        try:
            ttft, gaps, n = sbs.stream(port, model, p, new_tokens, False)
            with lock:
                out.append((ttft, gaps, n, None))
        except Exception as e:  # a failed stream is counted, not fatal
            with lock:
                out.append((0, [], 0, str(e)))

    t0 = time.perf_counter()
    ths = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    wall = time.perf_counter() - t0
    ok = [o for o in out if o[3] is None]
    itls = [g for o in ok for g in o[1]]
    return {"out_tok_s": sum(o[2] for o in ok) / wall,
            "ttft_ms_p50": 1e3 * sbs.percentile([o[0] for o in ok], 50) if ok else 0,
            "itl_ms_p50": 1e3 * sbs.percentile(itls, 50) if itls else 0, "tokens": sum(o[2] for o in ok),
            "errors": [o[3] for o in out if o[3]], "wall_s": wall}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packed", required=True)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--profile", required=True, help="the routing profile of the warm starts")
    ap.add_argument("--routing", required=True, help="the worker's --routing (replay:FILE for recorded routing)")
    ap.add_argument("--mode", default="6GiB", help="--vram-budget")
    ap.add_argument("--kv-blocks", type=int, default=256)
    ap.add_argument("--backend", default="cuda", help="cpu: a dry run of this script without a GPU")
    ap.add_argument("--predict", default="on", help="the gateway's --predict")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=100)
    ap.add_argument("--shape", default="qwen1.5-moe-a2.7b")
    ap.add_argument("--text-prompts", default="", help="JSON lines, each a text prompt (instead of random ids)")
    ap.add_argument("--rows", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--deadline", type=float, default=0)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    texts = [json.loads(l) for l in open(a.text_prompts, encoding="utf-8") if l.strip()] if a.text_prompts else []
    for cycle in range(a.cycles):
        for conc in [int(x) for x in a.concurrency.split(",")]:
            for state in ("off", "on"):
                if a.deadline and time.time() > a.deadline - 40:
                    sbs.log("deadline: stopping")
                    return
                tag = f"c{cycle}-n{conc}-{state}"
                w, g, port, ready, wlog = start(a, a.work, tag, a.profile if state == "on" else "")
                try:
                    # Same prompts for both states of a cycle; another set each cycle.
                    if texts:
                        r = text_wave(port, os.path.basename(a.packed.rstrip("/")),
                                      [texts[(cycle * 8 + i) % len(texts)] for i in range(conc)], a.new_tokens)
                    else:
                        r = sbs.run_wave(port, os.path.basename(a.packed), a.vocab, conc, a.prompt_tokens,
                                         a.new_tokens, conc, 1000 + cycle, False)
                finally:
                    stack.stop(w, g)
                log = sbs.tail(wlog, 200000)
                m = re.search(r"experts: (\d+) hits, (\d+) misses, ([\d.]+) MB copied, ([\d.]+) MB streamed", log)
                wm = re.search(r"warmed (\d+) of (\d+) experts from profile \S+ in ([\d.]+) ms \((\d+) islands, "
                               r"\d+ of its experts resident before; together they served ([\d.]+) %", log)
                hits, misses = (int(m.group(1)), int(m.group(2))) if m else (None, None)
                row = {"shape": a.shape, "budget": a.mode, "routing": a.routing, "warm_profile": state,
                       "cycle": cycle, "concurrency": conc, "new_tokens": a.new_tokens,
                       "prompt_tokens": a.prompt_tokens, "worker_ready_s": round(ready, 2),
                       "warmed": int(wm.group(1)) if wm else 0, "islands": int(wm.group(4)) if wm else None,
                       "warm_ms": float(wm.group(3)) if wm else 0.0,
                       "profile_coverage": float(wm.group(5)) / 100 if wm else None,
                       "out_tok_s": round(r["out_tok_s"], 1), "ttft_ms_p50": round(r["ttft_ms_p50"], 1),
                       "itl_ms_p50": round(r["itl_ms_p50"], 2), "wall_s": round(r["wall_s"], 3),
                       "tokens": r["tokens"], "errors": r["errors"][:2], "expert_hits": hits, "expert_misses": misses,
                       "hit_rate": round(hits / (hits + misses), 4) if m and hits + misses else None,
                       "mb_copied": float(m.group(3)) if m else None, "mb_streamed": float(m.group(4)) if m else None}
                sbs.log(f"  {tag}: {row['out_tok_s']} tok/s, ttft {row['ttft_ms_p50']} ms, "
                        f"hit rate {row['hit_rate']}, {row['mb_streamed']} MB streamed, warmed {row['warmed']}")
                with open(a.rows, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
