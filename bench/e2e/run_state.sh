# The state of a run on the GPU machine that resumes across calls, shared by
# device_run.sh and gguf_device_run.sh. Source it with W (the state folder,
# kept while the machine stays warm) and deadline (a Unix time) set: it makes
# $W/state, $W/logs and $out (OUT, default $W/out), and gives
#   left      seconds until the deadline
#   is_done S / mark S   whether stage S is done / that it is
#   say ...   a timestamped progress line
mkdir -p "$W/state" "$W/logs"
out=${OUT:-$W/out}
mkdir -p "$out"
left() { echo $((deadline - $(date +%s))); }
is_done() { [ -f "$W/state/$1" ]; }
mark() { touch "$W/state/$1"; }
say() { echo "== $(date -u +%T) [$(left) s left] $*"; }
