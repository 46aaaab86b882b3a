#!/usr/bin/env python3
"""Writes deploy/grafana/moe-serve-dashboard.json: a Grafana dashboard over the
gateway's /metrics (docs/operations.md). Run from the repository root after
changing a panel; the JSON is what operators import (Prometheus data source
chosen at import)."""
import json
ds = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
panels = []
y = [0]
def row(title):
    panels.append({"type": "row", "title": title, "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y[0]},
                   "id": len(panels) + 1, "panels": []})
    y[0] += 1
x = [0]
def ts(title, targets, unit="short", w=8, desc=""):
    if x[0] + w > 24:
        x[0] = 0
        y[0] += 8
    panels.append({"type": "timeseries", "title": title, "description": desc, "datasource": ds, "id": len(panels) + 1,
                   "gridPos": {"h": 8, "w": w, "x": x[0], "y": y[0]},
                   "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                   "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
                   "targets": [{"datasource": ds, "expr": e, "legendFormat": l, "refId": chr(65 + i)}
                               for i, (e, l) in enumerate(targets)]})
    x[0] += w
def newrow(title):
    x[0] = 0
    y[0] += 8
    row(title)
W = '{worker=~"$worker"}'
row("Requests")
ts("Requests / s by status", [('sum by (status) (rate(moe_gateway_requests_total{endpoint=~"/v1/.*"}[1m]))', "{{status}}")], "reqps")
ts("Output tokens / s", [("rate(moe_gateway_completion_tokens_total[1m])", "generated"),
                          ("rate(moe_gateway_prompt_tokens_total[1m])", "prompt")], "short")
ts("Time to first token", [("histogram_quantile(0.5, rate(moe_gateway_time_to_first_token_seconds_bucket[5m]))", "p50"),
                           ("histogram_quantile(0.99, rate(moe_gateway_time_to_first_token_seconds_bucket[5m]))", "p99")], "s")
ts("Inter-token latency", [("histogram_quantile(0.5, rate(moe_gateway_inter_token_latency_seconds_bucket[5m]))", "p50"),
                           ("histogram_quantile(0.99, rate(moe_gateway_inter_token_latency_seconds_bucket[5m]))", "p99")], "s")
ts("Sequences", [("moe_gateway_sequences_running", "running"), ("moe_gateway_sequences_waiting", "waiting"),
                 ("moe_gateway_main_waiting", "waiting for a main worker"),
                 ("moe_gateway_sequences_on_fallback", "on the fallback (overload)")])
ts("Oldest wait for a main worker", [("moe_gateway_main_oldest_wait_seconds", "oldest wait")], "s",
   desc="What --overload-wait-ms compares against.")
newrow("Overload, priorities, failover")
ts("Refused and degraded / s", [("rate(moe_gateway_overload_fallback_total[1m])", "sent to the fallback"),
                                ("rate(moe_gateway_overload_refused_total[1m])", "refused: overloaded"),
                                ("rate(moe_gateway_rate_limited_total[1m])", "refused: rate limit"),
                                ("rate(moe_gateway_admission_refused_total[1m])", "refused: admission bounds")], "reqps")
ts("Degraded (fallback serving)", [("moe_gateway_degraded", "degraded"),
                                    ('moe_gateway_worker_ready' + W, "{{worker}} ready")])
ts("Preemptions / s", [("rate(moe_gateway_preemptions_total[1m])", "all"),
                       ("rate(moe_gateway_priority_preemptions_total[1m])", "for an earlier priority")])
newrow("The card")
ts("Temperature", [("moe_worker_card_temperature_celsius" + W, "{{worker}}")], "celsius")
ts("SM clock", [("moe_worker_card_sm_clock_mhz" + W, "{{worker}} now"),
                ("moe_worker_card_sm_clock_max_mhz" + W, "{{worker}} max")], "none")
ts("Power", [("moe_worker_card_power_watts" + W, "{{worker}} draw"),
             ("moe_worker_card_power_limit_watts" + W, "{{worker}} limit")], "watt")
ts("Throttle reasons", [('moe_worker_card_throttle{worker=~"$worker",reason!="gpu_idle"} == 1', "{{worker}} {{reason}}")],
   "none", desc="1 while NVML reports the reason (gpu_idle left out).")
ts("Hot: step budget and batch halved", [("moe_gateway_worker_hot" + W, "{{worker}} hot"),
                                          ("moe_gateway_worker_step_token_budget" + W, "{{worker}} step budget"),
                                          ("moe_gateway_worker_batch_limit" + W, "{{worker}} batch limit")])
ts("Device memory of the worker", [("moe_worker_card_process_memory_bytes" + W, "{{worker}}"),
                                   ("moe_worker_card_memory_total_bytes" + W, "{{worker}} card")], "bytes")
ts("PCIe", [("moe_worker_card_pcie_rx_bytes_per_second" + W, "{{worker}} to the card"),
            ("moe_worker_card_pcie_tx_bytes_per_second" + W, "{{worker}} from the card")], "Bps")
newrow("Experts and KV")
ts("Expert hit rate", [("rate(moe_worker_expert_hits_total" + W + "[1m]) / (rate(moe_worker_expert_hits_total" + W +
                        "[1m]) + rate(moe_worker_expert_misses_total" + W + "[1m]))", "{{worker}}")], "percentunit")
ts("Expert bytes over the link per token",
   [("(rate(moe_worker_expert_bytes_copied_total" + W + "[1m]) + rate(moe_worker_expert_bytes_streamed_total" + W +
     "[1m])) / rate(moe_worker_tokens_total" + W + "[1m])", "{{worker}}")], "bytes")
ts("Islands", [("moe_worker_islands_used" + W, "{{worker}} used"), ("moe_worker_islands_total" + W, "{{worker}} total")])
ts("KV blocks", [("moe_worker_kv_blocks_used" + W, "{{worker}} used"),
                 ("moe_worker_kv_blocks_used" + W + " + moe_worker_kv_blocks_free" + W, "{{worker}} total")])
ts("Worker uptime", [("moe_worker_uptime_seconds" + W, "{{worker}}")], "s", desc="A drop: the worker restarted.")
dash = {
    "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "description": "the Prometheus that scrapes /metrics",
                  "type": "datasource", "pluginId": "prometheus", "pluginName": "Prometheus"}],
    "__requires": [{"type": "grafana", "id": "grafana", "name": "Grafana", "version": "9.0.0"},
                   {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
                   {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""}],
    "title": "moe-serve", "uid": "moe-serve", "schemaVersion": 36, "version": 1, "editable": True,
    "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "tags": ["moe-serve"],
    "templating": {"list": [{"name": "worker", "label": "worker", "type": "query", "datasource": ds,
                             "query": {"query": "label_values(moe_gateway_worker_ready, worker)", "refId": "W"},
                             "definition": "label_values(moe_gateway_worker_ready, worker)", "refresh": 2,
                             "includeAll": True, "multi": True, "allValue": ".*",
                             "current": {"text": "All", "value": "$__all"}}]},
    "panels": panels,
}
json.dump(dash, open("deploy/grafana/moe-serve-dashboard.json", "w"), indent=1)
print(len(panels), "panels")
