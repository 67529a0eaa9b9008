"""A multi-step Harbor task's later steps, run by `StepRunner` over the rollout's own context.

The task itself is the first step (the session runs its agent and verifier like any task's).
After it, for each later step (`RolloutContext.later_steps`: the task each step makes), as
Harbor does: stop if the previous step's verifier left no valid reward or the previous step is
below its `min_reward` (`step_gate`); the oracle switched to the step's solution; the agent's
home given back; the previous step's tests removed; the step's own work-dir files and setup
(`step_own`; a failing setup command ends the run there); then the step's agent (a new run on
its instruction, same sandbox, same gateway session) and verifier: the same public phases
(pi_env.rollout.phases) the first step ran, passed the step's task explicitly, so the
context's task is never swapped. One reward by the task's `multi_step_reward_strategy`
(`combine_step_rewards`); a step whose agent fails leaves the rollout unscored with that error.
"""

from __future__ import annotations

import dataclasses
from typing import cast

from ..endpoints import ORACLE, Endpoint
from ..harbor.rules import StepOwn, combine_step_rewards, step_gate, step_own
from ..judge import tail
from ..oracle import oracle_endpoint, release_oracle
from ..sandbox import SANDBOX_HOME
from ..sandbox.base import RestoresHome
from ..task import PiTask
from ..task_setup import capped
from . import phases
from .context import RolloutContext, StepOutcome, made


class StepRunner:
    """The steps after the first of the context's task (none for any other task)."""

    def __init__(self, ctx: RolloutContext):
        self.ctx = ctx
        self.endpoints: list[Endpoint] = []  # the oracle's scripts of later steps, released by release()

    def run(self, first: StepOutcome) -> None:
        """After the first step was verified: each later step, then the one reward."""
        ctx = self.ctx
        result = ctx.result
        if not ctx.later_steps or result.error_kind is not None:
            return
        rewards = [result.reward]
        result.step_rewards = [result.reward]
        previous = first
        for index, step in enumerate(ctx.later_steps):
            if not previous.verified:
                break  # the previous step has no verifier result: Harbor ends the run there
            if why := step_gate(ctx.task, index, rewards[-1]):
                ctx.note(why)
                break
            self._switch_oracle(step)
            sandbox = made(ctx.sandbox, "sandbox")
            if previous.home_aside:  # the agent continues in its home, not in verify's world
                cast(RestoresHome, sandbox).put_back_agent_home()  # set aside only by a sandbox that can
            sandbox.remove(f"{SANDBOX_HOME}/tests")  # the previous step's verifier
            if not self._prepare(step, step_own(ctx.task, index + 1)):
                break
            made(ctx.world, "verify world").reserve(sandbox, step)
            phases.start_agent(ctx, ctx.factory.runtime, step)
            played = play_step(ctx, step, index + 1)
            if played is None or result.error_kind is not None:
                return  # the agent or the sandbox failed: unscored, with that error
            previous = played
            rewards.append(result.reward)
            result.step_rewards.append(result.reward)
        combined = combine_step_rewards(ctx.task, rewards)
        if combined is None:
            return ctx.fail("internal", "no step of the multi-step task has a reward")
        result.reward, result.reward_source, result.error_kind, result.error = combined, "reward_file", None, None

    def _prepare(self, step: PiTask, own: StepOwn) -> bool:
        """What Harbor does before a later step's agent: the step's workdir/ files into the work
        dir, then its setup.sh and healthcheck. One failing ends the run there, as in Harbor:
        the reward is combined over the steps that ran (False)."""
        ctx = self.ctx
        for path, text in own.files.items():
            made(ctx.sandbox, "sandbox").write_file(path, text)
        for command in own.setup:
            ctx.check_open()
            outcome = ctx.run(
                command,
                capped(step.timeouts.setup_s, ctx.config.limits.setup_timeout_s),
                "full" if step.setup_network else "none",
            )
            ctx.result.setup_results.append(outcome)
            if not outcome.passed:
                ctx.check_open()  # close() killed it: not the task's failure
                why = "timed out" if outcome.timed_out else f"exited {outcome.exit_code}"
                ctx.note(
                    f"step {own.name!r}: setup command {command!r} {why}: "
                    f"{tail(outcome.stderr or outcome.stdout, 300)}; later steps skipped"
                )
                return False
        return True

    def _switch_oracle(self, step: PiTask) -> None:
        """The oracle replays each step's own solution: a new script, and the session's upstream
        key switched to it (the agent keeps its gateway token)."""
        ctx = self.ctx
        if not (ctx.endpoint and ctx.endpoint.synthetic and ctx.config.endpoint.name == ORACLE):
            return
        endpoint = oracle_endpoint(step, submit_command=ctx.factory.agent.submit_command)
        self.endpoints.append(endpoint)
        gateway = made(ctx.gateway_session, "gateway session")  # the oracle's endpoint: the gateway is open
        gateway.upstream = dataclasses.replace(gateway.upstream, api_key=endpoint.api_key)

    def release(self) -> None:
        for endpoint in self.endpoints:
            release_oracle(endpoint)


def play_step(ctx: RolloutContext, step: PiTask, index: int) -> StepOutcome | None:
    """A later step's agent (running) judged and verified: None when the rollout failed on it,
    unscored."""
    if not phases.judge(ctx, step):
        return None
    with ctx.clock.phase("verify"):
        return phases.verify(ctx, step, index)
