"""The learning run's torch-free parts: the coding task families (deterministic, disjoint splits,
oracle solves each family through the real Pi, a do-nothing agent does not), the held-out check
of a run directory, and GRPO rows built from collected training traces. The trained stages run
in the engine tier (tests/engines/test_learning_engine.py)."""

import json

import pytest

from pi_env import PiConfig, PiSessionFactory
from pi_env.learning.pipeline import LearnConfig, LeakError, check_held_out, read_tasks, rl_tasks, stage_tasks
from pi_env.learning.rows import group_advantages, rl_rows
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
    cfg = LearnConfig(run_dir=tmp_path, n_train=10, n_eval=5, n_rl=8)
    stage_tasks(cfg)
    tasks = {name: read_tasks(tmp_path / "tasks" / f"{name}.jsonl") for name in ("train", "eval", "rl")}
    digests = {name: {t.digest() for t in ts} for name, ts in tasks.items()}
    assert len(tasks["rl"]) == len(digests["rl"]) == 8
    assert not digests["rl"] & (digests["train"] | digests["eval"])
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


def test_rl_draws_fresh_tasks_favouring_the_families_that_fail(tmp_path):
    cfg = LearnConfig(run_dir=tmp_path, n_train=5, n_eval=5, n_rl=100, rl_tasks_per_step=4)
    stage_tasks(cfg)
    first = rl_tasks(cfg, 0, [])
    assert first == rl_tasks(cfg, 0, [])  # deterministic
    assert {t.task_id for t in first} <= {t.task_id for t in read_tasks(tmp_path / "tasks" / "rl.jsonl")}
    # history: rename_symbol always solved, data_program always failed
    history = [{"task_id": t.task_id, "group_id": t.task_id, "reward": 1.0 if t.metadata["family"] == "rename_symbol" else 0.0}
               for t in first]
    history += [{"task_id": f"rl-0-{i}-rename_symbol", "group_id": "x", "reward": 1.0} for i in range(8)]
    history += [{"task_id": f"rl-0-{i}-data_program", "group_id": "y", "reward": 0.0} for i in range(8)]
    drawn = [t for step in range(1, 40) for t in rl_tasks(cfg, step, history)]
    assert not {t.task_id for t in drawn} & {t.task_id for t in first}  # never a task used before
    count = {f: sum(t.metadata["family"] == f for t in drawn) for f in ("rename_symbol", "data_program")}
    assert count["data_program"] > 2 * count["rename_symbol"] > 0, count


def test_rl_falls_back_to_the_train_split_without_an_rl_split(tmp_path):
    cfg = LearnConfig(run_dir=tmp_path, n_train=6, n_eval=3, n_rl=0, rl_tasks_per_step=3)
    stage_tasks(cfg)
    assert {t.task_id for t in rl_tasks(cfg, 0, [])} <= {t.task_id for t in read_tasks(tmp_path / "tasks" / "train.jsonl")}


def test_group_advantages():
    assert group_advantages([1.0, 1.0, 1.0, 1.0]) == [0.0] * 4
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv[0] > 0 > adv[1] and abs(sum(adv)) < 1e-9 and abs(adv[0] - 1.0) < 1e-3


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
