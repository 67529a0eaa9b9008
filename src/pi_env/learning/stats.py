"""Paired statistics for comparing two checkpoints on the same tasks, in pure Python.

An eval of ~90 tasks has a standard error of ~5 points: a difference between two checkpoints
means something only with its uncertainty. Both checkpoints run the same tasks, so the
comparison is paired (per-task differences), which removes the spread between tasks:
- `paired_bootstrap`: the mean of after - before with a percentile bootstrap CI over tasks;
- `mcnemar_exact`: the exact two-sided McNemar test on pass flips (a binomial test on the
  tasks that passed under exactly one of the two checkpoints);
- `compare_samples`: several samples per task (and several RL seeds pooled): a paired cluster
  bootstrap, i.e. each task's samples are summarised by their mean and tasks (with all their
  samples) are resampled. Samples of one task are not independent (they share its difficulty),
  so resampling single samples would understate the CI; resampling whole tasks keeps that
  dependence, and with every task carrying the same number of samples the per-task mean is the
  cluster's sufficient summary of the paired difference (docs/learning_protocol.md).
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


def _points(result: dict) -> dict:
    return {"mean": round(100 * result["mean"], 1), "ci95": [round(100 * v, 1) for v in result["ci95"]]}


def compare_samples(
    before: dict[str, Sequence[float]],
    afters: Sequence[dict[str, Sequence[float]]],
    *,
    pass_at: float = 1.0,
    seed: int = 0,
    resamples: int = 10_000,
) -> dict:
    """Several scored samples per task (unscored ones left out beforehand): `before` one
    checkpoint's rewards by task id, `afters` one or more checkpoints' (RL seeds, pooled: a
    task's after-value is the mean over them of each one's per-task mean). Per task: the pass
    fraction (reward >= `pass_at`) and mean reward of its samples; the paired differences in
    points with a paired cluster-bootstrap 95 % CI (tasks resampled with all their samples).
    Only tasks with a scored sample on every side are paired (the rest counted in `unpaired`)."""
    if not afters:
        raise ValueError("no checkpoint to compare with")
    sides = [before, *afters]
    tasks = sorted(t for t in set(before).intersection(*afters) if all(side[t] for side in sides))
    everywhere = set().union(*sides)
    if not tasks:
        return {"tasks": 0, "unpaired": len(everywhere)}

    def rate(values: Sequence[float]) -> float:
        return sum(v >= pass_at for v in values) / len(values)

    def mean(values: Sequence[float]) -> float:
        return sum(values) / len(values)

    pass_before = [rate(before[t]) for t in tasks]
    pass_after = [mean([rate(side[t]) for side in afters]) for t in tasks]
    reward_before = [mean(before[t]) for t in tasks]
    reward_after = [mean([mean(side[t]) for side in afters]) for t in tasks]
    rate_diff = paired_bootstrap(pass_before, pass_after, resamples=resamples, seed=seed)
    reward_diff = paired_bootstrap(reward_before, reward_after, resamples=resamples, seed=seed)
    result = {
        "tasks": len(tasks),
        "unpaired": len(everywhere) - len(tasks),
        "checkpoints_pooled": len(afters),
        "samples_before": sum(len(before[t]) for t in tasks),
        "samples_after": sum(len(side[t]) for side in afters for t in tasks),
        "pass_before": round(100 * mean(pass_before), 1),
        "pass_after": round(100 * mean(pass_after), 1),
        "pass_points": _points(rate_diff),
        "reward_points": _points(reward_diff),
        "tasks_up": sum(a > b for a, b in zip(pass_after, pass_before)),
        "tasks_down": sum(a < b for a, b in zip(pass_after, pass_before)),
        "ci_method": "paired cluster bootstrap over tasks (per-task means), percentile, "
        f"{resamples} resamples, seed {seed}",
    }
    if len(afters) == 1 and all(len(before[t]) == 1 and len(afters[0][t]) == 1 for t in tasks):
        result["mcnemar"] = mcnemar_exact([p >= 1 for p in pass_before], [p >= 1 for p in pass_after])
    return result
