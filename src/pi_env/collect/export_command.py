"""`pi-env export DIR --format sft|grpo|atif`: a training-ready file from a collect store."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..arguments import EXIT_BAD_INPUT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="the --out directory of pi-env collect")
    parser.add_argument("--format", required=True, choices=["sft", "grpo", "atif"])
    parser.add_argument(
        "--keep", default=None, help="all, scored or reward>=X (default: sft reward>=1, grpo scored, atif all)"
    )
    parser.add_argument("--out", type=Path, default=None, help="output file (default DIR/exports/FORMAT.jsonl)")


def run(args) -> int:
    from .export import export
    from .store import StoreError

    try:
        path, rows, records = export(args.dir, args.format, keep=args.keep, path=args.out)
    except (ValueError, FileNotFoundError, StoreError) as error:
        print(f"pi-env: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"{args.format}: {rows} rows from {records} records -> {path}")
    return 0
