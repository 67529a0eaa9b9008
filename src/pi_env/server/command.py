"""`pi-env serve`: the OpenEnv server (MCP run_rollout, /web, /health, /docs) under uvicorn."""

from __future__ import annotations

import argparse
import os

from ..arguments import agent_argument, backend_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 to serve other machines)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--max-concurrent", type=int, default=None, help="rollouts at once (default: $MAX_CONCURRENT_ENVS or 4)"
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="calls that may wait for a slot; more are answered busy (default: $PI_ENV_MAX_QUEUE "
        "or 4 x max-concurrent)",
    )
    backend_argument(parser, default=None)  # None: $PI_ENV_SANDBOX_BACKEND or local
    agent_argument(parser, default=None)  # None: $PI_ENV_AGENT or pi; a call's `agent` argument wins
    parser.add_argument("--no-web", action="store_true", help="no web UI at /web")
    parser.add_argument(
        "--allow-base-url",
        action="append",
        default=[],
        metavar="URL",
        help="a model endpoint callers may send as base_url or endpoint (repeatable; a URL without a "
        "path allows its whole host:port). Added to $PI_ENV_ALLOWED_BASE_URLS; the catalog's "
        "endpoints and PI_ENV_LOCAL_BASE_URL are always allowed",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="close a session (/ws, OpenEnv's MCP sessions, a web UI tab's kept key) idle this long "
        "(default: $PI_ENV_IDLE_TIMEOUT_S or 300)",
    )


def run(args) -> int:
    # The app reads its settings from the environment, as it does under plain uvicorn or in a Space.
    for name, value in (
        ("MAX_CONCURRENT_ENVS", args.max_concurrent),
        ("PI_ENV_MAX_QUEUE", args.max_queue),
        ("PI_ENV_SANDBOX_BACKEND", args.backend),
        ("PI_ENV_AGENT", args.agent),
        ("PI_ENV_AGENT_VERSION", args.agent_version),
    ):
        if value is not None:
            os.environ[name] = str(value)
    if args.allow_base_url:
        given = [os.environ.get("PI_ENV_ALLOWED_BASE_URLS", ""), *args.allow_base_url]
        os.environ["PI_ENV_ALLOWED_BASE_URLS"] = ",".join(url for url in given if url)
    if args.idle_timeout is not None:
        os.environ["PI_ENV_IDLE_TIMEOUT_S"] = str(args.idle_timeout)
    if args.no_web:
        os.environ["ENABLE_WEB_INTERFACE"] = "false"
    import uvicorn

    from .app import create_pi_app

    # The access log shows paths without query strings (app.hide_query_strings_in_logs).
    # A bounded graceful shutdown: then running calls are cancelled, which deletes their sandboxes.
    uvicorn.run(
        create_pi_app(), host=args.host, port=args.port, access_log=True, log_level="info", timeout_graceful_shutdown=5
    )
    return 0
