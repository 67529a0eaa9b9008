#!/usr/bin/env bash
# The CPU gate loop tier: examples/gate_loop.py, a trainer-owned rollout through
# interception_gate with SmolLM2-135M-Instruct generating every turn on the CPU (transformers,
# float32), ending with the verified reward and the logprob reproduction check (asserts a max
# abs difference < 1e-3). It runs with the engine venv's python, which has torch and
# transformers and already has pi-env's own dependencies (pydantic, aiohttp, msgspec), so
# pi-env is taken from src/ (PYTHONPATH) without installing it there. About 2 minutes on 2 CPUs.
#
#   bash scripts/run_gate_loop.sh            # extra arguments go to gate_loop.py (e.g. --max-turns 2)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh            # system packages (bwrap, node, ...) and the main venv: Pi's sandbox
bash scripts/engines/install.sh vllm  # .engines/vllm-venv + the converted model (a no-op when current)
PY=${PI_ENV_ENGINES_DIR:-.engines}/vllm-venv/bin/python
PYTHONPATH=src HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 exec "$PY" examples/gate_loop.py "$@"
