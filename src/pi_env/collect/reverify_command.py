"""`pi-env reverify DATASET --tasks NEW_TASKS`: verify a dataset's kept work dirs again (reverify.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..arguments import backend_argument
from ..errors import exit_code_for, exit_code_of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", type=Path, help="the --out directory of pi-env collect --keep-workdir")
    parser.add_argument(
        "--tasks", type=Path, required=True, help="the task set whose verifiers score it (matched by task id)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output .jsonl (default DATASET/reverify-<UTC time>.jsonl; a bare name goes in DATASET); resumed when it exists",
    )
    parser.add_argument("--concurrency", type=int, default=2, help="re-verifications at once")
    parser.add_argument("--retries", type=int, default=2, help="extra attempts for infrastructure failures")
    backend_argument(parser, default=None)  # None: the dataset's own
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args) -> int:
    from ..sandbox import SandboxUnavailable
    from ..task import TaskError
    from .reverify import reverify
    from .runner import CollectError
    from .store import StoreError

    def progress(line: dict, done: int, total: int) -> None:
        if not args.quiet:
            new = line["new_reward"] if line["new_reward"] is not None else f"unscored ({line['error_kind']})"
            print(f"[{done}/{total}] {line['id']}: {line['old_reward']} -> {new}", file=sys.stderr, flush=True)

    try:
        config = None
        if args.backend:
            from .reverify import dataset_config

            config = dataset_config(args.dataset)
            config = config.model_copy(update={"sandbox": config.sandbox.model_copy(update={"backend": args.backend})})
        summary = reverify(
            args.dataset,
            args.tasks,
            args.out,
            config,
            concurrency=args.concurrency,
            retries=args.retries,
            progress=progress,
        )
    except (TaskError, CollectError, StoreError, ValueError, SandboxUnavailable) as error:
        print(f"pi-env: {error}", file=sys.stderr)
        return exit_code_of(error)  # bad input; a sandbox backend unavailable here: EXIT_INFRA
    print(
        f"reverify: {summary.records} records, {summary.same} same, {summary.changed} changed, "
        f"{summary.unscored} unscored {json.dumps(summary.unscored_kinds)}"
        + (f"; tasks missing from --tasks: {', '.join(summary.missing_tasks[:20])}" if summary.missing_tasks else "")
    )
    print(f"lines: {summary.out}  summary: {summary.summary_path}")
    return max((exit_code_for(kind) for kind in summary.unscored_kinds), default=0)
