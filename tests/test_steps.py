"""A multi-step Harbor task's step rules without a sandbox (pi_env.rollout.steps.StepRunner), over
a real rollout context whose sandbox and phases are stand-ins that play each step's agent and
verifier as told. test_harbor.py runs the same task (examples/harbor/text-tool: two steps,
min_reward 1.0 on the first, "mean") end to end."""

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest

from pi_env import PiConfig, PiTask, RolloutResult
from pi_env.harbor import load_harbor_task
from pi_env.results import CommandResult
from pi_env.rollout import steps
from pi_env.rollout.clock import PhaseClock
from pi_env.rollout.context import RolloutContext, StepOutcome
from pi_env.rollout.steps import StepRunner

TEXT_TOOL = Path(__file__).resolve().parents[1] / "examples" / "harbor" / "text-tool"


class StandIn:
    """A rollout context for `task` whose sandbox, verify world and setup commands only log
    what is asked of them, and the later steps' plays (`plays`, in order; an error kind: that
    step's agent failed)."""

    def __init__(self, task: PiTask, plays=(), setup_exit=0):
        self.plays, self.setup_exit, self.log = list(plays), setup_exit, []
        result = RolloutResult(task_id=task.task_id, mode="black_box")
        self.ctx = RolloutContext(
            factory=SimpleNamespace(config=PiConfig(), runtime="the runtime"),  # type: ignore[arg-type]
            task=task,
            clock=PhaseClock(result.timings, None),
            result=result,
        )
        self.ctx.sandbox = SimpleNamespace(  # type: ignore[assignment]
            put_back_agent_home=lambda: self.log.append("home back"),
            remove=lambda path: self.log.append(f"remove {path}"),
            write_file=lambda path, text: self.log.append(f"write {path}"),
        )
        self.ctx.world = SimpleNamespace(reserve=lambda sandbox, step: self.log.append("reserve"))  # type: ignore[assignment]
        self.ctx.run = lambda command, timeout_s, network: CommandResult(  # type: ignore[method-assign]
            cmd=command, exit_code=self.setup_exit, stderr="no sample today"
        )

    @property
    def result(self) -> RolloutResult:
        return self.ctx.result

    def start_agent(self, ctx, runtime, step):
        self.log.append(f"agent on {step.instruction.split(chr(10))[0]}")

    def play_step(self, ctx, step, index):
        play = self.plays.pop(0)
        if isinstance(play, str):
            ctx.fail(play, "the step's agent failed")
            return None
        ctx.result.reward = play.reward
        return play


@pytest.fixture(scope="module")
def text_tool() -> PiTask:
    return load_harbor_task(TEXT_TOOL)


@pytest.fixture
def stand_in(monkeypatch):
    """StandIn(task, plays, setup_exit=...), its plays standing in for the step's phases."""
    made = []

    def make(task, plays=(), **options):
        session = StandIn(task, plays, **options)
        made.append(session)
        return session

    monkeypatch.setattr(steps.phases, "start_agent", lambda *a: made[-1].start_agent(*a))
    monkeypatch.setattr(steps, "play_step", lambda *a: made[-1].play_step(*a))
    return make


@pytest.fixture
def run(stand_in):
    def run(task: PiTask, first: StepOutcome, plays=(), **options) -> StandIn:
        session = stand_in(task, plays, **options)
        session.result.reward = first.reward
        StepRunner(session.ctx).run(first)
        return session

    return run


def with_harbor(task: PiTask, **changes) -> PiTask:
    metadata = copy.deepcopy(task.metadata)
    metadata["harbor"].update(changes)
    return task.model_copy(update={"metadata": metadata})


def test_each_later_step_runs_on_its_own_task_and_the_rewards_combine(text_tool, run):
    session = run(text_tool, StepOutcome(1.0, True, home_aside=True), [StepOutcome(0.5, True)])
    result = session.result
    assert (result.reward, result.reward_source, result.step_rewards, result.error_kind) == (
        0.75,
        "reward_file",
        [1.0, 0.5],
        None,
    )
    words = text_tool.metadata["harbor"]["steps"][1]
    assert session.log == [
        "home back",
        "remove /root/tests",
        *(f"write {path}" for path in words["files"]),
        "reserve",
        f"agent on {words['instruction'].split(chr(10))[0]}",
    ]
    assert [r.cmd for r in result.setup_results] == words["setup"]  # setup.sh, then the healthcheck
    assert session.ctx.task is text_tool  # nothing swapped


def test_the_home_is_given_back_only_where_it_was_set_aside(text_tool, run):
    session = run(text_tool, StepOutcome(1.0, True, home_aside=False), [StepOutcome(1.0, True)])
    assert "home back" not in session.log and session.result.reward == 1.0


def test_a_step_below_its_min_reward_ends_the_run(text_tool, run):
    session = run(text_tool, StepOutcome(0.5, True), [StepOutcome(1.0, True)])
    result = session.result
    assert (result.reward, result.step_rewards) == (0.5, [0.5]) and session.plays  # step two never played
    assert "step 'lines' scored 0.5 below its min_reward 1.0: later steps skipped" in result.agent_log_tail


def test_a_step_without_a_verifier_result_ends_the_run(text_tool, run):
    session = run(text_tool, StepOutcome(1.0, False), [StepOutcome(0.0, True)])
    assert session.result.step_rewards == [1.0] and session.plays and not session.log


def test_a_later_steps_agent_failing_leaves_the_rollout_unscored(text_tool, run):
    result = run(text_tool, StepOutcome(1.0, True), ["agent_timeout"]).result
    assert (result.reward, result.error_kind, result.step_rewards) == (None, "agent_timeout", [1.0])


def test_a_failing_step_setup_ends_the_run_over_the_steps_that_ran(text_tool, run):
    session = run(text_tool, StepOutcome(1.0, True), [StepOutcome(0.0, True)], setup_exit=3)
    result = session.result
    assert (result.reward, result.step_rewards, result.error_kind) == (1.0, [1.0], None) and session.plays
    assert "step 'words': setup command 'bash setup.sh' exited 3: no sample today; later steps skipped" in (
        result.agent_log_tail
    )
    assert result.setup_results[-1].cmd == "bash setup.sh"


def test_final_scores_the_last_step_that_ran(text_tool, run):
    task = with_harbor(text_tool, multi_step_reward_strategy="final")
    assert run(task, StepOutcome(1.0, True), [StepOutcome(0.25, True)]).result.reward == 0.25


def test_a_failed_first_step_or_a_single_step_task_runs_nothing(stand_in):
    task = PiTask(instruction="x", verify=["true"])
    session = stand_in(task)
    assert not session.ctx.more_steps_after(0)
    StepRunner(session.ctx).run(StepOutcome(1.0, True))
    assert session.result.step_rewards is None and not session.log


def test_a_first_step_that_failed_is_left_as_it_is(text_tool, stand_in):
    session = stand_in(text_tool, [StepOutcome(1.0, True)])
    session.ctx.fail("infra", "the sandbox failed")
    assert session.ctx.more_steps_after(0) and not session.ctx.more_steps_after(1)
    StepRunner(session.ctx).run(StepOutcome(None, True))
    assert session.result.error_kind == "infra" and session.plays and not session.log
