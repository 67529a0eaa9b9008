"""`pi-env`: thin command line over the rooms (run, doctor)."""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import time
from pathlib import Path

from .arguments import (
    agent_argument,
    backend_argument,
    config_from_args,
    describe_sampling,
    endpoint_arguments,
    generation_arguments,
)
from .config import BLACK_BOX, TRANSPARENT_PROXY
from .errors import EXIT_BAD_INPUT, EXIT_INFRA, exit_code_for, exit_code_of

# Subcommands whose code lives with their room. Each module has `add_arguments(parser)` and
# `run(args) -> exit code`, and imports its heavy dependencies only inside `run`.
ROOM_COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pi_env.server.command", "the OpenEnv server: MCP run_rollout, web UI at /web, /health, /docs"),
    "collect": ("pi_env.collect.command", "run a task set into a resumable dataset directory (SFT/GRPO data)"),
    "export": ("pi_env.collect.export_command", "export a collected dataset as sft, grpo or atif JSON lines"),
    "reverify": (
        "pi_env.collect.reverify_command",
        "score a collected dataset's kept work dirs again with new tasks' verifiers (no agent runs)",
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pi-env", description="Run a coding agent (Pi by default) on tasks in a sandbox."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run rollouts of a task file, a JSONL task set or a directory of tasks")
    run.add_argument("tasks", type=Path, help="TASK.json, TASKS.jsonl or a directory of task JSON files")
    endpoint_arguments(run)
    run.add_argument(
        "--mode",
        default=None,
        choices=[BLACK_BOX, TRANSPARENT_PROXY],
        help="black_box (default) or transparent_proxy (the default with --sampling)",
    )
    generation_arguments(run)
    run.add_argument("--max-turns", type=int, default=None, help="model calls per rollout (default 50)")
    run.add_argument("--max-total-tokens", type=int, default=None, help="usage.total_tokens budget per rollout")
    run.add_argument("--trace-dir", default=None, help="where transparent_proxy writes per-turn trace files")
    run.add_argument(
        "--token-in",
        action="store_true",
        default=None,
        help="transparent_proxy: the gateway renders and bridges token ids itself, so each rollout is "
        "one exact sequence (needs pi-env[token-in] and a token-in engine such as vLLM)",
    )
    run.add_argument(
        "--renderer",
        default=None,
        help="token-in renderer: auto (default), chatml-hermes, a renderers name (qwen3, llama-3, ...) or module.Class",
    )
    run.add_argument(
        "--tokenizer", default=None, help="token-in tokenizer: a directory or model id (default: the model id)"
    )
    run.add_argument("--agent-timeout", type=float, default=None, help="seconds for the agent phase")
    backend_argument(run)
    run.add_argument(
        "--include-unsupported",
        action="store_true",
        help="run Harbor tasks whose environment this backend cannot honour (their rollouts are "
        "never scored: error_kind environment_unsupported)",
    )
    run.add_argument("--json", action="store_true", help="print each RolloutResult as JSON on stdout")
    run.add_argument("--out", type=Path, help="write the results as JSON lines to this file")

    doctor = commands.add_parser("doctor", help="check the sandbox, the agent (installed once) and the endpoint")
    endpoint_arguments(doctor)
    backend_argument(doctor)
    agent_argument(doctor)

    for name, (module_name, help_text) in ROOM_COMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(commands.add_parser(name, help=help_text))

    args = parser.parse_args(argv)
    if args.command != "serve":  # the server stops on SIGTERM its own way (uvicorn)
        signal.signal(signal.SIGTERM, _terminated)
    try:
        if args.command in ROOM_COMMANDS:
            return importlib.import_module(ROOM_COMMANDS[args.command][0]).run(args)
        return _run(args) if args.command == "run" else _doctor(args)
    except Terminated:
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        return 130


class Terminated(KeyboardInterrupt):
    """SIGTERM (`timeout`, `kill`, a scheduler): unwinds like Ctrl-C, so every open rollout closes
    its sandbox and gateway session, and the process exits through its normal clean-up."""


def _terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
    raise Terminated()


def _run(args) -> int:
    from pydantic import ValidationError

    from .endpoints import EndpointError
    from .results import unscored_result
    from .rollout import PiSessionFactory
    from .sandbox import SandboxUnavailable
    from .task import TaskError, load_tasks

    try:
        tasks = load_tasks(args.tasks)
        config = config_from_args(
            args,
            mode=args.mode,
            gateway={"max_turns": args.max_turns, "max_total_tokens": args.max_total_tokens},
            limits={"agent_timeout_s": args.agent_timeout},
            mode_settings={
                "trace_dir": args.trace_dir,
                "token_in": args.token_in,
                "renderer": args.renderer,
                "tokenizer": args.tokenizer,
            },
        )
        factory = PiSessionFactory(config)
    except (TaskError, EndpointError, ValidationError, ValueError, NotImplementedError, SandboxUnavailable) as error:
        return _refused(error)  # bad input; a sandbox backend unavailable here: EXIT_INFRA (pi_env.errors)
    print(f"pi-env: {describe_sampling(config)}", file=sys.stderr, flush=True)
    if refused := _environments_not_honoured(tasks, args.backend, args.include_unsupported):
        return _refused(refused)
    out = args.out.open("w") if args.out else None
    infra_failures = 0
    results = []
    try:
        for task in tasks:
            try:
                with factory.create(task) as session:
                    result = session.wait_for_completion()
            except (EndpointError, ValueError) as error:
                return _refused(error)
            except Exception as error:  # noqa: BLE001 - one rollout's failure never loses the others
                result = unscored_result(task.task_id, error)
            infra_failures += exit_code_for(result.error_kind) == EXIT_INFRA
            results.append(result)
            line = result.model_dump_json()
            if out:
                out.write(line + "\n")
                out.flush()
            if args.json:
                print(line, flush=True)
            else:
                _print_summary(result)
    finally:
        if out:
            out.close()
    if len(results) > 1 and not args.json:
        _print_totals(results)
    return EXIT_INFRA if infra_failures else 0


def _environments_not_honoured(tasks, backend: str, include: bool) -> str | None:
    """Harbor tasks: say what of each environment is approximated; refuse (the message) those
    whose environment `backend` cannot honour unless `include` (then they run unscored)."""
    from .harbor import harbor_facts, unsupported_reasons

    lines = []
    for task in tasks:
        if (facts := harbor_facts(task)) is None:
            continue
        for note in facts.environment.approximated if facts.environment else []:
            print(f"pi-env: {task.task_id}: {note}", file=sys.stderr)
        if why := unsupported_reasons(task, backend):
            lines.append(f"  {task.task_id}: " + "\n    ".join(why))
    if not lines:
        return None
    if include:
        print(
            f"pi-env: running {len(lines)} task(s) whose environment the {backend} backend cannot honour; "
            "they are not scored (environment_unsupported)",
            file=sys.stderr,
        )
        return None
    return (
        f"the {backend} backend cannot honour the environment of {len(lines)} task(s):\n"
        + "\n".join(lines)
        + "\nRun them on a backend that builds environments (--backend local as root, or --backend podman), "
        "or pass --include-unsupported to run them unscored."
    )


def _print_totals(results) -> None:
    scored = [r.reward for r in results if r.reward is not None]
    errors: dict[str, int] = {}
    for result in results:
        if result.error_kind:
            errors[result.error_kind] = errors.get(result.error_kind, 0) + 1
    mean = f"{sum(scored) / len(scored):.3f}" if scored else "n/a"
    print(
        f"{len(results)} rollouts, {len(scored)} scored, mean reward {mean}"
        + (f", unscored: {errors}" if errors else ""),
        flush=True,
    )


def _print_summary(result) -> None:
    reward = "None" if result.reward is None else f"{result.reward:.3f}"
    verdict = f"reward={reward}"
    if result.error_kind:
        verdict += f"  error={result.error_kind}: {result.error}"
    tag = " [synthetic]" if result.synthetic else ""
    print(
        f"{result.task_id:<24} {verdict}  turns={len(result.proxy_turns)}  wall={result.wall_s:.2f}s{tag}", flush=True
    )


def _refused(error: Exception | str) -> int:
    """Say why the command stops; its exit code: the error's (pi_env.errors), EXIT_BAD_INPUT for words."""
    print(f"pi-env: {error}", file=sys.stderr)
    return EXIT_BAD_INPUT if isinstance(error, str) else exit_code_of(error)


def _doctor(args) -> int:
    from .agent import get_agent
    from .agent.runtime import default_cache_dir
    from .endpoints import ORACLE, resolve_endpoint
    from .sandbox import SandboxError, get_backend
    from .sandbox.base import SandboxSpec

    config = config_from_args(args)
    ok = True

    def check(name: str, action) -> None:
        nonlocal ok
        started = time.monotonic()
        try:
            detail = action()
            print(f"[ok]   {name}: {detail} ({time.monotonic() - started:.2f} s)")
        except Exception as error:  # noqa: BLE001 - doctor reports every failure, whatever it is
            ok = False
            print(f"[FAIL] {name}: {error}")

    def sandbox_check() -> str:
        sandbox = get_backend(config.sandbox.backend).create(SandboxSpec())
        try:  # the Sandbox protocol has close(), not the context manager every backend adds
            outcome = sandbox.exec("echo sandbox-ok", timeout_s=30)
        finally:
            sandbox.close()
        if outcome.stdout.strip() != "sandbox-ok":
            raise SandboxError(f"unexpected output {outcome.stdout!r} {outcome.stderr!r}")
        return f"backend {config.sandbox.backend!r} runs commands"

    def runtime_check() -> str:
        agent = get_agent(config)
        installed = agent.install(config.sandbox.runtime_cache_dir)
        return f"{agent.name} {installed.version} ({agent.package}) at {installed.root}"

    def installed_agents() -> str:
        cache = Path(config.sandbox.runtime_cache_dir) if config.sandbox.runtime_cache_dir else default_cache_dir()
        found = sorted(record.parent.name for record in (cache / "runtimes").glob("*/runtime.json"))
        return ", ".join(found) or f"none yet in {cache} (each installs on its first rollout)"

    def endpoint_check() -> str:
        if config.endpoint.name == ORACLE:
            return "oracle (built-in; replays each task's solution)"
        endpoint = resolve_endpoint(config)
        return _probe_models(endpoint)

    check("sandbox", sandbox_check)
    if config.sandbox.backend in ("local", "podman"):
        from .sandbox.totals import host_totals

        totals = host_totals()
        print(f"{'[warn] ' if totals.why_not else '[ok]   '}sandbox totals: {totals.describe()}")
    check(f"agent {config.agent.name}", runtime_check)
    check("installed agents", installed_agents)
    check("endpoint", endpoint_check)
    return 0 if ok else EXIT_INFRA


def _probe_models(endpoint) -> str:
    import urllib.request

    request = urllib.request.Request(f"{endpoint.base_url}/models")
    if endpoint.api_key:
        request.add_header("Authorization", f"Bearer {endpoint.api_key}")
    with urllib.request.urlopen(request, timeout=15) as response:
        data = json.loads(response.read() or b"{}")
    ids = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)]
    found = "listed" if endpoint.model in ids else f"NOT among {ids[:5]}"
    return f"{endpoint.base_url} answers; model {endpoint.model!r} {found}"


if __name__ == "__main__":
    sys.exit(main())
