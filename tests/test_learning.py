"""The learning run's torch-free parts: the coding task families (deterministic, disjoint splits,
oracle solves each family through the real Pi, a do-nothing agent does not), the held-out check
of a run directory, and GRPO rows built from collected training traces. The trained stages run
in the engine tier (tests/engines/test_learning_engine.py)."""

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

from pi_env import PiConfig, PiSessionFactory
from pi_env.learning.pipeline import (
    LeakError,
    LearnConfig,
    check_held_out,
    eval_families,
    eval_set,
    read_tasks,
    stage_tasks,
)
from pi_env.learning.rows import group_advantages, raft_rows, rl_rows
from pi_env.task import PiTask
from pi_env.workspace.coding import (
    CODING_FAMILIES,
    TemplateLeakError,
    check_unseen_templates,
    generate_coding_tasks,
    make_coding_splits,
)
from pi_env.workspace.tasks import SplitOverlapError, check_disjoint

ROOT = Path(__file__).resolve().parents[1]


def test_splits_are_deterministic_sized_and_disjoint():
    train, evaluation = make_coding_splits(200, 50)
    again_train, again_eval = make_coding_splits(200, 50)
    assert [t.model_dump() for t in train] == [t.model_dump() for t in again_train]
    assert [t.model_dump() for t in evaluation] == [t.model_dump() for t in again_eval]
    assert len({t.digest() for t in train}) == 200 and len({t.digest() for t in evaluation}) == 50
    assert not {t.digest() for t in train} & {t.digest() for t in evaluation}
    assert {t.metadata["family"] for t in evaluation} == set(CODING_FAMILIES)
    for task in train + evaluation:
        assert task.solution and task.verify
    # hidden tests exist and the agent never sees them (staged only after it finished)
    hidden = [t for t in evaluation if t.metadata["family"] in ("implement_function", "fix_bug")]
    assert hidden and all(t.verify_files and not set(t.verify_files) & set(t.files) for t in hidden)


def test_every_generated_python_file_compiles():
    """Every file a family writes, visible or hidden, over a whole split (one broken quoting
    in one variant would make its tasks unsolvable)."""
    train, evaluation = make_coding_splits(200, 50)
    for task in train + evaluation:
        for path, text in {**task.files, **task.verify_files}.items():
            if path.endswith(".py"):
                compile(text, f"{task.task_id}:{path}", "exec")
        for step in task.solution:
            if step.tool == "write" and step.path.endswith(".py"):
                compile(step.content, f"{task.task_id}:solution", "exec")


def test_a_shared_task_is_caught():
    train = generate_coding_tasks(5, split="train")
    clone = train[2].model_copy(update={"task_id": "eval-renamed"})
    with pytest.raises(SplitOverlapError, match="eval-renamed"):
        check_disjoint(train=train, eval=[clone])


def test_bad_family_is_a_clear_error():
    with pytest.raises(ValueError, match="not one of"):
        generate_coding_tasks(3, families=["nope"])


@pytest.mark.needs_bwrap
@pytest.mark.parametrize("family", sorted(CODING_FAMILIES))
def test_oracle_solves_and_a_lazy_agent_fails(family):
    """Real Pi, real sandbox: the family's oracle solution scores 1; the same task with a
    solution that only looks around scores below 1 (the verify commands really check)."""
    task = generate_coding_tasks(1, split="eval", seed=7, families=[family])[0]
    lazy = PiTask.model_validate({**task.model_dump(), "solution": [{"tool": "bash", "command": "ls -R"}]})
    factory = PiSessionFactory(PiConfig(endpoint="oracle", mode="black_box"))
    with factory.create(task) as session:
        solved = session.wait_for_completion()
    with factory.create(lazy) as session:
        idle = session.wait_for_completion()
    assert solved.reward == 1.0, (solved.error, solved.verify_results)
    assert idle.reward is not None and idle.reward < 1.0


def _run_dir(tmp_path, sft_task_ids):
    cfg = LearnConfig(run_dir=tmp_path, n_train=6, n_eval=4)
    stage_tasks(cfg)
    export = tmp_path / "oracle" / "exports" / "sft.jsonl"
    export.parent.mkdir(parents=True)
    export.write_text("".join(json.dumps({"task_id": t}) + "\n" for t in sft_task_ids))
    return cfg


def test_held_out_check_passes_on_a_clean_run(tmp_path):
    cfg = _run_dir(tmp_path, ["train-0-0-write_file", "train-0-1-implement_function"])
    evaluation = [PiTask.model_validate_json(line) for line in (tmp_path / "tasks" / "eval.jsonl").read_text().splitlines()]
    assert check_held_out(cfg, evaluation) == 2


def test_held_out_check_catches_an_eval_task_trained_under_another_id(tmp_path):
    cfg = _run_dir(tmp_path, ["train-0-0-write_file"])
    eval_path = tmp_path / "tasks" / "eval.jsonl"
    evaluation = [PiTask.model_validate_json(line) for line in eval_path.read_text().splitlines()]
    # The leak: an eval task's content sits in the train file under a train id, and SFT used it.
    leaked = evaluation[1].model_copy(update={"task_id": "train-leak"})
    with (tmp_path / "tasks" / "train.jsonl").open("a") as handle:
        handle.write(leaked.model_dump_json() + "\n")
    with (tmp_path / "oracle" / "exports" / "sft.jsonl").open("a") as handle:
        handle.write(json.dumps({"task_id": "train-leak"}) + "\n")
    with pytest.raises(LeakError, match=evaluation[1].task_id):
        check_held_out(cfg, evaluation)


def test_held_out_check_refuses_unknown_training_ids(tmp_path):
    cfg = _run_dir(tmp_path, ["from-elsewhere"])
    with pytest.raises(LeakError, match="cannot prove"):
        check_held_out(cfg, [])


def test_the_rl_split_is_fresh_and_added_to_an_older_run_without_touching_it(tmp_path):
    """RL draws instances SFT never saw, disjoint from train and eval; a run directory made
    before the RL split existed gets one, its train and eval files unchanged."""
    cfg = LearnConfig(run_dir=tmp_path, n_train=10, n_eval=5, n_rl=8, n_heldout=6)
    stage_tasks(cfg)
    tasks = {name: read_tasks(tmp_path / "tasks" / f"{name}.jsonl") for name in ("train", "eval", "rl", "heldout")}
    digests = {name: {t.digest() for t in ts} for name, ts in tasks.items()}
    assert len(tasks["rl"]) == len(digests["rl"]) == 8
    assert not digests["rl"] & (digests["train"] | digests["eval"])
    # the paired held-out pool: n_heldout of every family, disjoint from every other split
    assert Counter(t.metadata["family"] for t in tasks["heldout"]) == {f: 6 for f in CODING_FAMILIES}
    assert not digests["heldout"] & (digests["train"] | digests["eval"] | digests["rl"])
    before = {name: (tmp_path / "tasks" / f"{name}.jsonl").read_text() for name in ("train", "eval")}
    (tmp_path / "tasks" / "rl.jsonl").unlink()
    assert stage_tasks(cfg)["rl"] == 8
    assert {name: (tmp_path / "tasks" / f"{name}.jsonl").read_text() for name in ("train", "eval")} == before
    assert read_tasks(tmp_path / "tasks" / "rl.jsonl") == tasks["rl"]
    # trained RL ids are known to the held-out check
    step = tmp_path / "rl" / "step_0"
    step.mkdir(parents=True)
    (step / "results.jsonl").write_text(json.dumps({"id": "r0", "task_id": tasks["rl"][0].task_id, "group_id": "g"}) + "\n")
    (tmp_path / "oracle" / "exports").mkdir(parents=True)
    (tmp_path / "oracle" / "exports" / "sft.jsonl").write_text("")
    assert check_held_out(cfg, tasks["eval"]) == 1


def test_group_advantages():
    assert group_advantages([1.0, 1.0, 1.0, 1.0]) == [0.0] * 4
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]  # Dr. GRPO: r - mean
    scaled = group_advantages([1.0, 0.0, 0.0, 1.0], scale=True)  # original GRPO: / std
    assert scaled[0] > 0 > scaled[1] and abs(sum(scaled)) < 1e-9 and abs(scaled[0] - 1.0) < 1e-3
    # a one-check partial-credit gap weighs less than a pass/fail split, unless scaled
    assert max(group_advantages([1.0, 2 / 3])) < max(group_advantages([1.0, 0.0]))
    assert abs(max(group_advantages([1.0, 2 / 3], scale=True)) - max(group_advantages([1.0, 0.0], scale=True))) < 1e-3


def _record(group, reward, segments):
    return {"group_id": group, "reward": reward,
            "training": {"segments": [{"token_ids": ids, "loss_mask": mask, "logprobs": lps}
                                      for ids, mask, lps in segments]}}


def test_rl_rows_use_every_segment_of_the_exact_trace():
    seg = ([1, 2, 3, 4], [0, 0, 1, 1], [None, None, -0.5, -0.1])
    split = ([1, 2, 9], [0, 0, 1], [None, None, -2.0])
    records = [_record("a", 1.0, [seg, split]), _record("a", 0.0, [seg]), _record("a", None, [seg]),
               _record("b", 0.5, [seg]), _record("b", 0.5, [seg])]
    rows = rl_rows(records)
    # group a: 2 scored rollouts (the unscored one is left out) -> 3 rows; group b: equal rewards -> weight 0
    assert [r.token_ids for r in rows[:3]] == [seg[0], split[0], seg[0]]
    assert rows[0].weight == rows[1].weight > 0 > rows[2].weight
    assert rows[1].old_logprobs == split[2] and rows[1].loss_mask == split[1]
    assert [r.weight for r in rows[3:]] == [0.0, 0.0]


def test_raft_rows_keep_the_passing_rollouts_of_mixed_groups_only():
    seg = ([1, 2, 3], [0, 1, 1], [None, -0.5, -0.1])
    records = [_record("mixed", 1.0, [seg]), _record("mixed", 0.0, [seg]), _record("mixed", None, [seg]),
               _record("all", 1.0, [seg]), _record("all", 1.0, [seg]), _record("none", 0.0, [seg])]
    rows = raft_rows(records)
    assert len(rows) == 1 and rows[0].weight == 1.0 and rows[0].token_ids == seg[0]


# ---------------------------------------------------------------------------------------------
# Unseen templates (issue 44, docs/learning_protocol.md)

TRAIN_POOL_SPLITS = {"train": 100, "eval": 25, "rl": 60, "heldout": 50}


def _signatures(task):
    """What the oracle writes apart from identifiers: each edit (old, new), each line of an
    implemented function's body, each other written file whole."""
    out = set()
    for step in task.solution:
        if step.tool == "edit":
            out.add(("edit", step.old, step.new))
        elif step.tool == "write" and task.metadata["family"] == "implement_function":
            out |= {("body", line.strip()) for line in step.content.splitlines()[1:] if line.strip()}
        elif step.tool == "write":
            out.add(("write", step.content))
    return out


def test_unseen_templates_never_appear_in_a_train_pool_split_over_many_seeds():
    """No template id, no (template, constants) pair and no exact edit of an unseen task is in
    any task of the train, eval, RL or held-out splits, for 20 seeds."""
    from pi_env.workspace.coding import template_key

    unseen_templates = set()
    for seed in range(20):
        others = [
            t for split, n in TRAIN_POOL_SPLITS.items() for t in generate_coding_tasks(n, split=split, seed=seed)
        ]
        unseen = generate_coding_tasks(60, split="unseen", seed=seed)
        assert {t.metadata["pool"] for t in others} == {"train"} and {t.metadata["pool"] for t in unseen} == {"unseen"}
        templates = {t.metadata["template"] for t in others}
        assert not templates & {t.metadata["template"] for t in unseen}
        assert not {template_key(t) for t in others} & {template_key(t) for t in unseen}
        trained_edits = set().union(*(_signatures(t) for t in others))
        for task in unseen:
            assert not _signatures(task) & trained_edits, task.task_id
        check_unseen_templates(unseen, others)
        unseen_templates |= {t.metadata["template"] for t in unseen}
    # every family has at least two unseen templates, all of them drawn
    by_family = Counter(name.split("/")[0] for name in unseen_templates)
    assert set(by_family) == set(CODING_FAMILIES) and min(by_family.values()) >= 2, by_family


def test_the_template_check_catches_a_train_template_in_the_unseen_set():
    train = generate_coding_tasks(10, split="train")
    unseen = generate_coding_tasks(5, split="unseen")
    with pytest.raises(TemplateLeakError, match="not unseen-pool"):
        check_unseen_templates([*unseen, train[0]], [])
    relabelled = train[0].model_copy(update={"metadata": {**train[0].metadata, "pool": "unseen"}})
    with pytest.raises(TemplateLeakError, match=train[0].metadata["template"]):
        check_unseen_templates([relabelled], train[1:])


def test_unseen_tasks_compile_and_train_pool_tasks_are_unchanged():
    """Every Python file of the unseen pool compiles; the train pool's generation is what it was
    before the unseen pool existed (so the committed r7 run's task files can still be audited)."""
    for task in generate_coding_tasks(120, split="unseen", seed=3):
        for path, text in {**task.files, **task.verify_files}.items():
            if path.endswith(".py"):
                compile(text, f"{task.task_id}:{path}", "exec")
        for step in task.solution:
            if step.tool == "write" and step.path.endswith(".py"):
                compile(step.content, f"{task.task_id}:solution", "exec")
    # digests of the generator before the unseen pool existed
    assert [t.digest()[:16] for t in generate_coding_tasks(5, split="train")] == [
        "f538eb1108136e9a", "08f060971e9b84f5", "36c3f8bd5802ba5c", "89b1e74ab2d0691e", "0e48e729863ca3db",
    ]
    assert [t.digest()[:16] for t in generate_coding_tasks(5, split="heldout")] == [
        "d1e165a2f3200b15", "d46bb1ef65dfcfe6", "0c22a3916742686b", "1e7df1b1626f0b04", "af635b33c0176273",
    ]


@pytest.mark.needs_bwrap
def test_oracle_solves_every_unseen_template_and_a_lazy_agent_fails():
    """Real Pi, real sandbox: one task of every unseen template, solved by its oracle; a do-nothing
    solution scores below 1."""
    by_template = {}
    for task in generate_coding_tasks(200, split="unseen", seed=11):
        by_template.setdefault(task.metadata["template"], task)
    factory = PiSessionFactory(PiConfig(endpoint="oracle", mode="black_box"))
    for template, task in sorted(by_template.items()):
        lazy = PiTask.model_validate({**task.model_dump(), "solution": [{"tool": "bash", "command": "ls -R"}]})
        with factory.create(task) as session:
            solved = session.wait_for_completion()
        with factory.create(lazy) as session:
            idle = session.wait_for_completion()
        assert solved.reward == 1.0, (template, solved.error, solved.verify_results)
        assert idle.reward is not None and idle.reward < 1.0, template


def test_the_tasks_stage_writes_an_unseen_split_and_keeps_the_labelled_heldout_one(tmp_path):
    cfg = LearnConfig(run_dir=tmp_path, n_train=10, n_eval=5, n_rl=12, n_heldout=3, n_unseen=4)
    summary = stage_tasks(cfg)
    tasks = {name: read_tasks(tmp_path / "tasks" / f"{name}.jsonl") for name in ("train", "eval", "rl", "heldout", "unseen")}
    assert summary["unseen"] == 4 * len(CODING_FAMILIES) and summary["heldout"] == 3 * len(CODING_FAMILIES)
    assert {t.metadata["split"] for t in tasks["heldout"]} == {"heldout"}
    assert {t.metadata["pool"] for t in tasks["heldout"]} == {"train"}
    assert {t.metadata["pool"] for t in tasks["unseen"]} == {"unseen"}
    assert not set(summary["templates"]["train_pool"]) & set(summary["templates"]["unseen_pool"])
    # RL never trains the excluded family; the paired evals include it
    assert cfg.rl_excluded_family == "rename_symbol"
    assert "rename_symbol" not in {t.metadata["family"] for t in tasks["rl"]}
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "summary.json").write_text(json.dumps({"rl_families": ["fix_bug", "write_file"]}))
    assert eval_families(cfg) == ["fix_bug", "write_file", "rename_symbol"]
    assert Counter(t.metadata["family"] for t in eval_set(cfg, "unseen")) == {"write_file": 2, "fix_bug": 1, "rename_symbol": 1}
    assert len(eval_set(cfg, "heldout")) == 3
    with pytest.raises(ValueError, match="never trains"):
        LearnConfig(run_dir=tmp_path, rl_families=["rename_symbol"])
    # the held-out check refuses an "unseen" eval task whose template was trained on
    (tmp_path / "oracle" / "exports").mkdir(parents=True)
    (tmp_path / "oracle" / "exports" / "sft.jsonl").write_text(json.dumps({"task_id": tasks["train"][0].task_id}) + "\n")
    assert check_held_out(cfg, tasks["heldout"], tasks["unseen"]) == 1
    with pytest.raises(LeakError, match="not unseen"):
        check_held_out(cfg, [], [tasks["heldout"][0]])


# ---------------------------------------------------------------------------------------------
# Per-sample results and the report's primary figure, from a synthetic run directory

SAMPLE_KEYS = {"checkpoint", "set", "task_id", "family", "template", "split", "sample", "reward", "passed"}


def _fake_eval(cfg, name, rewards_by_kind):
    """eval_<name>/ as stage_eval leaves it: per set, one record per (task, sample)."""
    root = cfg.run_dir / f"eval_{name}"
    summary = {"stage": name}
    for kind, by_task in rewards_by_kind.items():
        records = [
            {"id": f"{task}-{i}", "task_id": task, "group_id": task, "group_index": i, "reward": r, "messages": []}
            for task, rewards in by_task.items()
            for i, r in enumerate(rewards)
        ]
        (root / kind).mkdir(parents=True)
        (root / kind / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        summary[kind] = {"samples_per_task": 4, "count": len(records), "passed": 0, "pass_rate": 0.0, "unscored": 0}
    (root / "summary.json").write_text(json.dumps(summary))


def test_the_report_pools_seeds_on_unseen_templates_from_per_sample_results(tmp_path):
    from pi_env.learning.pipeline import sample_rows, stage_report
    from pi_env.learning.stats import compare_samples

    cfg = LearnConfig(run_dir=tmp_path, n_train=10, n_eval=5, n_rl=12, n_heldout=4, n_unseen=6,
                      rl_families=["fix_bug", "implement_function", "write_file"])
    stage_tasks(cfg)
    (tmp_path / "oracle" / "exports").mkdir(parents=True)
    (tmp_path / "oracle" / "exports" / "sft.jsonl").write_text("")
    unseen = [t.task_id for t in eval_set(cfg, "unseen")]
    heldout = [t.task_id for t in eval_set(cfg, "heldout")]
    assert len(unseen) == 6 and len(heldout) == 4
    rng = __import__("random").Random(1)

    def draw(tasks, p):
        return {t: [float(rng.random() < p) for _ in range(4)] for t in tasks}

    sft = {"unseen": draw(unseen, 0.3), "heldout": draw(heldout, 0.5)}
    _fake_eval(cfg, "sft", sft)
    _fake_eval(cfg, "sft_retest", {"unseen": draw(unseen, 0.3)})
    seeds = {0: "rl", 1: "rl_seed1", 2: "rl_seed2"}
    rl = {seed: {"unseen": draw(unseen, 0.6), "heldout": draw(heldout, 0.7)} for seed in seeds}
    for seed, arm in seeds.items():
        (tmp_path / arm).mkdir()
        _fake_eval(cfg, arm, rl[seed])
    steps = [{"step": k, "algorithm": "grpo", "kl_after": 1e-4, "kl_guard": "ok", "entropy_sampled": 0.1,
              "group_rewards": {}, "mean_reward": 0.5, "pass_rate": 0.5} for k in range(8)]
    (tmp_path / "rl" / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    _fake_eval(cfg, "rl_step4", {"unseen": draw(unseen, 0.5)})  # a curve checkpoint (eval_curve)
    runs = ["2026-12-06T10:15:34Z start commit aff8787", "2026-12-06T13:01:26Z end exit=143"]
    (tmp_path / "runs_started.txt").write_text("\n".join(runs) + "\n")
    report = stage_report(cfg)
    assert report["runs_log"] == runs  # every start and stop, as learn_on_cpu.sh logged them
    assert [(p["rl_steps"], p["checkpoint"]) for p in report["curve"]] == [(4, "rl_step4"), (8, "rl")]
    assert report["stages"]["rl"]["checks"] == {"collapse": {"1": False, "2": False},
                                                "collapse_reasons": {"1": [], "2": []}, "kl_max": 1e-4,
                                                "kl_limit": 0.01, "kl_over_limit": [], "kl_check_passed": True}

    assert report["seeds"] == [0, 1, 2] and report["samples_per_task"] == 4 and report["protocol_version"] == 3
    # the primary figure: per-task mean over samples, mean over seeds, minus SFT's, mean over tasks
    want = sum(
        sum(sum(rl[s]["unseen"][t]) / 4 for s in seeds) / 3 - sum(sft["unseen"][t]) / 4 for t in unseen
    ) / len(unseen)
    primary = report["unseen_rl_minus_sft_pass"]
    assert primary["mean"] == round(100 * want, 1) and primary["tasks"] == 6
    assert primary["ci95"][0] <= primary["mean"] <= primary["ci95"][1]
    pooled = compare_samples(sft["unseen"], [rl[s]["unseen"] for s in seeds], seed=cfg.seed)
    assert {k: primary[k] for k in ("mean", "ci95")} == pooled["pass_points"]
    assert set(report["unseen_rl_minus_sft_pass_by_seed"]) == {"0", "1", "2"}
    assert report["heldout_rl_minus_sft_pass"]["label"].startswith("in-distribution")
    assert report["heldout_rl_minus_sft_pass"]["tasks"] == 4
    assert report["sft_retest_minus_sft_unseen_pass"]["tasks"] == 6
    assert report["success_rule"]["1"]["met"] == (primary["ci95"][0] > 0)
    # protocol version 2's figure: the same, in mean reward (these rewards are 0/1, so equal to pass)
    reward = report["unseen_rl_minus_sft_reward"]
    assert {k: reward[k] for k in ("mean", "ci95")} == pooled["reward_points"] and reward["seeds"] == [0, 1, 2]
    assert set(report["unseen_rl_minus_sft_reward_by_seed"]) == {"0", "1", "2"}
    assert report["success_rule"]["2"] == {"figure": "unseen_rl_minus_sft_reward", "met": reward["ci95"][0] > 0,
                                           "rule": "pooled unseen RL - SFT reward 95 % CI low end > 0, with 3 RL seeds"}
    assert set(report["curve"][0]) == {"rl_steps", "checkpoint", "unseen_rl_minus_sft_pass", "unseen_rl_minus_sft_reward"}
    assert report["targets"]["primary_set"] == "unseen"
    if importlib.util.find_spec("matplotlib"):  # the plot, with the curve's panel
        assert (tmp_path / "learning_curve.png").stat().st_size > 10_000
    # per-sample rows: small, one per rollout, every checkpoint
    rows = [json.loads(line) for line in (tmp_path / "learn_samples.jsonl").read_text().splitlines()]
    assert all(set(row) == SAMPLE_KEYS for row in rows)
    assert len(rows) == 6 * 4 * (2 + 3 + 1) + 4 * 4 * (1 + 3)
    one = sample_rows(cfg, "rl_seed1")
    assert {(r["set"], r["sample"]) for r in one} == {(k, i) for k in ("unseen", "heldout") for i in range(4)}
    assert all(r["passed"] == (r["reward"] >= 1.0) and r["split"] == r["set"] for r in one)
    assert {r["template"].split("/")[0] for r in one} == {r["family"] for r in one}
    # and the JSONL alone gives back every pooled and per-seed unseen figure
    for key, figure in recompute_unseen_figures(report, rows).items():
        assert figure == report[key], key
    assert rows[0]["checkpoint"] == "sft" and rows[0]["set"] == "unseen"  # one SFT sample flipped: it shows
    flipped = [dict(rows[0], reward=1.0 - rows[0]["reward"]), *rows[1:]]
    assert recompute_unseen_figures(report, flipped)["unseen_rl_minus_sft_pass"] != report["unseen_rl_minus_sft_pass"]


def test_protocol_checks_and_curve_steps(tmp_path):
    from pi_env.learning.pipeline import curve_steps, protocol_checks

    cfg = LearnConfig(run_dir=tmp_path)
    assert curve_steps(cfg) == [3, 6]
    assert curve_steps(LearnConfig(run_dir=tmp_path, rl_seed=1)) == []  # the curve is seed 0's
    assert curve_steps(LearnConfig(run_dir=tmp_path, curve_steps="4,8", rl_steps=8)) == [4]  # 8: the final eval
    steps = [{"step": 0, "entropy_sampled": 0.12, "kl_after": 0.002},
             {"step": 1, "entropy_sampled": 0.02, "kl_after": 0.02}]
    worse = {"tasks": 10, "pass_points": {"mean": -20.0, "ci95": [-30.0, -5.0]},
             "reward_points": {"mean": -1.0, "ci95": [-3.0, 1.0]}}
    checks = protocol_checks(cfg, steps, worse)
    # (a) in version 1's metric (pass) fires, in version 2's (reward) not; (c) entropy in both
    assert checks["collapse"] == {"1": True, "2": True}
    assert [len(checks["collapse_reasons"][v]) for v in ("1", "2")] == [2, 1]
    assert checks["collapse_reasons"]["1"][0].startswith("unseen pass vs SFT")
    steady = [{"step": 0, "entropy_sampled": 0.12}, {"step": 1, "entropy_sampled": 0.1}]
    reward_down = {"tasks": 10, "pass_points": {"mean": 0.0, "ci95": [-2.0, 2.0]},
                   "reward_points": {"mean": -8.0, "ci95": [-12.0, -4.0]}}
    assert protocol_checks(cfg, steady, reward_down)["collapse"] == {"1": False, "2": True}
    assert checks["kl_over_limit"] == [{"step": 1, "kl_after": 0.02}] and checks["kl_check_passed"] is False


def test_stage_status_lists_the_curve_checkpoints(tmp_path):
    from pi_env.learning.pipeline import stage_status

    cfg = LearnConfig(run_dir=tmp_path, curve_steps="2,4,6")
    (tmp_path / "eval_rl_step2").mkdir()
    (tmp_path / "eval_rl_step2" / "summary.json").write_text("{}")
    (tmp_path / "eval_rl_step4").mkdir()  # stopped part-way: no summary yet
    status = stage_status(cfg)
    assert [status[f"eval_curve_step{k}"] for k in (2, 4, 6)] == ["done", "in progress or stopped", "not started"]
    assert status["tasks"] == "not started" and status["eval_sft"] == "not started"
    assert "eval_curve_step2" not in stage_status(LearnConfig(run_dir=tmp_path, curve_steps="2,4,6", rl_seed=1))  # seed 0's only


def test_a_stage_stopped_part_way_keeps_its_time_and_adds_it_when_it_resumes(tmp_path, monkeypatch):
    import time

    from pi_env.learning import pipeline

    cfg = LearnConfig(run_dir=tmp_path)
    real = pipeline.stage_tasks

    def stopped(cfg):  # SIGTERM arrives as SystemExit (pi_env.learning.__main__)
        time.sleep(3.0)  # longer than the real stage takes, so only the sum can reach it
        raise SystemExit(143)

    monkeypatch.setattr(pipeline, "stage_tasks", stopped)
    with pytest.raises(SystemExit):
        pipeline.run_stage(cfg, "tasks", pipeline.Engines(cfg))
    assert json.loads((tmp_path / "stage_partial_times.json").read_text())["tasks"] >= 3.0
    assert not (tmp_path / "stage_times.json").exists()  # not done: no stage time yet

    monkeypatch.setattr(pipeline, "stage_tasks", real)
    pipeline.run_stage(cfg, "tasks", pipeline.Engines(cfg))
    times = json.loads((tmp_path / "stage_times.json").read_text())
    assert times["tasks"] >= 3.0  # the stopped run's time plus the resumed one's
    assert json.loads((tmp_path / "stage_partial_times.json").read_text()) == {}
    assert set(json.loads((tmp_path / "stage_load.json").read_text())) == {"tasks"}

    pipeline.run_stage(cfg, "tasks", pipeline.Engines(cfg))  # done already: the time stays
    assert json.loads((tmp_path / "stage_times.json").read_text()) == times


def recompute_unseen_figures(report: dict, rows: list[dict]) -> dict:
    """A report's pooled and per-seed unseen figures (pass and reward), recomputed from its
    per-sample rows alone, the way anyone with the committed JSONL would."""
    from pi_env.learning.pipeline import _figure, arm_name
    from pi_env.learning.stats import compare_samples

    samples: dict = {}
    for row in rows:
        if row["reward"] is not None:
            samples.setdefault((row["checkpoint"], row["set"]), {}).setdefault(row["task_id"], []).append(row["reward"])
    seed, seeds = report["config"]["seed"], report["seeds"]
    sft = samples[("sft", "unseen")]
    arms = {s: samples[(arm_name("grpo", s), "unseen")] for s in seeds}
    figures = {}
    for metric in ("pass", "reward"):
        figures[f"unseen_rl_minus_sft_{metric}"] = _figure(
            compare_samples(sft, list(arms.values()), seed=seed), metric, seeds=seeds)
        figures[f"unseen_rl_minus_sft_{metric}_by_seed"] = {
            str(s): _figure(compare_samples(sft, [a], seed=seed), metric) for s, a in arms.items()}
    return figures


def test_the_committed_report_recomputes_from_its_committed_samples():
    """docs/learning_report.json's primary figures follow from the per-sample JSONL committed
    beside it (docs/learn_*samples.jsonl) and nothing else."""
    report = json.loads((ROOT / "docs" / "learning_report.json").read_text())
    if "unseen_rl_minus_sft_pass" not in report:
        pytest.skip("the committed report predates the protocol (r7); its per-sample results were never kept")
    [samples] = sorted((ROOT / "docs").glob("learn_*samples.jsonl"))
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert report["seeds"] == [0, 1, 2] and report["samples_per_task"] == 4
    recomputed = recompute_unseen_figures(report, rows)
    for key, figure in recomputed.items():
        assert figure == report[key], key
