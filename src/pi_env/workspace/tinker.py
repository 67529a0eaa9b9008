"""tinker-cookbook adapter: workspace tasks as cookbook RL environments.

Needs the optional extra `pi-env[tinker]` (tinker-cookbook). Each episode is a `WorkspaceEnv`
whose four tools are cookbook `Tool`s, wrapped by the cookbook's own `build_agent_tool_env`
(turn, tool-call, trajectory and generation-token limits; tools run sequentially, since they
share the workspace). The reward is graded once at the episode's end, and the episode's
sandbox is deleted right after; `cleanup()` closes whatever is left.

    builder = WorkspaceDatasetBuilder(model_name="Qwen/Qwen3-4B-Instruct-2507",
                                      renderer_name="qwen3_instruct")
    train, test = await builder()   # RLDatasets of WorkspaceEnvGroupBuilder

Builders hold only plain data (task, names, limits), so they pickle; the tokenizer and
renderer are loaded in `make_envs()` through the cookbook's `get_tokenizer`/`get_renderer`
(a local tokenizer directory works as `model_name`). No Tinker API key is involved here.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Sequence
from typing import Any

try:
    import chz
    from tinker_cookbook import model_info, tokenizer_utils
    from tinker_cookbook.renderers import Renderer, get_renderer
    from tinker_cookbook.rl.rollout_presets import RolloutConfig
    from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder
    from tinker_cookbook.tool_use import build_agent_tool_env
    from tinker_cookbook.tool_use.types import ToolInput, ToolResult
except ImportError as exc:  # pragma: no cover - depends on the optional extra
    raise ImportError(
        f"pi_env.workspace.tinker needs tinker-cookbook ({exc}); install the extra: pip install 'pi-env[tinker]'"
    ) from exc

from pi_env.workspace.env import WorkspaceEnv
from pi_env.workspace.reward import Mode
from pi_env.workspace.tasks import DEFAULT_LANGUAGES, WorkspaceTask, make_splits
from pi_env.workspace.tools import TOOL_SPECS, WorkspaceLimits

__all__ = ["WorkspaceDatasetBuilder", "WorkspaceEnvGroupBuilder", "WorkspaceRLDataset", "WorkspaceTool"]


class WorkspaceTool:
    """One of the four tools of a WorkspaceEnv, as a cookbook `Tool`."""

    def __init__(self, env: WorkspaceEnv, name: str):
        self._env = env
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    @property
    def description(self) -> str:
        return TOOL_SPECS[self._name]["description"]

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return TOOL_SPECS[self._name]["parameters"]

    def to_spec(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters_schema}

    async def run(self, input: ToolInput) -> ToolResult:
        # bash blocks for the program's run: keep the event loop (other rollouts) going.
        text = await asyncio.to_thread(self._env.call, self._name, input.arguments)
        return ToolResult(
            messages=[{"role": "tool", "content": text, "tool_call_id": input.call_id or "", "name": self._name}]
        )


class _SerializedTokenizer:
    """A HF fast tokenizer whose encode/decode hold one lock. The cookbook renders every env's
    prompt in a worker thread, and renderers that encode with split_special_tokens flip a flag
    on the shared Rust tokenizer: two at once fail with "RuntimeError: Already borrowed"."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._lock = threading.Lock()

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._tokenizer.encode(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._tokenizer.decode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


@functools.cache
def _shared_tokenizer(model_name: str) -> _SerializedTokenizer:
    return _SerializedTokenizer(tokenizer_utils.get_tokenizer(model_name))


class _Grader:
    """The episode's reward_fn: score the conversation, then delete the episode's sandbox."""

    def __init__(self, env: WorkspaceEnv):
        self._env = env

    async def __call__(self, messages: list[dict]) -> tuple[float, dict[str, float]]:
        try:
            result = self._env.reward(messages)
        finally:
            await asyncio.to_thread(self._env.close)
        # The cookbook needs a float: an unscored evaluation counts 0 here, flagged by
        # metrics["infrastructure_error"] so that an evaluator can drop it.
        return (0.0 if result.reward is None else result.reward), result.metrics


class WorkspaceEnvGroupBuilder(EnvGroupBuilder):
    """`group_size` episodes of one task (GRPO centres rewards across them)."""

    def __init__(
        self,
        task: WorkspaceTask,
        *,
        model_name: str,
        renderer_name: str | None = None,
        group_size: int = 1,
        mode: Mode = "train",
        max_turns: int = 8,
        max_tool_calls: int | None = 16,
        max_trajectory_tokens: int | None = 8192,
        max_generation_tokens: int | None = 1024,
        limits: WorkspaceLimits | None = None,
        backend: str = "local",
    ):
        if group_size < 1:
            raise ValueError(f"group_size: {group_size}; give at least 1")
        if mode not in ("train", "eval"):
            raise ValueError(f"mode: {mode!r}; give 'train' or 'eval'")
        self.task = task
        self.model_name = model_name
        self.renderer_name = renderer_name
        self.group_size = group_size
        self.mode = mode
        self.max_turns = max_turns
        self.max_tool_calls = max_tool_calls
        self.max_trajectory_tokens = max_trajectory_tokens
        self.max_generation_tokens = max_generation_tokens
        self.limits = limits or WorkspaceLimits()
        self.backend = backend
        self._episodes: list[WorkspaceEnv] = []  # live state: never pickled

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_episodes"] = []
        return state

    def renderer(self) -> Renderer:
        tokenizer = _shared_tokenizer(self.model_name)
        name = self.renderer_name or model_info.get_recommended_renderer_name(self.model_name)
        return get_renderer(name, tokenizer, model_name=self.model_name)

    async def make_envs(self) -> Sequence[Env]:
        renderer = await asyncio.to_thread(self.renderer)
        envs = []
        for _ in range(self.group_size):
            episode = WorkspaceEnv(self.task, mode=self.mode, limits=self.limits, backend=self.backend)
            self._episodes.append(episode)
            tools = [WorkspaceTool(episode, name) for name in TOOL_SPECS]
            system, user = episode.initial_messages()
            messages = renderer.create_conversation_prefix_with_tools(
                tools=[t.to_spec() for t in tools], system_prompt=system["content"]
            )
            envs.append(
                build_agent_tool_env(
                    renderer=renderer,
                    tools=tools,
                    initial_messages=[*messages, user],
                    reward_fn=_Grader(episode),
                    rollout_config=RolloutConfig(tool_execution="sequential"),
                    max_turns=self.max_turns,
                    max_tool_calls=self.max_tool_calls,
                    max_trajectory_tokens=self.max_trajectory_tokens,
                    max_generation_tokens=self.max_generation_tokens,
                )
            )
        return envs

    async def cleanup(self) -> None:
        episodes, self._episodes = self._episodes, []
        for episode in episodes:
            await asyncio.to_thread(episode.close)

    def logging_tags(self) -> list[str]:
        return ["pi-env-workspace", self.task.family, self.task.language]


class WorkspaceRLDataset(RLDataset):
    def __init__(self, builders: list[WorkspaceEnvGroupBuilder], batch_size: int):
        if batch_size < 1:
            raise ValueError(f"batch_size: {batch_size}; give at least 1")
        self.builders = builders
        self.batch_size = batch_size

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} of {len(self)}")
        return self.builders[index * self.batch_size : (index + 1) * self.batch_size]

    def __len__(self) -> int:
        return (len(self.builders) + self.batch_size - 1) // self.batch_size


@chz.chz
class WorkspaceDatasetBuilder(RLDatasetBuilder):
    """Generated workspace tasks (train/eval splits, checked disjoint) as cookbook datasets:
    train groups of `group_size` with the shaped reward, eval groups of one with the binary one."""

    model_name: str
    renderer_name: str | None = None
    batch_size: int = 8
    group_size: int = 4
    n_train: int = 256
    n_eval: int = 64
    seed: int = 0
    languages: tuple[str, ...] = DEFAULT_LANGUAGES
    families: tuple[str, ...] | None = None
    max_turns: int = 8
    max_tool_calls: int | None = 16
    max_trajectory_tokens: int | None = 8192
    max_generation_tokens: int | None = 1024
    timeout_s: float = 10.0

    def _builders(self, tasks: list[WorkspaceTask], group_size: int, mode: Mode) -> list[WorkspaceEnvGroupBuilder]:
        return [
            WorkspaceEnvGroupBuilder(
                task,
                model_name=self.model_name,
                renderer_name=self.renderer_name,
                group_size=group_size,
                mode=mode,
                max_turns=self.max_turns,
                max_tool_calls=self.max_tool_calls,
                max_trajectory_tokens=self.max_trajectory_tokens,
                max_generation_tokens=self.max_generation_tokens,
                limits=WorkspaceLimits(timeout_s=self.timeout_s),
            )
            for task in tasks
        ]

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        train, evaluation = make_splits(
            self.n_train, self.n_eval, seed=self.seed, languages=self.languages, families=self.families
        )
        test = WorkspaceRLDataset(self._builders(evaluation, 1, "eval"), self.batch_size) if evaluation else None
        return WorkspaceRLDataset(self._builders(train, self.group_size, "train"), self.batch_size), test
