"""The learning run's pure decisions: the paired statistics that judge RL against SFT, and the
schedule that decides where RL's rollouts go (pi_env.learning.stats, pi_env.learning.schedule)."""

import math
from collections import Counter

import pytest

from pi_env.learning.schedule import choose_families, first_visit, flat, rl_schedule
from pi_env.learning.stats import compare_paired, compare_samples, mcnemar_exact, paired_bootstrap

# Ten tasks: 4 flipped up (fail -> pass), 1 down, 3 passed both times, 2 failed both times.
BEFORE = [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]
AFTER = [1, 1, 1, 1, 0, 1, 1, 1, 0, 0]


def test_mcnemar_against_hand_computed_values():
    # 5 flips, split 4 up / 1 down: p = 2 * P(Bin(5, 1/2) <= 1) = 2 * (1 + 5) / 32
    assert mcnemar_exact([bool(v) for v in BEFORE], [bool(v) for v in AFTER]) == {"up": 4, "down": 1, "p": 0.375}
    # 7 up / 1 down: 2 * (1 + 8) / 256
    assert mcnemar_exact([False] * 7 + [True], [True] * 7 + [False])["p"] == 2 * 9 / 256
    # all flips one way, 6 of them: 2 / 64; no flip at all: p = 1
    assert mcnemar_exact([False] * 6, [True] * 6)["p"] == 2 / 64
    assert mcnemar_exact([True, False], [True, False]) == {"up": 0, "down": 0, "p": 1.0}


def _exact_bootstrap_quantiles(diffs, q_low=0.025, q_high=0.975):
    """The bootstrap distribution of the mean, computed exactly (n-fold convolution of the
    empirical distribution), and its 2.5 % / 97.5 % quantiles."""
    n = len(diffs)
    step = Counter(diffs)
    dist = {0: 1.0}
    for _ in range(n):
        nxt: dict = {}
        for total, p in dist.items():
            for value, count in step.items():
                nxt[total + value] = nxt.get(total + value, 0.0) + p * count / n
        dist = nxt
    cumulative, low, high = 0.0, None, None
    for total in sorted(dist):
        cumulative += dist[total]
        if low is None and cumulative >= q_low:
            low = total / n
        if high is None and cumulative >= q_high:
            high = total / n
    return low, high


def test_paired_bootstrap_matches_the_exact_bootstrap_distribution():
    result = paired_bootstrap(BEFORE, AFTER, resamples=20_000)
    assert result["n"] == 10 and math.isclose(result["mean"], 0.3)
    low, high = _exact_bootstrap_quantiles([b - a for a, b in zip(BEFORE, AFTER)])
    assert (low, high) == (-0.1, 0.7)  # by hand: sd of the mean sqrt(0.41 / 10) = 0.2, 0.3 +- 2 sd
    assert abs(result["ci95"][0] - low) <= 0.1 + 1e-9 and abs(result["ci95"][1] - high) <= 0.1 + 1e-9
    # two tasks, one flipped up: resampled means 0, 0.5, 1 with 1/4, 1/2, 1/4 -> CI [0, 1]
    assert paired_bootstrap([0, 0], [1, 0])["ci95"] == [0.0, 1.0]
    # no spread at all: the CI is the point
    assert paired_bootstrap([0.2] * 5, [0.7] * 5)["ci95"] == pytest.approx([0.5, 0.5])
    assert paired_bootstrap(BEFORE, AFTER, seed=3) == paired_bootstrap(BEFORE, AFTER, seed=3)


def test_paired_bootstrap_refuses_unpaired_input():
    with pytest.raises(ValueError, match="differ in length"):
        paired_bootstrap([1, 0], [1])
    with pytest.raises(ValueError, match="no paired"):
        paired_bootstrap([], [])


def test_compare_paired_pairs_by_task_in_points():
    before = {f"t{i}": float(v) for i, v in enumerate(BEFORE)}
    after = {f"t{i}": float(v) for i, v in enumerate(AFTER)}
    after["t4"] = 2 / 3  # partial credit: not a pass, but more reward than 0
    before["only-before"] = 1.0  # unscored on the other side: not paired
    result = compare_paired(before, after)
    assert result["tasks"] == 10 and result["unpaired"] == 1
    assert (result["pass_before"], result["pass_after"]) == (4, 7)
    assert result["pass_points"]["mean"] == 30.0
    assert result["reward_points"]["mean"] == pytest.approx(100 * (4 - 1 / 3) / 10, abs=0.05)  # t4: 1 -> 2/3
    assert result["mcnemar"]["p"] == 0.375
    low, high = result["pass_points"]["ci95"]
    assert low <= 30.0 <= high and low < 0  # +3 of 10 is not enough to claim a gain


def test_choose_families_prefers_the_band_then_the_nearest_to_half():
    assert choose_families({"a": 0.1, "b": 0.3, "c": 0.5, "d": 0.9, "e": 0.0}) == ["b", "c"]
    # one in the band: the two nearest 0.5 among those sometimes solved (never 0 or 1)
    assert choose_families({"a": 0.0, "b": 0.5, "c": 1.0, "d": 0.05}) == ["b", "d"]
    assert choose_families({"a": 0.0, "b": 1.0}) == ["a", "b"]  # nothing usable: still a choice, by distance
    assert choose_families({"a": 0.25, "b": 0.75, "c": 0.6}, at_least=2) == ["a", "b", "c"]


def test_schedule_round_robin_then_revisits_in_the_same_order():
    pool = {"x": ["x0", "x1", "x2", "x3"], "y": ["y0", "y1", "y2"], "z": ["z0"]}
    plan = rl_schedule(pool, ["x", "y"], steps=4, per_step=3)
    assert plan == [["x0", "y0", "x1"], ["y1", "x2", "y2"], ["x0", "y0", "x1"], ["y1", "x2", "y2"]]
    odd = rl_schedule(pool, ["x", "y"], steps=3, per_step=2)
    assert odd == [["x0", "y0"], ["x1", "y1"], ["x0", "y0"]]  # ceil(3 / 2) fresh steps, one revisit
    assert first_visit(plan, 2, "y0") == 0 and first_visit(plan, 1, "y1") is None
    with pytest.raises(ValueError, match="family 'z' has 1 RL tasks"):
        rl_schedule(pool, ["z"], steps=4, per_step=1)
    with pytest.raises(ValueError, match="no RL families"):
        rl_schedule(pool, [], steps=2, per_step=1)


def test_flat_groups():
    assert flat([1.0, 1.0, None]) and flat([0.0] * 8) and flat([None, None])
    assert not flat([1.0, 0.0]) and not flat([2 / 3, 1.0, 1.0])


def _step(k, rewards_by_task, guard="ok"):
    flat_rewards = [r for rs in rewards_by_task.values() for r in rs if r is not None]
    return {"step": k, "kl_guard": guard, "group_rewards": rewards_by_task,
            "mean_reward": sum(flat_rewards) / len(flat_rewards)}


def test_a_revisit_that_falls_below_its_first_visit_is_a_collapse_unless_the_guard_acted():
    from pi_env.learning.pipeline import collapse_check

    first = _step(0, {"a": [1, 1, 0, 1], "b": [1, 0, 1, 1], "c": [1, 1, 1, 1]})
    harder = _step(1, {"d": [0, 0, 0, 0], "e": [0, 0, 0, 0]})  # other tasks: lower, but no evidence of a fall
    worse = _step(2, {"a": [0, 0, 0, 1], "b": [0, 0, 0, 0], "c": [0, 1, 0, 0]})  # the same tasks, all lower
    result = collapse_check([first, harder, worse])
    assert [r["step"] for r in result["revisits"]] == [2] and result["revisits"][0]["tasks"] == 3
    assert result["falls"] and result["revisits"][0]["ci95"][1] < 0 and result["collapsed"]
    guarded = collapse_check([first, {**harder, "kl_guard": "rolled_back"}, worse])
    assert guarded["falls"] and not guarded["collapsed"]  # the guard acted between the two visits
    same = _step(2, {"a": [1, 0, 1, 1], "b": [1, 1, 0, 1], "c": [1, 1, 1, 0]})
    assert not collapse_check([first, harder, same])["falls"]


def test_revisit_gain_pairs_each_task_with_its_first_visit():
    from pi_env.learning.pipeline import revisit_gain

    steps = [_step(0, {"a": [0, 0, 1, 0], "b": [1, 0, 0, 0]}), _step(1, {"a": [1, 1, 1, 0], "b": [1, 1, 0, None]})]
    gain = revisit_gain(steps)
    assert gain["tasks"] == 2
    assert gain["pass_points"]["mean"] == pytest.approx(100 * ((0.75 - 0.25) + (2 / 3 - 0.25)) / 2, abs=0.05)
    assert "in-distribution" in gain["note"]
    assert revisit_gain(steps[:1]) is None


def test_compare_samples_with_one_sample_each_is_compare_paired():
    before = {f"t{i}": [float(v)] for i, v in enumerate(BEFORE)}
    after = {f"t{i}": [float(v)] for i, v in enumerate(AFTER)}
    samples = compare_samples(before, [after])
    paired = compare_paired({t: v[0] for t, v in before.items()}, {t: v[0] for t, v in after.items()})
    assert samples["pass_points"] == paired["pass_points"] and samples["mcnemar"] == paired["mcnemar"]
    assert samples["tasks"] == 10 and samples["tasks_up"] == 4 and samples["tasks_down"] == 1


def test_compare_samples_is_a_cluster_bootstrap_over_per_task_means():
    """Four samples per task: the figure is the mean over tasks of the per-task mean difference,
    its CI the paired bootstrap of those per-task means (tasks resampled with all their samples),
    so four copies of one sample carry no more information than that sample (a bootstrap over
    the 40 samples as if independent would halve the CI)."""
    before = {"a": [0, 0, 1, 0], "b": [1, 1, 0, 1], "c": [0, 0, 0, 0], "d": [1, 0, 0, 0]}
    after = {"a": [1, 1, 0, 1], "b": [1, 1, 1, 1], "c": [0, 1, 0, 0], "d": [0, 0, 0, 0], "e": [1, 1, 1, 1]}
    result = compare_samples(before, [after], seed=3)
    tasks = sorted(before)
    per_task = paired_bootstrap(
        [sum(before[t]) / 4 for t in tasks], [sum(after[t]) / 4 for t in tasks], seed=3
    )
    assert result["pass_points"]["mean"] == round(100 * per_task["mean"], 1) == 18.8
    assert result["pass_points"]["ci95"] == [round(100 * v, 1) for v in per_task["ci95"]]
    assert result["tasks"] == 4 and result["unpaired"] == 1 and "mcnemar" not in result
    assert result["samples_before"] == result["samples_after"] == 16
    single = {f"t{i}": [float(v)] for i, v in enumerate(BEFORE)}, {f"t{i}": [float(v)] for i, v in enumerate(AFTER)}
    copied = [{t: v * 4 for t, v in side.items()} for side in single]
    assert compare_samples(copied[0], [copied[1]])["pass_points"] == compare_samples(single[0], [single[1]])["pass_points"]


def test_compare_samples_pools_seeds_per_task():
    """Three RL seeds against one SFT eval: a task's after-value is the mean over seeds of each
    seed's per-task pass fraction; a task one seed left unscored is unpaired."""
    before = {"a": [0.0, 0.0], "b": [1.0, 0.0], "c": [1.0, 1.0]}
    seeds = [
        {"a": [1.0, 1.0], "b": [1.0, 1.0], "c": [1.0, 0.0]},
        {"a": [0.0, 1.0], "b": [1.0, 0.0], "c": [1.0, 1.0]},
        {"a": [0.0, 0.0], "b": [1.0, 1.0], "c": []},
    ]
    result = compare_samples(before, seeds)
    # c is unpaired (no scored sample under seed 2); a: 0.5 - 0, b: 5/6 - 0.5
    assert result["tasks"] == 2 and result["unpaired"] == 1 and result["checkpoints_pooled"] == 3
    assert result["pass_points"]["mean"] == round(100 * (0.5 + (5 / 6 - 0.5)) / 2, 1)
    # partial credit counts in the reward, not in the pass rate
    partial = compare_samples({"a": [2 / 3, 1.0]}, [{"a": [1.0, 1.0]}])
    assert partial["pass_points"]["mean"] == 50.0 and partial["reward_points"]["mean"] == round(100 / 6, 1)
    with pytest.raises(ValueError):
        compare_samples(before, [])
