#!/usr/bin/env python3
"""The card's health as a user's monitoring sees it, on the GPU machine:
moe-worker (CUDA) under --vram-budget on a model, moe-gateway in front, a
streaming load over HTTP, then /metrics scraped while the load runs and
after it. Checks that the card is read through NVML (temperature, clocks,
power, the worker's device memory within its budget, PCIe throughput) and
that the residency series move; writes the scrapes and a summary.

    python3 bench/gpu/card_metrics.py --build BUILD --model FILE --budget 8GiB --out DIR

BUILD holds worker/moe-worker and gateway/moe-gateway (a build tree, or a
folder laid out so).
"""
import argparse
import http.client
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gateway"))
import full_stack as fs  # noqa: E402


def scrape(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            values[k] = float(v)
    return text, values


def series(values, name):
    """The one worker's value of a series (the first label set)."""
    for k, v in values.items():
        if k.startswith(name + "{"):
            return v
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget", default="8GiB")
    ap.add_argument("--vocab", type=int, default=150000)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    budget_bytes = int(a.budget[:-3]) << 30 if a.budget.endswith("GiB") else int(a.budget)
    with fs.Stack(a.build, a.model, a.out, "cuda", ["--vram-budget", a.budget]) as st:
        model = "model"
        c = http.client.HTTPConnection("127.0.0.1", st.port, timeout=10)
        c.request("GET", "/v1/models")
        model = json.loads(c.getresponse().read())["data"][0]["id"]
        result = {}
        load = threading.Thread(target=lambda: result.update(
            fs.run_load(st.port, model, a.vocab, 8, 128, 128, 2, seed=7)))
        t0 = time.time()
        load.start()
        time.sleep(4.0)
        during_text, during = scrape(st.port)
        load.join()
        time.sleep(1.5)  # one more stats period
        after_text, after = scrape(st.port)
        wall = time.time() - t0
    open(os.path.join(a.out, "metrics-during-load.txt"), "w").write(during_text)
    open(os.path.join(a.out, "metrics-after-load.txt"), "w").write(after_text)
    hits = series(after, "moe_worker_expert_hits_total") or 0
    misses = series(after, "moe_worker_expert_misses_total") or 0
    tokens = series(after, "moe_worker_tokens_total") or 0
    moved = (series(after, "moe_worker_expert_bytes_copied_total") or 0) + \
        (series(after, "moe_worker_expert_bytes_streamed_total") or 0)
    summary = {
        "budget": a.budget,
        "load": {k: result.get(k) for k in ("out_tok_s", "tokens", "errors")},
        "wall_s": round(wall, 1),
        "card_available": series(during, "moe_worker_card_available"),
        "temperature_c_during": series(during, "moe_worker_card_temperature_celsius"),
        "sm_clock_mhz_during": series(during, "moe_worker_card_sm_clock_mhz"),
        "sm_clock_max_mhz": series(during, "moe_worker_card_sm_clock_max_mhz"),
        "memory_clock_mhz": series(during, "moe_worker_card_memory_clock_mhz"),
        "power_w_during": series(during, "moe_worker_card_power_watts"),
        "power_limit_w": series(during, "moe_worker_card_power_limit_watts"),
        "process_memory_mib": (series(during, "moe_worker_card_process_memory_bytes") or 0) / 2**20,
        "pcie_rx_mb_s_during": (series(during, "moe_worker_card_pcie_rx_bytes_per_second") or 0) / 1e6,
        "pcie_tx_mb_s_during": (series(during, "moe_worker_card_pcie_tx_bytes_per_second") or 0) / 1e6,
        "throttle_reasons_during": sorted(k.split('reason="')[1].rstrip('"}') for k, v in during.items()
                                          if k.startswith("moe_worker_card_throttle{") and v == 1),
        "islands_used": series(after, "moe_worker_islands_used"),
        "islands_total": series(after, "moe_worker_islands_total"),
        "hit_ratio": hits / (hits + misses) if hits + misses else None,
        "bytes_moved_per_token": moved / tokens if tokens else None,
        "hot": series(after, "moe_gateway_worker_hot"),
    }
    json.dump(summary, open(os.path.join(a.out, "card-metrics.json"), "w"), indent=1)
    print(json.dumps(summary, indent=1))
    problems = []
    if summary["card_available"] != 1:
        problems.append("the card is not read through NVML")
    if not summary["temperature_c_during"] or not summary["power_w_during"] or not summary["sm_clock_mhz_during"]:
        problems.append("temperature, power or clocks missing")
    if not (0 < summary["process_memory_mib"] * 2**20 <= budget_bytes * 1.02):
        problems.append(f"the worker's device memory {summary['process_memory_mib']:.0f} MiB is not within {a.budget}")
    if not tokens or result.get("errors"):
        problems.append(f"the load did not run cleanly: {result.get('errors')}")
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
