"""pi-env: scored rollouts of the Pi coding agent in an isolated sandbox.

`import pi_env` loads nothing else: each name below is imported from its home on first use
(tests/test_errors.py holds it to that). Task formats plug themselves in when a task needs one
(pi_env.task.FORMAT_PACKAGES).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# name -> the module it lives in (the docs import these from `pi_env`)
_EXPORTS = {
    "PiConfig": "pi_env.config",
    "PiTask": "pi_env.task",
    "TaskError": "pi_env.task",
    "load_tasks": "pi_env.task",
    "CommandResult": "pi_env.results",
    "RolloutEvent": "pi_env.results",
    "RolloutResult": "pi_env.results",
    "RolloutTurn": "pi_env.results",
    "TrainingTrace": "pi_env.results",
    "ErrorKind": "pi_env.errors",
    "PiEnvError": "pi_env.errors",
    # The lifecycle pulls in aiohttp and the sandbox backends.
    "PiSessionFactory": "pi_env.rollout",
    "PiSession": "pi_env.rollout",
    "run_rollout": "pi_env.rollout",
    "PiEnv": "pi_env.server.client",  # the server's client: needs the `mcp` SDK (the server extra)
}

__all__ = [
    "PiConfig",
    "PiTask",
    "TaskError",
    "load_tasks",
    "CommandResult",
    "RolloutEvent",
    "RolloutResult",
    "RolloutTurn",
    "TrainingTrace",
    "ErrorKind",
    "PiEnvError",
    "PiSessionFactory",
    "PiSession",
    "run_rollout",
    "PiEnv",
]

if TYPE_CHECKING:
    from .config import PiConfig
    from .errors import ErrorKind, PiEnvError
    from .results import CommandResult, RolloutEvent, RolloutResult, RolloutTurn, TrainingTrace
    from .rollout import PiSession, PiSessionFactory, run_rollout
    from .server.client import PiEnv
    from .task import PiTask, TaskError, load_tasks


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # once: later reads skip this function
        return value
    raise AttributeError(f"module 'pi_env' has no attribute {name!r}")
