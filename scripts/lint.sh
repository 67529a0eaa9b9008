#!/usr/bin/env bash
# The checks CI holds the package to before any test: ruff's formatter and linter, then mypy
# (rules for both in pyproject.toml). `ruff format src && ruff check --fix src` mends most of
# what ruff reports; mypy's findings are mended by hand (an Optional narrowed where the code
# knows it is set, a wrong annotation corrected; `type: ignore[code]` only with a reason).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff format --check src
.venv/bin/ruff check src
.venv/bin/python -m mypy  # files, plugin and overrides: [tool.mypy] in pyproject.toml
