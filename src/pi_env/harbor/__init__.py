"""Harbor task directories as `PiTask`s: what a task carries (`facts.py`: `HarborFacts`, on the
task under `metadata["harbor"]`), reading a task directory (`loader.py`) and the rules a rollout
applies (`rules.py`: steps, environment, artifacts). docs/harbor.md says what is honoured,
approximated and refused.

Importing this package plugs the Harbor format into `pi_env.task` (`register_task_format`):
`load_tasks` then takes Harbor task directories, and a task's `metadata["harbor"]` is checked
whenever a `PiTask` is validated. `pi_env.task` imports it by name (`FORMAT_PACKAGES`) the first
time a task needs a format, so `import pi_env` loads none of it.
"""

from __future__ import annotations

from ..task import TaskFormat, register_task_format
from .facts import METADATA_KEY, HarborEnvironment, HarborFacts, HarborStep, check_facts, harbor_facts, is_harbor
from .loader import harbor_task_dirs, is_harbor_task, load_harbor_task, load_harbor_tasks
from .rules import (
    BUILDING_BACKENDS,
    collect_artifacts,
    combine_step_rewards,
    environment_record,
    environment_spec,
    later_steps,
    step_gate,
    step_own,
    unsupported_reasons,
)

register_task_format(
    TaskFormat(
        key=METADATA_KEY,
        what="Harbor task (a directory with instruction.md and task.toml)",
        task_dirs=harbor_task_dirs,
        load=load_harbor_tasks,
        check=check_facts,
    )
)

__all__ = [
    "BUILDING_BACKENDS",
    "HarborEnvironment",
    "HarborFacts",
    "HarborStep",
    "collect_artifacts",
    "combine_step_rewards",
    "environment_record",
    "environment_spec",
    "harbor_facts",
    "harbor_task_dirs",
    "is_harbor",
    "is_harbor_task",
    "later_steps",
    "load_harbor_task",
    "load_harbor_tasks",
    "step_gate",
    "step_own",
    "unsupported_reasons",
]
