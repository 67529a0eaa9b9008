"""The learning run's torch-free parts: the coding task families (deterministic, disjoint splits,
oracle solves each family through the real Pi, a do-nothing agent does not), the held-out check
of a run directory, and GRPO rows built from collected training traces. The trained stages run
in the engine tier (tests/engines/test_learning_engine.py)."""

import json
from collections import Counter

import pytest

from pi_env import PiConfig, PiSessionFactory
from pi_env.learning.pipeline import LearnConfig, LeakError, check_held_out, read_tasks, stage_tasks
from pi_env.learning.rows import group_advantages, raft_rows, rl_rows
from pi_env.task import PiTask
from pi_env.workspace.coding import CODING_FAMILIES, generate_coding_tasks, make_coding_splits
from pi_env.workspace.tasks import SplitOverlapError, check_disjoint


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
