"""pi-env as an OpenEnv harness: `HarnessSessionFactory` is pi-env's `PiSessionFactory` that is
also an `openenv.core.harness.ResourceSessionFactory`; its sessions are `ResourceSession`s that also
satisfy openenv's `LoopOwningSession` and `TrainableSession` protocols. It is what TRL 1.16's
`trl.experimental.async_grpo.openenv_harness.HarnessRolloutWorker` drives, with no glue:

    from functools import partial
    from pi_env import PiConfig, load_tasks
    from pi_env.harness import HarnessSessionFactory, dataset_rows

    tasks = load_tasks("tasks.jsonl")
    config = PiConfig(endpoint={"name": "vllm", "model": "Qwen/Qwen3-8B"})
    worker = HarnessRolloutWorker(harness_session_factory=partial(HarnessSessionFactory, config, tasks=tasks),
                                  dataset=Dataset.from_list(dataset_rows(tasks)), ...)

What the worker does with it, and what pi-env does in turn:
- `factory(sampling=training_sampling({...}))`: those parameters are forced on every model call
  at the gateway (`PiConfig.mode.sampling`); a config whose mode nobody chose runs in
  transparent_proxy (token capture).
- `create(prompt, seed=group_id, episode_id=rollout_id)`: the prompt (a message list, a string,
  a dataset row, a task dict or a `PiTask`) selects the task: a task of the factory's list whose
  id or instruction it equals, else (given a list) `tasks[seed % len(tasks)]`, so every sample of
  a GRPO group gets the same task. Without a list, the prompt is the task.
- `wait_for_completion()`: the agent runs, then the task's verify commands. Raises
  `TimeoutError` when `timeout_s` passes first (the rollout goes on) and when the agent's time
  ran out before Pi made a single model call (unscored `agent_timeout`). An agent that ran out
  of time after calling the model is killed, verified and scored on what it left, like any
  agent that gave up (a time-out must not turn its 0 into a dropped sample):
  `metrics["truncated"]` tells the trainer.
- `fetch_training_trace()`: openenv's own `TrainingTrace`, one validated turn per model call with
  the engine's prompt ids, completion ids, logprobs and a loss mask. A model call whose capture
  cannot satisfy that contract raises ValueError naming the turn and why; nothing is dropped or
  filled in silently.
- `verify(transcript)`: `env_reward` is the rollout's reward, None when it could not be scored
  (setup failure, agent or endpoint error, timeout, infrastructure): never 0 for a failure.
- `close()`: idempotent, from any thread; kills the sandbox's processes and deletes it.

Pi runs its own tools inside the sandbox, so these sessions expose no tools (`list_tools()` is
empty): they are for loop-owning harnesses, not for a trainer that samples each turn itself.

Needs the `openenv` extra (`pip install 'pi-env[openenv]'`); `import pi_env` never imports it.
That is why there are two factories, with two names: `pi_env.PiSessionFactory` (the core, whose
sessions return pi-env's own `RolloutResult`/`RolloutTurn`/`TrainingTrace`) and its subclass
`HarnessSessionFactory`, which adds a task list to choose from, defaults to transparent_proxy,
and whose sessions speak openenv's types (TraceEntry, TrainingTrace, VerifyResult) and raise
TimeoutError for a killed agent, as TRL's worker expects.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

try:
    from openenv.core.harness import (
        ResourceSession,
        ResourceSessionFactory,
        TraceEntry,
        TrainingTrace,
        TrainingTurn,
        VerifyResult,
    )
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("pi_env.harness needs the openenv package: pip install 'pi-env[openenv]'") from error

from . import rollout
from .config import TRANSPARENT_PROXY, Mode, PiConfig
from .errors import unscored
from .proxy.capture import TurnCapture
from .proxy.records import TurnRecord
from .proxy.rewrite import SAMPLING_KEYS
from .results import RolloutEvent, RolloutResult
from .rollout import PiSession
from .sandbox import SandboxBackend
from .task import PiTask, TaskError, load_tasks

__all__ = ["HarnessSessionFactory", "HarnessSession", "dataset_rows", "prompt_text"]


class HarnessSessionFactory(rollout.PiSessionFactory, ResourceSessionFactory["HarnessSession"]):
    """Makes `HarnessSession`s: pi-env rollouts behind openenv's session contract.

    `config`, `sandbox_backend` and `mode` are the core factory's; the mode defaults to
    transparent_proxy here (a trainable session needs token capture) unless the config or
    `mode=` chose one. `tasks` (PiTasks, task dicts, or a task-set path for `load_tasks`) is
    what `create` chooses from; `sampling` is forced on every model call; `agent` names the
    coding agent (`pi`, `opencode`, `qwen-code`, `mini-swe-agent`; default: the config's)."""

    def __init__(
        self,
        config: PiConfig | None = None,
        sandbox_backend: str | SandboxBackend | None = None,
        mode: Mode | None = None,
        *,
        tasks: str | Path | Iterable[PiTask | dict] | None = None,
        sampling: Mapping[str, float | int] | None = None,
        agent: str | None = None,
    ):
        config = config or PiConfig()
        if mode is None and "mode" not in config.model_fields_set:
            mode = TRANSPARENT_PROXY
        super().__init__(config, sandbox_backend, mode, sampling=sampling, agent=agent)
        if isinstance(tasks, (str, Path)):
            tasks = load_tasks(tasks)
        self.tasks: list[PiTask] = [PiTask.coerce(task) for task in tasks or ()]

    # openenv's ResourceSessionFactory.create, not the core factory's: it takes any task reference
    # and returns an openenv session (HarnessSession wraps the PiSession), so it cannot match
    # PiSessionFactory.create's signature; the core create stays reachable through super().
    def create(  # type: ignore[override]
        self,
        task: Any = None,
        seed: int | None = None,
        episode_id: str | None = None,
        *,
        on_event: Callable[[RolloutEvent], None] | None = None,
    ) -> HarnessSession:
        """Start one rollout of the task `task` names (see `select_task`). Bad input raises;
        infrastructure failures surface as an unscored rollout (`verify().env_reward` None).
        Returns once the task and endpoint are checked: the sandbox, setup and Pi start in the
        background, so a trainer that stops can close() the session at once (TRL's worker closes
        the sessions it holds on stop, and waits for the rest)."""
        chosen = self.select_task(task, seed)
        return HarnessSession(
            super().create(chosen, seed=seed, episode_id=episode_id, on_event=on_event, background=True)
        )

    def select_task(self, task: Any = None, seed: int | None = None) -> PiTask:
        """The task a `create` argument names. A `PiTask` or a task dict is itself; a dataset
        row (a dict with "prompt") is its "task", else its "task_id" in the list, else its prompt.
        A prompt (a string, or a message list whose last user message is used) is the list's
        task with that id or instruction, else `tasks[seed % len(tasks)]`; with no list, a task
        with that instruction (and no verify commands: it will be unscored)."""
        if isinstance(task, PiTask):
            return task
        if isinstance(task, Mapping) and "prompt" in task and "instruction" not in task:
            if task.get("task") is not None:
                return self.select_task(task["task"], seed)
            if task.get("task_id") is not None and self.tasks:
                return self._by_id(str(task["task_id"]))
            return self.select_task(task["prompt"], seed)
        if isinstance(task, Mapping) and "role" in task:  # one chat message
            task = [task]
        if isinstance(task, Mapping):
            return PiTask.coerce(dict(task))
        if task is not None and not isinstance(task, str):
            task = prompt_text(task)
        if not self.tasks:
            if not task or not task.strip():
                raise TaskError("an empty prompt names no task (and this factory was given no task list)")
            return PiTask(instruction=task)
        if task:
            wanted = task.strip()
            by_id = [t for t in self.tasks if t.task_id == wanted]
            matches = by_id or [t for t in self.tasks if t.instruction.strip() == wanted]
            if matches:
                return matches[(seed or 0) % len(matches)]
        if seed is None:
            raise TaskError(
                f"the prompt {(task or '')[:80]!r} matches no task id or instruction of the factory's "
                f"{len(self.tasks)} tasks, and no seed was given to choose one"
            )
        return self.tasks[seed % len(self.tasks)]

    def _by_id(self, task_id: str) -> PiTask:
        for task in self.tasks:
            if task.task_id == task_id:
                return task
        raise TaskError(f"task_id {task_id!r} is not among the factory's {len(self.tasks)} tasks")


class HarnessSession(ResourceSession):
    """One pi-env rollout as an openenv session. The pi-env session is `pi_session` (its
    sandbox, gateway records, and for interception_gate `next_request`/`deliver`); the full
    `RolloutResult` is `result` once the rollout has finished."""

    def __init__(self, pi_session: PiSession):
        self.pi_session = pi_session
        self.task = pi_session.task
        self.episode_id = pi_session.episode_id
        self.seed = pi_session.seed
        self._close_lock = threading.Lock()
        self._closed = False

    # -- LoopOwningSession / TrainableSession ------------------------------------------------
    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        """Wait for the agent and the verify commands; returns the agent's exit code (-1 when
        the agent never ran). Raises TimeoutError when `timeout_s` passes first (the rollout goes
        on: call again, or close()) and when the agent ran past its own limit and was killed
        before Pi made a model call (the rollout is then finished, unscored, and its captured turns
        stay readable). An agent cut off later is scored: `verify()`'s metrics say `truncated`."""
        result = self.pi_session.wait_for_completion(timeout_s)
        if result.error_kind == "agent_timeout":
            raise TimeoutError(f"rollout {self.episode_id}: {result.error}")
        return result.agent_exit_code if result.agent_exit_code is not None else -1

    def fetch_proxy_trace(self) -> list[TraceEntry]:
        """Every model call so far, as openenv `TraceEntry`s: the forwarded request, the
        assembled answer, and what the engine gave of ids and logprobs (a missing logprob stays
        a None in place; this is the diagnostic view, not the training contract). Entries carry
        `reward` once the rollout has finished (None: unscored)."""
        finished = self.result
        entries = []
        for record in self._records():
            entry = _trace_entry(record, self._node_id(record))
            if finished is not None:
                entry["reward"] = finished.reward
            entries.append(entry)
        return entries

    def fetch_training_trace(self) -> TrainingTrace:
        """openenv's `TrainingTrace`: per model call, the engine's prompt ids, completion ids,
        logprobs and a loss mask (0 over the prompt, 1 over the completion), validated by
        openenv. Calls that generated nothing are left out: an upstream error, a call the agent
        hung up on before the answer ended, an answer the gateway made itself; so are an agent's
        extra calls outside the task's conversation (`RolloutTurn.extra_call`). Any other call
        without complete ids and logprobs raises ValueError (with the engine's reason): a
        trainer must not mistake a broken capture for an empty one."""
        if not self.pi_session.config.mode.captures:
            raise ValueError("black_box mode captures no tokens: a training trace needs mode='transparent_proxy'")
        turns = [
            _training_turn(record, self._node_id(record))
            for record in self._records()
            if _generated(record) and self.pi_session.extra_call(record) is None  # OpenCode's title: not the task's
        ]
        _link_sequences(turns)
        return TrainingTrace(turns=turns)

    # -- ResourceSession ---------------------------------------------------------------------
    def initial_messages(self) -> list[dict[str, Any]]:
        """The task as the agent receives it (Pi adds its own system prompt and tools)."""
        return [{"role": "user", "content": self.task.instruction}]

    def list_tools(self) -> list:
        """None: Pi runs its own tools (read, bash, edit, write) inside the sandbox."""
        return []

    def call_tool(self, name: str, arguments: dict[str, Any]):
        raise KeyError(f"Unknown tool: {name} (a pi-env session runs its agent's tools itself and exposes none)")

    def verify(self, transcript: list[dict[str, Any]] | None = None, final_state: Any | None = None) -> VerifyResult:
        """The rollout's own reward, from the task's verify commands run in the sandbox after
        the agent (waiting for them if needed). `transcript` and `final_state` are not used:
        the sandbox, not the trainer's view of the conversation, decides. `env_reward` is None
        whenever the rollout could not be scored, with the reason in `metrics["error_kind"]`."""
        try:
            result = self.pi_session.wait_for_completion()
        except Exception as error:  # noqa: BLE001 - a failed rollout is unscored, never 0
            kind, message = unscored(error)
            return VerifyResult(
                env_reward=None,
                done=True,
                metrics={"error_kind": kind},
                artifacts={"error": message, **self._ids()},
            )
        passed = sum(1 for r in result.verify_results if r.passed)
        metrics = {
            "error_kind": result.error_kind,
            "reward_source": result.reward_source,
            "stop_reason": result.stop_reason,
            "truncated": result.truncated,
            "budget_exhausted": result.budget_exhausted,
            "model_calls": len(result.proxy_turns),
            "verify_passed": passed,
            "verify_total": len(result.verify_results),
            "agent_exit_code": result.agent_exit_code,
            "wall_s": result.wall_s,
            **{f"time/{k}_s": v for k, v in result.timings.items()},
        }
        artifacts = {
            "error": result.error,
            "trace_path": result.trace_path,
            "sandbox_id": result.sandbox_id,
            "endpoint": result.endpoint,
            "model": result.model,
            "pi_version": result.pi_version,
            "synthetic": result.synthetic,
            "session_id": result.session_id,
            # The policy versions its tokens came from (numbers only; per turn: fetch_training_trace's metadata).
            "policy_version_min": result.training.policy_version_min if result.training else None,
            "policy_version_max": result.training.policy_version_max if result.training else None,
            **self._ids(),
        }
        return VerifyResult(env_reward=result.reward, done=True, metrics=metrics, artifacts=artifacts)

    def close(self) -> None:
        """Kill the agent and everything it started, delete the sandbox, end the gateway
        session. Idempotent; safe from another thread while a wait is in progress (the wait
        then ends with an unscored result or an error)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.pi_session.close()

    def __enter__(self) -> HarnessSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers -----------------------------------------------------------------------------
    @property
    def result(self) -> RolloutResult | None:
        """The finished rollout (pi-env's own record), or None while it runs."""
        return self.pi_session.result

    def _records(self) -> list[TurnRecord]:
        gateway = self.pi_session.gateway_session
        if gateway is None:
            return []
        gateway.wait_idle()  # a turn is recorded just after the agent has its answer
        return list(gateway.turns)

    def _node_id(self, record: TurnRecord) -> str:
        return f"{self.episode_id}:{record.turn}"

    def _ids(self) -> dict[str, Any]:
        return {"task_id": self.task.task_id, "episode_id": self.episode_id, "seed": self.seed}


def dataset_rows(tasks: Iterable[PiTask | dict]) -> list[dict[str, Any]]:
    """Dataset rows for a trainer (TRL's conversational format) whose prompts select these
    tasks in `HarnessSessionFactory.create`: one row per task, its instruction as the user
    message, plus its task_id."""
    rows = []
    for task in tasks:
        task = PiTask.coerce(task)
        rows.append({"prompt": [{"role": "user", "content": task.instruction}], "task_id": task.task_id})
    return rows


def prompt_text(prompt: Any) -> str:
    """The text of a prompt: a string, or the last user message of a message list (content
    as a string or as text parts)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence):
        users = [m for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        if users:
            content = users[-1].get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, Sequence):
                return "".join(
                    str(part.get("text", ""))
                    for part in content
                    if isinstance(part, Mapping) and part.get("type", "text") == "text"
                )
            return ""
    raise TaskError(
        f"cannot read a prompt from {type(prompt).__name__}: give a string, a message list, "
        f"a dataset row, a task dict or a PiTask"
    )


# -- openenv records from the gateway's --------------------------------------------------------


def _generated(record: TurnRecord) -> bool:
    """Does this recorded call hold a model generation? Not: an upstream error or no answer, a
    call the agent hung up on before the answer ended, an answer the gateway made itself."""
    if record.upstream_error or record.upstream_status is None or record.upstream_status >= 400:
        return False
    if record.client_disconnected:
        return False
    return not (record.capture is not None and record.capture.synthetic_answer)


def _training_turn(record: TurnRecord, node_id: str) -> TrainingTurn:
    capture = record.capture
    where = f"model call {record.turn} ({node_id})"
    if capture is None:
        raise ValueError(f"{where}: nothing was captured")
    choice = capture.choices[0] if capture.choices else None
    reason = capture.token_ids_missing_reason or (choice.alignment_error if choice else None) or "not given"
    if not capture.prompt_token_ids:
        raise ValueError(f"{where}: the engine gave no prompt_token_ids ({reason})")
    if choice is None or not choice.ids_complete:
        raise ValueError(f"{where}: the engine gave no complete completion ids ({reason})")
    completion = list(choice.token_ids)
    logprobs = list(choice.logprobs)
    known = [lp for lp in logprobs if lp is not None]
    if not len(known) == len(logprobs) == len(completion):
        missing = sum(1 for lp in logprobs if lp is None) + max(0, len(completion) - len(logprobs))
        raise ValueError(f"{where}: {missing} of {len(completion)} completion tokens have no logprob from the engine")
    prompt = list(capture.prompt_token_ids)
    return TrainingTurn(
        node_id=node_id,
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        per_token_logps=[float(lp) for lp in known],
        loss_mask=[0] * len(prompt) + [1] * len(completion),
        request=dict(capture.request),
        response=_response(capture),
        metadata=_metadata(record),
    )


def _link_sequences(turns: list[TrainingTurn]) -> None:
    """Mark how the calls chain, as openenv's capture graph links nodes by exact token prefix:
    a call whose prompt starts with the previous call's prompt + completion gets
    `metadata["parent_node_id"]` (a trainer merges the chain into one row: with token-in, the whole
    rollout), and every call its `metadata["sequence"]` (0-based, +1 at each break)."""
    sequence, previous = -1, None
    for turn in turns:
        if previous is not None:
            done = previous.prompt_token_ids + previous.completion_token_ids
            if turn.prompt_token_ids[: len(done)] == done:
                turn.metadata["parent_node_id"] = previous.node_id
        if "parent_node_id" not in turn.metadata:
            sequence += 1
        turn.metadata["sequence"] = sequence
        previous = turn


def _trace_entry(record: TurnRecord, node_id: str) -> dict[str, Any]:
    capture = record.capture
    entry: dict[str, Any] = {"metadata": {"node_id": node_id, **_metadata(record)}}
    if capture is None:  # black_box, or no answer: the call's status and timings only
        return entry
    choice = capture.choices[0] if capture.choices else None
    entry["request"] = dict(capture.request)
    entry["response"] = _response(capture)
    entry["prompt_token_ids"] = list(capture.prompt_token_ids)
    entry["completion_token_ids"] = list(capture.completion_token_ids)
    if choice is not None and choice.tokens:
        entry["completion_tokens"] = list(choice.tokens)
    entry["per_token_logps"] = list(capture.per_token_logps)
    if capture.prompt_token_ids and capture.completion_token_ids:
        entry["loss_mask"] = [0] * len(capture.prompt_token_ids) + [1] * len(capture.completion_token_ids)
    return entry


def _response(capture: TurnCapture) -> dict[str, Any]:
    response: dict[str, Any] = {
        "choices": [
            {"index": c.index, "message": c.message(), "finish_reason": c.finish_reason} for c in capture.choices
        ]
    }
    if capture.usage is not None:
        response["usage"] = dict(capture.usage)
    if capture.model is not None:
        response["model"] = capture.model
    return response


def _metadata(record: TurnRecord) -> dict[str, Any]:
    capture = record.capture
    metadata = {
        "turn": record.turn,
        "harness": "pi",
        "upstream_status": record.upstream_status,
        "latency_s": record.latency_s,
        "ttfb_s": record.ttfb_s,
        # The weights that generated it (docs/async-rl.md): a trainer drops or weighs stale turns by it.
        "policy_version": record.policy_version,
        "policy_version_source": record.policy_version_source,
    }
    if record.upstream_error:
        metadata["upstream_error"] = record.upstream_error[:500]
    if capture is not None:
        metadata.update(
            finish_reason=capture.finish_reason,
            token_ids_source=capture.token_ids_source,
            sampling_params={k: capture.request[k] for k in SAMPLING_KEYS if k in capture.request},
        )
        if capture.token_ids_missing_reason:
            metadata["token_ids_missing_reason"] = capture.token_ids_missing_reason
        if capture.fallback:
            metadata["capture_fallback"] = capture.fallback
        if capture.token_in:
            metadata["token_in"] = {k: v for k, v in capture.token_in.items() if k != "engine_request"}
    return metadata
