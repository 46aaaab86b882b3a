#!/usr/bin/env bash
# Runs each libFuzzer target of a MOE_FUZZ build for SECONDS from the seed
# corpus in the tree (new inputs go to a temporary folder; the seeds are not
# touched). A crash, leak or timeout stops it with the reproducer's path.
# Usage: deploy/fuzz.sh BUILD_DIR [SECONDS]   (default 30)
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1
seconds=${2:-30}
out=$(mktemp -d /tmp/moe-fuzz-XXXXXX)
status=0
for spec in tests/gateway/moe_http_fuzz:tests/gateway/fuzz_corpus/http_request \
            tests/tokenizer/moe_chat_template_fuzz:tests/tokenizer/fuzz_corpus/chat_template \
            tests/protocol/moe_protocol_fuzz: \
            tests/model/moe_gguf_fuzz:tests/model/fuzz_corpus/gguf; do
  bin=$build/${spec%%:*}
  seeds=${spec#*:}
  name=$(basename "$bin")
  mkdir -p "$out/$name/corpus"
  echo "fuzz: $name for $seconds s${seeds:+ from $seeds}"
  if ! (cd "$out/$name" && "$OLDPWD/$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
          -print_final_stats=1 corpus ${seeds:+"$OLDPWD/$seeds"} >log 2>&1 </dev/null); then
    echo "fuzz: $name FAILED; its log and reproducer are in $out/$name"
    tail -n 40 "$out/$name/log"
    status=1
    continue
  fi
  grep -E "^Done|stat::number_of_executed_units" "$out/$name/log" | sed "s/^/fuzz: $name: /"
done
[ "$status" = 0 ] && rm -rf "$out"
exit "$status"
