"""`RolloutContext`: everything one rollout's phases read and make, in one object.

The phases (`pi_env.rollout.phases`) are functions over it; `PiSession` owns one and runs them in
order on its threads; a multi-step task's later steps (`pi_env.rollout.steps`) call the same
phases with it. What a phase makes (the endpoint, the gateway session, the sandbox, the agent's
process, verify's world) is set here for the phases after it; `made()` says clearly when a phase
runs before the one that makes what it needs (a bug in the order, never the task's).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TypeVar

from ..config import BlackBox, PiConfig
from ..endpoints import Endpoint
from ..harbor.rules import later_steps
from ..proxy.gateway import GatewaySession, get_gateway
from ..read_budget import ReadBudget
from ..results import CommandResult, ErrorKind, RolloutResult
from ..sandbox import Sandbox, SandboxError, SandboxProcess, SandboxSpec
from ..task import PiTask
from ..task_setup import capped, run_command
from ..verify.workdir import WorkdirEntry
from ..verify.world import VerifyWorld
from .clock import PhaseClock
from .shared import FactoryState

LOG_TAIL_CHARS = 8000
T = TypeVar("T")


@dataclass(frozen=True)
class StepOutcome:
    """One verified step (the task itself is step 0): what its verifier left and what the next
    step starts from."""

    reward: float | None
    verified: bool  # the verifier left a valid reward file, or none was needed
    home_aside: bool = False  # the agent's home was set aside for verify: the next agent gets it back


@dataclass(eq=False)
class RolloutContext:
    """One rollout's state: its factory's shared parts, the task, the result being filled in, and
    what each phase has made so far."""

    factory: FactoryState  # the config, backend, agent, runtime and policy version the sessions share
    task: PiTask  # the task (a multi-step task's first step: its later steps are `later_steps`)
    clock: PhaseClock  # the phases' timing into result.timings, and the caller's events
    result: RolloutResult
    episode_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    replay: list[WorkdirEntry] | None = None  # reverify: a kept work dir in place of an agent
    # Made by the phases, in order:
    endpoint: Endpoint | None = None
    gateway_session: GatewaySession | None = None
    spec: SandboxSpec | None = None
    world: VerifyWorld | None = None  # verify's world (pi_env.verify.world), once the spec is known
    sandbox: Sandbox | None = None
    agent: SandboxProcess | None = None  # the running agent (the current step's)
    agent_deadline: float = 0.0  # time.monotonic() past which the agent is stopped
    closed: bool = False  # close() was called: every phase stops at its next check

    def __post_init__(self) -> None:
        # Bytes of what the agent wrote that the host reads, for the whole rollout (pi_env.read_budget).
        self.reads = ReadBudget(self.config.limits.max_read_bytes)

    @property
    def config(self) -> PiConfig:
        return self.factory.config

    @cached_property
    def later_steps(self) -> list[PiTask]:
        """A multi-step Harbor task's steps after the first (pi_env.harbor.rules.later_steps)."""
        return later_steps(self.task)

    def more_steps_after(self, index: int) -> bool:
        """Does a step follow step `index` (0: the task itself)?"""
        return index < len(self.later_steps)

    def fail(self, kind: ErrorKind, message: str) -> None:
        """The rollout ends unscored: `reward` None, with why (never a reward of 0)."""
        result = self.result
        result.reward, result.reward_source, result.error_kind, result.error = None, None, kind, message

    def note(self, text: str) -> None:
        """pi-env's own word on the rollout, after the agent's log."""
        self.result.agent_log_tail += f"\n[pi-env] {text}"

    def check_open(self) -> None:
        """close() from another thread during setup: stop here (and delete a sandbox that
        close() could not see yet, being created)."""
        if self.closed:
            if self.sandbox is not None:
                self.sandbox.close()
            self.end_gateway_session()
            raise SandboxError("the session was closed during setup")

    def end_gateway_session(self) -> None:
        """Revoke the session's token; without a trace_dir its trace was scratch: delete it.
        Idempotent (close() and a setup that close() interrupted may both call it)."""
        if self.gateway_session is not None:
            get_gateway().close_session(self.gateway_session)
            mode = self.config.mode
            kept = not isinstance(mode, BlackBox) and mode.trace_dir is not None
            if not kept and self.gateway_session.trace_path:
                Path(self.gateway_session.trace_path).unlink(missing_ok=True)
                self.result.trace_path = None

    def run(self, command: str, timeout_s: float, network, *, env: dict[str, str] | None = None) -> CommandResult:
        """One command in the sandbox (pi_env.task_setup.run_command)."""
        return run_command(made(self.sandbox, "sandbox"), command, timeout_s, network, env=env)

    def agent_limit(self, task: PiTask) -> float:
        """Seconds `task`'s agent may run: the task's limit, capped by the config's."""
        return capped(task.timeouts.agent_s, self.config.limits.agent_timeout_s)


def made(value: T | None, what: str) -> T:
    """`value`, which an earlier phase made: reaching here without it is a bug in the phase order."""
    if value is None:
        raise RuntimeError(f"rollout: the {what} is used before the phase that makes it")
    return value
