"""What pi-env's commands share: exit codes, the endpoint and backend arguments, and the config
they make. `cli` (run, doctor) and the rooms' own commands (`collect`, `export`, `serve`) import it
from here, so no room reaches back into the command line that dispatches to it."""

from __future__ import annotations

import argparse

from .config import PiConfig
from .sandbox import backend_names

EXIT_BAD_INPUT = 2  # the input was wrong; the message says what to fix
EXIT_INFRA = 3  # a rollout could not be scored for infrastructure reasons (sandbox, runtime, endpoint)


def endpoint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", default="oracle",
                        help="vllm, openai, hf_router, oracle (replays the task's solution) or an http(s) URL")
    parser.add_argument("--base-url", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--api-key", default=None, help="upstream key (or the endpoint's env var)")


def backend_argument(parser: argparse.ArgumentParser, default: str | None = "local") -> None:
    """`--backend`, naming every backend in the sandbox registry."""
    shown = "" if default is None else f"; default {default}"
    parser.add_argument("--backend", default=default, choices=backend_names(), metavar="BACKEND",
                        help=f"sandbox backend: {', '.join(backend_names())}{shown} "
                             "(local is bubblewrap; see docs/backends.md)")


def config_from_args(args, **extra) -> PiConfig:
    fields = dict(endpoint=args.endpoint, base_url=args.base_url, model=args.model, api_key=args.api_key,
                  sandbox_backend=args.backend, **extra)
    return PiConfig(**{k: v for k, v in fields.items() if v is not None})
