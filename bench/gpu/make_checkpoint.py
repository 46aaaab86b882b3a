#!/usr/bin/env python3
"""Writes a seeded random-weight Hugging Face checkpoint folder of a real
MoE shape, as transformers would save it: config.json, bf16 safetensors
shards of about 4 GB with model.safetensors.index.json, and the tokenizer
files of --tokenizer beside them (the real Qwen3 tokenizer for the Qwen
shapes). The weights are drawn on the GPU when there is one (fast), one
tensor at a time, so the host never holds more than a shard.

    python3 bench/gpu/make_checkpoint.py --shape qwen3-30b-a3b --out /tmp/qwen3 --tokenizer DIR

Shapes: qwen3-30b-a3b (30.5 B parameters, 61 GB), qwen1.5-moe-a2.7b
(14.3 B, 27 GB), deepseek-v2-lite (15.7 B, 31 GB; its 102,400-token vocabulary
read through the Qwen3 tokenizer's first ids); --tiny scales each down to a few MB (to check the
format here, without a GPU). Draws with torch where it is installed (the
GPU machine has it), else with Python's own generator (slow: --tiny only).
"""
import argparse
import json
import os
import random
import shutil
import struct
import sys
import time

SHAPES = {
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, intermediate_size=6144, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=40960, tie_word_embeddings=False, attention_bias=False, hidden_act="silu",
        bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16"),
    "qwen1.5-moe-a2.7b": dict(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", hidden_size=2048, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632, intermediate_size=5632,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False, vocab_size=151936,
        rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=False,
        hidden_act="silu", bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16"),
    # Its hub config.json (docs/cuda-mla.md), its own BOS / EOS ids (ordinary tokens of the Qwen3
    # tokenizer that --tokenizer gives it: inside the vocabulary, unlike that tokenizer's specials).
    "deepseek-v2-lite": dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        moe_intermediate_size=1408, intermediate_size=10944, first_k_dense_replace=1, moe_layer_freq=1,
        topk_method="greedy", n_group=1, topk_group=1, scoring_func="softmax", routed_scaling_factor=1.0,
        norm_topk_prob=False, vocab_size=102400, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        rms_norm_eps=1e-6, max_position_embeddings=163840, tie_word_embeddings=False, attention_bias=False,
        hidden_act="silu", bos_token_id=100000, eos_token_id=100001, torch_dtype="bfloat16"),
}


def tensors(cfg):
    """(name, shape, kind) in the order transformers writes them."""
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", H // nh)
    E = cfg.get("num_experts", cfg.get("n_routed_experts"))
    I = cfg["moe_intermediate_size"]
    V = cfg["vocab_size"]
    qwen3 = cfg["model_type"] == "qwen3_moe"
    deepseek = cfg["model_type"] == "deepseek_v2"

    def routed(p):
        """A MoE layer's router and experts."""
        yield p + "mlp.gate.weight", (E, H), "w"
        for e in range(E):
            q = p + f"mlp.experts.{e}."
            yield q + "gate_proj.weight", (I, H), "w"
            yield q + "up_proj.weight", (I, H), "w"
            yield q + "down_proj.weight", (H, I), "w"

    yield "model.embed_tokens.weight", (V, H), "w"
    for l in range(L):
        p = f"model.layers.{l}."
        yield p + "input_layernorm.weight", (H,), "one"
        yield p + "post_attention_layernorm.weight", (H,), "one"
        if deepseek:
            R, nope, rope, vd = (cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                                 cfg["v_head_dim"])
            yield p + "self_attn.q_proj.weight", (nh * (nope + rope), H), "w"
            yield p + "self_attn.kv_a_proj_with_mqa.weight", (R + rope, H), "w"
            yield p + "self_attn.kv_a_layernorm.weight", (R,), "one"
            yield p + "self_attn.kv_b_proj.weight", (nh * (nope + vd), R), "w"
            yield p + "self_attn.o_proj.weight", (H, nh * vd), "w"
            if l < cfg["first_k_dense_replace"]:
                D = cfg["intermediate_size"]
                yield p + "mlp.gate_proj.weight", (D, H), "w"
                yield p + "mlp.up_proj.weight", (D, H), "w"
                yield p + "mlp.down_proj.weight", (H, D), "w"
                continue
            yield from routed(p)
            S = cfg["n_shared_experts"] * I
            yield p + "mlp.shared_experts.gate_proj.weight", (S, H), "w"
            yield p + "mlp.shared_experts.up_proj.weight", (S, H), "w"
            yield p + "mlp.shared_experts.down_proj.weight", (H, S), "w"
            continue
        yield p + "self_attn.q_proj.weight", (nh * hd, H), "w"
        yield p + "self_attn.k_proj.weight", (nkv * hd, H), "w"
        yield p + "self_attn.v_proj.weight", (nkv * hd, H), "w"
        yield p + "self_attn.o_proj.weight", (H, nh * hd), "w"
        if qwen3:
            yield p + "self_attn.q_norm.weight", (hd,), "one"
            yield p + "self_attn.k_norm.weight", (hd,), "one"
        else:
            for n in ("q", "k", "v"):
                yield p + f"self_attn.{n}_proj.bias", ((nh if n == "q" else nkv) * hd,), "w"
        yield from routed(p)
        if not qwen3:
            S = cfg["shared_expert_intermediate_size"]
            yield p + "mlp.shared_expert.gate_proj.weight", (S, H), "w"
            yield p + "mlp.shared_expert.up_proj.weight", (S, H), "w"
            yield p + "mlp.shared_expert.down_proj.weight", (H, S), "w"
            yield p + "mlp.shared_expert_gate.weight", (1, H), "w"
    yield "model.norm.weight", (H,), "one"
    yield "lm_head.weight", (V, H), "w"


def write_safetensors(path, named):
    """named: [(name, shape, bf16 bytes)] -> one .safetensors file."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, data in named:
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, data in named:
            f.write(data)


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", help="a folder with tokenizer.json and tokenizer_config.json to copy beside")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--shard-gb", type=float, default=4.0)
    ap.add_argument("--tiny", action="store_true", help="the shape scaled down to a few MB")
    a = ap.parse_args()
    cfg = dict(SHAPES[a.shape])
    if a.tiny and cfg["model_type"] == "deepseek_v2":
        cfg.update(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=32, intermediate_size=128)
    elif a.tiny:
        cfg.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   num_experts=8, moe_intermediate_size=32, intermediate_size=128, vocab_size=cfg["vocab_size"])
        if "head_dim" in cfg:
            cfg["head_dim"] = 16
        if "shared_expert_intermediate_size" in cfg:
            cfg["shared_expert_intermediate_size"] = 64
        cfg["num_experts_per_tok"] = 2
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None and not a.tiny:
        sys.exit("make_checkpoint: torch is needed for a real-size checkpoint")
    os.makedirs(a.out, exist_ok=True)
    if torch is not None:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        gen = torch.Generator(device=dev).manual_seed(a.seed)
    else:
        rnd = random.Random(a.seed)

    def draw(shape, kind):
        """bf16 bytes: ones for norms, else N(0, 1/fan_in)."""
        n = numel(shape)
        if kind == "one":
            return struct.pack("<H", 0x3F80) * n
        std = 1.0 / (shape[-1] ** 0.5)
        if torch is not None:
            t = (torch.randn(shape, generator=gen, device=dev, dtype=torch.float32) * std).to(torch.bfloat16)
            return t.view(torch.int16).cpu().numpy().tobytes() if hasattr(t, "numpy") else bytes(t.cpu().untyped_storage())
        out = bytearray()
        for _ in range(n):
            bits = struct.unpack("<I", struct.pack("<f", rnd.gauss(0.0, std)))[0]
            out += struct.pack("<H", bits >> 16)
        return bytes(out)

    plan = list(tensors(cfg))
    total = sum(2 * numel(s) for _, s, _ in plan)
    limit = int(a.shard_gb * 1e9)
    shards, cur, cur_bytes = [], [], 0
    for t in plan:
        b = 2 * numel(t[1])
        if cur and cur_bytes + b > limit:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(t)
        cur_bytes += b
    shards.append(cur)
    weight_map, written, t0 = {}, 0, time.time()
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        named = []
        for name, shape, kind in shard:
            named.append((name, shape, draw(shape, kind)))
            weight_map[name] = fname
        write_safetensors(os.path.join(a.out, fname), named)
        written += sum(len(d) for _, _, d in named)
        del named
        print(f"make_checkpoint: shard {i + 1} of {len(shards)}, {written / 1e9:.1f} of {total / 1e9:.1f} GB, "
              f"{time.time() - t0:.0f} s", flush=True)
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": written}, "weight_map": weight_map}, f)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        eos = [cfg["eos_token_id"]] + ([151643] if cfg["vocab_size"] > 151643 else [])  # Qwen's <|endoftext|> too
        json.dump({"bos_token_id": cfg["bos_token_id"], "eos_token_id": eos}, f)
    if a.tokenizer:
        for n in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if os.path.exists(os.path.join(a.tokenizer, n)):
                shutil.copy(os.path.join(a.tokenizer, n), os.path.join(a.out, n))
    print(f"make_checkpoint: {a.out}: {a.shape}, {written / 1e9:.1f} GB in {len(shards)} shards, "
          f"{time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
