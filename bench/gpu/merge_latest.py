#!/usr/bin/env python3
"""bench/results/gpu-latest.json's engine rows replaced by a run_all.sh run.

run_all.sh writes the summary itself when transformers runs beside it; a
run without the peer (PEER=0, or the card's time too short for it) leaves
only its engine JSONs, and this script puts their rows into the summary in
place of the older engine rows. The full-stack rows (via gateway / worker,
measured by other scripts on their own date) are kept as they are, with
the card they were measured on. Each engine row gets the target it is held
to (transformers_peer.TARGETS) and no transformers figure (not measured in
that run).

  python3 bench/gpu/merge_latest.py --engine A.json,B.json --gpu NAME --commit C \
      [--date YYYY-MM-DD] [--summary bench/results/gpu-latest.json]
"""
import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transformers_peer import TARGETS  # noqa: E402 (the targets live beside the peer)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True, help="run_all.sh's engine JSONs, comma-separated")
    ap.add_argument("--gpu", required=True, help="the card the engine rows were measured on")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--summary", default="bench/results/gpu-latest.json")
    a = ap.parse_args()
    old = json.load(open(a.summary))
    engine = []
    for path in a.engine.split(","):
        rows = json.load(open(path))
        engine += rows["rows"] if isinstance(rows, dict) else rows
    out_rows = []
    for r in engine:
        row = dict(r)
        row["via"] = "engine"
        row["source"] = "weights made in memory"
        row["transformers_tok_s"] = None
        row["target_tok_s"] = TARGETS.get((r["shape"], r["mode"], r["phase"], r["batch"]))
        out_rows.append(row)
    full_stack_gpu = old.get("full_stack_gpu", old.get("gpu"))
    for r in old["rows"]:
        if r.get("via") == "engine":
            continue
        row = dict(r)
        row.setdefault("gpu", full_stack_gpu)
        out_rows.append(row)
    new = {"date": a.date, "gpu": a.gpu, "commit": a.commit, "transformers": None, "rows": out_rows}
    for key in ("full_stack_date", "full_stack_commit"):
        if key in old:
            new[key] = old[key]
    new["full_stack_gpu"] = full_stack_gpu
    with open(a.summary, "w") as f:
        json.dump(new, f, indent=1)
    print("%s: %d engine rows (%s, %s), %d full-stack rows kept" % (
        a.summary, len(engine), a.gpu, a.commit, len(out_rows) - len(engine)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
