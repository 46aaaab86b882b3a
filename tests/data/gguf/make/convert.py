#!/usr/bin/env python3
"""llama.cpp's own convert_hf_to_gguf.py, run on one of this project's checkpoint folders.

    convert.py --llama-cpp DIR MODEL_DIR --outtype q8_0 --outfile OUT.gguf [...]

Every argument after --llama-cpp DIR goes to convert_hf_to_gguf.py unchanged.

Why a wrapper: llama.cpp recognises a BPE pre-tokenizer by hashing the token ids of one
fixed text (conversion/base.py, TextModel.get_vocab_base_pre) and knows only the hashes of
published tokenizers. The tokenizers of our fixtures and of the demo model were trained by
this project, so their hashes are unknown and the converter stops with NotImplementedError.
This wrapper answers that one question, only where the converter cannot: it reads the
folder's tokenizer.json and names the llama.cpp pre-tokenizer (src/llama-vocab.cpp) whose
split regex is the one the tokenizer declares:

  Split(Qwen2 regex) + ByteLevel(use_regex=false)  ->  "qwen2"  (LLAMA_VOCAB_PRE_TYPE_QWEN2)
  ByteLevel(use_regex=true), GPT-2's built-in regex ->  "olmo"   (LLAMA_VOCAB_PRE_TYPE_OLMO;
        "gpt-2" maps to the same regex in llama-vocab.cpp, and "olmo" is what the converter
        writes for the OLMo tokenizers that OLMoE checkpoints ship)

Anything else is left to fail as it would. The rest of the conversion (tensor names, types,
metadata, the vocabulary itself) is llama.cpp's code, untouched.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

# The split regex of Qwen2's tokenizer.json, as our bytelevel_qwen tokenizers declare it.
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

log = logging.getLogger("convert.py")


def declared_pre_tokenizer(model_dir: Path) -> str | None:
    """The llama.cpp pre-tokenizer name for the folder's tokenizer.json, or None."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    pre = json.loads(path.read_text(encoding="utf-8")).get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["Split", "ByteLevel"]:
        regex = (steps[0].get("pattern") or {}).get("Regex")
        if regex == QWEN2_REGEX and steps[0].get("behavior") == "Isolated" and not steps[1].get("use_regex", True):
            return "qwen2"
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "olmo"
    return None


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 2 or args[0] != "--llama-cpp":
        sys.exit("usage: convert.py --llama-cpp DIR MODEL_DIR [convert_hf_to_gguf.py arguments]")
    llama_dir = Path(args[0 + 1]).resolve()
    rest = args[2:]
    sys.path.insert(0, str(llama_dir))
    sys.path.insert(1, str(llama_dir / "gguf-py"))

    import convert_hf_to_gguf  # noqa: E402  (llama.cpp's script; imports torch and conversion/)
    from conversion.base import TextModel  # noqa: E402

    upstream = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return upstream(self, tokenizer)
        except NotImplementedError:
            name = declared_pre_tokenizer(Path(self.dir_model))
            if name is None:
                raise
            log.warning("pre-tokenizer hash not known to llama.cpp; tokenizer.json declares "
                        "the split regex of llama.cpp's %r: writing tokenizer.ggml.pre = %r", name, name)
            return name

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(llama_dir / "convert_hf_to_gguf.py"), *rest]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
