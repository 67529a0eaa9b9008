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


def group_advantages(rewards: Sequence[float], eps: float = 1e-4) -> list[float]:
    """(r - group mean) / (group std + eps): GRPO's advantage. A group whose rewards are all
    equal teaches nothing and gets zeros."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std < eps:
        return [0.0] * len(rewards)
    return [(r - mean) / (std + eps) for r in rewards]


def rl_rows(records: list[dict]) -> list[Row]:
    """GRPO rows from collected rollouts' exact training traces: one row per sequence a trace
    split into (ids, loss mask, the engine's sampled logprobs), weighted by the rollout's group
    advantage. Unscored rollouts (reward None: infrastructure) are left out of their group."""
    groups: dict[str, list[dict]] = {}
    for record in records:
        if record.get("reward") is not None and record.get("training"):
            groups.setdefault(record["group_id"], []).append(record)
    rows = []
    for members in groups.values():
        for record, advantage in zip(members, group_advantages([m["reward"] for m in members])):
            for segment in record["training"]["segments"]:
                rows.append(Row(segment["token_ids"], segment["loss_mask"], segment["logprobs"], advantage))
    return rows
