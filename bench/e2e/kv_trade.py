"""KV blocks and expert islands trading places, through HTTP
(docs/kv-islands-trade.md).

A CUDA worker under a budget starts with its default KV pool (64 blocks of
16 tokens under a budget), a gateway in front of it. Short chats are timed
before, one long prompt (`--long-tokens`, default 30,000) is sent, short
chats are timed again while the KV holds the islands it took, then again
after the worker gave them back (`--kv-give-back-s`, 45 s here so that
both waves after the long prompt run while its KV holds the islands). The same with
`--kv-trade off`, where the long prompt cannot be served. One JSON line per
(kv trade, phase, concurrency) to --rows: islands and the gateway's KV
total from /metrics, tokens/s, hit rate, and the long prompt's status.

  python3 bench/e2e/kv_trade.py --packed Q3.moepack --bin BIN --budget 8GiB \\
      --routing replay:bench/e2e/traces/qwen3-30b-a3b.safetensors --rows rows.jsonl --work W
"""
import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import side_by_side as sbs  # noqa: E402
import stack  # noqa: E402


def metrics(port):
    """{name: summed value} of the gauges and counters this benchmark reads."""
    m = sbs.metric_sums(port, ("moe_worker_islands_total", "moe_worker_islands_used", "moe_gateway_kv_blocks_total",
                               "moe_worker_kv_blocks_free", "moe_worker_kv_blocks_used",
                               "moe_gateway_worker_expert_hits_total", "moe_gateway_worker_expert_misses_total"))
    if m is None:
        raise RuntimeError("the gateway's /metrics cannot be read")
    return m


def settled(port):
    time.sleep(1.3)  # the gateway asks its workers for stats every second
    return metrics(port)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    stack.run_arguments(ap)
    ap.add_argument("--budget", default="8GiB")
    ap.add_argument("--trades", default="on,off")
    ap.add_argument("--long-tokens", type=int, default=30000)
    ap.add_argument("--kv-give-back-s", type=int, default=45)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    done = stack.done_rows(a.rows, lambda r: r["kv_trade"])
    model = os.path.basename(a.packed)
    for trade in a.trades.split(","):
        if trade in done:
            continue
        if stack.past_deadline(a, 120):
            return
        tag = f"trade-{trade}"
        w, g, port, wlog = stack.start(a.bin, a.packed, a.work, tag,
                                       ["--backend", "cuda", "--vram-budget", a.budget, "--routing", a.routing,
                                        "--kv-trade", trade, "--kv-give-back-s", str(a.kv_give_back_s)])
        rows = []
        try:
            plan = re.search(r"KV (\d+) blocks \(([\d.]+ \w+)\), (\d+) islands", sbs.tail(wlog, 100000))
            sbs.log(f"  {tag}: " + (plan.group(0) if plan else "no plan line"))
            sbs.run_wave(port, model, a.vocab, 1, a.prompt_tokens, 16, 1, 7, False)

            def chats(phase, extra=None):
                for conc in [int(c) for c in a.concurrency.split(",")]:
                    m0 = settled(port)
                    n = 3 if conc == 1 else conc
                    r = sbs.run_wave(port, model, a.vocab, conc, a.prompt_tokens, a.new_tokens, n, 100 + conc, False)
                    m1 = settled(port)
                    hits = m1["moe_gateway_worker_expert_hits_total"] - m0["moe_gateway_worker_expert_hits_total"]
                    misses = m1["moe_gateway_worker_expert_misses_total"] - m0["moe_gateway_worker_expert_misses_total"]
                    row = {"shape": a.shape, "budget": a.budget, "routing": a.routing, "kv_trade": trade,
                           "phase": phase, "concurrency": conc, "requests": n, "prompt_tokens": a.prompt_tokens,
                           "new_tokens": a.new_tokens, "islands_at_start": m0["moe_worker_islands_total"],
                           "islands": m1["moe_worker_islands_total"],
                           "kv_blocks_announced": m1["moe_gateway_kv_blocks_total"],
                           "kv_blocks_worker_used": m1["moe_worker_kv_blocks_used"],
                           "out_tok_s": round(r["out_tok_s"], 1), "itl_ms_p50": round(r["itl_ms_p50"], 2),
                           "ttft_ms_p50": round(r["ttft_ms_p50"], 1), "errors": r["errors"][:2],
                           "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
                           "start_plan": plan.group(0) if plan else None}
                    if extra:
                        row.update(extra)
                    sbs.log(f"  {tag} {phase} c{conc}: {row['out_tok_s']} tok/s, hit rate {row['hit_rate']}, "
                            f"islands {row['islands_at_start']} -> {row['islands']}")
                    rows.append(row)

            chats("before")
            # The long prompt: served by taking islands, or refused.
            t0 = time.perf_counter()
            long_row = {"long_prompt_tokens": a.long_tokens}
            try:
                ttft, gaps, n = sbs.stream(port, model, [100 + (i * 7919) % (a.vocab - 400)
                                                         for i in range(a.long_tokens)], 16, False)
                long_row.update(long_status="served", long_ttft_s=round(ttft, 2), long_tokens_out=n,
                                long_prefill_tok_s=round(a.long_tokens / ttft, 1))
            except Exception as e:  # noqa: BLE001 - the refusal is the result without the trade
                long_row.update(long_status="refused", long_error=str(e)[:300])
            long_row["long_wall_s"] = round(time.perf_counter() - t0, 2)
            m = settled(port)
            long_row["islands_after_long"] = m["moe_worker_islands_total"]
            sbs.log(f"  {tag} long prompt of {a.long_tokens}: {long_row}")
            chats("after-long", long_row)
            # The grown KV goes back once mostly free for --kv-give-back-s.
            t1 = time.perf_counter()
            start_islands = rows[0]["islands"]
            while time.perf_counter() - t1 < a.kv_give_back_s + 30:
                if metrics(port)["moe_worker_islands_total"] == start_islands:
                    break
                time.sleep(0.5)
            back = {"islands_back_after_s": round(time.perf_counter() - t1, 1),
                    "kv_log": re.findall(r"moe-worker: KV (?:grew|gave back)[^\n]*", sbs.tail(wlog, 400000))[-6:]}
            chats("given-back", back)
        finally:
            stack.stop(w, g)
        with open(a.rows, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
