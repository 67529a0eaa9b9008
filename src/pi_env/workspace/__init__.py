"""Pi-shaped workspace tools for trainers that own the token loop (tinker-cookbook, plain Python).

`WorkspaceEnv` gives one episode: the prompt, Pi's four tools (read/write/edit over a bounded
in-memory workspace, bash running the model's program in the local bubblewrap sandbox) and the
shaped reward. `generate_tasks`/`make_splits` make the tasks. The tinker-cookbook adapter is
`pi_env.workspace.tinker` (optional extra `pi-env[tinker]`).
"""

from pi_env.workspace.env import WorkspaceEnv
from pi_env.workspace.reward import Score, score
from pi_env.workspace.tasks import (
    FAMILIES,
    LANGUAGES,
    SplitOverlapError,
    WorkspaceTask,
    available_languages,
    check_disjoint,
    generate_tasks,
    make_splits,
)
from pi_env.workspace.tools import RESULT_SCHEMA, Workspace, WorkspaceLimits, tool_schemas

__all__ = [
    "FAMILIES",
    "LANGUAGES",
    "RESULT_SCHEMA",
    "Score",
    "SplitOverlapError",
    "Workspace",
    "WorkspaceEnv",
    "WorkspaceLimits",
    "WorkspaceTask",
    "available_languages",
    "check_disjoint",
    "generate_tasks",
    "make_splits",
    "score",
    "tool_schemas",
]
