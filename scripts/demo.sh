#!/usr/bin/env bash
# The main job on its embedded defaults: the bundled example tasks, through the real Pi CLI in
# the local bubblewrap sandbox, driven by the oracle endpoint (no keys, no model). Prints rewards.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/pi-env run examples/ "$@"
