#!/usr/bin/env python3
"""The Python steps of make_gguf_fixtures.sh (numpy, and llama.cpp's gguf-py for `inspect`).

    fixtures.py requests NAME OUT.json        what llama_reference runs for one model
    fixtures.py inspect  FILE.gguf STEM       STEM.gguf.json, STEM.dequant.{safetensors,json}
    fixtures.py compare  DIR OUT.json         llama.cpp's logits and greedy tokens against
                                              transformers' (the fixtures' reference files)
    fixtures.py manifest DIR OUT.json ...     every file under DIR: size, sha256

NAME is a folder under tests/data/fixtures/ or "demo-moe" (models/demo-moe). Run from the
repository root. Safetensors files are read and written here with numpy alone.
"""
from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

import numpy as np

FIXTURES = Path("tests/data/fixtures")
DEMO = Path("models/demo-moe")
TINY = ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "qwen2_dense", "deepseek_v2"]

# ------------------------------------------------------------------ safetensors
_DT = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
       "I8": np.int8, "U8": np.uint8, "BF16": np.uint16}


def st_read(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, f = e["data_offsets"]
        a = np.frombuffer(raw, dtype=_DT[e["dtype"]], count=(f - b) // np.dtype(_DT[e["dtype"]]).itemsize,
                          offset=8 + n + b).reshape(e["shape"])
        if e["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[name] = a
    return out


def st_write(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    names = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32"}
    header: dict = {"__metadata__": metadata} if metadata else {}
    blobs, off = [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        blob = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for blob in blobs:
            f.write(blob)


# ------------------------------------------------------------------ requests
def test_strings(name: str) -> list[str]:
    """The tokenizer test strings, then the model's own prompt texts, each once."""
    tok = json.loads((FIXTURES / "tokenizers" / "reference.json").read_text(encoding="utf-8"))
    texts: list[str] = []
    for per_tokenizer in tok.values():
        texts += [s["text"] for s in per_tokenizer["strings"]]
        texts += [c["text"] for c in per_tokenizer.get("chats", [])]
    if name == "demo-moe":
        ref = json.loads((DEMO / "reference.json").read_text(encoding="utf-8"))
        texts += [s["prompt"] for s in ref["samples"]]
        texts.append((DEMO / "eval.txt").read_text(encoding="utf-8")[:4000])
    else:
        ref = json.loads((FIXTURES / name / "reference.json").read_text(encoding="utf-8"))
        texts += [p["text"] for p in ref["prompts"]]
    seen, out = set(), []
    for t in texts:
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


def cmd_requests(name: str, out: str) -> None:
    prompts = []
    if name == "demo-moe":
        ref = json.loads((DEMO / "reference.json").read_text(encoding="utf-8"))
        for i, s in enumerate(ref["samples"]):
            prompts.append({"name": f"s{i}", "ids": s["prompt_ids"], "greedy": len(s["greedy_ids"]), "logits": "all"})
        ids = st_read(DEMO / "reference.safetensors")["eval.ids"][:512]
        prompts.append({"name": "eval", "ids": [int(x) for x in ids], "greedy": 0, "logits": "summary"})
    else:
        ref = st_read(FIXTURES / name / "reference.safetensors")
        i = 0
        while f"p{i}.input_ids" in ref:
            prompts.append({"name": f"p{i}", "ids": [int(x) for x in ref[f"p{i}.input_ids"]],
                            "greedy": int(ref[f"p{i}.greedy_ids"].shape[0]), "logits": "all"})
            i += 1
    Path(out).write_text(json.dumps({"model": name, "prompts": prompts, "texts": test_strings(name)},
                                    ensure_ascii=True, indent=1))
    print(f"{out}: {len(prompts)} prompts")


# ------------------------------------------------------------------ inspect (gguf-py)
def _value(field, gguf):
    """A metadata value as JSON; long arrays are summarised (the file itself is the reference)."""
    t = field.types[0]
    if t == gguf.GGUFValueType.ARRAY:
        n = len(field.data)
        sub = field.types[-1].name
        vals = [field.contents(i) for i in range(min(n, 16))]
        if n <= 64:
            return {"array": sub, "n": n, "values": [field.contents(i) for i in range(n)]}
        return {"array": sub, "n": n, "first": vals, "last": [field.contents(i) for i in range(n - 4, n)]}
    return {"type": t.name, "value": field.contents()}


def cmd_inspect(path: str, stem: str, cap_quant: int, cap_float: int) -> None:
    import gguf  # llama.cpp's gguf-py (PYTHONPATH)
    from gguf.quants import dequantize

    r = gguf.GGUFReader(path)
    meta = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        meta[k] = _value(f, gguf)
    tensors, counts = [], {}
    for t in r.tensors:
        ty = t.tensor_type.name
        counts[ty] = counts.get(ty, 0) + 1
        tensors.append({"name": t.name, "type": ty, "ne": [int(x) for x in t.shape], "offset": int(t.data_offset),
                        "n_bytes": int(t.n_bytes)})
    info = {"file": Path(path).name, "size": Path(path).stat().st_size, "gguf_version": int(r.fields["GGUF.version"].contents()),
            "alignment": int(r.alignment), "data_offset": int(r.data_offset), "type_counts": counts, "metadata": meta,
            "tensors": tensors}
    Path(stem + ".gguf.json").write_text(json.dumps(info, indent=1, ensure_ascii=False))

    # The first tensor of each type (file order), dequantised by gguf-py, first elements only.
    done, out, listing = set(), {}, []
    floats = {"F32", "F16", "BF16", "F64"}
    for t in r.tensors:
        ty = t.tensor_type.name
        if ty in done:
            continue
        done.add(ty)
        ne0 = int(t.shape[0])
        cap = min(int(t.n_elements), cap_float if ty in floats else cap_quant)
        rows = -(-cap // ne0)
        data = t.data.reshape(-1, t.data.shape[-1])[:rows]
        if data.dtype == np.uint8:
            values = dequantize(data, t.tensor_type)
        else:
            values = data.astype(np.float32)
        values = np.asarray(values, dtype=np.float32).reshape(-1)[:cap]
        out[t.name] = values
        listing.append({"name": t.name, "type": ty, "ne": [int(x) for x in t.shape], "n_elements": int(t.n_elements),
                        "n_stored": int(values.size)})
    st_write(Path(stem + ".dequant.safetensors"), out,
             {"producer": "tests/data/gguf/make/fixtures.py inspect (gguf-py quants.dequantize)", "file": Path(path).name})
    Path(stem + ".dequant.json").write_text(json.dumps(listing, indent=1))
    print(f"{path}: {len(tensors)} tensors, types {counts}; dequantised {[e['type'] for e in listing]}")


# ------------------------------------------------------------------ compare
def cmd_compare(directory: str, out: str) -> None:
    d = Path(directory)
    rows = []
    for name in TINY:
        ref = st_read(FIXTURES / name / "reference.safetensors")
        for kind in ("bf16", "q8_0", "q4_k_m"):
            p = d / f"{name}-{kind}.llama.safetensors"
            if not p.is_file():
                rows.append({"file": p.name, "missing": True})
                continue
            got = st_read(p)
            i, worst, scale, agree, total, greedy_same, per_pos = 0, 0.0, 0.0, 0, 0, [], []
            while f"p{i}.logits" in ref:
                a, b = got.get(f"p{i}.logits"), ref[f"p{i}.logits"]
                if a is not None and a.shape == b.shape:
                    worst = max(worst, float(np.abs(a - b).max()))
                    per_pos += np.abs(a - b).max(-1).tolist()
                    scale = max(scale, float(np.abs(b).max()))
                    agree += int((a.argmax(-1) == b.argmax(-1)).sum())
                    total += b.shape[0]
                g, h = got.get(f"p{i}.greedy_ids"), ref.get(f"p{i}.greedy_ids")
                if g is not None and h is not None:
                    same = int(np.argmax(g != h)) if (g != h).any() else int(h.shape[0])
                    greedy_same.append(same)
                i += 1
            # A position whose top-k expert choice flips shows a large difference on its own;
            # the median over positions is the typical one.
            rows.append({"file": p.name, "max_abs_diff": worst, "median_position_max_abs_diff": float(np.median(per_pos)),
                         "max_abs_ref_logit": scale,
                         "argmax_agree": f"{agree}/{total}", "greedy_prefix_match": greedy_same})
    ref = json.loads((DEMO / "reference.json").read_text(encoding="utf-8"))
    for kind in ("q8_0", "mixed", "q4_k_m"):
        p = d / f"demo-moe-{kind}.llama.safetensors"
        if not p.is_file():
            rows.append({"file": p.name, "missing": True})
            continue
        got = st_read(p)
        greedy_same = []
        for i, s in enumerate(ref["samples"]):
            g, h = got.get(f"s{i}.greedy_ids"), np.array(s["greedy_ids"])
            if g is not None:
                greedy_same.append(int(np.argmax(g != h)) if (g != h).any() else int(h.shape[0]))
        nll = got.get("eval.nll")
        rows.append({"file": p.name, "greedy_prefix_match_of_48": greedy_same,
                     "eval_mean_nll_512": float(nll.mean()) if nll is not None else None,
                     "transformers_eval_nll_fp32_8192": float(ref.get("eval_nll_fp32", float("nan")))})
    Path(out).write_text(json.dumps(rows, indent=1))
    for row in rows:
        print(json.dumps(row))


# ------------------------------------------------------------------ manifest
def cmd_manifest(directory: str, out: str, commit: str, commands: str, extra: str | None) -> None:
    d = Path(directory)
    files = []
    for p in sorted(d.rglob("*")):
        if p.is_file():
            files.append({"path": str(p.relative_to(d)), "size": p.stat().st_size,
                          "sha256": hashlib.sha256(p.read_bytes()).hexdigest()})
    m = {"llama_cpp_commit": commit, "files": files,
         "commands": Path(commands).read_text(encoding="utf-8").splitlines() if Path(commands).is_file() else []}
    if extra and Path(extra).is_file():
        m["compare"] = json.loads(Path(extra).read_text())
    Path(out).write_text(json.dumps(m, indent=1))
    print(f"{out}: {len(files)} files, {sum(f['size'] for f in files)} bytes")


def main() -> None:
    a = sys.argv[1:]
    if a[:1] == ["requests"] and len(a) == 3:
        cmd_requests(a[1], a[2])
    elif a[:1] == ["inspect"] and len(a) in (3, 5):
        cmd_inspect(a[1], a[2], int(a[3]) if len(a) == 5 else 65536, int(a[4]) if len(a) == 5 else 4096)
    elif a[:1] == ["compare"] and len(a) == 3:
        cmd_compare(a[1], a[2])
    elif a[:1] == ["manifest"] and len(a) in (5, 6):
        cmd_manifest(a[1], a[2], a[3], a[4], a[5] if len(a) == 6 else None)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
