#!/usr/bin/env bash
# The real engine tier: installs what it needs (the main venv, then the engines and the
# converted SmolLM2-135M-Instruct into .engines/), then runs tests/engines against real
# engines started once for the session on 127.0.0.1 and stopped by PID at the end.
# ENGINE_TIER=1 turns every skip into an error: this command passes only if the tests ran.
#
#   bash scripts/test_engines.sh                 # vLLM and llama.cpp
#   ENGINES=vllm bash scripts/test_engines.sh    # vLLM only (no llama.cpp build, its tests deselected)
#
# Extra arguments go to pytest (e.g. -k tool, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINES=${ENGINES:-vllm llama}
bash scripts/bootstrap.sh
# shellcheck disable=SC2086 # a list of words on purpose
bash scripts/engines/install.sh $ENGINES
ENGINE_TIER=1 ENGINE_TIER_ENGINES="$ENGINES" exec .venv/bin/python -m pytest tests/engines -q -rA --durations=0 "$@"
