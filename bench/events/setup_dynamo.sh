#!/usr/bin/env bash
# Builds the environment in which Dynamo's standalone KV indexer runs, the real router-side
# consumer of `kvsieve serve --kv-events` (tests/test_kv_events_dynamo.py, `kvsieve bench events`).
#
#   bash bench/events/setup_dynamo.sh [DIR]     (default ~/.cache/kvsieve/dynamo-venv; ~250 MB, seconds)
#
# A venv apart from kvsieve's own: ai-dynamo-runtime is a Rust extension with a few Python
# dependencies and no torch; every package is pinned and installed with --no-deps, so that
# nothing can pull another version (or a CUDA torch) in. Reused when it already answers.
set -euo pipefail
dir="${1:-$HOME/.cache/kvsieve/dynamo-venv}"
if [ -x "$dir/bin/python" ] && "$dir/bin/python" -m dynamo.indexer --help >/dev/null 2>&1; then
  echo "Dynamo environment ready (reused): $dir"
  exit 0
fi
python3 -m venv "$dir"
"$dir/bin/pip" install -q --disable-pip-version-check --no-deps \
  ai-dynamo-runtime==1.6.1 pydantic==2.13.5 pydantic_core==2.46.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing_extensions==4.16.0 uvloop==0.23.0
"$dir/bin/python" -m dynamo.indexer --help >/dev/null
echo "Dynamo environment ready: $dir"
