"""`pi-env collect TASKS --out DIR`: run a task set into a dataset directory (resumable)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..arguments import (
    backend_argument,
    config_from_args,
    describe_sampling,
    endpoint_arguments,
    generation_arguments,
)
from ..config import BLACK_BOX, TRANSPARENT_PROXY
from ..errors import EXIT_INFRA, exit_code_for, exit_code_of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("tasks", type=Path, help="TASKS.jsonl, a directory of task JSON files, or Harbor task dir(s)")
    parser.add_argument("--out", type=Path, required=True, help="dataset directory (resumed when it exists)")
    endpoint_arguments(parser)
    parser.add_argument(
        "--mode",
        default=None,
        choices=[BLACK_BOX, TRANSPARENT_PROXY],
        help="transparent_proxy (default) records token ids and logprobs for training",
    )
    generation_arguments(parser)
    parser.add_argument("--group-size", type=int, default=1, help="rollouts per task (a GRPO group)")
    parser.add_argument("--concurrency", type=int, default=4, help="rollouts at once")
    parser.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    parser.add_argument("--retries", type=int, default=2, help="extra attempts for infrastructure failures")
    parser.add_argument(
        "--keep",
        default="all",
        help="what results.jsonl keeps: all, scored, reward>=X (the rest goes to discarded.jsonl)",
    )
    parser.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="skip what the store already holds (default); --no-resume refuses a non-empty --out",
    )
    parser.add_argument(
        "--include-unsupported",
        action="store_true",
        help="also run Harbor tasks whose environment the local backend cannot honour",
    )
    parser.add_argument("--executor", default="local", choices=["local", "ray"])
    parser.add_argument("--ray-address", default=None, help="existing Ray cluster (default: start a local one)")
    parser.add_argument("--ray-num-cpus", type=float, default=1.0, help="CPUs Ray reserves per rollout")
    parser.add_argument("--max-turns", type=int, default=None, help="model calls per rollout (default 50)")
    parser.add_argument("--agent-timeout", type=float, default=None, help="seconds for the agent phase")
    parser.add_argument(
        "--trace-dir",
        default=None,
        help="where transparent_proxy writes per-turn trace files (default: OUT/traces, kept with the dataset)",
    )
    parser.add_argument(
        "--keep-workdir",
        action="store_true",
        help="keep each rollout's final work dir (OUT/workdirs/, tar.gz) so pi-env reverify can score it again",
    )
    parser.add_argument(
        "--keep-workdir-max-mb",
        type=float,
        default=None,
        help="a larger work dir (its files' bytes) is not kept, and its record says so (default 64)",
    )
    backend_argument(parser)
    parser.add_argument("--push-to-hub", metavar="REPO", default=None, help="upload the dataset to this Hub repo")
    parser.add_argument("--private", action="store_true", help="create the Hub repo private")
    parser.add_argument("--quiet", action="store_true", help="no progress view")


def run(args) -> int:
    from pydantic import ValidationError

    from ..endpoints import EndpointError
    from ..sandbox import SandboxUnavailable
    from ..task import TaskError
    from .report import print_summary
    from .runner import CollectError, CollectRunner

    try:
        config = config_from_args(
            args,
            mode=args.mode or TRANSPARENT_PROXY,
            gateway={"max_turns": args.max_turns},
            limits={"agent_timeout_s": args.agent_timeout},
            mode_settings={"trace_dir": args.trace_dir or str(Path(args.out) / "traces")},
            result={
                "keep_workdir": args.keep_workdir or None,
                "keep_workdir_max_bytes": int(args.keep_workdir_max_mb * (1 << 20))
                if args.keep_workdir_max_mb
                else None,
            },
        )
        runner = CollectRunner(
            args.tasks,
            args.out,
            config,
            group_size=args.group_size,
            concurrency=args.concurrency,
            limit=args.limit,
            retries=args.retries,
            keep=args.keep,
            executor=args.executor,
            ray_address=args.ray_address,
            ray_num_cpus=args.ray_num_cpus,
            resume=args.resume,
            include_unsupported=args.include_unsupported,
            progress=not args.quiet,
        )
        print(f"pi-env: {describe_sampling(config)}", file=sys.stderr, flush=True)
        summary = runner.run()
    except (TaskError, EndpointError, CollectError, ValidationError, ValueError, SandboxUnavailable) as error:
        print(f"pi-env: {error}", file=sys.stderr)
        return exit_code_of(error)  # bad input; a sandbox backend unavailable here: EXIT_INFRA
    print_summary(summary)
    print(f"dataset: {args.out}/results.jsonl  report: {args.out}/report.png  card: {args.out}/README.md")
    if args.push_to_hub:
        from .card import push_to_hub

        try:
            url = push_to_hub(args.out, args.push_to_hub, private=args.private)
        except Exception as error:  # noqa: BLE001 - the collected data is safe on disk; say why the push failed
            print(f"pi-env: push to {args.push_to_hub} failed: {type(error).__name__}: {error}", file=sys.stderr)
            return EXIT_INFRA
        print(f"pushed: {url}")
    return max((exit_code_for(kind) for kind in summary.counts.get("errors", {})), default=0)
