#!/usr/bin/env bash
# A test-only venv with PyPI `harbor` (it needs Python >= 3.12; pi-env supports 3.11), whose own
# pydantic models validate pi-env's ATIF exports (tests/test_atif.py). Usage:
#   scripts/harbor_venv.sh [PYTHON3.12+]   -> .venv-harbor/
set -euo pipefail
cd "$(dirname "$0")/.."
# The first candidate that really runs and is 3.12+ (a pyenv shim exists but fails when its
# version is not selected).
PYTHON="${1:-}"
if [ -z "$PYTHON" ]; then
  for c in python3.13 python3.12 "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python; do
    if "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then PYTHON=$c; break; fi
  done
fi
if [ -x .venv-harbor/bin/python ] && .venv-harbor/bin/python -c "import harbor" 2>/dev/null; then exit 0; fi
# No 3.12+ here: say so and go on; tests/test_atif.py then skips with this reason (-rs prints it).
if [ -z "$PYTHON" ]; then echo "harbor_venv: WARNING no python3.12+ found (pass one as the argument); ATIF validation will be skipped" >&2; exit 0; fi
"$PYTHON" -m venv .venv-harbor
.venv-harbor/bin/pip install -q "harbor==0.26.0"
.venv-harbor/bin/python -c "from harbor.models.trajectories import Trajectory; print('harbor', Trajectory.model_fields['schema_version'].default)"
