"""Training rows and GRPO advantages, without torch (the trainer imports these)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Row:
    """One training sequence: ids, which positions are trained (1 = the model generated it),
    the sampled logprobs there (GRPO's old policy; None for SFT) and a weight (the advantage)."""

    token_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float | None] | None = None
    weight: float = 1.0


def group_advantages(rewards: Sequence[float], *, scale: bool = False, eps: float = 1e-4) -> list[float]:
    """GRPO's advantage: r - group mean, divided by the group's std when `scale` (the original
    GRPO; off by default, as in Dr. GRPO and TRL's `scale_rewards=False`: a one-check
    partial-credit gap then weighs less than a real pass/fail split instead of the same). A group
    whose rewards are all equal teaches nothing and gets zeros."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std < eps:
        return [0.0] * len(rewards)
    return [(r - mean) / (std + eps) if scale else r - mean for r in rewards]


def _scored_groups(records: list[dict]) -> list[list[dict]]:
    """Rollouts with a training trace by group; unscored ones (reward None: infrastructure) are
    left out of their group, never counted as 0."""
    groups: dict[str, list[dict]] = {}
    for record in records:
        if record.get("reward") is not None and record.get("training"):
            groups.setdefault(record["group_id"], []).append(record)
    return list(groups.values())


def _rows(record: dict, weight: float) -> list[Row]:
    return [Row(s["token_ids"], s["loss_mask"], s["logprobs"], weight) for s in record["training"]["segments"]]


def rl_rows(records: list[dict], *, scale_rewards: bool = False) -> list[Row]:
    """GRPO rows from collected rollouts' exact training traces: one row per sequence a trace
    split into (ids, loss mask, the engine's sampled logprobs), weighted by the rollout's group
    advantage."""
    rows = []
    for members in _scored_groups(records):
        for record, advantage in zip(members, group_advantages([m["reward"] for m in members], scale=scale_rewards)):
            rows += _rows(record, advantage)
    return rows


def raft_rows(records: list[dict], *, pass_at: float = 1.0) -> list[Row]:
    """Rejection sampling (RAFT / Reinforce-Rej): the passing rollouts of mixed groups, weight 1,
    for plain NLL. Groups that all pass are left out like GRPO's flat groups (nothing to choose)."""
    rows = []
    for members in _scored_groups(records):
        passed = [m for m in members if m["reward"] >= pass_at]
        if 0 < len(passed) < len(members):
            for record in passed:
                rows += _rows(record, 1.0)
    return rows
