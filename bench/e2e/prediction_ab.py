"""Expert prediction and grouped batching, each on and off, through HTTP.

Per configuration a CUDA worker is started under `--budget` with a fixed KV
pool (`--kv-trade off`, so every configuration has the same islands) and
the routing `--routing` names, and a gateway in front of it:

  off       --predict off --grouped-batching off
  predict   --predict on  --grouped-batching off
  grouped   --predict on  --grouped-batching on

Each first serves `--learn` requests (the predictor learns from the
worker's routing summaries), then waves of streamed /v1/completions at each
concurrency. Per wave, from the gateway's /metrics: expert misses and bytes
over the link (copied into islands and streamed) per completion token,
distinct experts per worker step (steps that reported their expert use),
and the share of predicted experts the request then used. Rows as
bench/results/prediction-ab-latest.json holds them, one JSON line each, to
--rows: "prediction" compares off with predict, "grouping" predict with
grouped.

  python3 bench/e2e/prediction_ab.py --packed Q15.moepack --bin BIN --budget 6GiB \\
      --routing replay:bench/e2e/traces/qwen1.5-moe-a2.7b.safetensors --shape qwen1.5-moe-a2.7b \\
      --rows rows.jsonl --work W
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import side_by_side as sbs  # noqa: E402
import stack  # noqa: E402

CONFIGS = {
    "off": ["--predict", "off", "--grouped-batching", "off"],
    "predict": ["--predict", "on", "--grouped-batching", "off"],
    "grouped": ["--predict", "on", "--grouped-batching", "on"],
}
KEYS = ("moe_gateway_worker_expert_hits_total", "moe_gateway_worker_expert_misses_total",
        "moe_worker_expert_bytes_copied_total", "moe_worker_expert_bytes_streamed_total",
        "moe_gateway_steps_with_usage_total", "moe_gateway_step_experts_total",
        "moe_gateway_predicted_experts_total", "moe_gateway_prediction_hits_total")


def counters(port):
    m = stack.settled_metrics(port, KEYS)
    return {k: m.get(k) or 0.0 for k in KEYS}


def rows_of(config, conc, d, tokens, wave, a):
    """This wave's rows: the mechanisms the configuration is a side of."""
    per_token = lambda v: round(v / tokens, 3) if tokens else None  # noqa: E731
    steps = d["moe_gateway_steps_with_usage_total"]
    predicted = d["moe_gateway_predicted_experts_total"]
    base = {"shape": a.shape, "budget": a.budget, "routing": a.routing, "concurrency": conc,
            "tok_s": round(wave["out_tok_s"], 1),
            "link_bytes_per_token": per_token(d["moe_worker_expert_bytes_copied_total"] +
                                              d["moe_worker_expert_bytes_streamed_total"]),
            "misses_per_token": per_token(d["moe_gateway_worker_expert_misses_total"]),
            "distinct_experts_per_step": round(d["moe_gateway_step_experts_total"] / steps, 2) if steps else None,
            "prediction_accuracy": round(d["moe_gateway_prediction_hits_total"] / predicted, 4) if predicted else None,
            "hit_rate": None, "tokens": tokens, "itl_ms_p50": round(wave["itl_ms_p50"], 2),
            "ttft_ms_p50": round(wave["ttft_ms_p50"], 1), "errors": wave["errors"][:2], "config": config}
    h, m = d["moe_gateway_worker_expert_hits_total"], d["moe_gateway_worker_expert_misses_total"]
    base["hit_rate"] = round(h / (h + m), 4) if h + m else None
    sides = {"off": [("prediction", "off")], "predict": [("prediction", "on"), ("grouping", "off")],
             "grouped": [("grouping", "on")]}[config]
    return [dict(base, mechanism=mech, state=state) for mech, state in sides]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    stack.run_arguments(ap)
    ap.add_argument("--budget", required=True)
    ap.add_argument("--shape", required=True)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--kv-blocks", type=int, default=320)
    ap.add_argument("--backend", default="cuda", help="cpu: a check of this script on a machine without a GPU")
    ap.add_argument("--configs", default="off,predict,grouped")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--learn", type=int, default=32)
    ap.add_argument("--requests-at-1", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    done = stack.done_rows(a.rows, lambda r: (r["config"], r["concurrency"]))
    for config in a.configs.split(","):
        # grouping only changes which ready sequences a step takes: measured where many wait
        concs = [int(c) for c in a.concurrency.split(",")
                 if (config, int(c)) not in done and not (config == "grouped" and int(c) == 1)]
        if not concs:
            continue
        if stack.past_deadline(a, 60):
            return
        tag = f"{a.shape}-{config}"
        w, g, port, wlog = stack.start(a.bin, a.packed, a.work, tag,
                                       ["--backend", a.backend, "--kv-blocks", str(a.kv_blocks), "--routing", a.routing] +
                                       (["--vram-budget", a.budget, "--kv-trade", "off"] if a.backend == "cuda" else []),
                                       CONFIGS[config])
        try:
            sbs.log(f"  {tag}: learning from {a.learn} requests")
            sbs.run_wave(port, os.path.basename(a.packed), a.vocab, 8, a.prompt_tokens, 16, a.learn, 7, False)
            for conc in concs:
                c0 = counters(port)
                n = a.requests_at_1 if conc == 1 else conc
                wave = sbs.run_wave(port, os.path.basename(a.packed), a.vocab, conc, a.prompt_tokens, a.new_tokens,
                                    n, 100 + conc, False)
                c1 = counters(port)
                d = {k: c1[k] - c0[k] for k in KEYS}
                for row in rows_of(config, conc, d, wave["tokens"], wave, a):
                    sbs.log(f"  {tag} c{conc} {row['mechanism']} {row['state']}: {row['tok_s']} tok/s, "
                            f"{row['link_bytes_per_token']} link B/token, {row['misses_per_token']} misses/token, "
                            f"{row['distinct_experts_per_step']} experts/step, accuracy {row['prediction_accuracy']}")
                    with open(a.rows, "a") as f:
                        f.write(json.dumps(row) + "\n")
        finally:
            stack.stop(w, g)


if __name__ == "__main__":
    main()
