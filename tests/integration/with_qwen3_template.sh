#!/usr/bin/env bash
# Runs a test file (run_with_server.sh) against the demo model served with
# Qwen3's chat template (tests/data/qwen3-chat-template) in place of its own:
# a folder of links to the demo model's files beside that template.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=$(mktemp -d /tmp/moe-qwen3-template-XXXXXX)
trap 'rm -rf "$dir"' EXIT
for f in "$MOE_MODEL"/*; do
  case $(basename "$f") in chat_template.jinja) ;; *) ln -s "$(cd "$(dirname "$f")" && pwd)/$(basename "$f")" "$dir/" ;; esac
done
cp "$here/../data/qwen3-chat-template/chat_template.jinja" "$dir/chat_template.jinja"
MOE_MODEL=$dir bash "$here/run_with_server.sh" "$@"
