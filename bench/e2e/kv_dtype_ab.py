"""What a one-byte KV cache buys under a budget, through HTTP.

Per budget and per `--kv-dtype`, a CUDA worker is started with a KV pool of
`--kv-blocks` blocks (2,048 of 16 tokens: a 32 K context), its plan read from
its log (islands, KV bytes), and a gateway in front of it; after one warm-up
request, waves of `concurrency` streams each send one prompt and read
`new_tokens` tokens. Expert hits and misses per wave come from the gateway's
/metrics. One JSON line per (budget, kv dtype, concurrency) to --rows.

  python3 bench/e2e/kv_dtype_ab.py --packed Q3.moepack --bin BIN --budgets 8GiB,12GiB \\
      --routing replay:bench/e2e/traces/qwen3-30b-a3b.safetensors --rows rows.jsonl --work W
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import side_by_side as sbs  # noqa: E402
import stack  # noqa: E402


def counters(port):
    m = stack.settled_metrics(port, sbs.EXPERT_KEYS)
    return tuple(m.get(k) or 0.0 for k in sbs.EXPERT_KEYS)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    stack.run_arguments(ap)
    ap.add_argument("--budgets", default="8GiB,12GiB")
    ap.add_argument("--kv-dtypes", default="bf16,int8")
    ap.add_argument("--kv-blocks", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--requests-at-1", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    done = stack.done_rows(a.rows, lambda r: (r["budget"], r["kv_dtype"], r["concurrency"]))
    for budget in a.budgets.split(","):
        for kv in a.kv_dtypes.split(","):
            concs = [int(c) for c in a.concurrency.split(",") if (budget, kv, int(c)) not in done]
            if not concs:
                continue
            if stack.past_deadline(a, 60):
                return
            tag = f"{budget}-{kv}"
            w, g, port, wlog = stack.start(a.bin, a.packed, a.work, tag,
                                           ["--backend", "cuda", "--vram-budget", budget, "--kv-blocks",
                                            str(a.kv_blocks), "--kv-dtype", kv, "--routing", a.routing])
            try:
                log = sbs.tail(wlog, 100000)
                m = re.search(r"KV (\d+) blocks \(([\d.]+ \w+)\), (\d+) islands of ([\d.]+ \w+)", log)
                rows_dtype = re.search(r"KV rows (\w+)", log)
                sbs.log(f"  {tag}: " + (m.group(0) if m else "no plan line") +
                        f"; KV rows {rows_dtype.group(1) if rows_dtype else '?'}")
                sbs.run_wave(port, os.path.basename(a.packed), a.vocab, 1, a.prompt_tokens, 16, 1, 7, False)
                for conc in concs:
                    h0, m0 = counters(port)
                    n = a.requests_at_1 if conc == 1 else conc
                    r = sbs.run_wave(port, os.path.basename(a.packed), a.vocab, conc, a.prompt_tokens, a.new_tokens,
                                     n, 100 + conc, False)
                    h1, m1 = counters(port)
                    hits, misses = h1 - h0, m1 - m0
                    row = {"shape": a.shape, "budget": budget, "kv_dtype": kv,
                           "kv_rows": rows_dtype.group(1) if rows_dtype else None,
                           "kv_blocks": int(m.group(1)) if m else None, "kv_bytes": m.group(2) if m else None,
                           "islands": int(m.group(3)) if m else None, "routing": a.routing, "concurrency": conc,
                           "requests": n, "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
                           "out_tok_s": round(r["out_tok_s"], 1), "ttft_ms_p50": round(r["ttft_ms_p50"], 1),
                           "itl_ms_p50": round(r["itl_ms_p50"], 2), "tokens": r["tokens"], "errors": r["errors"][:2],
                           "expert_hits": hits, "expert_misses": misses,
                           "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None}
                    sbs.log(f"  {tag} c{conc}: {row['out_tok_s']} tok/s, itl {row['itl_ms_p50']} ms, "
                            f"hit rate {row['hit_rate']}, islands {row['islands']}")
                    with open(a.rows, "a") as f:
                        f.write(json.dumps(row) + "\n")
            finally:
                stack.stop(w, g)


if __name__ == "__main__":
    main()
