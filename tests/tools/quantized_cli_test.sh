#!/bin/sh
# The moe CLI on a GPTQ folder: `moe generate` greedy on it, on the packed
# file `moe convert` makes of it (the same blobs and tensors: the same
# text), and on the plain folder of its dequantised weights (the same text
# where no greedy step is a near tie: checked for this prompt and length).
#   quantized_cli_test.sh MOE WRITER FIXTURE_DIR WORK_DIR
set -eu
moe=$1 writer=$2 fixture=$3 work=$4
rm -rf "$work" && mkdir -p "$work"
"$writer" "$fixture" gptq 32 "$work/gptq" "$work/plain"
gen() { "$moe" generate --model "$1" --prompt "def main():" --max-tokens 12 --temperature 0 --threads 2; }
gen "$work/gptq" > "$work/gptq.txt"
"$moe" convert --model "$work/gptq" --out "$work/gptq.moepack" 2> /dev/null
gen "$work/gptq.moepack" > "$work/packed.txt"
gen "$work/plain" > "$work/plain.txt"
test -s "$work/gptq.txt" || { echo "moe generate wrote nothing on the GPTQ folder"; exit 1; }
cmp "$work/gptq.txt" "$work/packed.txt" || { echo "the packed file generates another text"; exit 1; }
cmp "$work/gptq.txt" "$work/plain.txt" || { echo "the dequantised folder generates another text"; exit 1; }
echo "moe generate on a GPTQ folder, its packed file and its dequantised folder: $(wc -c < "$work/gptq.txt") bytes, the same"
