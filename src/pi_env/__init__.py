"""pi-env: scored rollouts of the Pi coding agent in an isolated sandbox.

Kept light: heavy parts are imported where they are used.
"""

# Plugs the Harbor task format into pi_env.task (load_tasks, metadata["harbor"] checked) before any task loads.
from . import harbor as _harbor  # noqa: F401
from .config import PiConfig
from .results import CommandResult, RolloutEvent, RolloutResult, RolloutTurn
from .task import PiTask, TaskError, load_tasks

__all__ = [
    "PiConfig",
    "PiTask",
    "TaskError",
    "load_tasks",
    "CommandResult",
    "RolloutEvent",
    "RolloutResult",
    "RolloutTurn",
    "PiSessionFactory",
    "PiSession",
    "run_rollout",
    "PiEnv",
]


def __getattr__(name: str):
    # The lifecycle pulls in aiohttp and the sandbox backends: load it on first use only.
    if name in ("PiSessionFactory", "PiSession", "run_rollout"):
        from . import rollout

        return getattr(rollout, name)
    if name == "PiEnv":  # the server's client: needs the `mcp` SDK (the server extra)
        from .server.client import PiEnv

        return PiEnv
    raise AttributeError(f"module 'pi_env' has no attribute {name!r}")
