#!/usr/bin/env python3
"""Converts a Hugging Face MoE checkpoint folder (safetensors, bf16) of the
Qwen2-MoE or Qwen3-MoE architecture into a Q8_0 GGUF file that llama.cpp
loads, quickly: the tensors are quantised by a pool of processes, each one
writing its bytes straight to their place in the output file.

The metadata (hyperparameters, tokenizer, chat template) is not computed
here: it is copied verbatim from a GGUF that llama.cpp's own converter wrote
for the same folder in --vocab-only mode, given with --meta, or made on the
spot when --llama-cpp names a llama.cpp source tree:

    python3 convert_hf_to_gguf.py DIR --vocab-only --outtype q8_0 --outfile meta.gguf
    python3 bench/e2e/hf_to_gguf.py DIR --meta meta.gguf --out model-q8_0.gguf
    python3 bench/e2e/hf_to_gguf.py DIR --llama-cpp /path/to/llama.cpp --out model-q8_0.gguf

The tensors get the names, shapes and types that convert_hf_to_gguf.py
--outtype q8_0 gives them for these architectures: 1-D tensors, norms,
biases and the routers (ffn_gate_inp, ffn_gate_inp_shexp) in F32, every
other matrix in Q8_0 (F16 where a row is not a multiple of 32 long), the
experts of a layer stacked into one 3-D tensor per projection. The Q8_0
blocks are bit-identical to what that converter writes. Only numpy is
needed (no torch, no safetensors package).
"""
import argparse
import json
import multiprocessing
import os
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

GGUF_MAGIC = b"GGUF"
ALIGN_DEFAULT = 32
QK8_0 = 32

# ggml type ids
T_F32, T_F16, T_Q8_0 = 0, 1, 8
TYPE_NAMES = {T_F32: "F32", T_F16: "F16", T_Q8_0: "Q8_0"}

# GGUF metadata value types: fixed sizes, and the two variable ones
KV_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
KV_STRING, KV_ARRAY = 8, 9

ARCHS = {"Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe"}

# safetensors dtype -> (bytes per element, numpy dtype of the raw words)
ST_DTYPES = {"BF16": (2, np.uint16), "F16": (2, np.float16), "F32": (4, np.float32)}

TASK_ELEMS = 1 << 22      # at most this many elements per pool task
SUB_ELEMS = 1 << 17       # processed this many at a time inside a task (cache-sized)


def log(msg):
    print(f"hf_to_gguf: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- GGUF metadata

class Reader:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, n):
        if self.pos + n > len(self.buf):
            raise ValueError("GGUF metadata ends early")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def u32(self):
        return struct.unpack("<I", self.take(4))[0]

    def u64(self):
        return struct.unpack("<Q", self.take(8))[0]

    def string(self):
        return self.take(self.u64()).decode("utf-8", errors="replace")


def read_value(r, vtype, keep):
    """Reads one value; returns it when keep (scalars and strings only), else skips it."""
    if vtype in KV_FIXED:
        raw = r.take(KV_FIXED[vtype])
        if not keep:
            return None
        fmt = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}[vtype]
        return struct.unpack(fmt, raw)[0]
    if vtype == KV_STRING:
        s = r.string()
        return s if keep else None
    if vtype == KV_ARRAY:
        etype, count = r.u32(), r.u64()
        if etype in KV_FIXED:
            r.take(KV_FIXED[etype] * count)
        else:
            for _ in range(count):
                read_value(r, etype, False)
        return None
    raise ValueError(f"unknown GGUF value type {vtype}")


def load_meta(path):
    """The key/value section of a GGUF file, verbatim, with its count and
    the scalar values (for general.architecture and general.alignment)."""
    with open(path, "rb") as f:
        buf = f.read()
    r = Reader(buf)
    if r.take(4) != GGUF_MAGIC:
        raise SystemExit(f"hf_to_gguf: {path}: not a GGUF file")
    version = r.u32()
    if version not in (2, 3):
        raise SystemExit(f"hf_to_gguf: {path}: GGUF version {version} is not handled")
    n_tensors, n_kv = r.u64(), r.u64()
    if n_tensors != 0:
        raise SystemExit(f"hf_to_gguf: {path} holds {n_tensors} tensors; give a --vocab-only file")
    start = r.pos
    values = {}
    for _ in range(n_kv):
        key = r.string()
        vtype = r.u32()
        v = read_value(r, vtype, True)
        if v is not None:
            values[key] = v
    return version, n_kv, buf[start:r.pos], values


def make_meta(llama_dir, model_dir, out_path):
    script = os.path.join(llama_dir, "convert_hf_to_gguf.py")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(llama_dir, "gguf-py") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, script, model_dir, "--vocab-only", "--outtype", "q8_0", "--outfile", out_path]
    log("metadata: " + " ".join(cmd))
    t0 = time.time()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-4000:])
        raise SystemExit(f"hf_to_gguf: llama.cpp's converter failed ({p.returncode})")
    log(f"metadata: written in {time.time() - t0:.1f} s")


# ---------------------------------------------------------------- safetensors

def read_safetensors_index(model_dir):
    """{name: (path, dtype, shape, absolute byte offset)} over all shards."""
    idx = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not files:
        raise SystemExit(f"hf_to_gguf: no .safetensors files in {model_dir}")
    out = {}
    for fn in files:
        path = os.path.join(model_dir, fn)
        with open(path, "rb") as f:
            hlen = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(hlen))
        base = 8 + hlen
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in ST_DTYPES:
                raise SystemExit(f"hf_to_gguf: {name}: dtype {info['dtype']} is not handled")
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])
            if end - begin != ST_DTYPES[info["dtype"]][0] * int(np.prod(shape, dtype=np.int64)):
                raise SystemExit(f"hf_to_gguf: {name}: size does not match its shape")
            out[name] = (path, info["dtype"], shape, base + begin)
    return out, [os.path.join(model_dir, f) for f in files]


# ---------------------------------------------------------------- tensor plan

def gguf_name(hf):
    """The GGUF name of an HF tensor, or (stacked name, expert id) for an
    expert's matrix; None for tensors that are dropped."""
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    if hf.endswith("rotary_emb.inv_freq"):
        return None
    parts = hf.split(".")
    if len(parts) < 5 or parts[0] != "model" or parts[1] != "layers" or not parts[2].isdigit():
        raise SystemExit(f"hf_to_gguf: tensor {hf} is not known")
    b = f"blk.{int(parts[2])}."
    rest = ".".join(parts[3:])
    if rest.startswith("mlp.experts."):
        sub = rest[len("mlp.experts."):].split(".")
        if len(sub) == 3 and sub[0].isdigit() and sub[2] == "weight" and sub[1] in ("gate_proj", "up_proj", "down_proj"):
            return (b + {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}[sub[1]]
                    + ".weight", int(sub[0]))
        raise SystemExit(f"hf_to_gguf: tensor {hf} is not known")
    table = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
        "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
        "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
        "mlp.shared_expert.down_proj": "ffn_down_shexp",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }
    stem, _, suffix = rest.rpartition(".")
    if stem in table and suffix in ("weight", "bias"):
        return b + table[stem] + "." + suffix
    raise SystemExit(f"hf_to_gguf: tensor {hf} is not known")


def pick_type(name, n_dims, ne0):
    """The type convert_hf_to_gguf.py --outtype q8_0 gives a tensor."""
    if n_dims <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return T_F32
    stem = name[:-len(".weight")]
    if stem.endswith(".ffn_gate_inp") or stem.endswith(".ffn_gate_inp_shexp"):
        return T_F32
    if ne0 % QK8_0 != 0:
        return T_F16     # what that converter falls back to when Q8_0 cannot take a row
    return T_Q8_0


def row_bytes(ttype, ne0):
    if ttype == T_Q8_0:
        return ne0 // QK8_0 * (2 + QK8_0)
    return ne0 * (4 if ttype == T_F32 else 2)


def plan_tensors(st, arch):
    """[(gguf name, numpy-order shape, type, [(hf name, ...)])] in model order."""
    groups, order = {}, []
    for hf in st:
        g = gguf_name(hf)
        if g is None:
            continue
        if isinstance(g, tuple):
            name, eid = g
            if name not in groups:
                groups[name] = {}
                order.append(name)
            groups[name][eid] = hf
        else:
            if g in groups:
                raise SystemExit(f"hf_to_gguf: two tensors map to {g}")
            groups[g] = hf
            order.append(g)

    def sort_key(n):
        if n.startswith("token_embd"):
            return (-1, 0, n)
        if n.startswith("blk."):
            return (int(n.split(".")[1]), 1, n)
        return (1 << 30, 2 if n.startswith("output.") else 1, n)

    plan = []
    for name in sorted(order, key=sort_key):
        g = groups[name]
        if isinstance(g, dict):
            n_exp = max(g) + 1
            if sorted(g) != list(range(n_exp)):
                raise SystemExit(f"hf_to_gguf: {name}: experts are missing")
            srcs = [g[e] for e in range(n_exp)]
            shapes = {st[s][2] for s in srcs}
            if len(shapes) != 1:
                raise SystemExit(f"hf_to_gguf: {name}: experts of different shapes")
            shape = (n_exp,) + shapes.pop()
        else:
            srcs = [g]
            shape = st[g][2]
        ttype = pick_type(name, len(shape), shape[-1])
        plan.append((name, shape, ttype, srcs))
    if arch == "qwen3moe" and any(".attn_q.bias" in p[0] for p in plan):
        log("note: a qwen3moe checkpoint with q/k/v biases")
    return plan


# ---------------------------------------------------------------- workers

def to_f32(raw, dtype):
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def quantize_q8_0(x):
    """float32 values (a multiple of 32 of them) -> Q8_0 blocks as bytes:
    per 32 values, the fp16 scale d = max|x| / 127, then the int8 values
    x * (1/d) rounded to the nearest integer, halves away from zero
    (the rounding of ggml's reference quantiser)."""
    blocks = x.reshape(-1, QK8_0)
    d = np.abs(blocks).max(axis=1) / np.float32(127)
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d != 0)
    y = blocks * inv[:, None]
    a = np.abs(y)
    q = np.floor(a)
    q += (a - q) >= np.float32(0.5)
    np.copysign(q, y, out=q)
    out = np.empty((blocks.shape[0], 2 + QK8_0), dtype=np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.astype(np.int8).view(np.uint8)
    return out


def encode(x, ttype):
    if ttype == T_Q8_0:
        return quantize_q8_0(x)
    if ttype == T_F16:
        return x.astype(np.float16)
    return x


_OUT_FD = None


def worker_init(out_path):
    global _OUT_FD
    _OUT_FD = os.open(out_path, os.O_WRONLY)


def run_task(task):
    """One slice of one source tensor: read, convert, write at its offset."""
    path, dtype, src_off, n, ttype, dst_off, tid = task
    esize, npdt = ST_DTYPES[dtype]
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=src_off, shape=(n * esize,))
    raw = mm.view(npdt)
    parts = []
    for s in range(0, n, SUB_ELEMS):
        parts.append(encode(to_f32(raw[s:s + SUB_ELEMS], dtype), ttype).tobytes())
    del raw, mm
    data = b"".join(parts)
    written = 0
    while written < len(data):
        written += os.pwrite(_OUT_FD, data[written:], dst_off + written)
    return tid, n * esize


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(
        description="Convert a bf16 safetensors Hugging Face folder of Qwen2MoeForCausalLM or "
                    "Qwen3MoeForCausalLM to a Q8_0 GGUF (tensors as llama.cpp's convert_hf_to_gguf.py "
                    "--outtype q8_0 writes them), with a pool of processes.",
        epilog="The metadata comes from --meta (a GGUF written by llama.cpp's convert_hf_to_gguf.py "
               "DIR --vocab-only --outtype q8_0) or is made with --llama-cpp. Progress goes to stderr.")
    ap.add_argument("model_dir", help="the Hugging Face folder (config.json, *.safetensors)")
    ap.add_argument("--out", required=True, help="the GGUF file to write")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--meta", help="a --vocab-only GGUF of the same folder; its key/value section is copied")
    src.add_argument("--llama-cpp", metavar="DIR",
                     help="a llama.cpp source tree: run its convert_hf_to_gguf.py --vocab-only "
                          "(PYTHONPATH at its gguf-py) to make the metadata first")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1,
                    help="worker processes (default: the number of CPUs, %(default)s here)")
    ap.add_argument("--delete-consumed", action="store_true",
                    help="delete each .safetensors shard of MODEL_DIR as soon as all of its tensors are "
                         "written (for a disk that cannot hold the folder and the GGUF together); "
                         "destroys the input folder")
    a = ap.parse_args()

    with open(os.path.join(a.model_dir, "config.json")) as f:
        cfg = json.load(f)
    hf_arch = (cfg.get("architectures") or [None])[0]
    if hf_arch not in ARCHS:
        raise SystemExit(f"hf_to_gguf: architecture {hf_arch} is not handled (only {', '.join(ARCHS)})")
    arch = ARCHS[hf_arch]

    t_start = time.time()
    tmp_meta = None
    meta_path = a.meta
    if a.llama_cpp:
        fd, tmp_meta = tempfile.mkstemp(suffix=".gguf", prefix="meta-", dir=os.path.dirname(os.path.abspath(a.out)))
        os.close(fd)
        make_meta(a.llama_cpp, a.model_dir, tmp_meta)
        meta_path = tmp_meta
    version, n_kv, kv_bytes, values = load_meta(meta_path)
    if tmp_meta:
        os.unlink(tmp_meta)
    if values.get("general.architecture") != arch:
        raise SystemExit(f"hf_to_gguf: the metadata is for {values.get('general.architecture')}, the folder is {arch}")
    align = int(values.get("general.alignment", ALIGN_DEFAULT))

    st, shard_paths = read_safetensors_index(a.model_dir)
    plan = plan_tensors(st, arch)

    # header: magic, version, tensor count, kv count, kv section, tensor infos
    infos, offset = [], 0
    for name, shape, ttype, _ in plan:
        offset += -offset % align
        nb = name.encode()
        dims = list(reversed(shape))
        infos.append(struct.pack("<Q", len(nb)) + nb + struct.pack("<I", len(dims))
                     + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", ttype, offset))
        nrows = int(np.prod(shape[:-1], dtype=np.int64))
        offset += nrows * row_bytes(ttype, shape[-1])
    head = GGUF_MAGIC + struct.pack("<IQQ", version, len(plan), n_kv) + kv_bytes + b"".join(infos)
    data_start = len(head) + (-len(head) % align)
    total = data_start + offset

    # tasks: slices of whole rows of each source tensor, at most TASK_ELEMS elements
    tasks, t_off = [], 0
    for name, shape, ttype, srcs in plan:
        t_off += -t_off % align
        ne0 = shape[-1]
        rb = row_bytes(ttype, ne0)
        for hf in srcs:
            path, dtype, sshape, soff = st[hf]
            esize = ST_DTYPES[dtype][0]
            nrows = int(np.prod(sshape[:-1], dtype=np.int64)) if len(sshape) > 1 else 1
            rows_per = max(1, TASK_ELEMS // ne0)
            for r0 in range(0, nrows, rows_per):
                r1 = min(nrows, r0 + rows_per)
                tasks.append((path, dtype, soff + r0 * ne0 * esize, (r1 - r0) * ne0, ttype,
                              data_start + t_off + r0 * rb, len(tasks)))
            t_off += nrows * rb
    assert data_start + t_off == total
    # read the shards in order, each from start to end
    tasks.sort(key=lambda t: (shard_paths.index(t[0]), t[2]))
    left = {p: 0 for p in shard_paths}
    for t in tasks:
        left[t[0]] += 1

    counts = {}
    for _, _, ttype, _ in plan:
        counts[TYPE_NAMES[ttype]] = counts.get(TYPE_NAMES[ttype], 0) + 1
    in_bytes = sum(t[3] * ST_DTYPES[t[1]][0] for t in tasks)
    log(f"{a.model_dir}: {hf_arch} ({arch}), {len(plan)} tensors ({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}), "
        f"{in_bytes / 1e9:.2f} GB in, {total / 1e9:.2f} GB out, {len(tasks)} tasks on {a.jobs} processes")

    with open(a.out, "wb") as f:
        f.truncate(total)
        f.write(head)
        f.write(b"\0" * (data_start - len(head)))

    ctx = multiprocessing.get_context("fork")
    done_bytes, last, t0 = 0, 0.0, time.time()
    by_id = {t[6]: t for t in tasks}
    with ctx.Pool(a.jobs, initializer=worker_init, initargs=(a.out,)) as pool:
        for i, (tid, nb) in enumerate(pool.imap_unordered(run_task, tasks, chunksize=1), 1):
            done_bytes += nb
            p = by_id[tid][0]
            left[p] -= 1
            if left[p] == 0 and a.delete_consumed:
                os.unlink(p)
                log(f"deleted {os.path.basename(p)}")
            now = time.time()
            if now - last >= 5 or i == len(tasks):
                last = now
                el = now - t0
                log(f"{done_bytes / 1e9:.2f} of {in_bytes / 1e9:.2f} GB read, {i} of {len(tasks)} tasks, "
                    f"{el:.0f} s, {done_bytes / 1e6 / max(el, 1e-9):.0f} MB/s")
    el = time.time() - t0
    log(f"wrote {a.out}: {total / 1e9:.2f} GB in {el:.1f} s ({in_bytes / 1e6 / max(el, 1e-9):.0f} MB/s of input), "
        f"{time.time() - t_start:.1f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
