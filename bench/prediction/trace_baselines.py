"""Routing-only expert guesses on a recorded routing trace of a real model
(bench/e2e/traces/README.md says where the recordings come from): per
layer, the mean recall of a token's recorded experts by
  - transition: the experts layer t-1 chose for this token, through a table
    of layer t-1 -> t co-occurrences learned online over the tokens before;
  - frequency: layer t's most used experts over the tokens before;
  - previous token: the experts layer t chose for the token before.
A trace holds expert ids only, no hidden states: the router-on-an-earlier-
hidden-state guess (`moe layer-ahead`) cannot be scored on it.

  python3 bench/prediction/trace_baselines.py bench/e2e/traces/qwen3-30b-a3b.safetensors --slots 6
"""
import argparse
import json
import struct


def read_trace(path, tensor="routing_topk"):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        meta = header[tensor]
        assert meta["dtype"] == "I16"
        L, T, K = meta["shape"]
        begin, end = meta["data_offsets"]
        f.seek(8 + n + begin)
        data = struct.unpack("<%dh" % (L * T * K), f.read(end - begin))
    return [[list(data[(l * T + t) * K:(l * T + t + 1) * K]) for t in range(T)] for l in range(L)], L, T, K


def topk(scores, k):
    return sorted(range(len(scores)), key=lambda e: (-scores[e], e))[:k]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--slots", type=int, default=6, help="the recorded ranks to use (the rest may be synthesized)")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--json")
    a = ap.parse_args()
    trace, L, T, K = read_trace(a.trace)
    k = min(a.slots, K)
    E = a.experts
    trans = [[[0] * E for _ in range(E)] for _ in range(L)]
    used = [[0] * E for _ in range(L)]
    rows = []
    sums = [{"transition": 0.0, "frequency": 0.0, "previous_token": 0.0, "n": 0, "n_prev": 0} for _ in range(L)]
    for t in range(T):
        for l in range(L):
            truth = trace[l][t][:k]
            s = sums[l]
            if l >= 1:
                score = [0] * E
                for f in trace[l - 1][t][:k]:
                    row = trans[l][f]
                    for e in range(E):
                        score[e] += row[e]
                g = topk(score, k)
                s["transition"] += len(set(g) & set(truth)) / k
                for f in trace[l - 1][t][:k]:
                    for e in truth:
                        trans[l][f][e] += 1
            g = topk(used[l], k)
            s["frequency"] += len(set(g) & set(truth)) / k
            for e in truth:
                used[l][e] += 1
            if t >= 1:
                s["previous_token"] += len(set(trace[l][t - 1][:k]) & set(truth)) / k
                s["n_prev"] += 1
            s["n"] += 1
    print(f"{a.trace}: {L} layers, {T} tokens, top-{k} of the recorded ranks; mean recall")
    print("%5s %11s %10s %15s" % ("layer", "transition", "frequency", "previous-token"))
    for l, s in enumerate(sums):
        r = {"layer": l, "transition": s["transition"] / s["n"] if l else None, "frequency": s["frequency"] / s["n"],
             "previous_token": s["previous_token"] / max(s["n_prev"], 1)}
        rows.append(r)
        print("%5d %11s %10.3f %15.3f" % (l, "-" if r["transition"] is None else "%.3f" % r["transition"],
                                          r["frequency"], r["previous_token"]))
    mean = {key: sum(r[key] for r in rows if r[key] is not None) / len([r for r in rows if r[key] is not None])
            for key in ("transition", "frequency", "previous_token")}
    print("%5s %11.3f %10.3f %15.3f" % ("mean", mean["transition"], mean["frequency"], mean["previous_token"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"trace": a.trace, "layers": L, "tokens": T, "k": k, "rows": rows, "mean": mean}, f, indent=1)


if __name__ == "__main__":
    main()
