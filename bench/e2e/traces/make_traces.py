#!/usr/bin/env python3
"""Build the routing traces the e2e benchmark replays (`--routing replay:FILE`).

Output: one safetensors file per benchmark shape, each holding a single tensor
`routing_topk`, dtype I16, shape [layers, tokens, top_k] (what
replay/routing_trace.cpp `read_routing_trace(path, "routing_topk")` and
cuda_engine/create.cpp accept):

    qwen3-30b-a3b.safetensors       48 layers x T x 8,  ids < 128
    qwen1.5-moe-a2.7b.safetensors   24 layers x T x 4,  ids < 60

Where the routing comes from
----------------------------
Both are built from per-token, per-layer expert choices that real models made
and that were published as CSV files in the Apache-2.0 repository
github.com/Helldez/BigMoeOnEdge, commit 36020f2f127f061f837fa2ff430e9d1d745438f9
(docs/bench-data/2026-07-15-route-trace/, unchanged at 2d4f2b11db128cbe32da738ce114c0479542f458).
The engine there is a llama.cpp-based CPU runtime; both runs used the same chat
prompt ("Explain how a mixture-of-experts model decides which experts handle
each token.", ChatML, thinking off), greedy-style decoding of 128 tokens, and
`--n-expert-used 6`, i.e. the router's six best experts instead of the
models' native eight.  Copies (xz) are in source/; their git blob ids are
checked before use.

  source/qwen3-30b-a3b.route.csv.xz    Qwen3-30B-A3B (Q4_K_M GGUF): 48 layers,
                                       128 experts, 6 recorded per token
  source/gemma-4-26b-a4b.route.csv.xz  Gemma-4-26B-A4B-it (Q4_K_M GGUF): 30 layers,
                                       128 experts, 6 recorded per token

Each CSV row is one (step, layer, slot) with slot = router rank (0 = highest
weight).  Steps are absolute positions: the prompt (prefill) first, then the
decoded tokens, so consecutive steps are consecutive tokens of one text.  A
step missing any layer is dropped (llama.cpp skips the last layer for prompt
rows whose logits are not needed: Qwen's steps 0-26 lack layer 47), so the
Qwen trace starts at the last prompt token.

Mapping onto the benchmark shapes
---------------------------------
What an expert cache sees is, per layer, how skewed expert popularity is and
how much one token's expert set overlaps the next one's.  The mapping keeps
both as far as the shapes allow; the measured statistics (printed by this
script, copied into README.md) are the check.

qwen3-30b-a3b  <- Qwen3-30B-A3B (same layers, same experts, 6 -> 8 per token)
  * layers and expert ids are kept as recorded; the six recorded experts fill
    slots 0-5 in router order.
  * slots 6-7 (the router's 7th/8th choice, not recorded) are filled per layer
    from that layer's own recording: with probability q the slot reuses an
    expert of the previous token's (mapped) set that the current token lacks,
    otherwise it is drawn from the layer's recorded popularity (counts + 0.5,
    so an unseen expert can appear), excluding experts already in the set.  q is
    solved per draw so that P(slot in previous set) equals a reuse target tau:
        q = (tau - pi) / (1 - pi),  pi = popularity mass of the reusable experts,
    and tau is tuned per layer (bisection) until the widened layer's overlap
    fraction mean |S_t & S_t+1| / 8 equals the recorded mean |S_t & S_t+1| / 6
    (the next token's recorded experts also hit the added ones, so tau ends
    below the recorded value).  Random streams: random.Random("SEED:target:layer"),
    SEED fixed below, so the output is reproducible byte for byte.

qwen1.5-moe-a2.7b  <- Gemma-4-26B-A4B (30 -> 24 layers, 128 -> 60 experts, 6 -> 4)
  (--qwen15-source qwen3 builds it from the Qwen3-30B-A3B recording instead.)
  * layers: 24 source layers evenly spaced, first and last kept:
        src = round(i * (L_src - 1) / 23), i = 0..23.
  * top-k: the router's top 4 of the recorded 6 (slots 0-3) are kept; slots 4-5
    are only used as fallbacks (below).
  * experts: per layer, the 128 source experts are ranked by how often they are
    among the kept top-4 (ties: count over all 6 slots, then id) and rank r goes
    to target expert floor(r * 60 / 128), so each target merges 2-3 source
    experts of neighbouring popularity.  That keeps the popularity curve as a
    function of the expert fraction (the share of the top 10 % of experts is
    that of the source's top 10 %).  When two of a token's top-4 land on the same
    target, the token takes its next recorded choice (slot 4, then 5) that lands
    elsewhere -- what a router with fewer experts would do -- and only if those
    collide too, the free target nearest in popularity rank.  Merging can only
    add reuse between neighbouring tokens (a different source expert of the same
    merged target counts as a hit); the statistics show how much.

Statistics (per layer l over tokens t; k = top-k, E = experts):
  top10  = share of all routings that go to the ceil(E/10) most used experts
  overlap = mean over t of |S_t & S_t+1| / k
printed for the source, the mapped trace, and a uniform random draw of the
mapped shape (k distinct experts per token, seeded) for contrast.

Usage:  python3 make_traces.py [--out-dir DIR] [--qwen15-source gemma4|qwen3] [--check]
Only the standard library is needed; runs offline from source/.
"""

import argparse
import hashlib
import io
import json
import lzma
import math
import os
import random
import struct
import sys
from array import array

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 20260715  # the recording's date; any fixed value works

REPO = "Helldez/BigMoeOnEdge"
COMMIT = "36020f2f127f061f837fa2ff430e9d1d745438f9"
SOURCES = {
    "qwen3": {
        "file": "source/qwen3-30b-a3b.route.csv.xz",
        "path": "docs/bench-data/2026-07-15-route-trace/qwen.route.csv",
        "blob": "fadee394f8bec86de3e7b22aadd79512b6cb583f",
        "model": "Qwen3-30B-A3B (Q4_K_M GGUF)",
    },
    "gemma4": {
        "file": "source/gemma-4-26b-a4b.route.csv.xz",
        "path": "docs/bench-data/2026-07-15-route-trace/gemma.route.csv",
        "blob": "b6e69bb5c43b616f1d2b92e6b828737afdd93ab3",
        "model": "Gemma-4-26B-A4B-it (Q4_K_M GGUF)",
    },
}
TARGETS = {
    "qwen3-30b-a3b": {"layers": 48, "experts": 128, "k": 8, "source": "qwen3"},
    "qwen1.5-moe-a2.7b": {"layers": 24, "experts": 60, "k": 4, "source": "gemma4"},
}


# ---------------------------------------------------------------- reading


def git_blob_id(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def load_source(name):
    """Returns (meta, routes): routes[l][t] = expert ids in router order."""
    src = SOURCES[name]
    with lzma.open(os.path.join(HERE, src["file"]), "rb") as f:
        raw = f.read()
    blob = git_blob_id(raw)
    if blob != src["blob"]:
        sys.exit(f"{src['file']}: git blob {blob}, expected {src['blob']}: not the recorded file")
    meta, cells = {}, {}
    header = None
    for line in io.StringIO(raw.decode("utf-8")):
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            if "n_expert_used=" in line:  # "# model=... arch=... n_layer=.. n_expert=.. n_expert_used=.."
                for word in line[1:].split():
                    key, _, val = word.partition("=")
                    meta[key] = val
            continue
        fields = line.split(",")
        if header is None:
            header = fields
            continue
        row = dict(zip(header, fields))
        key = (int(row["turn"]), int(row["step"]))
        slot, layer, expert = int(row["slot"]), int(row["layer"]), int(row["expert"])
        cells.setdefault(key, {}).setdefault(layer, {})[slot] = expert
    n_layer, n_expert, k = int(meta["n_layer"]), int(meta["n_expert"]), int(meta["n_expert_used"])
    steps = sorted(cells)
    complete = [s for s in steps if len(cells[s]) == n_layer]
    # keep the longest run of consecutive complete steps of one turn
    best, run = [], []
    for s in complete:
        if run and (s[0] != run[-1][0] or s[1] != run[-1][1] + 1):
            run = []
        run.append(s)
        if len(run) > len(best):
            best = list(run)
    routes = []
    for layer in range(n_layer):
        per_tok = []
        for s in best:
            slots = cells[s][layer]
            ids = [slots[j] for j in range(k)]
            assert len(set(ids)) == k and all(0 <= e < n_expert for e in ids), (s, layer, ids)
            per_tok.append(ids)
        routes.append(per_tok)
    meta.update(
        n_layer=n_layer, n_expert=n_expert, k=k, steps_total=len(steps),
        first_step=best[0][1], last_step=best[-1][1], tokens=len(best),
    )
    return meta, routes


# ---------------------------------------------------------------- statistics


def layer_stats(tokens, n_expert, k):
    counts = [0] * n_expert
    for ids in tokens:
        for e in ids[:k]:
            counts[e] += 1
    top = sorted(counts, reverse=True)[: math.ceil(n_expert / 10)]
    top10 = sum(top) / (len(tokens) * k)
    ov = [len(set(a[:k]) & set(b[:k])) / k for a, b in zip(tokens, tokens[1:])]
    return top10, sum(ov) / len(ov), sum(1 for c in counts if c)


def trace_stats(routes, n_expert, k):
    per = [layer_stats(tokens, n_expert, k) for tokens in routes]
    return {
        "top10": [p[0] for p in per],
        "overlap": [p[1] for p in per],
        "touched": [p[2] for p in per],
    }


def uniform_routes(n_layer, n_tok, n_expert, k, seed):
    rng = random.Random(seed)
    return [[rng.sample(range(n_expert), k) for _ in range(n_tok)] for _ in range(n_layer)]


def mean(xs):
    return sum(xs) / len(xs)


def summary_line(label, st):
    t, o = st["top10"], st["overlap"]
    return (f"  {label:<34} top10 mean {mean(t):.3f} (min {min(t):.3f}, max {max(t):.3f})"
            f"   overlap mean {mean(o):.3f} (min {min(o):.3f}, max {max(o):.3f})")


# ---------------------------------------------------------------- mapping


def pick_layers(n_src, n_dst):
    if n_dst == 1:
        return [0]
    return [round(i * (n_src - 1) / (n_dst - 1)) for i in range(n_dst)]


def widen_k(tokens, n_expert, k_src, k_dst, rng, target_overlap=None):
    """Adds k_dst - k_src experts per token, keeping the layer's popularity and
    its overlap between neighbouring tokens (see the module docstring)."""
    counts = [0.5] * n_expert
    for ids in tokens:
        for e in ids:
            counts[e] += 1
    if target_overlap is None:
        ov = [len(set(a) & set(b)) / k_src for a, b in zip(tokens, tokens[1:])]
        target_overlap = sum(ov) / len(ov)
    out, prev = [], None
    for ids in tokens:
        cur = list(ids)
        while len(cur) < k_dst:
            have = set(cur)
            free = [e for e in range(n_expert) if e not in have]
            reuse = [e for e in (prev or []) if e not in have]
            w_free = sum(counts[e] for e in free)
            pi = sum(counts[e] for e in reuse) / w_free if reuse else 0.0
            q = (target_overlap - pi) / (1.0 - pi) if reuse and pi < 1.0 else 0.0
            pool = reuse if rng.random() < max(0.0, min(1.0, q)) else free
            cur.append(rng.choices(pool, weights=[counts[e] for e in pool])[0])
        out.append(cur)
        prev = cur
    return out


def widen_k_calibrated(tokens, n_expert, k_src, k_dst, seed):
    """widen_k with its reuse target tuned (bisection, same random stream each
    try) so that the widened layer's overlap fraction equals the recorded one:
    the reuse of the added slots by the next token's recorded experts would
    otherwise push it up."""
    ov = [len(set(a) & set(b)) / k_src for a, b in zip(tokens, tokens[1:])]
    want = sum(ov) / len(ov)

    def run(tau):
        out = widen_k(tokens, n_expert, k_src, k_dst, random.Random(seed), tau)
        got = [len(set(a) & set(b)) / k_dst for a, b in zip(out, out[1:])]
        return out, sum(got) / len(got)

    lo, hi = 0.0, 1.0
    best = run(want)
    for _ in range(14):
        mid = (lo + hi) / 2
        out, got = run(mid)
        if abs(got - want) < abs(best[1] - want):
            best = (out, got)
        if got > want:
            hi = mid
        else:
            lo = mid
    return best[0]


def fold_experts(tokens, n_src, n_dst, k_dst):
    """Maps ids < n_src onto ids < n_dst by popularity rank fraction, taking the
    next recorded choice when two of a token's experts collide."""
    kept = [0] * n_src
    alls = [0] * n_src
    for ids in tokens:
        for e in ids[:k_dst]:
            kept[e] += 1
        for e in ids:
            alls[e] += 1
    order = sorted(range(n_src), key=lambda e: (-kept[e], -alls[e], e))
    target = [0] * n_src
    for rank, e in enumerate(order):
        target[e] = rank * n_dst // n_src
    out, fallbacks, nearest = [], 0, 0
    for ids in tokens:
        got = []
        for j, e in enumerate(ids):
            t = target[e]
            if t not in got:
                got.append(t)
                if j >= k_dst:
                    fallbacks += 1
            if len(got) == k_dst:
                break
        if len(got) < k_dst:  # the recorded choices ran out: nearest free rank
            base = target[ids[0]]
            for d in range(1, n_dst):
                for t in (base + d, base - d):
                    if 0 <= t < n_dst and t not in got and len(got) < k_dst:
                        got.append(t)
                        nearest += 1
                if len(got) == k_dst:
                    break
        out.append(got)
    return out, fallbacks, nearest


def build(target_name, spec, src_meta, src_routes):
    L, E, K = spec["layers"], spec["experts"], spec["k"]
    k_src, e_src = src_meta["k"], src_meta["n_expert"]
    layers = pick_layers(src_meta["n_layer"], L)
    notes = {"layers": layers, "fallbacks": 0, "nearest": 0}
    routes = []
    for l_src in layers:
        tokens = src_routes[l_src]
        if E < e_src:
            tokens, fb, nr = fold_experts(tokens, e_src, E, min(K, k_src))
            notes["fallbacks"] += fb
            notes["nearest"] += nr
        elif E > e_src:
            raise SystemExit(f"{target_name}: the source has fewer experts than the target")
        else:
            tokens = [ids[:K] for ids in tokens]
        if K > k_src:
            tokens = widen_k_calibrated(tokens, E, k_src, K, f"{SEED}:{target_name}:{l_src}")
        routes.append([ids[:K] for ids in tokens])
    return routes, notes


# ---------------------------------------------------------------- writing


def write_safetensors(path, routes, metadata):
    L, T, K = len(routes), len(routes[0]), len(routes[0][0])
    data = array("h", (e for tokens in routes for ids in tokens for e in ids))
    if sys.byteorder != "little":
        data.byteswap()
    payload = data.tobytes()
    header = {
        "__metadata__": {k: str(v) for k, v in metadata.items()},
        "routing_topk": {"dtype": "I16", "shape": [L, T, K], "data_offsets": [0, len(payload)]},
    }
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.write(payload)


def read_back(path, want):
    """Re-reads a written file with the checks replay/routing_trace.cpp and
    model/safetensors.cpp make, plus the ones cuda_engine/create.cpp makes."""
    with open(path, "rb") as f:
        raw = f.read()
    (hlen,) = struct.unpack("<Q", raw[:8])
    assert 8 + hlen <= len(raw) and (8 + hlen) % 8 == 0
    header = json.loads(raw[8 : 8 + hlen].decode("utf-8"))
    t = header["routing_topk"]
    assert t["dtype"] == "I16" and len(t["shape"]) == 3
    L, T, K = t["shape"]
    b, e = t["data_offsets"]
    region = raw[8 + hlen :]
    assert 0 <= b <= e <= len(region) and e - b == L * T * K * 2
    ids = array("h")
    ids.frombytes(region[b:e])
    if sys.byteorder != "little":
        ids.byteswap()
    assert (L, K) == (want["layers"], want["k"]), (L, K)
    for l in range(L):
        for tok in range(T):
            row = ids[(l * T + tok) * K : (l * T + tok + 1) * K]
            assert len(set(row)) == K and all(0 <= x < want["experts"] for x in row), (l, tok, row)
    return L, T, K, max(ids) + 1


# ---------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=HERE)
    ap.add_argument("--qwen15-source", choices=sorted(SOURCES), default="gemma4")
    ap.add_argument("--check", action="store_true", help="only re-read and check existing files")
    args = ap.parse_args()
    TARGETS["qwen1.5-moe-a2.7b"]["source"] = args.qwen15_source

    if args.check:
        for name, spec in TARGETS.items():
            path = os.path.join(args.out_dir, name + ".safetensors")
            L, T, K, ne = read_back(path, spec)
            print(f"{path}: routing_topk I16 [{L}, {T}, {K}], largest id + 1 = {ne}: ok")
        return

    loaded = {}
    for name, spec in TARGETS.items():
        sname = spec["source"]
        if sname not in loaded:
            loaded[sname] = load_source(sname)
        meta, src_routes = loaded[sname]
        routes, notes = build(name, spec, meta, src_routes)
        L, E, K = spec["layers"], spec["experts"], spec["k"]
        T = len(routes[0])
        src = SOURCES[sname]
        path = os.path.join(args.out_dir, name + ".safetensors")
        write_safetensors(path, routes, {
            "source_repo": "https://github.com/" + REPO,
            "source_commit": COMMIT,
            "source_path": src["path"],
            "source_blob": src["blob"],
            "source_model": src["model"],
            "source_steps": f"{meta['first_step']}..{meta['last_step']}",
            "source_shape": f"{meta['n_layer']}x{meta['n_expert']} top-{meta['k']}",
            "source_layers_used": ",".join(map(str, notes["layers"])),
            "mapping": "bench/e2e/traces/make_traces.py docstring",
            "seed": SEED,
            "license": "Apache-2.0 (source data); see bench/e2e/traces/README.md",
        })
        read_back(path, spec)

        s_src = trace_stats([src_routes[l] for l in range(meta["n_layer"])], meta["n_expert"], meta["k"])
        s_src_sel = trace_stats([src_routes[l] for l in notes["layers"]], meta["n_expert"], min(K, meta["k"]))
        s_map = trace_stats(routes, E, K)
        s_uni = trace_stats(uniform_routes(L, T, E, K, SEED), E, K)
        s_uni_src = trace_stats(uniform_routes(meta["n_layer"], T, meta["n_expert"], meta["k"], SEED),
                                meta["n_expert"], meta["k"])
        print(f"{name}: [{L}, {T}, {K}] ids < {E}  <- {src['model']}, steps "
              f"{meta['first_step']}..{meta['last_step']} of {meta['steps_total']}  -> {path}")
        if notes["fallbacks"] or notes["nearest"]:
            print(f"  collisions after folding: {notes['fallbacks']} filled from recorded slots >= {K}, "
                  f"{notes['nearest']} from the nearest free rank ({L * T * K} routings)")
        print(summary_line(f"source {meta['n_layer']}x{meta['n_expert']} top-{meta['k']}", s_src))
        if (len(notes["layers"]) != meta["n_layer"]) or K < meta["k"]:
            print(summary_line(f"source, kept layers, top-{min(K, meta['k'])}", s_src_sel))
        print(summary_line(f"uniform {meta['n_layer']}x{meta['n_expert']} top-{meta['k']}", s_uni_src))
        print(summary_line(f"mapped {L}x{E} top-{K}", s_map))
        print(summary_line(f"uniform {L}x{E} top-{K}", s_uni))
        print("  per layer (mapped layer: source layer, top10 src -> mapped, overlap src -> mapped, "
              "experts touched src -> mapped):")
        for i, l_src in enumerate(notes["layers"]):
            print(f"    {i:2d}: {l_src:2d}  {s_src_sel['top10'][i]:.3f} -> {s_map['top10'][i]:.3f}   "
                  f"{s_src_sel['overlap'][i]:.3f} -> {s_map['overlap'][i]:.3f}   "
                  f"{s_src_sel['touched'][i]:3d} -> {s_map['touched'][i]:3d}")


if __name__ == "__main__":
    main()
