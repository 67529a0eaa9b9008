#!/usr/bin/env bash
# Everything pi-env needs on a fresh Debian/Ubuntu machine: system packages, a venv, the package.
# Idempotent and quiet when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
command -v slirp4netns >/dev/null || need+=(slirp4netns)  # the internet, not the host, for setup/verify
command -v ip >/dev/null || need+=(iproute2)          # the host's addresses, kept from the sandbox
command -v rg >/dev/null || need+=(ripgrep)           # Pi's grep tool
command -v fdfind >/dev/null || command -v fd >/dev/null || need+=(fd-find)  # Pi's find tool
command -v npm >/dev/null || need+=(nodejs npm)       # installs the Pi runtime once
command -v python3 >/dev/null || need+=(python3)
# mini-swe-agent's venv is made by the system's python3 (the sandbox sees /usr, not a pyenv)
[ -x /usr/bin/python3 ] && /usr/bin/python3 -c "import ensurepip, venv" 2>/dev/null || need+=(python3 python3-venv)
command -v socat >/dev/null || need+=(socat)           # bench/proxy_overhead.py --c-relay: the relay floor in C
command -v chromium >/dev/null || need+=(chromium)     # the web UI test's headless browser (Playwright drives it)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; else SUDO=; fi
  echo "[bootstrap] installing system packages: ${need[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[bootstrap] creating .venv" >&2
  "$PY" -m venv .venv
fi
# A linked venv whose pi_env is another checkout's (a git worktree sharing it) is left
# alone: an editable install from here would point every checkout using it at this one.
here=$(pwd -P)
installed=$(env -u PYTHONPATH .venv/bin/python -c "import importlib.util as u; s = u.find_spec('pi_env')
print(s.origin if s else '')" 2>/dev/null || true)
if [ -L .venv ] && [ -n "$installed" ] && [ "${installed#"$here/src/"}" = "$installed" ]; then
  echo "[bootstrap] .venv's pi_env is $installed, not this checkout's: not reinstalling it from $here" >&2
# find_spec, not import: openenv alone takes seconds to import.
elif ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in
    ['pi_env', 'pytest', 'pytest_timeout', 'ruff', 'mypy', 'openenv', 'mcp', 'rich', 'datasets', 'ray', 'playwright', 'mkdocs']))" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.pi-env-installed ]; then
  echo "[bootstrap] installing pi-env into .venv" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'
  touch .venv/.pi-env-installed
fi
