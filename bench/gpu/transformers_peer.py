#!/usr/bin/env python3
"""The peer on the same GPU and the same shapes: transformers, bf16, random
weights, greedy `generate`. Decode tokens/s at batch 1 and 8 after a
128-token prompt, and a 512-token prefill, for the Qwen1.5-MoE-A2.7B and
Qwen3-30B-A3B shapes that moe-bench-engine measures; then, given that
benchmark's JSON (one file or several, comma-separated), one table of
ratios and targets, and with --summary the machine-readable summary
(bench/results/gpu-latest.json): {"date", "gpu", "commit", "rows": [...]}.

  transformers_peer.py [--shape qwen15|qwen3|dsv2lite|all] [--new-tokens 48]
                       [--ours a.json[,b.json]] [--json OUT] [--summary OUT]
                       [--commit REV]

Runs where torch and transformers are installed (the GPU machine).
"""
import argparse
import datetime
import json
import subprocess
import sys
import time


SHAPES = {
    "Qwen1.5-MoE-A2.7B": dict(
        kind="qwen2_moe", hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632, intermediate_size=5632, num_experts=60,
        num_experts_per_tok=4, norm_topk_prob=False, vocab_size=151936, rope_theta=1e6),
    "Qwen3-30B-A3B": dict(
        kind="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, moe_intermediate_size=768, intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, vocab_size=151936, rope_theta=1e6),
    # Its hub config (docs/cuda-mla.md); not in --shape all.
    "DeepSeek-V2-Lite": dict(
        kind="deepseek_v2", hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        moe_intermediate_size=1408, intermediate_size=10944, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, first_k_dense_replace=1, norm_topk_prob=False, routed_scaling_factor=1.0,
        topk_method="greedy", n_group=1, topk_group=1, vocab_size=102400, rope_theta=1e4),
}
SHAPE_FLAGS = {"qwen15": ["Qwen1.5-MoE-A2.7B"], "qwen3": ["Qwen3-30B-A3B"], "dsv2lite": ["DeepSeek-V2-Lite"],
               "all": ["Qwen1.5-MoE-A2.7B", "Qwen3-30B-A3B"]}
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


# What each row must reach (the targets; llama.cpp Q4_K_M on this
# machine is the engine to beat). Key: (shape, mode, phase, batch).
TARGETS = {
    ("Qwen1.5-MoE-A2.7B", "resident", "decode", 1): 520,
    ("Qwen1.5-MoE-A2.7B", "resident", "decode", 8): 1670,
    ("Qwen1.5-MoE-A2.7B", "resident", "prefill", 512): 14100,
    ("Qwen1.5-MoE-A2.7B", "budget-6GiB", "decode", 1): 215,
    ("Qwen3-30B-A3B", "resident", "decode", 1): 380,
    ("Qwen3-30B-A3B", "budget-12GiB", "decode", 1): 130,
    ("Qwen3-30B-A3B", "budget-12GiB", "prefill", 512): 2800,
}


def build(name):
    import torch
    import transformers
    spec = dict(SHAPES[name])
    kind = spec.pop("kind")
    if kind == "deepseek_v2":
        theta = spec.pop("rope_theta")
        try:  # transformers 5 spells RoPE settings rope_parameters
            cfg = transformers.DeepseekV2Config(**spec, max_position_embeddings=163840, torch_dtype="bfloat16",
                                                rope_parameters=dict(YARN, rope_theta=theta))
        except TypeError:
            cfg = transformers.DeepseekV2Config(**spec, max_position_embeddings=163840, torch_dtype="bfloat16",
                                                rope_theta=theta, rope_scaling=dict(YARN, type="yarn"))
    else:
        cfg_cls = transformers.Qwen2MoeConfig if kind == "qwen2_moe" else transformers.Qwen3MoeConfig
        cfg = cfg_cls(**spec, max_position_embeddings=4096, torch_dtype="bfloat16")
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model.eval()
    impl = "default"
    # The fastest experts implementation this transformers offers, when it has a switch.
    for setter in ("set_experts_implementation",):
        if hasattr(model, setter):
            try:
                getattr(model, setter)("grouped_mm")
                impl = "grouped_mm"
            except Exception as e:  # noqa: BLE001 - reported, the default is kept
                impl = "default (grouped_mm refused: %s)" % e
    return model, impl


def timed_generate(model, batch, prompt_len, new_tokens):
    import torch
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device="cuda")
    attn = torch.ones_like(ids)
    model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    torch.cuda.synchronize()
    t0 = time.time()
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=new_tokens, do_sample=False,
                         min_new_tokens=new_tokens)
    torch.cuda.synchronize()
    dt = time.time() - t0
    return batch * (out.shape[1] - prompt_len) / dt


def timed_prefill(model, n):
    import torch
    ids = torch.randint(0, model.config.vocab_size, (1, n), device="cuda")
    with torch.no_grad():
        model(ids)
        torch.cuda.synchronize()
        runs = []
        for _ in range(3):
            t0 = time.time()
            model(ids)
            torch.cuda.synchronize()
            runs.append(time.time() - t0)
    return n / sorted(runs)[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="all")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--ours", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--summary", default="")
    ap.add_argument("--commit", default="")
    a = ap.parse_args()
    if not a.commit:
        try:
            a.commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                      check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            a.commit = "unknown"
    try:
        import torch
        import transformers
    except ImportError as e:
        print("SKIPPED: torch/transformers not installed (%s)" % e)
        return 0
    if a.shape not in SHAPE_FLAGS:
        print("transformers_peer.py: --shape takes %s" % "|".join(SHAPE_FLAGS), file=sys.stderr)
        return 2
    names = SHAPE_FLAGS[a.shape]
    rows = []
    for name in names:
        try:
            model, impl = build(name)
        except Exception as e:  # noqa: BLE001 - said, and the other shapes still run
            print("%s: transformers could not build this shape: %s" % (name, e), flush=True)
            continue
        print("%s: transformers %s, experts %s" % (name, transformers.__version__, impl), flush=True)
        for b in (1, 8):
            tps = timed_generate(model, b, 128, a.new_tokens)
            rows.append({"shape": name, "mode": "resident", "phase": "decode", "batch": b, "transformers_tok_s": tps})
            print("  decode b%d: %.1f tok/s" % (b, tps), flush=True)
        tps = timed_prefill(model, 512)
        rows.append({"shape": name, "mode": "resident", "phase": "prefill", "batch": 512, "transformers_tok_s": tps})
        print("  prefill 512: %.0f tok/s" % tps, flush=True)
        del model
        torch.cuda.empty_cache()
    if a.ours:
        ours = []
        for path in a.ours.split(","):
            o = json.load(open(path))
            ours += o["rows"] if isinstance(o, dict) else o
        peer = {(r["shape"], r["mode"], r["phase"], r["batch"]): r["transformers_tok_s"] for r in rows}
        print("\n| shape | mode | routing | phase | batch | ours (dense) | transformers | ours / transformers "
              "| target | hit rate | PCIe MB/token | GPU MiB |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        summary = []
        for o in ours:
            key = (o["shape"], o["mode"], o["phase"], o["batch"])
            tf = peer.get(key)
            target = TARGETS.get(key)
            row = dict(o)
            row["transformers_tok_s"] = tf
            row["target_tok_s"] = target
            summary.append(row)
            print("| %s | %s | %s | %s | %d | %.0f (%s) | %s | %s | %s | %.3f | %.1f | %.0f |" % (
                o["shape"], o["mode"], o.get("routing", "router"), o["phase"], o["batch"], o["ours_tok_s"],
                o.get("dense_weights", "bf16"), "%.1f" % tf if tf else "-",
                "%.1fx" % (o["ours_tok_s"] / tf) if tf else "-",
                ("%d %s" % (target, "met" if o["ours_tok_s"] >= target else "not met")) if target else "-",
                o.get("hit_rate", 1.0), o.get("pcie_mb_per_token", 0.0), o.get("peak_gpu_mib", 0.0)))
        if a.summary:
            gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "unknown"
            with open(a.summary, "w") as f:
                json.dump({"date": datetime.date.today().isoformat(), "gpu": gpu, "commit": a.commit,
                           "transformers": transformers.__version__, "rows": summary}, f, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
