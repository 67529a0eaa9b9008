"""A Harbor task's facts (pi_env.harbor.facts.HarborFacts) without a sandbox: task dicts written by
earlier versions of the loader load with the same facts and rules, and malformed facts fail when the
task is validated, naming the key to fix. test_harbor.py runs the same tasks end to end."""

import json
from pathlib import Path

import pytest

from pi_env import PiTask, TaskError, load_tasks
from pi_env.harbor import (
    HarborFacts,
    combine_step_rewards,
    environment_spec,
    harbor_facts,
    is_harbor,
    later_steps,
    load_harbor_task,
    step_gate,
    step_own,
    unsupported_reasons,
)
from pi_env.task import validate_task

ROOT = Path(__file__).resolve().parents[1]
# Written by the loader of commit 51b5d57 (metadata["harbor"] a plain dict), its checkout's path
# replaced by /checkout: examples/harbor/text-tool (two steps) and column-stats (a Dockerfile).
PREVIOUS = ROOT / "tests" / "data" / "harbor_tasks_51b5d57.jsonl"


def as_checkout(value):
    """This checkout's absolute paths as the fixture writes them."""
    return json.loads(json.dumps(value).replace(str(ROOT) + "/", "/checkout/"))


@pytest.mark.parametrize("name", ["text-tool", "column-stats"])
def test_a_task_dict_the_previous_loader_wrote_loads_with_the_same_facts_and_rules(name):
    previous = {task.task_id: task for task in load_tasks(PREVIOUS)}[name]
    fresh = load_harbor_task(Path("examples/harbor") / name)
    facts = harbor_facts(previous)
    assert isinstance(facts, HarborFacts) and is_harbor(previous)
    assert len(facts.steps) == (2 if name == "text-tool" else 0)
    assert facts.model_dump() == as_checkout(harbor_facts(fresh).model_dump())
    # The task around the facts, and what every rule makes of them.
    assert previous.model_dump(exclude={"metadata"}) == fresh.model_dump(exclude={"metadata"})
    for backend in ("local", "podman", "hf"):
        assert unsupported_reasons(previous, backend) == unsupported_reasons(fresh, backend)
        spec, fresh_spec = environment_spec(previous, backend), environment_spec(fresh, backend)
        assert (spec and as_checkout(spec.__dict__)) == (fresh_spec and as_checkout(fresh_spec.__dict__))
    assert [t.model_dump(exclude={"metadata"}) for t in later_steps(previous)] == [
        t.model_dump(exclude={"metadata"}) for t in later_steps(fresh)
    ]
    assert [step_own(previous, i) for i in range(3)] == [step_own(fresh, i) for i in range(3)]
    assert step_gate(previous, 0, 0.5) == step_gate(fresh, 0, 0.5)
    assert combine_step_rewards(previous, [1.0, 0.0]) == combine_step_rewards(fresh, [1.0, 0.0]) == 0.5


def test_the_first_loaders_four_keys_still_make_harbor_facts():
    # b1538eb's loader wrote only these; everything added since has a default.
    task = PiTask(
        instruction="x",
        metadata={"harbor": {"source": "t", "path_map": {"/app": "/root/workdir"}, "unsupported": ["a"], "notes": []}},
    )
    facts = harbor_facts(task)
    assert (facts.environment, facts.steps, facts.artifacts, facts.multi_step_reward_strategy) == (None, [], [], "mean")
    assert unsupported_reasons(task, "podman") == ["a"] and later_steps(task) == []
    assert harbor_facts(PiTask(instruction="x")) is None and unsupported_reasons(PiTask(instruction="x")) == []


def broken(**changes) -> dict:
    task = json.loads(PREVIOUS.read_text().splitlines()[0])
    task["metadata"]["harbor"].update(changes)
    return task


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"path_map": None}, "path_map: Input should be a valid dictionary"),
        ({"steps": [{"instruction": "x", "verify_files": {}}]}, "steps.0.name: Field required"),
        ({"steps": [{"name": "a", "instruction": "x", "verify_files": {"/etc/passwd": ""}}]}, "is absolute"),
        ({"environment": {"needs_build": "sometimes"}}, "environment.needs_build: Input should be a valid boolean"),
        ({"pathmap": {}}, "pathmap: Extra inputs are not permitted"),
    ],
)
def test_malformed_facts_fail_when_the_task_is_validated_naming_the_key(changes, named):
    with pytest.raises(TaskError) as error:
        validate_task(broken(**changes), source="tasks.jsonl:1")
    message = str(error.value)
    assert message.startswith("tasks.jsonl:1: invalid task:\n  - metadata: metadata[\"harbor\"] is not Harbor's facts")
    assert named in message and "load the task again from its Harbor directory" in message


def test_facts_broken_after_validation_fail_where_they_are_read():
    task = load_harbor_task(ROOT / "examples" / "harbor" / "text-tool")
    copied = task.model_copy(update={"metadata": {"harbor": {"source": "x"}}})  # model_copy does not validate
    with pytest.raises(TaskError, match=r"task text-tool: metadata\[\"harbor\"\].*path_map: Field required"):
        later_steps(copied)



def test_a_later_step_is_everything_staged_and_run_before_its_agent():
    # What a fresh verify sandbox replays for step k: the task's files and setup (the first step
    # is the task itself), then every later step's own up to k, later ones winning.
    def step(name, files, setup):
        return {"name": name, "instruction": f"do {name}", "verify_files": {f"tests/{name}.sh": "true"},
                "files": files, "setup": setup}

    facts = {"source": "t", "path_map": {"/app": "/root/workdir"},
             "steps": [step("one", {}, []), step("two", {"a.txt": "2", "b.txt": "b"}, ["echo two"]),
                       step("three", {"c.txt": "c", "a.txt": "3"}, ["echo three"])]}  # fmt: skip
    task = PiTask(instruction="do one", files={"base.txt": "base", "a.txt": "0"}, setup=["echo task"],
                  metadata={"harbor": facts})
    two, three = later_steps(task)
    assert (two.instruction, three.instruction) == ("do two", "do three")
    assert two.files == {"base.txt": "base", "a.txt": "2", "b.txt": "b"}
    assert two.setup == ["echo task", "echo two"]
    assert three.files == {"base.txt": "base", "a.txt": "3", "b.txt": "b", "c.txt": "c"}
    assert three.setup == ["echo task", "echo two", "echo three"] and three.verify_files == {"tests/three.sh": "true"}
