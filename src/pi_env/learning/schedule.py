"""Where RL's rollouts go, as pure functions: which families (those the policy sometimes
solves), which tasks in which step (a fixed round-robin, each task visited twice), which
revisits to skip (groups known to be flat).

GRPO learns only from groups whose rewards differ. A family the policy always fails (or always
solves) gives flat groups: all of its rollouts are spent for nothing. So RL draws from the
families whose sampled pass rate, measured on the starting policy, is in [low, high]; every
task comes back once, half a stage later, which gives a paired in-distribution "revisit" gain
for free (the same task before and after the steps in between).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def choose_families(
    pass_rates: Mapping[str, float], *, low: float = 0.2, high: float = 0.8, at_least: int = 2
) -> list[str]:
    """The families whose pass rate is in [low, high]; if fewer than `at_least` are, the
    `at_least` families nearest 0.5 among those with a pass rate strictly between 0 and 1 (a
    family never or always solved gives no signal at all), else nearest 0.5. Sorted by name."""
    inside = [f for f, rate in pass_rates.items() if low <= rate <= high]
    if len(inside) >= at_least:
        return sorted(inside)
    usable = {f: r for f, r in pass_rates.items() if 0 < r < 1} or dict(pass_rates)
    nearest = sorted(usable, key=lambda f: (abs(usable[f] - 0.5), f))
    return sorted(nearest[:at_least])


def rl_schedule(
    tasks_by_family: Mapping[str, Sequence[str]], families: Sequence[str], *, steps: int, per_step: int
) -> list[list[str]]:
    """Task ids per step: the first ceil(steps / 2) steps take fresh tasks round-robin over
    `families` (in the given order, each family's tasks in theirs), `per_step` a step; the
    remaining steps visit the same tasks again in the same order. Raises if a family runs out."""
    if steps < 1 or per_step < 1:
        raise ValueError(f"rl steps {steps}, tasks per step {per_step}: both must be >= 1")
    if not families:
        raise ValueError("no RL families to draw from")
    fresh_steps = (steps + 1) // 2
    taken = {f: 0 for f in families}
    fresh: list[str] = []
    for i in range(fresh_steps * per_step):
        family = families[i % len(families)]
        pool = tasks_by_family.get(family) or []
        if taken[family] >= len(pool):
            raise ValueError(
                f"family {family!r} has {len(pool)} RL tasks; the schedule needs more "
                f"(use a larger --n-rl or fewer --rl-steps)"
            )
        fresh.append(pool[taken[family]])
        taken[family] += 1
    first = [fresh[k * per_step : (k + 1) * per_step] for k in range(fresh_steps)]
    return first + first[: steps - fresh_steps]


def first_visit(schedule: Sequence[Sequence[str]], step: int, task_id: str) -> int | None:
    """The earlier step that ran `task_id` (None on its first visit)."""
    return next((k for k in range(step) if task_id in schedule[k]), None)


def flat(rewards: Sequence[float | None]) -> bool:
    """A group that teaches GRPO nothing: every scored reward equal (or none scored)."""
    return len({r for r in rewards if r is not None}) <= 1
