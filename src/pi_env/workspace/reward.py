"""The shaped reward of a workspace episode, read from its conversation.

Four components:
  mutation        a write or edit succeeded
  executed        a program run exited 0 (bash status ok)
  output_correct  such a run's last non-empty stdout line was the expected answer
  final_correct   the last integer in the last assistant message is the expected answer
Training: 1.0 if all four, else 0.15 mutation + 0.15 executed + 0.6 output_correct + 0.1 final
correct; -0.1 whenever any tool call hit an infrastructure error (the episode says nothing
about the model: metrics["infrastructure_error"] lets a trainer drop it). Evaluation: 1.0 if
all four, else 0.0, and None (unscored, never a 0) when a tool call hit an infrastructure error.

Only tool messages carrying a result of this package count; with `trusted` (what
WorkspaceEnv passes), only results this episode's tools really returned.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pi_env.workspace.tools import RESULT_SCHEMA

Mode = Literal["train", "eval"]
WEIGHTS = {"mutation": 0.15, "executed": 0.15, "output_correct": 0.6, "final_correct": 0.1}
INFRASTRUCTURE_REWARD = -0.1
_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Score:
    """An episode's reward and its parts (`metrics`); `reward` is None for an evaluation episode
    that hit an infrastructure error (unscored, never 0)."""

    reward: float | None  # None: an evaluation that infrastructure failed
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def infrastructure_error(self) -> bool:
        return self.metrics.get("infrastructure_error", 0.0) > 0


def message_text(message: Mapping[str, Any]) -> str:
    """The visible text of a message: a str content, or its text parts (not thinking)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "") for part in content if isinstance(part, Mapping) and part.get("type") == "text"
        )
    return ""


def final_integer(messages: Sequence[Mapping[str, Any]]) -> int | None:
    """The last integer in the last assistant message, if any."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            found = _INTEGER.findall(message_text(message))
            return int(found[-1]) if found else None
    return None


def tool_results(messages: Sequence[Mapping[str, Any]], trusted: Collection[str] | None = None) -> list[dict[str, Any]]:
    results = []
    for message in messages:
        if message.get("role") != "tool":
            continue
        text = message_text(message)
        if trusted is not None and text not in trusted:
            continue
        try:
            result = json.loads(text)
        except ValueError:
            continue
        if isinstance(result, dict) and result.get("schema") == RESULT_SCHEMA:
            results.append(result)
    return results


def score(
    messages: Sequence[Mapping[str, Any]],
    expected: int,
    *,
    mode: Mode = "train",
    trusted: Collection[str] | None = None,
) -> Score:
    if mode not in ("train", "eval"):
        raise ValueError(f"mode: {mode!r}; give 'train' or 'eval'")
    results = tool_results(messages, trusted)
    parts = {
        "mutation": any(r["tool"] in ("write", "edit") and r["status"] == "ok" for r in results),
        "executed": any(r["tool"] == "bash" and r["status"] == "ok" for r in results),
        "output_correct": any(
            r["tool"] == "bash" and r["status"] == "ok" and r.get("output_correct") is True for r in results
        ),
        "final_correct": final_integer(messages) == expected,
    }
    infrastructure = any(r["status"] == "infrastructure_error" for r in results)
    all_four = all(parts.values())
    if mode == "eval":
        reward = None if infrastructure else 1.0 if all_four else 0.0
    elif infrastructure:
        reward = INFRASTRUCTURE_REWARD
    elif all_four:
        reward = 1.0
    else:
        reward = round(sum(WEIGHTS[name] for name, hit in parts.items() if hit), 6)
    metrics = {name: float(hit) for name, hit in parts.items()}
    metrics.update(
        tool_called=float(bool(results)),
        functional_correct=float(parts["mutation"] and parts["executed"] and parts["output_correct"]),
        infrastructure_error=float(infrastructure),
    )
    return Score(reward, metrics)
