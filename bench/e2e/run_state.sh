# The state of a run on the GPU machine that resumes across calls, shared by
# device_run.sh and gguf_device_run.sh. Source it with W (the state folder,
# kept while the machine stays warm) and deadline (a Unix time) set: it makes
# $W/state, $W/logs and $out (OUT, default $W/out), and gives
#   left      seconds until the deadline
#   is_done S / mark S   whether stage S is done / that it is
#   say ...   a timestamped progress line
#   seeded_pack SHAPE OUT   stage `pack`: a seeded random-weight HF folder of
#             SHAPE (bench/gpu/make_checkpoint.py, tokenizer from $TOK) made
#             into our packed file OUT by $BIN/moe convert, the folder removed
#   unpack_payload   stage `unpack`: .device-build/payload.tar.xz into $W (bin/
#             and tokenizer/: BIN and TOK), the demo model's weights from
#             .device-build/demo.safetensors.xz where the tree lacks them (and it travelled)
#   gpu_tests T[:FILTER] ...   stage `test-T` each: $BIN/T with its Catch
#             filter into $W/logs/tests-T.log, its summary lines said
#             (GREP_EXTRA: more lines of the log to show)
mkdir -p "$W/state" "$W/logs"
out=${OUT:-$W/out}
mkdir -p "$out"
left() { echo $((deadline - $(date +%s))); }
is_done() { [ -f "$W/state/$1" ]; }
mark() { touch "$W/state/$1"; }
say() { echo "== $(date -u +%T) [$(left) s left] $*"; }
seeded_pack() {  # shape out
  is_done pack && return 0
  local shape=$1 pack=$2 hf
  hf=$(dirname "$pack")/hf
  say "a seeded $shape checkpoint folder, then moe convert -> $pack"
  rm -rf "$hf"
  python3 bench/gpu/make_checkpoint.py --shape "$shape" --out "$hf" --tokenizer "$TOK" >$W/logs/make.log 2>&1 ||
    { tail -5 $W/logs/make.log; return 1; }
  /usr/bin/time -f "   moe convert: %e s, peak RSS %M KB" $BIN/moe convert --model "$hf" --out "$pack" \
    >$W/logs/convert.log 2>&1 || { tail -3 $W/logs/convert.log; return 1; }
  tail -2 $W/logs/convert.log
  rm -rf "$hf"
  mark pack
}
unpack_payload() {
  if ! is_done unpack; then
    tar xJf .device-build/payload.tar.xz -C "$W" &&
      { [ -f models/demo-moe/model.safetensors ] || [ ! -f .device-build/demo.safetensors.xz ] ||
        xz -dc .device-build/demo.safetensors.xz >models/demo-moe/model.safetensors; } &&
      mark unpack
  fi
  BIN=$W/payload/bin
  TOK=$W/payload/tokenizer
}
gpu_tests() {  # T[:FILTER] ...
  local spec t filter rc
  for spec in "$@"; do
    t=${spec%%:*}
    filter=""
    [ "$spec" != "$t" ] && filter=${spec#*:}
    is_done "test-$t" && continue
    [ "$(left)" -gt 200 ] || break
    say "$t $filter"
    (timeout $(($(left) - 30)) "$BIN/$t" $filter) >"$W/logs/tests-$t.log" 2>&1
    rc=$?
    grep -E "^(test cases|assertions)|FAILED|passed${GREP_EXTRA:+|$GREP_EXTRA}" "$W/logs/tests-$t.log" | tail -6
    [ $rc = 0 ] && mark "test-$t" || say "$t exited $rc"
  done
}
