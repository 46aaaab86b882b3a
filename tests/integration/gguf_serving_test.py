"""`moe-gateway --model X.gguf`, with nothing beside the file, through HTTP
(curl), against what llama.cpp computed on the same file
(tests/data/gguf/README.md):
  1. the demo model's GGUF files, Q8_0 and mixed-type (Qwen3-MoE, gpt2 BPE
     tokenizer, its chat template from the file): greedy completions of llama.cpp's prompts
     (as token ids) agree with llama.cpp's greedy tokens up to its first
     near tie (llama.cpp's own margin below 0.5 logits), the first prompt
     over all 48 tokens; streamed text equals the text answered at once;
  2. a chat completion renders the file's chat template: its prompt is the
     token count of that template's text sent as a completion, and its
     answer that completion's;
  3. Mixtral's Q4_K_M file (SentencePiece tokenizer, experts quantised again
     to INT4): text prompts count the tokens llama.cpp counted (BOS added),
     and a greedy completion is served;
  4. a GGUF that is not one (truncated) stops the gateway at start with the
     file and the reason.
Env: MOE_GATEWAY (and MOE_WORKER_BACKEND=cuda to have the gateway's own
worker on the GPU: `--worker-arg --backend=cuda`).
"""
import http.client
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from redis_harness import free_port  # noqa: E402
DATA = os.path.join(HERE, "..", "data", "gguf")
failures = []
# curl where it is installed (CI installs it); Python's own HTTP client where
# it is not (the GPU machine).
CURL = shutil.which("curl") is not None


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def safetensors(path):
    """name -> list of numbers (I64 / F32 only)."""
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        body = raw[8 + n + a:8 + n + b]
        fmt = {"I64": "q", "F32": "f"}.get(t["dtype"])
        if fmt:
            out[name] = list(struct.unpack("<%d%s" % (len(body) // struct.calcsize(fmt), fmt), body))
    return out


class Gateway:
    def __init__(self, model):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="moe-gguf-gw-", suffix=".log", delete=False)
        args = [os.environ["MOE_GATEWAY"], "--model", model, "--host", "127.0.0.1", "--port", str(self.port)]
        if os.environ.get("MOE_WORKER_BACKEND"):
            args += ["--worker-arg", "--backend=" + os.environ["MOE_WORKER_BACKEND"]]
            # On the GPU a prompt found in the prefix cache is computed in
            # another split of passes, whose bf16 rounding can turn a near tie
            # (docs/prefix-cache.md); the chat-against-completion check below
            # sends one prompt twice and wants the same tokens.
            args += ["--worker-arg", "--prefix-cache=off"]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        self.model = None  # the id /v1/models gives, sent with every request

    def wait_healthy(self, timeout=120):
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                return False
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    return True
            except OSError:
                pass
            time.sleep(0.2)
        return False

    def log_text(self):
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def get(self, path):
        if CURL:
            return subprocess.run(["curl", "-sS", f"http://127.0.0.1:{self.port}{path}"], capture_output=True,
                                  timeout=60).stdout
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        c.request("GET", path)
        return c.getresponse().read()

    def models(self):
        ids = [m["id"] for m in json.loads(self.get("/v1/models"))["data"]]
        self.model = ids[0] if ids else None
        return ids

    def post(self, path, body, stream=False):
        body = dict(body, model=self.model)
        if CURL:
            r = subprocess.run(["curl", "-sS", "-N", "-H", "Content-Type: application/json", "-d", json.dumps(body),
                                f"http://127.0.0.1:{self.port}{path}"], capture_output=True, timeout=300)
            raw = r.stdout
        else:
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
            c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            raw = c.getresponse().read()
        text = raw.decode("utf-8", errors="replace")
        if stream:
            return text
        try:
            return json.loads(text)
        except ValueError:
            return {"unparsed": text}

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.unlink(self.log.name)


def streamed_text(sse):
    out = ""
    for line in sse.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            ev = json.loads(line[6:])
            for c in ev.get("choices", []):
                out += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return out


def demo(name):
    stem = os.path.join(DATA, name)
    if not os.path.exists(stem + ".gguf"):
        check(False, f"{name}.gguf is in tests/data/gguf")
        return
    ref = safetensors(stem + ".llama.safetensors")
    meta = json.load(open(stem + ".llama.json"))
    greedy_text = {p["name"]: p["greedy_text"] for p in meta["prompts"]}
    gw = Gateway(stem + ".gguf")
    try:
        ok = gw.wait_healthy()
        check(ok, f"the gateway serves {name}.gguf")
        if not ok:
            print(gw.log_text()[-4000:])
            return
        models = gw.models()
        print("  /v1/models:", models)
        check(models == [name + ".gguf"], "/v1/models names the file")
        s = 0
        while f"s{s}.greedy_ids" in ref:
            p = f"s{s}"
            ids = [int(x) for x in ref[p + ".input_ids"]]
            want = ref[p + ".greedy_ids"]
            margins = ref[p + ".greedy_margin"]
            sure = next((i for i, m in enumerate(margins) if m < 0.5), len(margins))
            r = gw.post("/v1/completions", {"prompt": ids, "max_tokens": len(want), "temperature": 0,
                                             "logprobs": 1})
            if "choices" not in r:
                check(False, f"{name} {p}: a completion ({r})")
                s += 1
                continue
            text = r["choices"][0]["text"]
            pieces = r["choices"][0]["logprobs"]["tokens"]
            agreed = "".join(pieces[:sure])
            print(f"  {p}: llama.cpp sure for {sure} tokens; ours {text[:60]!r}")
            check(greedy_text[p].startswith(agreed),
                  f"{name} {p}: our first {sure} greedy tokens are llama.cpp's (before its first near tie)")
            check(r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == len(want),
                  f"{name} {p}: usage counts {len(ids)} prompt and {len(want)} completion tokens")
            if s == 0:
                check(text == greedy_text[p], f"{name} {p}: all {len(want)} greedy tokens are llama.cpp's")
                sse = gw.post("/v1/completions", {"prompt": ids, "max_tokens": len(want), "temperature": 0,
                                                   "stream": True}, stream=True)
                check(streamed_text(sse) == text, f"{name} {p}: the streamed text is the text answered at once")
            s += 1
        check(s >= 4, "llama.cpp's four demo prompts were compared")

        # The chat template comes from the file (tokenizer.chat_template).
        msgs = [{"role": "user", "content": "def fibonacci(n):"}]
        chat = gw.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 12, "temperature": 0})
        rendered = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\ndef fibonacci(n):<|im_end|>\n<|im_start|>assistant\n")
        plain = gw.post("/v1/completions", {"prompt": rendered, "max_tokens": 12, "temperature": 0})
        check("choices" in chat and "choices" in plain, "a chat completion and a completion answer")
        if "choices" in chat and "choices" in plain:
            check(chat["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"],
                  f"the chat prompt is the file's template rendered ({chat['usage']['prompt_tokens']} tokens)")
            check(chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"],
                  "the chat answer is the completion of that rendered template")
        for line in gw.log_text().splitlines():
            if "backend" in line:
                print("  log:", line[:200])
    finally:
        gw.stop()


def mixtral():
    stem = os.path.join(DATA, "mixtral-q4_k_m")
    meta = json.load(open(stem + ".llama.json"))
    gw = Gateway(stem + ".gguf")
    try:
        ok = gw.wait_healthy()
        check(ok, "the gateway serves Mixtral's Q4_K_M GGUF file (SentencePiece tokenizer)")
        if not ok:
            print(gw.log_text()[-4000:])
            return
        gw.models()
        counted = 0
        for t in meta["tokenisations"]:
            if not t["text"] or t["ids_plain"] != t["ids_parse"]:
                continue
            r = gw.post("/v1/completions", {"prompt": t["text"], "max_tokens": 4, "temperature": 0})
            if "usage" not in r:
                check(False, f"a completion of {t['text']!r} ({r})")
                continue
            if r["usage"]["prompt_tokens"] != len(t["ids_special"]):
                check(False, f"{t['text']!r}: {r['usage']['prompt_tokens']} prompt tokens, "
                             f"llama.cpp {len(t['ids_special'])}")
            counted += 1
            if counted == 6:
                break
        check(counted == 6, "six text prompts count the tokens llama.cpp counts (BOS added)")
    finally:
        gw.stop()


def broken():
    tmp = tempfile.mkdtemp(prefix="moe-gguf-broken-")
    try:
        path = os.path.join(tmp, "cut.gguf")
        with open(os.path.join(DATA, "qwen3_moe-q8_0.gguf"), "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[:len(data) // 2])
        gw = Gateway(path)
        try:
            gw.proc.wait(timeout=60)
            log = gw.log_text()
            check(gw.proc.returncode not in (0, None), "a truncated GGUF stops the gateway at start")
            check("cut.gguf" in log and "truncated" in log, "and it says which file and why")
            if "truncated" not in log:
                print(log[-2000:])
        except subprocess.TimeoutExpired:
            check(False, "a truncated GGUF stops the gateway at start")
        finally:
            gw.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    print("HTTP client:", "curl" if CURL else "http.client", "; worker backend:",
          os.environ.get("MOE_WORKER_BACKEND", "the gateway's default"))
    for name in sys.argv[1:] or ["demo-moe-q8_0", "demo-moe-mixed"]:
        demo(name)
    mixtral()
    broken()
    if failures:
        print(f"{len(failures)} failed:", *failures, sep="\n  ")
        return 1
    print("all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
