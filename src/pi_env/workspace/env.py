"""WorkspaceEnv: the plain-Python loop API over one workspace episode.

with WorkspaceEnv(task) as env:
    messages = env.initial_messages()
    ...  # the trainer samples; for each tool call:
    messages.append({"role": "tool", "tool_call_id": id, "content": env.call(name, args)})
    score = env.reward(messages)  # Score(reward, metrics)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pi_env.workspace import prompt, reward
from pi_env.workspace.tasks import WorkspaceTask
from pi_env.workspace.tools import Workspace, WorkspaceLimits, tool_schemas


class WorkspaceEnv:
    """One episode. `mode` is "train" (shaped reward) or "eval" (binary). Close it (or use
    `with`): that deletes the episode's sandbox."""

    def __init__(
        self,
        task: WorkspaceTask | Mapping[str, Any],
        *,
        mode: reward.Mode = "train",
        limits: WorkspaceLimits | None = None,
        backend: str = "local",
    ):
        if mode not in ("train", "eval"):
            raise ValueError(f"mode: {mode!r}; give 'train' or 'eval'")
        self.task = task if isinstance(task, WorkspaceTask) else WorkspaceTask.from_dict(dict(task))
        self.mode = mode
        self.workspace = Workspace(self.task, limits=limits, backend=backend)
        self._issued: list[str] = []  # every result handed out: only these count for reward

    def initial_messages(self) -> list[dict[str, Any]]:
        return prompt.initial_messages(self.task)

    @staticmethod
    def tools() -> list[dict[str, Any]]:
        return tool_schemas()

    def call(self, tool_name: str, args: Mapping[str, Any] | str) -> str:
        """Run a tool; its JSON result, to send back as the tool message's content."""
        text = json.dumps(self.workspace.call(tool_name, args), ensure_ascii=False)
        self._issued.append(text)
        return text

    def reward(self, messages: Sequence[Mapping[str, Any]]) -> reward.Score:
        return reward.score(messages, self.task.expected, mode=self.mode, trusted=set(self._issued))

    def close(self) -> None:
        self.workspace.close()

    def __enter__(self) -> WorkspaceEnv:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
