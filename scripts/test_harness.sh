#!/usr/bin/env bash
# The OpenEnv/TRL harness tier: pi_env.harness against the real `openenv` and TRL 1.16
# packages (tests/test_harness_openenv.py; the default suite has openenv and runs all but the TRL test). Installs
# pi-env with the `openenv` and `trl` extras into its own venv, .venv-harness (about 1.7 GB:
# openenv pins gradio, TRL pulls torch). torch is installed first as the CPU build (2.13.0;
# on this kind of machine pip takes it from a local file), so nothing pulls a CUDA build.
# HARNESS_TIER=1 makes a missing package an error instead of a skip.
#
#   bash scripts/test_harness.sh          # extra arguments go to pytest (e.g. -k trl, -x)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh  # system packages (bwrap, node, ...) and the main venv
PY=${PYTHON:-python3}
VENV=.venv-harness
if [ ! -x $VENV/bin/python ]; then
  echo "[harness] creating $VENV" >&2
  "$PY" -m venv $VENV
fi
if ! $VENV/bin/python -c "import pi_env, openenv, trl, torch, tinker_cookbook, pytest, pytest_timeout" 2>/dev/null \
   || [ pyproject.toml -nt $VENV/.pi-env-installed ]; then
  echo "[harness] installing torch (CPU), then pi-env[test,openenv,trl,tinker] into $VENV" >&2
  $VENV/bin/python -m pip install -q --disable-pip-version-check 'torch==2.13.0'
  $VENV/bin/python -m pip install -q --disable-pip-version-check -e '.[test,openenv,trl,tinker]'
  touch $VENV/.pi-env-installed
fi
HARNESS_TIER=1 TRL_EXPERIMENTAL_SILENCE=1 exec $VENV/bin/python -m pytest tests/test_harness_openenv.py tests/test_workspace_tinker.py -q -rs "$@"
