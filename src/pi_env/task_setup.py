"""A task's setup commands run in a sandbox, and a command as the result records it.

`run_setup`: `PiConfig.sandbox.extra_setup_shell` then the task's `setup`, in order, each under the
task's setup time limit (else the config's) and the task's network choice; the first that fails
ends setup, and says why (the rollout fails `setup_failed`). The session (pi_env.rollout) runs it
before the agent, and again in a fresh verify sandbox when verify's world is rebuilt from
scratch (pi_env.verify.world), where the results are not the rollout's. `run_command` is one
command, setup's or verify's, as a `CommandResult`.
"""

from __future__ import annotations

from collections.abc import Callable

from .config import PiConfig
from .judge import tail
from .results import CommandResult
from .sandbox import Sandbox
from .sandbox.base import Network
from .task import PiTask


def capped(own: float | int | None, cap: float | int | None):
    """A task's own limit (a time, memory, disk; from its file or a caller) can only lower the
    operator's cap, never raise it. None: no limit of the task's / no cap."""
    if own is None or own == 0:
        return cap
    return own if cap is None else min(own, cap)


def run_command(
    sandbox: Sandbox, command: str, timeout_s: float, network: Network, *, env: dict[str, str] | None = None
) -> CommandResult:
    outcome = sandbox.exec(command, timeout_s=timeout_s, network=network, env=env)
    return CommandResult(
        cmd=command,
        exit_code=outcome.exit_code,
        stdout=outcome.stdout,
        stderr=outcome.stderr,
        duration_s=round(outcome.duration_s, 4),
        timed_out=outcome.timed_out,
    )


def run_setup(
    sandbox: Sandbox,
    config: PiConfig,
    task: PiTask,
    results: list[CommandResult],
    check_open: Callable[[], None],
) -> str | None:
    """Each setup command's result appended to `results` as it ends; None when all passed, else
    why the first that failed did. `check_open` raises once the session is closed: before each
    command, and after a failure (close() killed it: not the task's failure)."""
    for command in [*config.sandbox.extra_setup_shell, *task.setup]:
        check_open()
        outcome = run_command(
            sandbox,
            command,
            capped(task.timeouts.setup_s, config.limits.setup_timeout_s),
            "full" if task.setup_network else "none",
        )
        results.append(outcome)
        if not outcome.passed:
            check_open()
            why = "timed out" if outcome.timed_out else f"exited {outcome.exit_code}"
            return f"setup command {command!r} {why}: {tail(outcome.stderr or outcome.stdout, 500)}"
    return None
