#!/usr/bin/env bash
# The test suite: real Pi, real bubblewrap, the scripted OpenAI-compatible server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q "$@"
