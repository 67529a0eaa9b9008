#!/usr/bin/env bash
# Style that CI holds the package to: ruff's formatter and linter (rules in pyproject.toml).
# `ruff format src && ruff check --fix src` mends most of what this reports.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff format --check src
.venv/bin/ruff check src
