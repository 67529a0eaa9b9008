"""Paired statistics for comparing two checkpoints on the same tasks, in pure Python.

An eval of ~90 tasks has a standard error of ~5 points: a difference between two checkpoints
means something only with its uncertainty. Both checkpoints run the same tasks, so the
comparison is paired (per-task differences), which removes the spread between tasks:
- `paired_bootstrap`: the mean of after - before with a percentile bootstrap CI over tasks;
- `mcnemar_exact`: the exact two-sided McNemar test on pass flips (a binomial test on the
  tasks that passed under exactly one of the two checkpoints).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def paired_bootstrap(
    before: Sequence[float], after: Sequence[float], *, resamples: int = 10_000, seed: int = 0
) -> dict:
    """Mean of `after[i] - before[i]` and its 95 % percentile-bootstrap CI (tasks resampled with
    replacement; deterministic for `seed`)."""
    if len(before) != len(after):
        raise ValueError(f"paired samples differ in length: {len(before)} vs {len(after)}")
    if not before:
        raise ValueError("no paired samples")
    diffs = [b - a for a, b in zip(before, after)]
    n = len(diffs)
    rng = random.Random(seed)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    low, high = means[math.floor(0.025 * resamples)], means[math.ceil(0.975 * resamples) - 1]
    return {"mean": sum(diffs) / n, "ci95": [low, high], "n": n}


def mcnemar_exact(before: Sequence[bool], after: Sequence[bool]) -> dict:
    """Exact two-sided McNemar test: of the tasks whose outcome flipped, how surprising is the
    split between up (failed before, passed after) and down, if either direction were equally
    likely. p = min(1, 2 * P(Binomial(flips, 1/2) <= min(up, down)))."""
    if len(before) != len(after):
        raise ValueError(f"paired samples differ in length: {len(before)} vs {len(after)}")
    up = sum(1 for a, b in zip(before, after) if b and not a)
    down = sum(1 for a, b in zip(before, after) if a and not b)
    flips = up + down
    tail = sum(math.comb(flips, k) for k in range(min(up, down) + 1)) / 2**flips
    return {"up": up, "down": down, "p": min(1.0, 2 * tail)}


def compare_paired(before: dict[str, float], after: dict[str, float], *, pass_at: float = 1.0, seed: int = 0) -> dict:
    """Two checkpoints' rewards by task id (unscored rollouts left out beforehand) -> pass-rate and
    mean-reward differences in points with bootstrap CIs, and McNemar on pass flips. Tasks missing
    from either side are not paired (counted in `unpaired`)."""
    tasks = sorted(set(before) & set(after))
    if not tasks:
        return {"tasks": 0, "unpaired": len(set(before) ^ set(after))}
    passed_before = [before[t] >= pass_at for t in tasks]
    passed_after = [after[t] >= pass_at for t in tasks]
    rate = paired_bootstrap([float(p) for p in passed_before], [float(p) for p in passed_after], seed=seed)
    reward = paired_bootstrap([before[t] for t in tasks], [after[t] for t in tasks], seed=seed)

    def points(result: dict) -> dict:
        return {"mean": round(100 * result["mean"], 1), "ci95": [round(100 * v, 1) for v in result["ci95"]]}

    return {
        "tasks": len(tasks),
        "unpaired": len(set(before) ^ set(after)),
        "pass_before": sum(passed_before),
        "pass_after": sum(passed_after),
        "pass_points": points(rate),
        "reward_points": points(reward),
        "mcnemar": mcnemar_exact(passed_before, passed_after),
    }
