"""The training view of a rollout: the engine's own token ids, merged into sequences a trainer
can score, with a loss mask over the tokens the model generated.

A turn whose prompt ids start with the previous turn's prompt + completion ids (the
conversation was only appended to) continues the same sequence; its new prompt tokens (tool
results, the next user message) get mask 0. Where that fails (the chat template re-rendered
history differently, or a turn has no ids) a new sequence starts, so nothing is ever
re-tokenised or spliced. The view's types are pi_env.results' (`TrainingTrace`,
`TrainingSegment`, `TurnAlignment`); this module is the one conversion from turns to them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

# The training view's types live with the result's (pi_env.results); imported from here too.
from .results import TrainingSegment, TrainingTrace, TurnAlignment

__all__ = ["TrainingSegment", "TrainingTrace", "TurnAlignment", "TurnIds", "build_training_trace"]


class TurnIds(Protocol):
    """What the builder reads of a turn (a RolloutTurn has it)."""

    turn: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    per_token_logps: list[float | None]


def build_training_trace(turns: Iterable[TurnIds]) -> TrainingTrace:
    trace = TrainingTrace()
    current: TrainingSegment | None = None
    for turn in sorted(turns, key=lambda t: t.turn):  # the order the agent made its calls
        if extra := getattr(turn, "extra_call", None):  # not the task's conversation (OpenCode's title)
            trace.turns.append(
                TurnAlignment(
                    turn=turn.turn,
                    segment=None,
                    extends_previous=False,
                    note=f"extra call ({extra}): left out",
                    extra_call=extra,
                )
            )
            continue
        prompt, completion = list(turn.prompt_token_ids), list(turn.completion_token_ids)
        if not prompt or not completion:
            what = "prompt" if not prompt else "completion"
            trace.turns.append(
                TurnAlignment(
                    turn=turn.turn, segment=None, extends_previous=False, note=f"no {what} token ids from the engine"
                )
            )
            current = None
            continue
        logprobs = list(turn.per_token_logps)
        if len(logprobs) != len(completion):
            logprobs = [None] * len(completion)  # never misalign: unknown stays unknown
        if current is not None and prompt[: len(current.token_ids)] == current.token_ids:
            extends = True
            current._extend(prompt[len(current.token_ids) :], generated=False)
            note = None
        else:
            extends = False
            note = None if current is None else "prompt does not extend the previous turn: new sequence"
            why = (getattr(turn, "token_in", None) or {}).get("reason")
            if note and why:  # token-in says why it rendered in full
                note += f" ({why})"
            current = TrainingSegment(prompt_length=len(prompt))
            current._extend(prompt, generated=False)
            trace.segments.append(current)
        current._extend(completion, generated=True, logprobs=logprobs)
        current.turns.append(turn.turn)
        current.policy_versions.append(getattr(turn, "policy_version", None))
        trace.turns.append(
            TurnAlignment(turn=turn.turn, segment=len(trace.segments) - 1, extends_previous=extends, note=note)
        )
    _version_span(trace)
    return trace


def _version_span(trace: TrainingTrace) -> None:
    versions: list[Any] = [v for segment in trace.segments for v in segment.policy_versions]
    for version in versions:
        if not any(type(version) is type(seen) and version == seen for seen in trace.policy_versions):
            trace.policy_versions.append(version)
    if versions and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in versions):
        trace.policy_version_min, trace.policy_version_max = min(versions), max(versions)
