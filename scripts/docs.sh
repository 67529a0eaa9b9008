#!/usr/bin/env bash
# The documentation site: install the docs extra and build docs/ with `mkdocs build --strict`
# (a broken link or anchor, a page missing from the nav, an API object mkdocstrings cannot find
# all fail it). The site goes to site/ (or $1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/python -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null \
  || .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[docs]'
NO_MKDOCS_2_WARNING=1 exec .venv/bin/python -m mkdocs build --strict --site-dir "${1:-site}"
