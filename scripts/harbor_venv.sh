#!/usr/bin/env bash
# A test-only venv with PyPI `harbor` (it needs Python >= 3.12; pi-env supports 3.11), whose own
# pydantic models validate pi-env's ATIF exports (tests/test_atif.py). Usage:
#   scripts/harbor_venv.sh [PYTHON3.12+]   -> .venv-harbor/
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${1:-$(command -v python3.13 || command -v python3.12 || ls -d "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python 2>/dev/null | tail -1 || true)}"
if [ -x .venv-harbor/bin/python ] && .venv-harbor/bin/python -c "import harbor" 2>/dev/null; then exit 0; fi
if [ -z "$PYTHON" ]; then echo "harbor_venv: no python3.12+ found; pass one as the argument" >&2; exit 1; fi
"$PYTHON" -m venv .venv-harbor
.venv-harbor/bin/pip install -q "harbor==0.26.0"
.venv-harbor/bin/python -c "from harbor.models.trajectories import Trajectory; print('harbor', Trajectory.model_fields['schema_version'].default)"
