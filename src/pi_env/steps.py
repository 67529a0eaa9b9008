"""A multi-step Harbor task's later steps, run by `StepRunner` in the rollout's own session.

The task itself is the first step (rollout.py runs its agent and verifier like any task's).
After it, for each later step (`pi_env.harbor.rules.later_steps`: the task each step makes), as
Harbor does: stop if the previous step's verifier left no valid reward or the previous step is
below its `min_reward` (`step_gate`); the oracle switched to the step's solution; the agent's
home given back; the previous step's tests removed; the step's own work-dir files and setup
(`step_own`; a failing setup command ends the run there); then the step's agent (a new Pi run on
its instruction, same sandbox, same gateway session) and verifier. One reward by the task's
`multi_step_reward_strategy` (`combine_step_rewards`); a step whose agent fails leaves the
rollout unscored with that error.

The runner owns the steps' order and rules; the session (`PiSession`, the same room's) plays
each step's agent and verifier for the step's task, passed explicitly: the session's task is
never swapped, and nothing re-enters the session's scoring. What the runner uses of the session
is `StepSession`, so this module never imports rollout.py (which imports it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

from .config import PiConfig
from .endpoints import ORACLE, Endpoint
from .harbor.rules import StepOwn, combine_step_rewards, later_steps, step_gate, step_own
from .judge import tail
from .oracle import oracle_endpoint, release_oracle
from .proxy.gateway import GatewaySession
from .results import CommandResult, ErrorKind, RolloutResult
from .sandbox import SANDBOX_HOME
from .task import PiTask
from .task_setup import capped


@dataclass(frozen=True)
class StepOutcome:
    """One verified step: what its verifier left and what the next step starts from."""

    reward: float | None
    verified: bool  # the verifier left a valid reward file, or none was needed
    home_aside: bool = False  # the agent's home was set aside for verify: the next agent gets it back


class StepSession(Protocol):
    """What StepRunner uses of its session (`PiSession`): the session's state and the plays it
    makes for a step's task."""

    config: PiConfig
    factory: Any  # its .runtime, for the step's agent
    endpoint: Endpoint | None
    gateway_session: GatewaySession | None
    sandbox: Any
    _world: Any  # verify's world (pi_env.verify.world.VerifyWorld): .reserve(sandbox, step)
    _result: RolloutResult

    def _check_open(self) -> None: ...

    def _run(self, command: str, timeout_s: float, network: Any) -> CommandResult: ...

    def _start_agent(self, runtime: Any, task: PiTask) -> None: ...

    def _play_step(self, step: PiTask, index: int) -> StepOutcome | None: ...

    def _fail(self, kind: ErrorKind, message: str) -> None: ...


class StepRunner:
    """The steps after the first of `task` (none for any other task)."""

    def __init__(self, session: StepSession, task: PiTask):
        self.session, self.first = session, task
        self.endpoints: list[Endpoint] = []  # the oracle's scripts of later steps, released by release()

    @cached_property
    def later(self) -> list[PiTask]:
        return later_steps(self.first)

    def more_after(self, index: int) -> bool:
        """Does a step follow step `index` (0: the first)?"""
        return index < len(self.later)

    def run(self, first: StepOutcome) -> None:
        """After the first step was verified: each later step, then the one reward."""
        session = self.session
        result = session._result
        if not self.later or result.error_kind is not None:
            return
        rewards = [result.reward]
        result.step_rewards = [result.reward]
        previous = first
        for index, step in enumerate(self.later):
            if not previous.verified:
                break  # the previous step has no verifier result: Harbor ends the run there
            if why := step_gate(self.first, index, rewards[-1]):
                result.agent_log_tail += f"\n[pi-env] {why}"
                break
            self._switch_oracle(step)
            if previous.home_aside:  # the agent continues in its home, not in verify's world
                session.sandbox.put_back_agent_home()
            session.sandbox.remove(f"{SANDBOX_HOME}/tests")  # the previous step's verifier
            if not self._prepare(step, step_own(self.first, index + 1)):
                break
            session._world.reserve(session.sandbox, step)
            session._start_agent(session.factory.runtime, step)
            played = session._play_step(step, index + 1)
            if played is None or result.error_kind is not None:
                return  # the agent or the sandbox failed: unscored, with that error
            previous = played
            rewards.append(result.reward)
            result.step_rewards.append(result.reward)
        combined = combine_step_rewards(self.first, rewards)
        if combined is None:
            return session._fail("internal", "no step of the multi-step task has a reward")
        result.reward, result.reward_source, result.error_kind, result.error = combined, "reward_file", None, None

    def _prepare(self, step: PiTask, own: StepOwn) -> bool:
        """What Harbor does before a later step's agent: the step's workdir/ files into the work
        dir, then its setup.sh and healthcheck. One failing ends the run there, as in Harbor:
        the reward is combined over the steps that ran (False)."""
        session = self.session
        for path, text in own.files.items():
            session.sandbox.write_file(path, text)
        for command in own.setup:
            session._check_open()
            outcome = session._run(
                command,
                capped(step.timeouts.setup_s, session.config.limits.setup_timeout_s),
                "full" if step.setup_network else "none",
            )
            session._result.setup_results.append(outcome)
            if not outcome.passed:
                session._check_open()  # close() killed it: not the task's failure
                why = "timed out" if outcome.timed_out else f"exited {outcome.exit_code}"
                session._result.agent_log_tail += (
                    f"\n[pi-env] step {own.name!r}: setup command {command!r} {why}: "
                    f"{tail(outcome.stderr or outcome.stdout, 300)}; later steps skipped"
                )
                return False
        return True

    def _switch_oracle(self, step: PiTask) -> None:
        """The oracle replays each step's own solution: a new script, and the session's upstream
        key switched to it (Pi keeps its gateway token)."""
        session = self.session
        if not (session.endpoint and session.endpoint.synthetic and session.config.endpoint.name == ORACLE):
            return
        endpoint = oracle_endpoint(step, submit_command=session.factory.agent.submit_command)
        self.endpoints.append(endpoint)
        gateway = session.gateway_session
        assert gateway is not None  # the oracle's endpoint: the session's gateway is open
        gateway.upstream = dataclasses.replace(gateway.upstream, api_key=endpoint.api_key)

    def release(self) -> None:
        for endpoint in self.endpoints:
            release_oracle(endpoint)
