#!/usr/bin/env bash
# The real engine tier: installs what it needs (the main venv, then vLLM's CPU build and the
# converted SmolLM2-135M-Instruct into .engines/), then runs tests/engines against a real vLLM
# started once for the session on 127.0.0.1 and stopped by PID at the end.
# ENGINE_TIER=1 turns every skip into an error: this command passes only if the tests ran.
# Extra arguments go to pytest (e.g. -k tool, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
bash scripts/engines/install.sh
ENGINE_TIER=1 exec .venv/bin/python -m pytest tests/engines -q -rA --durations=0 "$@"
